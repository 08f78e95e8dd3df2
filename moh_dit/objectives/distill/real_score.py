"""The real score of distribution matching (a part of :class:`~moh_dit.objectives.distill.dmd2.DMD2Distill` and the
methods on its pieces): the frozen teacher's velocity guided at the real score's own scale, and, for the samples a
multi-step generator makes from its grids' later start times, at a scale of their own (``distill.real_guidance_later``:
the first step lays out the image, the later ones its detail). The scale may move over training too
(``distill.real_guidance_end`` over ``distill.real_guidance_ramp`` steps, then held): a scale above the sampler's pulls
a short run's students fastest, and its curves turn up late at two steps, so the ramp brings it down as they near the
teacher."""

from __future__ import annotations

import torch

from moh_dit.argtypes import is_number, is_whole
from moh_dit.errors import ConfigError

__all__ = ["RealScore"]


class RealScore:
    """The real score's scales and velocity, for an objective with the grids' ``start_times`` (1 first:
    :class:`~moh_dit.objectives.distill.generator.GridGenerator`)."""

    def set_real_scales(
        self,
        real_guidance: float | None,
        real_guidance_later: float | None,
        real_guidance_end: float | None = None,
        real_guidance_ramp: int | None = None,
    ) -> None:
        """The real score's scale (``None``: the teacher's) and the later steps' (``None``: the same), each >= 1; and
        the scale ``real_guidance`` moves to, linearly over the first ``real_guidance_ramp`` training steps (both or
        neither; ``None``: it stays)."""
        owners = {"real_guidance": "teacher", "real_guidance_later": "first step", "real_guidance_end": "start"}
        for key, scale in zip(owners, (real_guidance, real_guidance_later, real_guidance_end)):
            if scale is not None and (not is_number(scale) or not 1 <= scale < float("inf")):
                raise ConfigError(
                    f"distill.{key} must be a guidance scale >= 1 (1: the teacher unguided) or null (the "
                    f"{owners[key]}'s), got {scale!r}"
                )
        if real_guidance_ramp is not None and (not is_whole(real_guidance_ramp) or real_guidance_ramp < 1):
            raise ConfigError(
                f"distill.real_guidance_ramp must be a count of training steps >= 1, got {real_guidance_ramp!r}"
            )
        if (real_guidance_end is None) != (real_guidance_ramp is None):
            raise ConfigError(
                "distill.real_guidance_end and distill.real_guidance_ramp go together: the scale the real score moves "
                f"to and the training steps it takes (got {real_guidance_end!r} and {real_guidance_ramp!r})"
            )
        if real_guidance_end is not None and (real_guidance is None or real_guidance_later is not None):
            raise ConfigError(
                f"distill.real_guidance_end={real_guidance_end} moves the one scale distill.real_guidance sets: give "
                "distill.real_guidance and leave distill.real_guidance_later unset"
            )
        self.real_guidance = None if real_guidance is None else float(real_guidance)
        self.real_guidance_later = None if real_guidance_later is None else float(real_guidance_later)
        self.real_guidance_end = None if real_guidance_end is None else float(real_guidance_end)
        self.real_guidance_ramp = real_guidance_ramp

    def real_scale_at(self, step: int) -> float | None:
        """The real score's scale at training ``step`` (the first start time's; ``None``: the teacher's)."""
        if self.real_guidance_end is None:
            return self.real_guidance
        moved = min(1.0, step / self.real_guidance_ramp)
        return self.real_guidance + (self.real_guidance_end - self.real_guidance) * moved

    def real_scales(self, step: int = 0) -> list[float | None]:
        """The real score's scale at each start time of the grids (1 first; ``None``: the teacher's) at ``step``."""
        first = self.real_scale_at(step)
        later = first if self.real_guidance_later is None else self.real_guidance_later
        return [first] + [later] * (len(self.start_times) - 1)

    def describe_real(self) -> str:
        """The real score's scales in words, where they are its own (empty where it is the teacher's)."""
        real = ""
        if self.real_guidance is not None:
            real = (
                ", its real score unguided"
                if self.real_guidance == 1
                else f", its real score guided at {self.real_guidance:g}"
            )
        if self.real_guidance_later is not None:
            real += f" ({self.real_guidance_later:g} on the later grid steps)"
        if self.real_guidance_end is not None:
            real += f", moving to {self.real_guidance_end:g} over {self.real_guidance_ramp} steps"
        return real

    def real_velocity(
        self, teacher, x_t, t, labels, drop, autocast, start, grad: bool = False, step: int = 0
    ) -> torch.Tensor:
        """The real score's velocity at ``(x_t, t)`` at training ``step``: the teacher's guided at
        :meth:`real_scale_at`, and at ``real_guidance_later`` for the samples made from a later grid time than the
        first (``start``); ``grad``: as :meth:`Teacher.velocity`'s. Each scale's rows are one pass of the teacher, so
        its evaluations count as before."""
        if self.real_guidance_later is None:
            return teacher.velocity(x_t, t, labels, drop, autocast, self.real_scale_at(step), grad)
        later = start < self.start_times[0]
        scales = self.real_scales(step)  # the first start time's, then the later ones' (one scale: no ramp beside it)
        v = torch.empty_like(x_t)
        for rows, scale in ((~later, scales[0]), (later, scales[-1])):
            rows = rows.nonzero().flatten()
            if rows.numel():
                y, dropped = (None if a is None else a[rows] for a in (labels, drop))
                v[rows] = teacher.velocity(x_t[rows], t[rows], y, dropped, autocast, scale, grad).to(v.dtype)
        return v
