r"""Which intervals a distillation trains: the draws of ``(t, r)`` (``r <= t``, flow time 1 is noise).

MeanFlow draws ``t`` and ``r`` as the larger and smaller of two logit-normal(-0.4, 1) draws and sets ``r = t`` for a
share of each batch. Such draws almost never span the interval a one-step sampler evaluates, ``[1, 0]``: about 0.035%
of them have ``t > 0.9`` and ``r < 0.1`` (``experiments/distill_diagnosis.py`` measures it), so a student that starts
as its teacher keeps the teacher's single Euler step there. Three keys change the coverage
(docs/objective.md#interval-coverage):

- ``r`` drawn from its own distribution (``distill.r_time_sampling``, ``r_time_mean``, ``r_time_std``; Decoupled
  MeanFlow, arXiv:2510.24474, draws ``t ~ LN(0.4, 1)`` and ``r ~ LN(-1.2, 1)``), then ordered as before;
- a share of the interval samples placed exactly on the intervals the student samples with (``distill.grid_share``,
  over the grids of ``distill.grid_steps`` steps: 1 step ``[1, 0]``; 2 steps ``[1, 0.5], [0.5, 0]``; each interval of
  the union equally often);
- the share of each batch with ``r = t`` (``objective.equal_times``), as MeanFlow's.

Every draw comes from the step's generator on the CPU, in a fixed order, so that a resumed run draws what an
uninterrupted one does; with ``r`` drawn as ``t`` and no grid share the draws are MeanFlow's own.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from moh_dit.argtypes import is_number, is_whole
from moh_dit.errors import ConfigError
from moh_dit.objectives.distill.grids import sampler_intervals
from moh_dit.objectives.meanflow import TIME_SAMPLING

__all__ = ["TimeDistribution", "IntervalCoverage", "VSD_TIME_SAMPLING", "vsd_times", "loss_time_ranges"]


# how the VSD (or SiD) loss draws the flow times it noises the generator's samples at, within distill.dmd_time:
# uniform in flow time, or uniform over the index of EDM's Karras sigmas (rho 7) between the range's ends, as
# NVlabs/FastGen's DMD2 draws them (uniform over 1000 such sigmas) and SiD draws its loss's noise levels
VSD_TIME_SAMPLING = ("uniform", "karras")
KARRAS_RHO = 7.0  # EDM's


def vsd_times(u: torch.Tensor, low: float, high: float, sampling: str = "uniform") -> torch.Tensor:
    """Flow times in ``[low, high]`` from uniform draws ``u`` in [0, 1), increasing in ``u``: ``uniform`` in flow
    time, or ``karras``: the noise level ``sigma = t / (1 - t)`` (the flow path ``(1 - t) x + t e`` is EDM's ``x + sigma
    e`` scaled by ``1 - t``) drawn as ``(s_lo^(1/rho) + u (s_hi^(1/rho) - s_lo^(1/rho)))^rho``, the continuous form of
    uniform over the index of Karras sigmas, then mapped back to ``t = sigma / (1 + sigma)``."""
    if sampling == "uniform":
        return low + (high - low) * u
    if sampling != "karras":
        raise ConfigError(f"distill.dmd_time_sampling must be one of {', '.join(VSD_TIME_SAMPLING)}, got {sampling!r}")
    if high >= 1:  # sigma is infinite at t = 1: Karras sigmas need a finite largest noise level
        raise ConfigError(f"distill.dmd_time_sampling=karras needs distill.dmd_time's last time below 1, got {high!r}")
    lo, hi = (torch.tensor(t / (1 - t), dtype=torch.float64) ** (1 / KARRAS_RHO) for t in (low, high))
    sigma = (lo + u.to(torch.float64) * (hi - lo)) ** KARRAS_RHO
    return (sigma / (1 + sigma)).to(u.dtype)


def loss_time_ranges(
    dmd_time: Sequence[float], gan_time: Sequence[float] | None, sampling: str
) -> tuple[tuple[float, float], tuple[float, float] | None]:
    """``distill.dmd_time`` (the VSD loss's flow times, drawn by ``sampling``) and ``distill.gan_time`` (the
    discriminator's own, or ``None``: the VSD loss's) checked, as ``(first, last)`` pairs in (0, 1]."""
    low, high = (float(v) for v in dmd_time)
    if not 0 < low < high <= 1:
        raise ConfigError(f"distill.dmd_time must be [first, last] flow times in (0, 1], got {list(dmd_time)!r}")
    vsd_times(torch.zeros(1), low, high, sampling)  # refuses an unknown law, or karras up to t = 1
    if gan_time is None:
        return (low, high), None
    bounds = list(gan_time) if isinstance(gan_time, (list, tuple)) else []
    if len(bounds) != 2 or not all(is_number(v) for v in bounds) or not 0 < bounds[0] < bounds[1] <= 1:
        raise ConfigError(
            f"distill.gan_time must be [first, last] flow times in (0, 1] or null (the VSD loss's), got {gan_time!r}"
        )
    return (low, high), (float(bounds[0]), float(bounds[1]))


@dataclass(frozen=True)
class TimeDistribution:
    """Flow times drawn ``logit-normal`` (``sigmoid(N(mean, std))``) or ``uniform`` on [0, 1]."""

    sampling: str = "logit-normal"
    mean: float = -0.4
    std: float = 1.0

    def __post_init__(self) -> None:
        if self.sampling not in TIME_SAMPLING:
            raise ConfigError(f"times are drawn {' or '.join(TIME_SAMPLING)}, got {self.sampling!r}")
        if not (float("-inf") < self.mean < float("inf") and 0 < self.std < float("inf")):
            raise ConfigError(f"a logit-normal's mean must be finite and its std > 0, got {self.mean}, {self.std}")

    def draw(self, n: int, generator: torch.Generator) -> torch.Tensor:
        if self.sampling == "uniform":
            return torch.rand(n, generator=generator)
        return torch.sigmoid(self.mean + self.std * torch.randn(n, generator=generator))


@dataclass(frozen=True)
class IntervalCoverage:
    """The draws of ``(t, r)`` (see the module docstring).

    Args:
        t: the distribution of the two draws (and of ``r``'s where ``r`` is None).
        r: ``r``'s own distribution, or ``None``.
        equal_times: the share of each batch with ``r = t`` (its first samples, as MeanFlow's JAX code).
        grid_share: the share of the other samples put on the sampler's intervals (the first of them).
        grid_steps: the step counts whose grids' intervals those are.
    """

    t: TimeDistribution = TimeDistribution()
    r: TimeDistribution | None = None
    equal_times: float = 0.75
    grid_share: float = 0.0
    grid_steps: tuple[int, ...] = (1, 2)

    def __post_init__(self) -> None:
        for key, value in (("objective.equal_times", self.equal_times), ("distill.grid_share", self.grid_share)):
            if not is_number(value) or not 0 <= value <= 1:
                raise ConfigError(f"{key} must be a share in [0, 1], got {value!r}")
        steps = self.grid_steps
        if not steps or not all(is_whole(n) and n >= 1 for n in steps):
            raise ConfigError(f"distill.grid_steps must be sampler step counts >= 1, e.g. [1, 2], got {list(steps)!r}")

    @property
    def intervals(self) -> list[tuple[float, float]]:
        return sampler_intervals(self.grid_steps)

    def draw(self, n: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """``(t, r)`` for ``n`` samples (float32, on the CPU, from ``generator``): two draws ordered so that
        ``t >= r``; the first ``floor(n * equal_times)`` samples with ``r = t``; the first ``floor(k * grid_share)`` of
        the ``k`` others on the sampler's intervals, each drawn uniformly among them."""
        a = self.t.draw(n, generator)
        b = (self.r or self.t).draw(n, generator)
        t, r = torch.maximum(a, b), torch.minimum(a, b)
        equal = int(n * self.equal_times)
        on_grid = int((n - equal) * self.grid_share)
        if on_grid:
            table = torch.tensor(self.intervals, dtype=torch.float32)
            chosen = table[torch.randint(len(table), (on_grid,), generator=generator)]
            t[equal : equal + on_grid], r[equal : equal + on_grid] = chosen[:, 0], chosen[:, 1]
        return t, torch.where(torch.arange(n) < equal, t, r)

    def describe(self) -> str:
        def law(d: TimeDistribution) -> str:
            return "uniform" if d.sampling == "uniform" else f"logit-normal({d.mean:g}, {d.std:g})"

        r = f", r {law(self.r)}" if self.r is not None else ""
        grid = (
            f", {self.grid_share:.0%} of the intervals on the {'/'.join(map(str, self.grid_steps))}-step grids"
            if self.grid_share
            else ""
        )
        return f"t {law(self.t)}{r}; r = t for {self.equal_times:.0%}{grid}"
