r"""Classifier-free guidance folded into the training target, shared by the objectives that offer it (DDPM, flow,
MeanFlow).

Inside the guided times, the target ``y`` of a sample (DDPM's noise, flow's velocity, MeanFlow's instantaneous
velocity) is replaced by

    y_g = omega y + (1 - omega - kappa) f(x_t, null) + kappa f(x_t, c)        (kappa = 0: f_u + omega (y - f_u))

where ``f`` is the network's own prediction of that target (its current weights, or its EMA's), without gradient.
MeanFlow's authors write it with ``omega`` and ``kappa``; Model Guidance (Tang et al. 2025, arXiv:2502.12154) writes
``y + w sg(f(x_t, c) - f(x_t, null))``, which is ``omega = 1, kappa = w``. At the fixed point the network's conditional
prediction is classifier-free guidance of scale ``omega / (1 - kappa)`` applied to its unconditional one, so the
trained model samples at that guidance with one evaluation per step. Samples whose label was dropped keep ``y``: they
teach the unconditional prediction the guidance is built from.

Written here rather than taken from a library: diffusers' guiders act at sampling time, and no library folds
guidance into a training target.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from moh_dit.argtypes import is_number, is_whole
from moh_dit.errors import ConfigError

__all__ = ["FoldedGuidance", "GUIDANCE_SOURCES", "FOLDED_KEYS"]

GUIDANCE_SOURCES = ("model", "ema")  # whose predictions the guided target is built from
FOLDED_KEYS = ("guidance_scale", "guidance_mix", "guidance_times")  # what a model records of it


def _number(value: Any, what: str, low: float, high: float) -> float:
    if not is_number(value) or not low <= value <= high:
        raise ConfigError(f"{what} must be a number in [{low}, {high}], got {value!r}")
    return float(value)


@dataclass(frozen=True)
class FoldedGuidance:
    """Guidance folded into a training target (see the module docstring).

    ``omega``, ``kappa``: the mix (recorded with the model as ``guidance_scale``, ``guidance_mix``); ``times``: the
    ``[first, last]`` flow times where it applies (recorded as ``guidance_times``; an objective with another time
    axis converts its times to flow times of the same noise level); ``warmup``: training steps before it applies;
    ``source``: ``model`` (the network being trained) or ``ema`` (its EMA weights) makes the predictions."""

    omega: float = 1.0
    kappa: float = 0.0
    times: tuple[float, float] = (0.0, 1.0)
    warmup: int = 0
    source: str = "model"

    @classmethod
    def create(
        cls,
        scale: float | None = None,
        mix: float | None = None,
        times: Any = None,
        warmup: int | None = None,
        source: str | None = None,
    ) -> FoldedGuidance:
        """Checked values (``None``: the default); each error names its config key."""
        omega = 1.0 if scale is None else _number(scale, "objective.guidance_scale (omega)", -math.inf, math.inf)
        kappa = 0.0 if mix is None else _number(mix, "objective.guidance_mix (kappa)", 0.0, 0.999)
        times = [0.0, 1.0] if times is None else times
        if not isinstance(times, (list, tuple)) or len(times) != 2 or not all(is_number(v) for v in times):
            raise ConfigError(f"objective.guidance_times must be [first, last] flow times, got {times!r}")
        if not 0 <= times[0] <= times[1] <= 1:
            raise ConfigError(f"objective.guidance_times must satisfy 0 <= first <= last <= 1, got {list(times)}")
        warmup = 0 if warmup is None else warmup
        if not is_whole(warmup) or warmup < 0:
            raise ConfigError(f"objective.guidance_warmup must be a number of steps >= 0, got {warmup!r}")
        source = source or "model"
        if source not in GUIDANCE_SOURCES:
            raise ConfigError(
                f"objective.guidance_source must be one of {', '.join(GUIDANCE_SOURCES)}, got {source!r}"
            )
        return cls(omega, kappa, (float(times[0]), float(times[1])), warmup, source)

    @property
    def active(self) -> bool:
        """Whether it changes the target at all (omega != 1 or kappa > 0)."""
        return self.omega != 1.0 or self.kappa > 0

    @property
    def forwards(self) -> float:
        """Forward passes per image it adds to a training step (FLOPs, MFU): the conditional and unconditional
        predictions with ``kappa``, the unconditional one without (counted for every sample, an upper bound outside
        the guided times and the warm-up), none when inactive."""
        return (2.0 if self.kappa > 0 else 1.0) if self.active else 0.0

    @property
    def effective_scale(self) -> float:
        """The classifier-free guidance scale the trained model samples at: ``omega / (1 - kappa)``."""
        return self.omega / (1 - self.kappa)

    def record(self) -> dict[str, Any]:
        """What the model records (what the weights learned; the warm-up and source only shaped training)."""
        return {"guidance_scale": self.omega, "guidance_mix": self.kappa, "guidance_times": list(self.times)}

    def describe(self) -> str:
        when = "" if self.times == (0.0, 1.0) else f" at flow times {self.times[0]:g}-{self.times[1]:g}"
        after = f", from step {self.warmup}" if self.warmup else ""
        whose = "its EMA's" if self.source == "ema" else "its own"
        return (
            f"guidance folded into training (omega {self.omega:g}, kappa {self.kappa:g}: CFG "
            f"{self.effective_scale:g}{when}, {whose} predictions{after})"
        )

    def rows(self, flow_t: torch.Tensor, drop: torch.Tensor | None, step: int | None) -> torch.Tensor:
        """The indices of the samples it guides: inside the times, label kept, the warm-up over (``step`` None: a
        caller outside training, always over)."""
        if not self.active or (step is not None and step < self.warmup):
            return torch.zeros(0, dtype=torch.long, device=flow_t.device)
        rows = (flow_t >= self.times[0]) & (flow_t <= self.times[1])
        if drop is not None:
            rows &= drop == 0
        return rows.nonzero().flatten()

    def fold(
        self,
        target: torch.Tensor,
        rows: torch.Tensor,
        labels: torch.Tensor,
        null_id: int | None,
        predict: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    ) -> torch.Tensor:
        """``target`` with its ``rows`` guided. ``predict(index, labels)`` is the network's prediction of the target
        for the samples ``index`` with ``labels`` as given (called once, batched: the unconditional half, and with
        kappa > 0 the conditional one); it runs without gradient here."""
        if rows.numel() == 0:
            return target
        if null_id is None:
            raise ConfigError("guidance folded into training needs label dropout (model.class_dropout_prob > 0)")
        y = labels[rows]
        both = self.kappa > 0  # kappa = 0 needs only the unconditional prediction
        y_in = torch.cat([torch.full_like(y, null_id), y]) if both else torch.full_like(y, null_id)
        with torch.no_grad():
            out = predict(rows.repeat(2 if both else 1), y_in).float()
        uncond, cond = out.chunk(2) if both else (out, None)
        mine = target[rows].float()
        if both:
            guided = self.omega * mine + (1 - self.omega - self.kappa) * uncond + self.kappa * cond
        else:
            guided = uncond + self.omega * (mine - uncond)
        folded = target.clone()
        folded[rows] = guided.to(target.dtype)
        return folded
