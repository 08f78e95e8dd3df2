"""DMD's regression, a DMD2 or SiD generator's optional mode-coverage term (``distill.regression``, its weight): the
generator's sample from a state of a recorded teacher trajectory held to that trajectory's end, by a distance of
:mod:`~moh_dit.objectives.distill.distances`.

DMD (Yin et al. 2023, arXiv:2311.18828) regresses a one-step generator from the trajectory's noise
(``distill.regression_from: noise``). A multi-step generator trains from later grid times too, and in a hand-off
(``distill.dmd_input: lead``) it trains from nowhere else. So ``regression_from: start`` regresses from the
trajectory's state at each sample's own start time (``terms["start"]``: pure noise at 1, the teacher's own middle at
0.5): the jump the generator makes there, held to where the teacher's sampler went from the same state. The
recorded set must hold those times on its grid (moh_dit/training/distill/sources.py adds them to a set the run records
and refuses a given set without them).
"""

from __future__ import annotations

from typing import Any

import torch

from moh_dit.errors import ConfigError
from moh_dit.objectives.base import Noised
from moh_dit.objectives.distill import distances

__all__ = ["TrajectoryRegression", "REGRESSION_FROM"]

# where the regression's generator sample starts: the trajectory's noise (DMD's), or its state at each sample's start
REGRESSION_FROM = ("noise", "start")


class TrajectoryRegression:
    """DMD's regression for a generator on grids (:class:`~moh_dit.objectives.distill.generator.GridGenerator`, whose
    ``start_times`` and ``average_velocity`` it reads)."""

    def set_regression(
        self, weight: float, distance: str, feature_time: float | None, regression_from: str = "noise"
    ) -> None:
        """Its weight (checked by the caller), distance and start: a :class:`ConfigError` naming the key for an
        unknown start, or a start other than the noise with the regression off."""
        self.regression = float(weight)
        self.distance = distances.regression_distance(distance, feature_time, bool(weight))
        if regression_from not in REGRESSION_FROM:
            raise ConfigError(
                f"distill.regression_from must be one of {', '.join(REGRESSION_FROM)}, got {regression_from!r}"
            )
        if regression_from != "noise" and not weight:
            raise ConfigError("distill.regression_from needs DMD's regression on (distill.regression > 0)")
        self.regression_from = regression_from

    def describe_regression(self) -> str:
        start = " from each sample's start time" if self.regression_from == "start" else ""
        return (
            f"DMD's regression on the teacher's trajectories{start}, weight {self.regression:g}, by "
            f"{self.distance.describe()}"
        )

    def regression_loss(self, model, noised: Noised, autocast, frozen: dict[str, Any]) -> torch.Tensor:
        """Per sample, the generator's sample from the chosen trajectory's state at the start (its noise at 1) against
        the trajectory's end, by the run's distance (which may read the trajectory's noise and the teacher)."""
        trajectories = frozen["trajectories"]
        device = noised.x_t.device
        n = noised.terms["pick"].shape[0]
        grid = trajectories.grid.to(device)
        last = torch.full((n,), len(grid) - 1, device=device)
        at = noised.terms["start"].to(device) if self.regression_from == "start" else torch.ones(n, device=device)
        index = (grid[None, :] - at[:, None].double()).abs().argmin(dim=1)
        off = (grid[index] - at.double()).abs() > 1e-6  # the start times are float32
        if bool(off.any()):
            raise ConfigError(
                f"the regression's trajectories have no state at the start times {sorted(set(at[off].tolist()))}: "
                "record a set whose grid holds them"
            )
        # the trajectory's noise is read apart only where the regression starts elsewhere (the distance may read it)
        first = () if self.regression_from == "noise" else (torch.zeros_like(last),)
        *noise, state, end, y = trajectories.states(noised.terms, (*first, index, last), device)
        noise = noise[0] if noise else state
        at = at.float()
        with autocast():
            u = self.average_velocity(model, state, at, torch.zeros_like(at), y, torch.zeros_like(y)).sample.float()
        return self.distance(
            state - at.reshape(-1, *[1] * (state.ndim - 1)) * u, end, noise, y, frozen["teacher"], autocast
        )
