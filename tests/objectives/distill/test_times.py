"""Which intervals a distillation trains (moh_dit/objectives/distill/times.py) and how trajectory distillation snaps
them to its trajectories' grid (moh_dit/objectives/distill/trajectory.py): MeanFlow's own draws by default, r from its own
distribution, a share exactly on the sampler's intervals, the share near the one-step interval against its closed
form, and the snapped pairs."""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from moh_dit.errors import ConfigError
from moh_dit.objectives.distill import MeanFlowDistill
from moh_dit.objectives.distill.times import IntervalCoverage, TimeDistribution, sampler_intervals
from moh_dit.objectives.distill.trajectory import snap_to_grid
from moh_dit.objectives.meanflow import MeanFlow


def test_by_default_a_student_draws_meanflows_own_times():
    """Without r's own distribution or a grid share, the draws are MeanFlow's, draw for draw (students of 0.5 resume
    and compare as they were trained)."""
    for kwargs in (dict(), dict(time_sampling="uniform", equal_times=0.25)):
        ours = MeanFlowDistill(**kwargs).draw_times(64, torch.Generator().manual_seed(3))
        theirs = MeanFlow(**kwargs).draw_times(64, torch.Generator().manual_seed(3))
        assert all(torch.equal(a, b) for a, b in zip(ours, theirs))


def test_the_share_near_the_one_step_interval_is_the_closed_form_of_two_logit_normal_draws():
    """With t, r the larger and smaller of two logit-normal(-0.4, 1) draws, P(t > 0.9 and r < 0.1) = 2 P(a > 0.9)
    P(b < 0.1), about 0.034%: 0.5's recipe trains the one-step interval almost never (uniform draws: 2%)."""
    coverage = IntervalCoverage(equal_times=0.0)
    t, r = coverage.draw(2_000_000, torch.Generator().manual_seed(0))
    phi = statistics.NormalDist(-0.4, 1.0).cdf
    z = math.log(9)
    closed = 2 * (1 - phi(z)) * phi(-z)
    assert closed == pytest.approx(3.4e-4, rel=0.02)
    assert float(((t > 0.9) & (r < 0.1)).double().mean()) == pytest.approx(closed, rel=0.1)
    t, r = IntervalCoverage(TimeDistribution("uniform"), equal_times=0.0).draw(1_000_000, torch.Generator())
    assert float(((t > 0.9) & (r < 0.1)).double().mean()) == pytest.approx(0.02, rel=0.05)


def test_r_from_its_own_distribution_is_ordered_below_t():
    """Decoupled MeanFlow's t ~ LN(0.4, 1), r ~ LN(-1.2, 1): the pair is still ordered (t >= r), and r's draws lie
    lower than t's."""
    coverage = IntervalCoverage(TimeDistribution(mean=0.4), TimeDistribution(mean=-1.2), equal_times=0.0)
    t, r = coverage.draw(100_000, torch.Generator().manual_seed(0))
    assert torch.all(t >= r) and float(r.median()) < 0.3 < float(t.median())


def test_a_grid_share_puts_that_share_of_the_intervals_exactly_on_the_samplers_own():
    coverage = IntervalCoverage(equal_times=0.25, grid_share=0.5, grid_steps=(1, 2))
    assert sampler_intervals((1, 2)) == [(1.0, 0.0), (1.0, 0.5), (0.5, 0.0)]
    t, r = coverage.draw(80, torch.Generator().manual_seed(0))
    assert torch.equal(t[:20], r[:20])  # the first quarter: r = t
    on_grid = {(float(a), float(b)) for a, b in zip(t[20:50], r[20:50])}  # half of the other 60
    assert on_grid == {(1.0, 0.0), (1.0, 0.5), (0.5, 0.0)}
    assert not any((float(a), float(b)) in on_grid for a, b in zip(t[50:], r[50:]))


@pytest.mark.parametrize(
    "kwargs, said",
    [(dict(grid_share=1.5), "grid_share"), (dict(grid_steps=(0,)), "grid_steps"), (dict(equal_times=-1), "equal")],
)
def test_a_bad_coverage_is_one_clear_line(kwargs, said):
    with pytest.raises(ConfigError, match=said):
        IntervalCoverage(**kwargs)


def test_snapped_pairs_keep_an_interval_at_least_one_step_long_and_r_equal_t_one_time():
    grid = torch.tensor([1.0, 0.75, 0.5, 0.25, 0.0], dtype=torch.float64)
    t = torch.tensor([1.0, 0.6, 0.3, 0.02, 0.5, 0.9])
    r = torch.tensor([0.0, 0.55, 0.3, 0.0, 0.5, 0.4])
    i, j = snap_to_grid(t, r, grid)
    assert i.tolist() == [0, 2, 3, 3, 2, 0]
    assert j.tolist() == [4, 3, 3, 4, 2, 2]  # 0.6 -> 0.55 snaps to one time: one step on; 0.02 -> 0: the last step
