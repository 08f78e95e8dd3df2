"""DMD2's generator on its grids (:class:`GridGenerator`, a part of :class:`~moh_dit.objectives.distill.dmd2.DMD2Distill`):
the start times it trains at, its input there (the data noised; its own sample from the grid's step before: backward
simulation; or a frozen lead model's first steps: the hand-off it will be sampled with), its sample, and its sampler,
which predicts the data at each grid time and noises it afresh to the next
(:class:`~moh_dit.objectives.flow_schedulers.MeanFlowScheduler` with ``renoise``)."""

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

# a multi-step generator's input at a grid time below 1: the data noised to it, its own sample from the grid time
# before (backward simulation: each renoising with the start's own noise, or with noise of its own at every renoising,
# as DMD2's code and the sampler do), or the state a frozen lead model reaches there (distill.lead_model; a hand-off's)
DMD_INPUTS = ("data", "generator", "generator_fresh", "lead")
SIMULATED = ("generator", "generator_fresh")  # the inputs made by the generator's own earlier steps
# each input in a run's description (a one-step generator has no later input to describe)
INPUT_WORDS = {"generator": "; backward simulation", "generator_fresh": "; backward simulation, noised afresh"}


class GridGenerator:
    """A generator of the data in one step from each time of its grids, for an objective with ``average_velocity``
    and ``network_time`` (:class:`~moh_dit.objectives.distill.meanflow.MeanFlowDistill`)."""

    def place_grids(
        self, steps: tuple[int, ...], dmd_input: str, midpoint: float, first_share: float | None = None
    ) -> None:
        """Its grids (``steps``' counts, the two-step grid's middle at ``midpoint``), every start time on them (1
        first) and, for each, the grid times before it on the coarsest grid that holds it: its backward simulation's
        path when ``dmd_input`` is one of :data:`SIMULATED`. ``first_share``: the share of the samples drawn at the
        first start time, the rest alike over the later ones (``None``: every start time alike)."""
        if dmd_input not in DMD_INPUTS:
            raise ConfigError(f"distill.dmd_input must be one of {', '.join(DMD_INPUTS)}, got {dmd_input!r}")
        # a share of 0 (every sample on a later step) only where a lead makes the steps before: the generator's own
        # first step is then never trained, and in a hand-off it is never sampled
        share_ok = is_number(first_share) and 0 <= first_share < 1 and (first_share > 0 or dmd_input == "lead")
        if first_share is not None and not share_ok:
            raise ConfigError(
                f"distill.dmd_first_share must be a share between 0 and 1 (of the samples that start from pure noise; "
                f"0 only with distill.dmd_input=lead) or null (every start time alike), got {first_share!r}"
            )
        grids = generator_grids(steps, midpoint)
        self.start_times = sorted({start for grid in grids.values() for start in grid}, reverse=True)
        self.first_share = None if first_share is None else float(first_share)
        self.paths: dict[float, list[float]] = {}
        self.path_grids: dict[float, int] = {}  # the step count of the grid each path is on
        for n in sorted(grids):
            for index, start in enumerate(grids[n]):
                if start not in self.paths:
                    self.paths[start], self.path_grids[start] = grids[n][:index], n

    def check_later_steps(self, options: dict[str, Any], lead_model: str | None, trained: bool) -> None:
        """The keys that shape a multi-step generator's later grid steps (``options``: the real score's scale there,
        the share of the samples; ``dmd_input: lead`` and ``lead_model``) need such steps, and the lead model comes
        with ``dmd_input: lead`` and only with it: a :class:`ConfigError` naming the key otherwise (a generator rebuilt
        from its record for sampling, ``trained`` False, is not checked)."""
        if not trained:
            return
        single = len(self.start_times) == 1
        for key, value in (options | {"dmd_input": "lead" if self.dmd_input == "lead" else None}).items():
            if value is not None and single:
                raise ConfigError(
                    f"distill.{key}={value} shapes the generator's later grid steps, and distill.dmd_steps="
                    f"{list(self.dmd_steps)} has none: give a multi-step grid (e.g. [1, 2]) or drop it"
                )
        if self.dmd_input == "lead" and "lead" not in type(self).frozen_models_for({"dmd_input": "lead"}):
            raise ConfigError(f"distill.dmd_input=lead is DMD2's and SiD's, not distill.method={self.method}'s")
        if (self.dmd_input == "lead") != (lead_model is not None):
            raise ConfigError(
                "distill.dmd_input=lead trains the later steps on a lead model's first steps: give distill.lead_model"
                if lead_model is None
                else f"distill.lead_model={lead_model} is read only with distill.dmd_input=lead (it is {self.dmd_input})"
            )

    def start_shares(self) -> list[float]:
        """The share of the samples drawn at each start time (1 first): alike, or ``first_share`` at the first and
        the rest alike over the later ones."""
        n = len(self.start_times)
        if self.first_share is None or n == 1:
            return [1.0 / n] * n
        return [self.first_share] + [(1.0 - self.first_share) / (n - 1)] * (n - 1)

    def describe_input(self) -> str:
        """The later steps' input in words, for the run's description ("" for the data noised, or one step)."""
        if len(self.start_times) == 1 or self.dmd_input == "data":
            return ""
        return INPUT_WORDS.get(self.dmd_input) or f"; later steps from the lead {self.lead_model}'s"

    def path_draws(self, shape: torch.Size, generator: torch.Generator) -> dict[str, torch.Tensor]:
        """The backward simulation's own noises (``dmd_input: generator_fresh``), batch first: one per forward of the
        longest path, the first its pure noise at 1 and each next the renoising after a forward; none otherwise (the
        step's other draws stay as they were)."""
        depth = max(map(len, self.paths.values()), default=0)
        if self.dmd_input != "generator_fresh" or not depth:
            return {}
        return {"path_noise": torch.randn((shape[0], depth, *shape[1:]), generator=generator)}

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
        """The forwards (without gradient) of the backward simulation or of the lead's first steps, per image on
        average, at the generator's size: each start time's path, weighed by its share of the draws (none with the
        data as the input)."""
        if self.dmd_input == "data":
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
    def generate(self, net, noised: Noised, labels: torch.Tensor | None, drop, autocast, lead=None, **kwargs: Any):
        """The generator's samples ``x`` from its inputs at the drawn start times (pure noise at 1), and its output
        (MoH's loss, head masks). A start time below 1 sees the data noised to it, the generator's own sample from
        the grid time before (without gradient) noised to it, or where the frozen ``lead`` model's first steps from the
        same noise reach (:class:`~moh_dit.sampling.leads.Lead`; ``dmd_input: lead``)."""
        terms = noised.terms
        start, noise = terms["start"], terms["start_noise"]
        source = terms["real"]
        if self.dmd_input in SIMULATED and bool((start < 1).any()):
            path_noise = terms.get("path_noise")
            source = self.backward_simulation(net, noise, start, labels, drop, autocast, path_noise)
        shape = (-1, *([1] * (noise.ndim - 1)))
        z = (1 - start).reshape(shape) * source + start.reshape(shape) * noise
        if self.dmd_input == "lead":
            z = self.lead_input(lead, z, noise, start, labels, drop, autocast)
        with autocast():
            out = self.average_velocity(net, z, start, torch.zeros_like(start), labels, drop, **kwargs)
        return z - start.reshape(shape) * out.sample.float(), out

    @torch.no_grad()
    def lead_input(self, lead, z: torch.Tensor, noise: torch.Tensor, start: torch.Tensor, labels, drop, autocast):
        """``z`` with each row that starts below 1 replaced by where ``lead``'s first steps take the row's ``noise``
        on the grid its start time is on: as many steps as that grid has before the start."""
        if lead is None:
            raise ConfigError("distill.dmd_input=lead trains on a lead model's first steps: give distill.lead_model")
        z = z.clone()
        for target in self.start_times:
            path, rows = self.paths[target], (start == target).nonzero().flatten()
            if not path or rows.numel() == 0:
                continue
            y = labels[rows] if labels is not None else None
            dropped = drop[rows] if drop is not None else None
            z[rows] = lead.first_steps(self, noise[rows], y, self.path_grids[target], len(path), dropped, autocast)
        return z

    @torch.no_grad()
    def backward_simulation(self, net, noise, start, labels, drop, autocast, path_noise=None) -> torch.Tensor:
        """For each sample that starts below 1, the generator's own prediction of the data at the grid time before
        its start: from pure noise down its path (the coarsest grid that holds its start), renoised to each next
        time; only those rows are run. Without ``path_noise`` the path starts from the sample's ``noise`` and every
        renoising reuses it; with it (:meth:`path_draws`) the path starts from its first noise and each renoising
        takes the next, so that the input is the sampler's (each step's noise its own) and its noise at the start time
        (``noise``, added by the caller) is uncorrelated with the path, as in DMD2's code."""
        x = torch.zeros_like(noise)
        for target in self.start_times:
            path = self.paths[target]
            rows = (start == target).nonzero().flatten()
            if not path or rows.numel() == 0:
                continue
            # the noise at each forward of the path: the start's own throughout, or one draw per forward
            noises = [noise[rows]] * len(path) if path_noise is None else path_noise[rows].unbind(1)
            z, y = noises[0], labels[rows] if labels is not None else None
            dropped = drop[rows] if drop is not None else None
            for index, now in enumerate(path):
                t = torch.full((rows.numel(),), now, device=noise.device)
                with autocast(), net.routed_rows(rows) if hasattr(net, "routed_rows") else nullcontext():
                    u = self.average_velocity(net, z, t, torch.zeros_like(t), y, dropped).sample.float()
                predicted = z - now * u
                if index + 1 < len(path):  # renoised to the path's next time (the last lands at the start time)
                    z = (1 - path[index + 1]) * predicted + path[index + 1] * noises[index + 1]
            x[rows] = predicted
        return x
