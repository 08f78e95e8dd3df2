"""DMD2's generator on its grids (:class:`GridGenerator`, a part of :class:`~moh_dit.objectives.distill.dmd2.DMD2Distill`):
the start times it trains at, its input there (the data noised, or its own sample from the grid's step before:
backward simulation), its sample, and its sampler, which predicts the data at each grid time and noises it afresh to
the next (:class:`~moh_dit.objectives.flow_schedulers.MeanFlowScheduler` with ``renoise``)."""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch

from moh_dit.argtypes import is_number
from moh_dit.errors import ConfigError
from moh_dit.objectives.base import Noised, NoiseLevel
from moh_dit.objectives.distill.grids import generator_grids
from moh_dit.objectives.flow_schedulers import MeanFlowScheduler
from moh_dit.objectives.noise import flow_sigma

__all__ = ["GridGenerator", "DMD_INPUTS"]

DMD_INPUTS = ("data", "generator")  # a multi-step generator's input at a grid time


class GridGenerator:
    """A generator of the data in one step from each time of its grids, for an objective with ``average_velocity``
    and ``network_time`` (:class:`~moh_dit.objectives.distill.meanflow.MeanFlowDistill`)."""

    def place_grids(
        self, steps: tuple[int, ...], dmd_input: str, midpoint: float, first_share: float | None = None
    ) -> None:
        """Its grids (``steps``' counts, the two-step grid's middle at ``midpoint``), every start time on them (1
        first) and, for each, the grid times before it on the coarsest grid that holds it: its backward simulation's
        path when ``dmd_input`` is ``generator``. ``first_share``: the share of the samples drawn at the first start
        time, the rest alike over the later ones (``None``: every start time alike)."""
        if dmd_input not in DMD_INPUTS:
            raise ConfigError(f"distill.dmd_input must be {' or '.join(DMD_INPUTS)}, got {dmd_input!r}")
        if first_share is not None and (not is_number(first_share) or not 0 < first_share < 1):
            raise ConfigError(
                f"distill.dmd_first_share must be a share between 0 and 1 (of the samples that start from pure noise) "
                f"or null (every start time alike), got {first_share!r}"
            )
        grids = generator_grids(steps, midpoint)
        self.start_times = sorted({start for grid in grids.values() for start in grid}, reverse=True)
        self.first_share = None if first_share is None else float(first_share)
        self.paths: dict[float, list[float]] = {}
        for n in sorted(grids):
            for index, start in enumerate(grids[n]):
                self.paths.setdefault(start, grids[n][:index])

    def start_shares(self) -> list[float]:
        """The share of the samples drawn at each start time (1 first): alike, or ``first_share`` at the first and
        the rest alike over the later ones."""
        n = len(self.start_times)
        if self.first_share is None or n == 1:
            return [1.0 / n] * n
        return [self.first_share] + [(1.0 - self.first_share) / (n - 1)] * (n - 1)

    def draw_starts(self, n: int, generator: torch.Generator) -> torch.Tensor:
        """``n`` start times drawn from ``generator`` at :meth:`start_shares` (alike: one draw per sample, as moh-dit
        drew them before ``first_share``)."""
        starts = torch.tensor(self.start_times)
        if self.first_share is None:
            return starts[torch.randint(len(starts), (n,), generator=generator)]
        first = torch.rand(n, generator=generator) < self.first_share
        later = starts[1:][torch.randint(len(starts) - 1, (n,), generator=generator)]
        return torch.where(first, starts[0], later)

    def simulated_forwards(self) -> float:
        """The generator's forwards (without gradient) of the backward simulation, per image on average: each start
        time's path, weighed by its share of the draws (none with the data as the input)."""
        if self.dmd_input != "generator":
            return 0.0
        return sum(len(self.paths[s]) * share for s, share in zip(self.start_times, self.start_shares()))

    # ------------------------------------------------------------------------------------------------
    # Sampling: the data predicted at each grid time, noised afresh to the next
    # ------------------------------------------------------------------------------------------------
    def make_scheduler(self, name: str) -> MeanFlowScheduler:
        self.check_sampler(name)
        return MeanFlowScheduler(num_train_timesteps=1000, renoise=True)

    def set_timesteps(
        self, scheduler: MeanFlowScheduler, steps: int, time_shift: float, device: torch.device | str | None
    ) -> None:
        """The grids it trained at (the two-step grid's middle at ``dmd_midpoint``), shifted further by ``time_shift``
        (shifts compose by multiplying)."""
        super().set_timesteps(scheduler, steps, time_shift * self.dmd_midpoint / (1 - self.dmd_midpoint), device)

    def step_time(self, scheduler: MeanFlowScheduler, index: int, t: torch.Tensor):
        now = scheduler.sigmas[index].float().to(t.device)
        return self.network_time(now, torch.zeros_like(now)), NoiseLevel(flow_sigma(float(now)))

    # ------------------------------------------------------------------------------------------------
    # Training: the generator's sample from its start
    # ------------------------------------------------------------------------------------------------
    def generate(self, net, noised: Noised, labels: torch.Tensor | None, drop, autocast, **kwargs: Any):
        """The generator's samples ``x`` from its inputs at the drawn start times (pure noise at 1), and its output
        (MoH's loss, head masks). A start time below 1 sees the data noised to it, or the generator's own sample from
        the grid time before (without gradient), noised to it."""
        terms = noised.terms
        start, noise = terms["start"], terms["start_noise"]
        source = terms["real"]
        if self.dmd_input == "generator" and bool((start < 1).any()):
            source = self.backward_simulation(net, noise, start, labels, drop, autocast)
        shape = (-1, *([1] * (noise.ndim - 1)))
        z = (1 - start).reshape(shape) * source + start.reshape(shape) * noise
        with autocast():
            out = self.average_velocity(net, z, start, torch.zeros_like(start), labels, drop, **kwargs)
        return z - start.reshape(shape) * out.sample.float(), out

    @torch.no_grad()
    def backward_simulation(self, net, noise, start, labels, drop, autocast) -> torch.Tensor:
        """For each sample that starts below 1, the generator's own prediction of the data at the grid time before
        its start: from pure noise down its path (the coarsest grid that holds its start), renoised with its
        ``noise`` to each next time; only those rows are run."""
        x = torch.zeros_like(noise)
        for target in self.start_times:
            path = self.paths[target]
            rows = (start == target).nonzero().flatten()
            if not path or rows.numel() == 0:
                continue
            z, y = noise[rows], labels[rows] if labels is not None else None
            dropped = drop[rows] if drop is not None else None
            for index, now in enumerate(path):
                t = torch.full((rows.numel(),), now, device=noise.device)
                with autocast(), net.routed_rows(rows) if hasattr(net, "routed_rows") else nullcontext():
                    u = self.average_velocity(net, z, t, torch.zeros_like(t), y, dropped).sample.float()
                predicted = z - now * u
                after = path[index + 1] if index + 1 < len(path) else target
                z = (1 - after) * predicted + after * noise[rows]
            x[rows] = predicted
        return x
