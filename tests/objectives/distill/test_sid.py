"""SiD (moh_dit/objectives/distill/sid.py): its loss against mingyuanzhou/SiD's ``generator_loss`` on fixed inputs
(recorded by tests/reference_outputs/record_sid.py), its gradient through both scores' inputs against finite
differences, what a generator step costs, and its key refused in one line where it is wrong."""

from __future__ import annotations

import contextlib
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from moh_dit.objectives.distill.dmd_losses import sid_loss

from ...reference_outputs.record_sid import fake_score, real_score

REC = load_file(Path(__file__).resolve().parents[2] / "reference_outputs" / "sid_official.safetensors")


@pytest.mark.parametrize("alpha", [1.2, 0.5])
def test_the_sid_loss_and_its_gradient_through_both_scores_equal_sids(alpha):
    """SiD's loss per pixel, averaged per sample here; its gradient (of the sum) in the generated images, through the
    scores' inputs ``x + sigma n`` (the noise recorded as SiD drew it), is the pixel count times ours."""
    images = REC["images"]
    x_in, sigma = REC[f"alpha{alpha}.x"], REC[f"alpha{alpha}.sigma"].reshape(-1, 1, 1, 1)
    noise = x_in - images  # sigma n, held
    leaf = images.clone().requires_grad_(True)
    noised = leaf + noise
    loss = sid_loss(leaf, real_score(noised, sigma), fake_score(noised, sigma), alpha)
    loss.sum().backward()
    torch.testing.assert_close(loss.detach(), REC[f"alpha{alpha}.loss"].flatten(1).mean(1), rtol=1e-5, atol=1e-7)
    pixels = images[0].numel()
    torch.testing.assert_close(leaf.grad * pixels, REC[f"alpha{alpha}.grad"], rtol=1e-5, atol=1e-6)


class _Fake:
    """A fake score as the objective calls it: a velocity of the linear path, its weights frozen."""

    def __init__(self, net):
        self.net = net

    def velocity(self, z, t, labels, drop, autocast):
        return self.net(z, t, labels)


def _teacher(net):
    from moh_dit.training.distill.teacher import Teacher, TeacherGuidance

    class Model(torch.nn.Module):
        null_class_id = 3

    teacher = Teacher.__new__(Teacher)
    teacher.model, teacher.source, teacher.evaluations = Model(), "toy", 0
    teacher.guidance = TeacherGuidance(1.0, (0.0, 1.0))
    teacher.objective = type("O", (), {"linear_velocity": staticmethod(lambda _, z, t, y: net(z, t, y))})()
    return teacher


def test_the_generator_step_differentiates_through_both_scores_and_counts_the_teachers_backward():
    """The gradient of SiD's loss in the generated sample equals central finite differences of that loss with its
    normaliser held (it has no gradient) in float64: the scores' Jacobians are in it. DMD2's VSD, on the same
    inputs, has only the direct term. The teacher's evaluations count its backward (three passes per row)."""
    from moh_dit.objectives.distill.dmd2 import DMD2Distill
    from moh_dit.objectives.distill.sid import SiDDistill

    from ...helpers.toy_velocity import ToyTeacher

    real_net, fake_net = ToyTeacher(seed=1).double(), ToyTeacher(seed=2).double()
    teacher, fake = _teacher(real_net), _Fake(fake_net)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 2, 4, 4, generator=g, dtype=torch.float64)
    eps = torch.randn(x.shape, generator=g, dtype=torch.float64)
    t = torch.tensor([0.2, 0.5, 0.8], dtype=torch.float64)
    labels = torch.tensor([0, 2, 1])
    objective = SiDDistill(sid_alpha=1.2, real_guidance=1.0)
    path = lambda x: (1 - t.reshape(-1, 1, 1, 1)) * x + t.reshape(-1, 1, 1, 1) * eps  # noqa: E731
    leaf = x.clone().requires_grad_(True)
    first = torch.ones(3, dtype=torch.float64)  # every sample from the one-step grid's start
    objective.distribution_loss(
        leaf, path(leaf), t, labels, None, contextlib.nullcontext, teacher, fake, first
    ).sum().backward()
    assert teacher.evaluations == 3 * 3  # three rows, each a forward and a backward (two)

    def clean(net, z):
        return z - t.reshape(-1, 1, 1, 1) * net(z, t, labels)

    held = 1 / (x - clean(real_net, path(x))).abs().flatten(1).mean(1).detach()

    def loss(x):  # SiD's loss with its normaliser held at x's
        real, gap = clean(real_net, path(x)), clean(real_net, path(x)) - clean(fake_net, path(x))
        return (held * (gap * ((real - x) - 1.2 * gap)).flatten(1).mean(1)).sum()

    expected = torch.zeros_like(x).flatten()
    h = 1e-6
    for i in range(x.numel()):
        step = torch.zeros_like(x).flatten()
        step[i] = h
        with torch.no_grad():
            expected[i] = (loss(x + step.view_as(x)) - loss(x - step.view_as(x))) / (2 * h)
    # central differences in float64 at h = 1e-6 carry a rounding error of about eps |loss| / h (~1e-9 here); the
    # scores' Jacobians, which a gradient without them would miss, are of order 1e-2
    torch.testing.assert_close(leaf.grad, expected.view_as(x), rtol=1e-6, atol=5e-9)
    # VSD on the same inputs: no score is differentiated (the teacher counted once per row)
    leaf = x.clone().requires_grad_(True)
    plain = _teacher(real_net)
    vsd = DMD2Distill(real_guidance=1.0).distribution_loss(
        leaf, path(leaf), t, labels, None, contextlib.nullcontext, plain, fake, first
    )
    vsd.sum().backward()
    assert plain.evaluations == 3
    direct = (clean(fake_net, path(x)) - clean(real_net, path(x))).detach()
    weight = 1 / ((x - clean(real_net, path(x))).abs().flatten(1).mean(1) + 1e-6)
    torch.testing.assert_close(leaf.grad, weight.view(-1, 1, 1, 1) * direct / x[0].numel())


def test_a_sid_generator_step_counts_both_scores_backwards_and_a_fake_step_as_dmd2s():
    """Per image at 4 fake-score updates per generator update, one step: the generator's forward and backward (3),
    the fake score's forward and backward to the sample (3); the real score's three passes per evaluation, two
    evaluations where it is guided. A fake-score step is DMD2's."""
    from moh_dit.objectives.distill.dmd2 import DMD2Distill
    from moh_dit.objectives.distill.sid import SiDDistill

    sid, dmd2 = SiDDistill(real_guidance=1.0), DMD2Distill(real_guidance=1.0)
    assert sid.step_forwards(0) == 3.0 + 3.0 and dmd2.step_forwards(0) == 3.0 + 1.0
    assert sid.step_forwards(1) == dmd2.step_forwards(1) == 4.0
    assert sid.teacher_forwards_at(0) == 3.0 and SiDDistill(real_guidance=2.0).teacher_forwards_at(0) == 6.0
    assert sid.teacher_forwards_at(1) == 0.0
    assert sid.logged_terms == ("sid_loss", "fake_score_loss")
    assert "SiD's score-identity loss (alpha 1.2)" in sid.describe_loss()


def test_the_later_steps_real_score_has_its_own_scale_and_its_gradient_runs_through_it():
    """distill.real_guidance_later: in one batch from both starts of the two-step grid, each sample's SiD loss and
    its gradient are those of a batch of its own step alone at that step's scale; the teacher counts three passes per
    row at each scale (two evaluations per guided row), and the cost the study plans by averages the two starts."""
    from moh_dit.objectives.distill.sid import SiDDistill

    from ...helpers.toy_velocity import ToyTeacher

    real_net, fake_net = ToyTeacher(seed=1).double(), ToyTeacher(seed=2).double()
    fake = _Fake(fake_net)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 2, 4, 4, generator=g, dtype=torch.float64)
    eps = torch.randn(x.shape, generator=g, dtype=torch.float64)
    t = torch.tensor([0.3, 0.5, 0.6, 0.8], dtype=torch.float64)
    labels, start = torch.tensor([0, 2, 1, 1]), torch.tensor([1.0, 0.5, 1.0, 0.5], dtype=torch.float64)
    path = lambda x, rows: (1 - t[rows].reshape(-1, 1, 1, 1)) * x + t[rows].reshape(-1, 1, 1, 1) * eps[rows]  # noqa: E731
    both = SiDDistill(real_guidance=3.0, real_guidance_later=1.0, dmd_steps=[1, 2])
    teacher = _teacher(real_net)
    teacher.guidance = type(teacher.guidance)(1.0, (0.0, 1.0))
    leaf = x.clone().requires_grad_(True)
    every = torch.arange(4)
    loss = both.distribution_loss(
        leaf, path(leaf, every), t, labels, None, contextlib.nullcontext, teacher, fake, start
    )
    loss.sum().backward()
    assert teacher.evaluations == 3 * (2 * 2 + 2)  # the first step's two rows guided (two evaluations), the later not
    for scale, rows in ((3.0, torch.tensor([0, 2])), (1.0, torch.tensor([1, 3]))):
        alone = SiDDistill(real_guidance=scale)
        part = x[rows].clone().requires_grad_(True)
        expected = alone.distribution_loss(
            part, path(part, rows), t[rows], labels[rows], None, contextlib.nullcontext, _teacher(real_net), fake,
            torch.ones(2, dtype=torch.float64),
        )  # fmt: skip
        expected.sum().backward()
        torch.testing.assert_close(loss[rows].detach(), expected.detach())
        torch.testing.assert_close(leaf.grad[rows], part.grad)
    # the loss differs from the first step's scale everywhere: the later rows' scale is read
    same = SiDDistill(real_guidance=3.0, dmd_steps=[1, 2]).distribution_loss(
        x, path(x, every), t, labels, None, contextlib.nullcontext, _teacher(real_net), fake, start
    )
    assert torch.allclose(same[[0, 2]], loss[[0, 2]].detach()) and not torch.allclose(same[[1, 3]], loss[[1, 3]])
    assert both.teacher_forwards_at(0) == 3.0 * (2 + 1) / 2  # the two starts drawn alike
    assert SiDDistill(real_guidance=3.0, dmd_steps=[1, 2]).teacher_forwards_at(0) == 6.0
    assert "(1 on the later grid steps)" in both.describe()


def test_a_ramped_real_score_is_read_at_the_training_step():
    """distill.real_guidance_end over distill.real_guidance_ramp: SiD's loss and its gradient at training step s are
    those of a fixed real score at the ramp's scale there (8 -> 2 over 100 steps: 5 at step 50, 2 from step 100)."""
    from moh_dit.objectives.distill.sid import SiDDistill

    from ...helpers.toy_velocity import ToyTeacher

    real_net, fake = ToyTeacher(seed=1).double(), _Fake(ToyTeacher(seed=2).double())
    g = torch.Generator().manual_seed(2)
    x = torch.randn(3, 2, 4, 4, generator=g, dtype=torch.float64)
    eps = torch.randn(x.shape, generator=g, dtype=torch.float64)
    t, labels = torch.tensor([0.3, 0.5, 0.8], dtype=torch.float64), torch.tensor([0, 2, 1])
    ramped = SiDDistill(real_guidance=8.0, real_guidance_end=2.0, real_guidance_ramp=100)

    def loss_and_grad(objective, step):
        teacher = _teacher(real_net)
        teacher.guidance = type(teacher.guidance)(1.0, (0.0, 1.0))
        leaf = x.clone().requires_grad_(True)
        x_t = (1 - t.reshape(-1, 1, 1, 1)) * leaf + t.reshape(-1, 1, 1, 1) * eps
        loss = objective.distribution_loss(
            leaf, x_t, t, labels, None, contextlib.nullcontext, teacher, fake, torch.ones(3, dtype=torch.float64), step
        )
        loss.sum().backward()
        return loss.detach(), leaf.grad

    for step, scale in ((50, 5.0), (100, 2.0), (400, 2.0)):
        for got, expected in zip(loss_and_grad(ramped, step), loss_and_grad(SiDDistill(real_guidance=scale), 0)):
            torch.testing.assert_close(got, expected)
    assert not torch.allclose(loss_and_grad(ramped, 0)[0], loss_and_grad(ramped, 50)[0])


@pytest.mark.parametrize(
    ("overrides", "says"),
    [
        (["distill.method=sid", "distill.sid_alpha=-0.5"], "distill.sid_alpha must be a number >= 0 (SiD's 1.2)"),
        (["distill.method=sid", "distill.real_guidance=0.5"], "distill.real_guidance must be a guidance scale >= 1"),
        (["distill.method=dmd2", "distill.sid_alpha=1.0"], "distill.sid_alpha: not an option of distill.method=dmd2"),
    ],
)
def test_a_wrong_sid_key_is_refused_in_one_line_that_names_it(overrides, says, tmp_path):
    from moh_dit.errors import ConfigError
    from moh_dit.training.config import load_config

    config = {"objective": {"name": "distill"}, "distill": {"teacher": str(tmp_path / "teacher")},
              "train": {"output_dir": str(tmp_path / "out")}}  # fmt: skip
    with pytest.raises(ConfigError, match=re.escape(says)) as caught:
        load_config(config, overrides)
    assert "\n" not in str(caught.value)


def test_a_yaml_true_is_no_alpha():
    from moh_dit.errors import ConfigError
    from moh_dit.objectives.distill.sid import SiDDistill

    with pytest.raises(ConfigError, match=re.escape("distill.sid_alpha must be a number >= 0")):
        SiDDistill(sid_alpha=True)
