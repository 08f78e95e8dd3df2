"""The distances of DMD's regression (moh_dit/objectives/distill/distances.py): the squared error; LPIPS's form in the
teacher's block tokens against a brute-force count on a teacher whose blocks are known linear maps, and on a tiny
MoH-DiT teacher its gradient reaches the sample and never the teacher; every wrong setting refused in one line."""

from __future__ import annotations

import contextlib
import re

import pytest
import torch
from torch import nn

from moh_dit.errors import ConfigError
from moh_dit.objectives.distill.distances import SquaredError, TeacherFeatures, regression_distance

from ...helpers.factories import tiny_model

G = torch.Generator().manual_seed(0)
X, END, NOISE = (torch.randn(3, 2, 4, 4, generator=G) for _ in range(3))
LABELS = torch.tensor([0, 1, 2])


class LinearBlocks(nn.Module):
    """A network of tokens (N, H*W, C) through blocks of a linear map and a tanh, the time and label ignored."""

    def __init__(self, depth: int = 3, width: int = 2) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(depth))

    def forward(self, z):
        h = z.flatten(2).transpose(1, 2)
        for block in self.blocks:
            h = block(h)
        return h


class FakeTeacher:
    """What the distance reads of a teacher: its network (``model``) and its objective's ``linear_velocity``."""

    def __init__(self, model) -> None:
        self.model, self.times = model.requires_grad_(False), []
        self.objective = self

    def linear_velocity(self, net, z, t, labels):
        self.times.append(t)
        return net(z)


def test_the_squared_error_is_the_mean_over_pixels_per_sample():
    got = SquaredError()(X, END, NOISE, LABELS, None, contextlib.nullcontext)
    torch.testing.assert_close(got, torch.stack([((a - b) ** 2).mean() for a, b in zip(X, END)]))


@pytest.mark.parametrize("time", [0.0, 0.3])
def test_the_teacher_feature_distance_is_lpips_form_on_every_blocks_tokens(time):
    teacher = FakeTeacher(LinearBlocks())
    got = TeacherFeatures(time)(X, END, NOISE, LABELS, teacher, contextlib.nullcontext)
    expected = torch.zeros(3)
    blocks = teacher.model.blocks
    for n in range(3):  # by hand: each image on the path to its noise, every block, every token, every channel
        a = ((1 - time) * X[n] + time * NOISE[n]).flatten(1).T  # (tokens, channels)
        b = ((1 - time) * END[n] + time * NOISE[n]).flatten(1).T
        for block in blocks:
            a, b = block(a), block(b)
            per_token = [sum((p[c] / p.norm() - q[c] / q.norm()) ** 2 for c in range(len(p))) for p, q in zip(a, b)]
            expected[n] += sum(per_token) / len(per_token) / len(blocks)
    torch.testing.assert_close(got, expected)
    assert all(torch.equal(t, torch.full((3,), time)) for t in teacher.times)  # the teacher read both at that time


def test_the_teacher_feature_distance_on_a_moh_dit_teacher_is_zero_at_the_end_and_its_gradient_reaches_the_sample():
    from moh_dit.objectives.flow import Flow

    model = tiny_model(signal=0.1, in_channels=2, sample_size=4).eval()
    teacher = FakeTeacher(model)
    teacher.objective = Flow()
    distance = TeacherFeatures(0.2)
    same = distance(END, END, NOISE, LABELS, teacher, contextlib.nullcontext)
    torch.testing.assert_close(same, torch.zeros(3))
    x = X.clone().requires_grad_(True)
    far = distance(x, END, NOISE, LABELS, teacher, contextlib.nullcontext)
    assert (far > 0).all()
    far.sum().backward()
    assert x.grad.abs().sum() > 0 and all(p.grad is None for p in model.parameters())
    assert distance.teacher_passes == 4.0 and SquaredError.teacher_passes == 0.0


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (("lpips",), "unknown distill.regression_distance 'lpips'; choose one of mse, teacher_features"),
        (("mse", 0.1), "distill.regression_feature_time is read by distill.regression_distance=teacher_features only"),
        (("teacher_features", 1.0), "distill.regression_feature_time must be a flow time in [0, 1), got 1.0"),
        (("teacher_features", -0.1), "distill.regression_feature_time must be a flow time in [0, 1)"),
        (("teacher_features", True), "distill.regression_feature_time must be a flow time in [0, 1)"),
        (("teacher_features", None, False), "distill.regression_distance and its settings need DMD's regression on"),
    ],
)
def test_a_wrong_distance_or_setting_is_refused_naming_the_key(args, says):
    with pytest.raises(ConfigError, match=re.escape(says)):
        regression_distance(*args)


def test_the_distances_settings_reach_it_and_the_default_is_the_squared_error():
    assert isinstance(regression_distance(), SquaredError)
    assert regression_distance("teacher_features").time == 0.0
    assert regression_distance("teacher_features", 0.25).time == 0.25
    assert "at flow time 0.25" in regression_distance("teacher_features", 0.25).describe()
