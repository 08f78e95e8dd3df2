"""The fake score's own guidance (a part of :class:`~moh_dit.objectives.distill.dmd2.DMD2Distill` and the methods on its
pieces), SiD-LSG's *long and short guidance* (Zhou et al., arXiv:2406.01561; mingyuanzhou/SiD-LSG): the fake score
is trained through its classifier-free-guided prediction at one scale (``distill.fake_guidance``, LSG's kappa_1) and
read by the generator's loss at another (``distill.fake_guidance_eval``, kappa_2 = kappa_3; null: the same).

What it changes, in the limit of a fake score that fits: trained guided at ``k1``, the fake's conditional and
unconditional predictions ``c`` and ``u`` satisfy ``u + k1 (c - u) = g_c``, the generator's class-conditional score
(``u`` is the generator's unconditional score: the rows whose label the run drops train it directly). Read at ``k2``
it gives ``u + (k2 / k1) (g_c - u)``: at ``k2 = k1`` the generator's own score, as without the key (the difference
is then only in how the network fits), and at ``k2 > k1`` the generator's score guided away from its own
unconditional one, so that matching the real score's guided distribution leaves the generator itself less sharp than
that target (more of its variety). Both scales guide over the teacher's guided flow times (the real score's), on the
fake score itself (CFG, never the teacher's guide); each guided pass runs the conditional and unconditional halves
in one batched forward (counted as two)."""

from __future__ import annotations

import dataclasses
from typing import Any

from moh_dit.argtypes import is_number
from moh_dit.errors import ConfigError

__all__ = ["FakeGuidance"]


class FakeGuidance:
    """The fake score's training and reading scales (1: unguided, as DMD2's), and the guidance they make from the
    teacher's (its flow times)."""

    def set_fake_scales(self, fake_guidance: float | None, fake_guidance_eval: float | None) -> None:
        """The scale the fake score trains at (``None``: 1, unguided) and the one the generator's loss reads it at
        (``None``: the training scale), each >= 1."""
        for key, scale in (("fake_guidance", fake_guidance), ("fake_guidance_eval", fake_guidance_eval)):
            if scale is not None and (not is_number(scale) or not 1 <= scale < float("inf")):
                raise ConfigError(
                    f"distill.{key} must be a guidance scale >= 1 (1: the fake score unguided) or null, got {scale!r}"
                )
        self.fake_guidance = None if fake_guidance is None else float(fake_guidance)
        self.fake_guidance_eval = None if fake_guidance_eval is None else float(fake_guidance_eval)

    @property
    def fake_train_scale(self) -> float:
        """The scale the fake score is trained at (1: its plain conditional prediction)."""
        return 1.0 if self.fake_guidance is None else self.fake_guidance

    @property
    def fake_read_scale(self) -> float:
        """The scale the generator's loss reads the fake score at."""
        return self.fake_train_scale if self.fake_guidance_eval is None else self.fake_guidance_eval

    def fake_guidance_of(self, teacher: Any, scale: float) -> Any | None:
        """The guidance the fake score runs at ``scale``: the teacher's (its flow times) as CFG on the fake score
        itself; ``None`` where ``scale`` is 1."""
        if scale == 1.0:
            return None
        return dataclasses.replace(teacher.guidance, scale=scale, guide=None)

    def fake_velocity(self, fake: Any, teacher: Any, x_t, t, labels, drop, autocast) -> Any:
        """The fake score's velocity at ``(x_t, t)`` as the generator's loss reads it: guided at
        :attr:`fake_read_scale` over the teacher's guided flow times (unguided at 1)."""
        guidance = self.fake_guidance_of(teacher, self.fake_read_scale)
        if guidance is None:
            return fake.velocity(x_t, t, labels, drop, autocast)
        return fake.velocity(x_t, t, labels, drop, autocast, guidance)

    def train_fake(self, fake: Any, teacher: Any, x, labels, drop, generator, autocast, real, generated) -> Any:
        """The fake score's losses on the generator's samples ``x`` (``FakeScore.train_on``), trained through its
        prediction guided at :attr:`fake_train_scale` (unguided at 1)."""
        guidance = self.fake_guidance_of(teacher, self.fake_train_scale)
        trained = {"guidance": guidance} if guidance is not None else {}
        return fake.train_on(x, labels, drop, generator, autocast, real, generated, **trained)

    def fake_record(self) -> dict[str, float]:
        """The scales for the generator's record, where they are set."""
        keys = ("fake_guidance", "fake_guidance_eval")
        return {key: getattr(self, key) for key in keys if getattr(self, key) is not None}

    def describe_fake(self) -> str:
        """The fake score's guidance in words (empty where it is unguided)."""
        if self.fake_train_scale == 1.0 and self.fake_read_scale == 1.0:
            return ""
        read = "" if self.fake_read_scale == self.fake_train_scale else f", read at {self.fake_read_scale:g}"
        return f"; the fake score guided at {self.fake_train_scale:g} in training{read} (SiD-LSG)"
