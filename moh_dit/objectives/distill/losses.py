r"""The meanflow method's loss and the references' stabilisers, per sample (docs/objective.md#the-stabilisers):

    g = v - u - w (t - r) du/dt            the step from the student's u to its target (no gradient); w the warm-up
    g = clamp(g, -c, c)                    with a tangent clamp (FACM's c = 1)

    l2        L = sum (u - sg(u + g))^2,   loss = L / sg(L + eps)^p                      MeanFlow's adaptive weight
    opt-grad  g = g sqrt(1 / D)  (spatial invariance, D elements),
              loss = sum (u - sg(u + g / (norm(g) + eps)^p))^2                           FastGen's `opt_grad`

``w = min(1, step / tangent_warmup)`` (FastGen's tangent warm-up: the derivative's term, which refers to the student
itself, grows in over the first steps; sCM's 10k, FastGen's distillation recipe 2000). Without clamp and warm-up,
``l2`` is MeanFlow's loss exactly. ``opt-grad`` regresses the student on a step of bounded length towards its target
(its gradient is ``2 g / (norm(g) + eps)^p``): one far-off sample cannot dominate an update. The arithmetic is in
float64, as FastGen's ``_mf_pred_to_loss``; ``tests/objectives/distill/test_losses.py`` checks every case against
outputs recorded from it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from moh_dit.argtypes import is_number, is_whole
from moh_dit.errors import ConfigError
from moh_dit.objectives.base import Losses

__all__ = ["TangentLoss", "TANGENT_LOSSES"]

TANGENT_LOSSES = ("l2", "opt-grad")


@dataclass(frozen=True)
class TangentLoss:
    """A meanflow student's loss (see the module docstring): ``kind`` (``l2`` or ``opt-grad``), the weight's ``power``
    and ``eps`` (``objective.adaptive_power``, ``adaptive_eps``: FastGen's ``poly_p`` and ``norm_const``), the
    ``spatial_invariance`` of an ``opt-grad`` step, the elementwise ``clamp`` of the step (``None``: none) and the
    steps of the derivative's ``warmup`` (0: none)."""

    kind: str = "l2"
    power: float = 1.0
    eps: float = 0.01
    spatial_invariance: bool = False
    clamp: float | None = None
    warmup: int = 0

    def __post_init__(self) -> None:
        if self.kind not in TANGENT_LOSSES:
            raise ConfigError(f"distill.loss must be {' or '.join(TANGENT_LOSSES)}, got {self.kind!r}")
        if not isinstance(self.spatial_invariance, bool):
            raise ConfigError(f"distill.spatial_invariance must be true or false, got {self.spatial_invariance!r}")
        if self.spatial_invariance and self.kind != "opt-grad":
            raise ConfigError(
                f"distill.spatial_invariance=true scales the opt-grad loss's step, not {self.kind}'s: with "
                f"distill.loss={self.kind} set distill.spatial_invariance=false"
            )
        clamp = self.clamp
        if clamp is not None and (not is_number(clamp) or not 0 < clamp < math.inf):
            raise ConfigError(f"distill.tangent_clamp must be a number > 0 (FACM's 1) or null, got {clamp!r}")
        warm = self.warmup
        if not is_whole(warm) or warm < 0:
            raise ConfigError(f"distill.tangent_warmup must be a number of steps >= 0, got {warm!r}")

    def warm(self, step: int | None) -> float:
        """The derivative term's weight at training ``step`` (1 without warm-up, or outside training)."""
        if not self.warmup or step is None:
            return 1.0
        return min(1.0, step / self.warmup)

    def __call__(
        self, u: torch.Tensor, velocity: torch.Tensor, derivative: torch.Tensor, step: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(loss, step g, weight)`` per sample for the student's ``u`` (with gradient), the teacher's ``velocity``
        and ``derivative = (t - r) du/dt`` (both without gradient): the loss in ``u``'s dtype, ``g`` (after clamp and
        scaling) and the weight in float64."""
        u64 = u.double()
        g = velocity.double() - u64.detach() - self.warm(step) * derivative.double()
        if self.clamp is not None:
            g = g.clamp(-self.clamp, self.clamp)
        if self.kind == "l2":
            error = ((u64 - (u64.detach() + g)) ** 2).flatten(1).sum(dim=1)
            weight = 1 / (error.detach() + self.eps) ** self.power
            return (error * weight).to(u.dtype), g, weight
        if self.spatial_invariance:
            g = g * math.sqrt(g.shape[0] / g.numel())
        weight = 1 / (torch.linalg.vector_norm(g.flatten(1), dim=1) + self.eps) ** self.power
        moved = (u64 + g * weight.reshape(-1, *([1] * (g.ndim - 1)))).detach()
        return ((u64 - moved) ** 2).flatten(1).sum(dim=1).to(u.dtype), g, weight

    def regress(self, u: torch.Tensor, target: torch.Tensor, step: int | None = None) -> Losses:
        """The loss of ``u`` (float32, with gradient) on a ``target`` held fixed (no derivative term) and the unweighted
        error the logs follow: the methods whose target holds nothing of the student's derivative."""
        loss, _, _ = self(u, target, torch.zeros_like(target), step)
        mse = ((u.detach() - target) ** 2).flatten(1).mean(dim=1)
        return Losses(loss=loss, mse=mse, logged=mse)

    def describe(self) -> str:
        weight = f"p {self.power:g}, c {self.eps:g}"
        parts = [
            f"MeanFlow's adaptively weighted error ({weight})"
            if self.kind == "l2"
            else f"FastGen's opt-grad step ({weight}{', per element' if self.spatial_invariance else ''})"
        ]
        if self.clamp is not None:
            parts.append(f"the step clamped to +-{self.clamp:g}")
        if self.warmup:
            parts.append(f"the derivative warmed up over {self.warmup} steps")
        return "; ".join(parts)
