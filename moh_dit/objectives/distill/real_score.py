"""The real score of distribution matching (a part of :class:`~moh_dit.objectives.distill.dmd2.DMD2Distill` and the
methods on its pieces): the frozen teacher's velocity guided at the real score's own scale, and, for the samples a
multi-step generator makes from its grids' later start times, at a scale of their own (``distill.real_guidance_later``:
the first step lays out the image, the later ones its detail)."""

from __future__ import annotations

import torch

from moh_dit.argtypes import is_number
from moh_dit.errors import ConfigError

__all__ = ["RealScore"]


class RealScore:
    """The real score's scales and velocity, for an objective with the grids' ``start_times`` (1 first:
    :class:`~moh_dit.objectives.distill.generator.GridGenerator`)."""

    def set_real_scales(self, real_guidance: float | None, real_guidance_later: float | None) -> None:
        """The real score's scale (``None``: the teacher's) and the later steps' (``None``: the same); each >= 1."""
        for key, scale in (("real_guidance", real_guidance), ("real_guidance_later", real_guidance_later)):
            if scale is not None and (not is_number(scale) or not 1 <= scale < float("inf")):
                raise ConfigError(
                    f"distill.{key} must be a guidance scale >= 1 (1: the teacher unguided) or null (the "
                    f"{'teacher' if key == 'real_guidance' else 'first step'}'s), got {scale!r}"
                )
        self.real_guidance = None if real_guidance is None else float(real_guidance)
        self.real_guidance_later = None if real_guidance_later is None else float(real_guidance_later)

    def real_scales(self) -> list[float | None]:
        """The real score's scale at each start time of the grids (1 first; ``None``: the teacher's)."""
        later = self.real_guidance if self.real_guidance_later is None else self.real_guidance_later
        return [self.real_guidance] + [later] * (len(self.start_times) - 1)

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
        return real

    def real_velocity(self, teacher, x_t, t, labels, drop, autocast, start, grad: bool = False) -> torch.Tensor:
        """The real score's velocity at ``(x_t, t)``: the teacher's guided at ``real_guidance``, and at
        ``real_guidance_later`` for the samples made from a later grid time than the first (``start``); ``grad``: as
        :meth:`Teacher.velocity`'s. Each scale's rows are one pass of the teacher, so its evaluations count as
        before."""
        if self.real_guidance_later is None:
            return teacher.velocity(x_t, t, labels, drop, autocast, self.real_guidance, grad)
        later = start < self.start_times[0]
        v = torch.empty_like(x_t)
        for rows, scale in ((~later, self.real_guidance), (later, self.real_guidance_later)):
            rows = rows.nonzero().flatten()
            if rows.numel():
                y, dropped = (None if a is None else a[rows] for a in (labels, drop))
                v[rows] = teacher.velocity(x_t[rows], t[rows], y, dropped, autocast, scale, grad).to(v.dtype)
        return v
