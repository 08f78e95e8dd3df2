r"""Trajectory distillation (``distill.method: trajectory``): the student's average velocity over ``[r, t]`` learned
as the secant of the teacher's own sampling trajectory between those times (CMT, Hu et al. 2025, arXiv:2509.24526;
Lagrangian flow-map distillation, Boffi et al. 2025, arXiv:2505.18825):

    u_tgt(x_ti, ti, tj) = (x_ti - x_tj) / (ti - tj)        two states of one trajectory (ti > tj)
    u_tgt(x_ti, ti, ti) = v_T(x_ti, ti)                     r = t: the teacher's guided velocity at the state
    L = sum over pixels (u - u_tgt)^2,   loss = L / sg(L + c)^p      (MeanFlow's adaptive weight)

The trajectories are the teacher's sampler run from noise with its guidance (moh_dit/training/distill/trajectories.py): a
regression on fixed targets, with no derivative of the student and nothing of the student's own in its target, so
none of MeanFlow's self-reference. ``(t, r)`` are drawn as every method draws them (the interval coverage,
:class:`~moh_dit.objectives.distill.times.IntervalCoverage`: a share on the student's own sampling intervals) and
snapped to the trajectory's grid, which holds the student's sampling times. The student and its sampling are the
meanflow method's (:class:`~moh_dit.objectives.distill.MeanFlowDistill`): a trajectory student can be post-trained
by MeanFlow (``distill.student_from``), CMT's second stage.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from typing import Any

import torch

from moh_dit.errors import ConfigError
from moh_dit.objectives.base import Losses, Noised
from moh_dit.objectives.distill.meanflow import MeanFlowDistill

__all__ = ["TrajectoryDistill", "snap_to_grid"]


def snap_to_grid(t: torch.Tensor, r: torch.Tensor, grid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Indices ``(i, j)`` into ``grid`` (flow times from 1 down to 0) of the times nearest ``t`` and ``r``; an interval
    (``r < t``) keeps at least one step of the grid (``j > i``), ``r = t`` stays one time (``i = j``)."""
    grid = grid.to(t.device, torch.float64)
    last = len(grid) - 1
    i = (grid[None, :] - t.double()[:, None]).abs().argmin(dim=1)
    j = (grid[None, :] - r.double()[:, None]).abs().argmin(dim=1)
    interval = t > r
    i = torch.where(interval & (i == last), i - 1, i)
    j = torch.where(interval & (j <= i), i + 1, j)
    return i, torch.where(interval, j, i)


class TrajectoryDistill(MeanFlowDistill):
    """Trajectory distillation (see the module docstring). The trajectory keys (``distill.trajectories``, ...) shape
    the set beside the student (``moh_dit.training.distill.sources``), recorded here for its card."""

    method = "trajectory"
    title = "A flow map"
    frozen_models = ("teacher", "trajectories")
    runs_bare_module = False  # one forward with gradient: DDP and a compiled network apply

    def __init__(
        self,
        trajectories: str | None = None,
        trajectory_count: int = 2048,
        trajectory_sampler: str | None = None,
        trajectory_steps: int | None = None,
        trajectory_shard_size: int = 256,
        **options: Any,
    ) -> None:
        super().__init__(**options)
        self.source = trajectories or "recorded by the run"

    def describe_loss(self) -> str:
        return (
            f"{self.tangent_loss.describe()} against secants of the teacher's trajectories ({self.source}), its "
            f"velocity where r = t; times: {self.coverage.describe()}, snapped to the trajectories' grid"
        )

    @property
    def logged_terms(self) -> tuple[str, ...]:
        return ()

    def student_forwards(self) -> float:
        """The student's forward and backward: no derivative."""
        return 3.0

    def teacher_forwards(self) -> float:
        """The teacher's (guided) forwards for the samples with ``r = t``; the trajectories' own cost is the set's
        (its manifest)."""
        return super().teacher_forwards() * self.equal_times

    def noised(self, x0: torch.Tensor, generator: torch.Generator, device: torch.device) -> Noised:
        """The step's draws, on the CPU from ``generator``: ``(t, r)``, which stored trajectory (``pick``), and for
        trajectories drawn online their noise and label (``class_pick``, ``null_pick``). The states are read in
        :meth:`forward_losses`."""
        n = x0.shape[0]
        t, r = self.draw_times(n, generator)
        picks = {name: torch.rand(n, generator=generator) for name in ("pick", "class_pick", "null_pick")}
        noise = torch.randn(x0.shape, generator=generator)
        terms = {"t": t, "r": r, "noise": noise, **picks}
        terms = {k: v.to(device) for k, v in terms.items()}
        return Noised(x0, self.network_time(terms["t"], terms["r"]), terms)

    def forward_losses(
        self,
        model: torch.nn.Module,
        noised: Noised,
        labels: torch.Tensor | None,
        drop: torch.Tensor | None,
        want_heads: bool,
        autocast: Callable[[], AbstractContextManager],
        frozen: Mapping[str, Any] | None = None,
        step: int | None = None,
        ema: torch.nn.Module | None = None,
    ) -> tuple[Losses, Any]:
        """Two states of each sample's trajectory (its own label: the data's labels and their dropout are not
        used), their secant or the teacher's velocity as the target, and one forward of ``model`` (wrapped for DDP)
        with gradient."""
        if not frozen or "trajectories" not in frozen:
            raise ConfigError("trajectory distillation learns from the teacher's trajectories (distill.trajectories)")
        source, teacher = frozen["trajectories"], frozen["teacher"]
        device = noised.x_t.device
        i, j = snap_to_grid(noised.terms["t"], noised.terms["r"], source.grid)
        x_i, x_j, y = source.pairs(noised.terms, i, j, device)
        grid = source.grid.to(device)
        t, r = grid[i], grid[j]
        target = ((x_i.double() - x_j.double()) / (t - r).clamp(min=1e-12).reshape(-1, 1, 1, 1)).float()
        equal = (i == j).nonzero().flatten()
        if equal.numel():
            target[equal] = teacher.velocity(x_i[equal], t[equal].float(), y[equal], None, autocast).float()
        noised.x_t, noised.terms["t"], noised.terms["r"] = x_i, t.float(), r.float()
        noised.time, noised.terms["target"] = self.network_time(t.float(), r.float()), target
        with autocast():
            out = self.average_velocity(
                model, x_i, t.float(), r.float(), y, torch.zeros_like(y), return_head_masks=want_heads
            )
        return self.tangent_loss.regress(out.sample.float(), target), out
