r"""Consistency post-training of a flow map with a small fixed step (``distill.method: ect``), CMT's second stage
(Hu et al. 2025, arXiv:2509.24526: mid-training on the teacher's trajectories, then ECT with a small fixed
``Δt``; ECT: Geng et al. 2024, arXiv:2406.14548) written for moh-dit's flow-map student.

The student's jump from ``t`` to ``r`` is ``X(z_t; t -> r) = z_t - (t - r) u(z_t, t, r)``. Consistency asks the jump from
``z_t`` to equal the jump from a point ``Δt`` further down the same ODE trajectory. That point is one Euler step
``z_s = z_t - (t - s) v`` with ``s = max(t - Δt, r)``, and the jump from it is the student's own, held fixed:

    u_tgt = [(t - s) v + (s - r) sg(u(z_s, s, r))] / (t - r)        (r < t)
    u_tgt = v                                                        (r = t: flow matching)
    L = sum over pixels (u(z_t, t, r) - u_tgt)^2,   loss = L / sg(L + c)^p     (MeanFlow's adaptive weight)

``v`` is the step's velocity (``distill.ect_step``):

- ``teacher``: the teacher's guided velocity at ``z_t``, so that the student keeps the teacher's guidance folded in as
  every other method does (consistency distillation with ECT's fixed small step);
- ``data``: the data's own conditional velocity ``eps - x`` of the noised sample (ECT's consistency *training*: no
  teacher evaluation at all). It learns the unguided flow, so it is refused for a student that folds guidance.

ECT's own curriculum (``distill.ect_dt_start``): the step starts large and halves every ``distill.ect_dt_every``
training steps down to ``distill.ect_dt`` (``Δt_k = max(Δt, Δt_0 / 2^floor(k / every))``, ECT's stage-wise shrinking
of ``t - r`` with its ratio 2), so that the early targets lean on the step's velocity over a long stretch and the
student's own jump is asked for from farther off only as it is learned; without it the step is fixed (CMT's).

As ``Δt -> 0`` the target is MeanFlow's ``v - (t - r) du/dt`` (the meanflow method) without a derivative of the student:
one forward without gradient stands in for the JVP. The student starts from another (``distill.student_from``: CMT's
trajectory student) and samples as every flow map does.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from typing import Any

import torch

from moh_dit.argtypes import is_number, is_whole
from moh_dit.errors import ConfigError
from moh_dit.objectives.base import Losses, Noised
from moh_dit.objectives.distill.meanflow import MeanFlowDistill

__all__ = ["ECTDistill", "ECT_STEPS", "consistency_target"]

ECT_STEPS = ("teacher", "data")  # where the step down the trajectory takes its velocity


def consistency_target(
    v: torch.Tensor, u_from_step: torch.Tensor, t: torch.Tensor, s: torch.Tensor, r: torch.Tensor
) -> torch.Tensor:
    """The average velocity over ``[r, t]`` of one step of velocity ``v`` from ``t`` to ``s`` followed by the jump
    ``u_from_step`` from ``s`` to ``r`` (``r <= s <= t``, each (N,)); ``v`` itself where ``r = t``."""
    shape = (-1, *([1] * (v.ndim - 1)))
    span = (t - r).reshape(shape)
    step, rest = (t - s).reshape(shape), (s - r).reshape(shape)
    blended = (step * v + rest * u_from_step) / span.clamp(min=1e-12)
    return torch.where(span > 0, blended, v)


class ECTDistill(MeanFlowDistill):
    """Consistency post-training with a small fixed step (see the module docstring).

    Args:
        ect_dt: the fixed step down the trajectory, in flow time (0 < Δt < 1): the target's Euler step; smaller is
            closer to MeanFlow's continuous target, larger leans more on the student's own jump.
        ect_step: where the step's velocity comes from, ``teacher`` (guided, folded in) or ``data`` (``eps - x``,
            unguided students only).
        **options: the flow map's (:class:`~moh_dit.objectives.distill.MeanFlowDistill`: the interval draws, the
            loss and its weighting, the head, the teacher's record).
    """

    method = "ect"
    title = "A flow map post-trained by consistency"
    runs_bare_module = False  # one forward with gradient (the target's is without): DDP and a compiled network apply

    def __init__(
        self,
        ect_dt: float = 0.01,
        ect_step: str = "teacher",
        ect_dt_start: float | None = None,
        ect_dt_every: int = 1000,
        **options: Any,
    ) -> None:
        super().__init__(**options)
        if not is_number(ect_dt) or not 0 < ect_dt < 1:
            raise ConfigError(
                f"distill.ect_dt must be a step in flow time between 0 and 1 (e.g. 0.01), got {ect_dt!r}"
            )
        if ect_dt_start is not None and (not is_number(ect_dt_start) or not ect_dt < ect_dt_start <= 1):
            raise ConfigError(
                f"distill.ect_dt_start must be null (a fixed step) or a step above distill.ect_dt={ect_dt:g} and at "
                f"most 1 (ECT's curriculum halves it down to distill.ect_dt), got {ect_dt_start!r}"
            )
        if not is_whole(ect_dt_every) or ect_dt_every < 1:
            raise ConfigError(
                f"distill.ect_dt_every must be a whole number of training steps of at least 1, got {ect_dt_every!r}"
            )
        if ect_step not in ECT_STEPS:
            raise ConfigError(f"distill.ect_step must be {' or '.join(ECT_STEPS)}, got {ect_step!r}")
        scale = self.teacher_guidance.get("scale", 1.0)
        if ect_step == "data" and scale != 1.0:
            raise ConfigError(
                f"distill.ect_step=data steps along the data's unguided flow, but this student folds the teacher's "
                f"guidance {scale:g}: distill.ect_step=teacher, or distill.guidance_scale=1"
            )
        self.ect_dt, self.ect_step = float(ect_dt), ect_step
        self.ect_dt_start = None if ect_dt_start is None else float(ect_dt_start)
        self.ect_dt_every = ect_dt_every

    def step_size(self, step: int | None) -> float:
        """The step down the trajectory at training step ``step``: fixed, or ECT's curriculum halving
        ``distill.ect_dt_start`` every ``distill.ect_dt_every`` steps down to ``distill.ect_dt`` (its end where the
        step is not known)."""
        if self.ect_dt_start is None or step is None:
            return self.ect_dt
        return max(self.ect_dt, self.ect_dt_start / 2 ** (step // self.ect_dt_every))

    def describe_loss(self) -> str:
        velocity = "the teacher's velocity" if self.ect_step == "teacher" else "the data's velocity eps - x"
        size = (
            f"{self.ect_dt:g} (fixed step)"
            if self.ect_dt_start is None
            else f"{self.ect_dt_start:g} halved every {self.ect_dt_every} steps down to {self.ect_dt:g} (ECT's curriculum)"
        )
        return (
            f"{self.tangent_loss.describe()} against the student's own jump from one step of {velocity} "
            f"{size} down the trajectory (consistency); times: {self.coverage.describe()}"
        )

    @property
    def logged_terms(self) -> tuple[str, ...]:
        # the curriculum's step, so that a log shows where it stands (a fixed step is in the run's description)
        return () if self.ect_dt_start is None else ("ect_dt",)

    def student_forwards(self) -> float:
        """The student's forward and backward, and its forward without gradient at the stepped point."""
        return 4.0

    def teacher_forwards(self) -> float:
        """The teacher's (guided) forwards for the step's velocity; none for the data's."""
        return super().teacher_forwards() if self.ect_step == "teacher" else 0.0

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
        """The step's velocity, the student's jump from the stepped point (the bare network, without gradient), then
        one forward of ``model`` (wrapped for DDP) with gradient against the consistency target."""
        from accelerate.utils import extract_model_from_parallel

        t, r, z = noised.terms["t"], noised.terms["r"], noised.x_t
        if self.ect_step == "teacher":
            v = self.target_velocity(model, noised, labels, drop, autocast, frozen, step, ema)
        else:
            v = noised.terms["velocity"].float()
        size = self.step_size(step)
        s = torch.maximum(t - size, r)
        z_s = z - (t - s).reshape(-1, *([1] * (z.ndim - 1))) * v
        net = extract_model_from_parallel(model, keep_torch_compile=False)
        with torch.no_grad(), autocast():
            jump = self.average_velocity(net, z_s.to(z.dtype), s, r, labels, drop).sample.float()
        target = consistency_target(v.float(), jump, t, s, r).detach()
        noised.terms["target"] = target
        with autocast():
            out = self.average_velocity(model, z, t, r, labels, drop, return_head_masks=want_heads)
        losses = self.tangent_loss.regress(out.sample.float(), target, step)
        if self.ect_dt_start is not None:
            losses.extras["ect_dt"] = torch.full_like(losses.loss, size)
        return losses, out
