r"""Trajectory distillation regularised by DMD2 in one run (``distill.method: rcm``), as rCM does it (NVlabs/rcm,
arXiv:2510.08431: a consistency loss plus a DMD loss, the fake score updated in 1 of 5 iterations at a fifth of the
student's rate): the student is a flow map trained on the secants of the teacher's trajectories
(:class:`~moh_dit.objectives.distill.trajectory.TrajectoryDistill`, no derivative of the student), and its jump to the
data from each grid time, ``x = z - t u(z, t, 0)``, is pushed towards the teacher's distribution by the variational
score distillation of DMD2 (:class:`~moh_dit.objectives.distill.dmd2.DMD2Distill`) against a fake score trained on
those samples:

    student steps   L = L_secant(u; trajectories) + vsd_weight * VSD(x; x0_real, x0_fake)   [VSD from vsd_start]
    fake steps      the teacher's objective on the student's samples (1 of every student_updates + 1 steps)

DMD alone loses variety, the secants alone sharpness (rCM's README); together neither stage waits for the other, and
the whole budget trains one student. It samples as DMD2's generator does (the data predicted at each grid time,
renoised to the next), where both terms train it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from typing import Any

import torch

from moh_dit.argtypes import is_whole
from moh_dit.errors import ConfigError
from moh_dit.objectives.base import Losses, Noised
from moh_dit.objectives.distill.dmd2 import DMD2Distill
from moh_dit.objectives.distill.methods import METHODS, TRAJECTORY_KEYS
from moh_dit.objectives.distill.trajectory import TrajectoryDistill

__all__ = ["RCMDistill"]

# the options of the flow-map student both parts share (the interval draws, the loss, the head, the teacher's record)


class RCMDistill(DMD2Distill):
    """rCM's recipe on moh-dit's pieces (see the module docstring).

    Args:
        student_updates: student updates per fake-score update (rCM's 4: the fake score in 1 of 5 steps).
        vsd_start: the training step from which the VSD term trains the student (rCM: after the other loss's
            warm-up); the fake score trains from the start, so that it tracks the student when it does.
        vsd_weight: the VSD term's weight beside the secants' loss.
        trajectories, trajectory_*: the teacher's trajectories (as the trajectory method's).
        **options: DMD2's (its grids, the real score's guidance, the GAN term) and the flow map's (the interval
            draws, the loss and its weighting, the head).
    """

    method = "rcm"
    title = "A flow map regularised by DMD2"
    frozen_models = ("teacher", "trajectories")
    update_names = {"student": "student_updates", "fake_score": "fake_score_updates"}

    def __init__(
        self,
        student_updates: int = 4,
        vsd_start: int = 0,
        trajectories: str | None = None,
        trajectory_count: int = 2048,
        trajectory_sampler: str | None = None,
        trajectory_steps: int | None = None,
        trajectory_shard_size: int = 256,
        **options: Any,
    ) -> None:
        dmd_only = set(METHODS["dmd2"].keys) - set(TRAJECTORY_KEYS)  # DMD2's own keys: not the flow map's
        flow_map = {k: v for k, v in options.items() if k not in dmd_only and k != "method"}
        super().__init__(**options)
        for key, value in (("student_updates", student_updates), ("vsd_start", vsd_start)):
            if not is_whole(value) or value < (1 if key == "student_updates" else 0):
                raise ConfigError(
                    f"distill.{key} must be a whole number >= {1 if key == 'student_updates' else 0}, got {value!r}"
                )
        self.student_updates, self.vsd_start = student_updates, vsd_start
        trajectory = dict(trajectories=trajectories, trajectory_count=trajectory_count,
                          trajectory_sampler=trajectory_sampler, trajectory_steps=trajectory_steps,
                          trajectory_shard_size=trajectory_shard_size)  # fmt: skip
        self.secants = TrajectoryDistill(**trajectory, **flow_map)

    @classmethod
    def frozen_models_for(cls, options: Mapping[str, Any]) -> tuple[str, ...]:
        return cls.frozen_models

    def describe_loss(self) -> str:
        start = f" from step {self.vsd_start}" if self.vsd_start else ""
        return (
            f"{self.secants.describe_loss()} + {self.vsd_weight:g} x VSD of its samples against the teacher's and a fake "
            f"score's{start}; {self.student_updates} student updates per fake-score update"
        )

    @property
    def logged_terms(self) -> tuple[str, ...]:
        return ("secant_loss", *super().logged_terms)

    def updates(self, step: int) -> str:
        """The fake score every ``student_updates + 1``-th step, the student on the others."""
        return "fake_score" if step % (self.student_updates + 1) == self.student_updates else "student"

    def vsd_on(self, step: int | None) -> bool:
        return bool(self.vsd_weight) and (step or 0) >= self.vsd_start

    # ------------------------------------------------------------------------------------------------
    # What it costs
    # ------------------------------------------------------------------------------------------------
    def step_forwards(self, step: int, companions: Mapping[str, Any] | None = None) -> float:
        """A student step: the secants' forward and backward, and with the VSD term DMD2's generator step (the
        student's sample, its backward, the fake score's forward, the GAN term's); a fake-score step: DMD2's."""
        dmd = super().step_forwards(step, companions)
        if self.updates(step) == "fake_score":
            return dmd
        return 3.0 + (dmd if self.vsd_on(step) else 0.0)

    def student_forwards(self) -> float:
        cycle = range(self.vsd_start, self.vsd_start + self.student_updates + 1)
        return sum(self.step_forwards(s) for s in cycle) / (self.student_updates + 1)

    def teacher_forwards_at(self, step: int) -> float:
        """The teacher's forwards per image at ``step``: its velocity at the secants' ``r = t`` samples on a student
        step, and the real score's once the VSD term is on."""
        if self.updates(step) != "student":
            return 0.0
        return self.secants.teacher_forwards() + (super().teacher_forwards_at(step) if self.vsd_on(step) else 0.0)

    def teacher_forwards(self) -> float:
        cycle = range(self.vsd_start, self.vsd_start + self.student_updates + 1)
        return sum(self.teacher_forwards_at(s) for s in cycle) / (self.student_updates + 1)

    # ------------------------------------------------------------------------------------------------
    # Training
    # ------------------------------------------------------------------------------------------------
    def noised(self, x0: torch.Tensor, generator: torch.Generator, device: torch.device) -> Noised:
        """DMD2's draws and the secants' (``terms["secants"]``), both from the step's generator."""
        noised = super().noised(x0, generator, device)
        noised.terms["secants"] = self.secants.noised(x0, generator, device)
        return noised

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
        companions: Mapping[str, Any] | None = None,
    ) -> tuple[Losses, Any]:
        """The secants' loss and, from ``vsd_start``, DMD2's generator loss on the student steps (the bare network:
        the trainer averages its gradients); the fake score's loss on the others."""
        from accelerate.utils import extract_model_from_parallel

        if not frozen or "trajectories" not in frozen or not companions or "fake_score" not in companions:
            raise ConfigError("rcm learns from the teacher's trajectories beside a fake score (distill.method=rcm)")
        net = extract_model_from_parallel(model, keep_torch_compile=False)
        if self.updates(step or 0) == "fake_score":
            fake = companions["fake_score"]
            losses, out = self._fake_score_losses(net, noised, labels, drop, autocast, fake, step, frozen)
            losses.extras["secant_loss"] = torch.zeros_like(losses.loss)
            return losses, out
        secants, out = self.secants.forward_losses(
            net, noised.terms["secants"], labels, drop, want_heads, autocast, frozen, step
        )
        zero = torch.zeros_like(secants.loss)
        extras = {"secant_loss": secants.loss.detach(), "vsd_loss": zero, "fake_score_loss": zero}
        extras |= {"gan_generator": zero, "gan_discriminator": zero} if self.gan_weight else {}
        extras |= {"regression": zero} if self.regression else {}
        loss = secants.loss
        if self.vsd_on(step):
            dmd, _ = self._generator_losses(net, noised, labels, drop, False, autocast, frozen, companions, step)
            loss = loss + dmd.loss
            extras |= {k: v for k, v in dmd.extras.items() if k in extras}
        return Losses(loss=loss, mse=secants.mse, logged=secants.logged, extras=extras), out
