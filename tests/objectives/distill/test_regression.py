"""DMD's regression (moh_dit/objectives/distill/regression.py): from the trajectory's noise (DMD's, one step) or from
its state at each sample's start time, against brute force on a toy generator and a toy set of trajectories."""

from __future__ import annotations

import contextlib

import pytest
import torch

from moh_dit.errors import ConfigError
from moh_dit.objectives.base import Noised


class _Trajectories:
    """A set of ``count`` trajectories on ``grid`` (random states; trajectory k's label k % 3), chosen by
    ``terms["pick"]`` as a stored set chooses them."""

    def __init__(self, grid, count=5, shape=(1, 2, 2)):
        self.grid = torch.tensor(grid, dtype=torch.float64)
        self.count = count
        self.all = torch.randn(count, len(grid), *shape, generator=torch.Generator().manual_seed(4))

    def chosen(self, terms):
        return (terms["pick"].double() * self.count).long().clamp(max=self.count - 1)

    def states(self, terms, indices, device):
        k = self.chosen(terms)
        return (*(self.all[k, index] for index in indices), k % 3)


class _Generator(torch.nn.Module):
    """Called as a MoHDiT: ``u = z + t`` (network time 1000 t), so its data prediction from z at t is z - t (z + t)."""

    def forward(self, z, times, y=None, force_drop_ids=None, **_):
        from moh_dit.model.network import MoHDiTOutput

        t = torch.as_tensor(times[0], dtype=z.dtype).reshape(-1, 1, 1, 1) / 1000
        return MoHDiTOutput(sample=z + t, aux_loss=z.new_zeros(()))


def _loss(regression_from, start, grid=(1.0, 0.75, 0.5, 0.25, 0.0)):
    from moh_dit.objectives.distill.dmd2 import DMD2Distill

    objective = DMD2Distill(dmd_steps=[1, 2], regression=1.0, regression_from=regression_from)
    trajectories = _Trajectories(grid)
    pick = torch.tensor([0.1, 0.5, 0.9, 0.3])
    terms = {"pick": pick, "start": torch.tensor(start)}
    noised = Noised(torch.zeros(4, 1, 2, 2), torch.zeros(4), terms)
    frozen = {"trajectories": trajectories, "teacher": None}
    loss = objective.regression_loss(_Generator(), noised, contextlib.nullcontext, frozen)
    return objective, trajectories, terms, loss


def test_from_the_start_each_sample_jumps_from_its_trajectorys_state_at_its_own_start_time():
    objective, trajectories, terms, loss = _loss("start", [1.0, 0.5, 0.5, 1.0])
    assert "from each sample's start time" in objective.describe_loss()
    k = trajectories.chosen(terms)
    for row, s in enumerate(terms["start"].tolist()):  # brute force, row by row
        state = trajectories.all[k[row], [1.0, 0.75, 0.5, 0.25, 0.0].index(s)]
        predicted = state - s * (state + s)
        end = trajectories.all[k[row], -1]
        torch.testing.assert_close(loss[row], ((predicted - end) ** 2).mean())


def test_from_the_noise_every_sample_is_the_one_step_sample_of_the_trajectorys_noise_as_dmd_regresses():
    objective, trajectories, terms, loss = _loss("noise", [1.0, 0.5, 0.5, 1.0])
    assert "start time" not in objective.describe_loss()
    k = trajectories.chosen(terms)
    noise, end = trajectories.all[k, 0], trajectories.all[k, -1]
    torch.testing.assert_close(loss, ((noise - (noise + 1) - end) ** 2).mean(dim=(1, 2, 3)))


def test_the_set_must_hold_the_later_start_times_of_the_generators_grids_only_for_a_regression_from_them():
    from moh_dit.training.config_sections import DistillSection
    from moh_dit.training.distill.sources import regression_times

    start = DistillSection(regression=1.0, regression_from="start", dmd_steps=(1, 2, 4), dmd_midpoint=0.3)
    shift = 0.3 / 0.7  # the four-step grid shifted so that 0.5 lands on 0.3
    assert regression_times(start) == pytest.approx([shift * a / (1 + (shift - 1) * a) for a in (0.75, 0.5, 0.25)])
    assert regression_times(DistillSection(regression=1.0, dmd_steps=(1, 2))) == []  # from the noise: 1 is always held
    assert regression_times(DistillSection(regression_from="start", dmd_steps=(1, 2))) == []  # the regression off


def test_a_start_time_the_trajectories_do_not_hold_is_refused_in_one_line():
    with pytest.raises(ConfigError, match=r"no state at the start times \[0.5\]: record a set whose grid holds them"):
        _loss("start", [1.0, 0.5, 0.5, 1.0], grid=(1.0, 0.75, 0.25, 0.0))


@pytest.mark.parametrize(
    ("options", "says"),
    [
        ({"regression": 1.0, "regression_from": "middle"}, "distill.regression_from must be one of noise, start"),
        ({"regression": 0.0, "regression_from": "start"}, r"distill.regression_from needs DMD's regression on"),
    ],
)
def test_a_wrong_regression_start_is_refused_in_one_line(options, says):
    from moh_dit.objectives.distill.dmd2 import DMD2Distill

    with pytest.raises(ConfigError, match=says):
        DMD2Distill(dmd_steps=[1, 2], **options)
