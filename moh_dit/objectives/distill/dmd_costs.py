"""What a step of distribution matching costs (DMD2's and the methods on its pieces: SiD's, rCM's), per image in
network evaluations at the student's size: which network a step updates, and every pass of the networks trained and
of the teacher. The training logs count the same passes as they happen (docs/objective.md#what-a-distillation-costs);
the study sets each stage's length from these counts (experiments/distill_dmd2.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["DMDCosts"]


def _halves(scale: float) -> float:
    """The passes of one guided evaluation: its conditional and unconditional halves (1 where unguided)."""
    return 1.0 if scale == 1.0 else 2.0


class DMDCosts:
    """The cost side of :class:`~moh_dit.objectives.distill.dmd2.DMD2Distill`, a mixin before the distillation's
    base: it reads the method's settings (``fake_updates``, ``gan_weight``, ``gan_start``, ``vsd_weight``,
    ``regression`` and its ``distance``, ``score_passes``, the fake score's scales), the real score's scale at each
    start time (:meth:`~moh_dit.objectives.distill.real_score.RealScore.real_scales`) and its grids' shares and
    backward simulation's passes."""

    def updates(self, step: int) -> str:
        """Which network training ``step`` updates: the student first, then the fake score ``fake_updates`` times."""
        return "student" if step % (self.fake_updates + 1) == 0 else "fake_score"

    def gan_on(self, step: int | None) -> bool:
        """Whether the GAN term and its discriminator train at ``step``."""
        return bool(self.gan_weight) and (step or 0) >= self.gan_start

    def step_forwards(self, step: int, companions: Mapping[str, Any] | None = None) -> float:
        """Every pass of the networks trained at training ``step``, per image, in forwards at the student's size (a
        backward counts two; the real score's evaluations are counted as they happen). The generator's step: its
        backward simulation, its forward and backward, the fake score's forward, the GAN term's pass to the
        discriminator's block (``gan_share``: the share of the depth it runs) with its backward, the regression's
        forward and backward and its distance's passes of the teacher. The fake score's: the generator's forward, its
        own loss's forward and backward, and the discriminator's passes on real and generated images with their
        backwards. The discriminator's block over the fake score's depth from ``companions`` (its middle by default).
        A distribution loss that differentiates through the scores (:attr:`score_passes`) counts their backwards. A
        guided fake score (:class:`~moh_dit.objectives.distill.fake_guidance.FakeGuidance`) counts two of each of its
        passes, where it is guided and where not (as the budget counts the teacher: as if guided at every time)."""
        fake = (companions or {}).get("fake_score")
        share = fake.block_share if fake is not None else 0.5
        gan = 3.0 * share if self.gan_on(step) else 0.0
        if self.updates(step) == "student":
            fake = self.score_passes * _halves(self.fake_read_scale) if self.vsd_weight else 0.0
            regressed = 3.0 + self.distance.teacher_passes if self.regression else 0.0
            return self.simulated_forwards() + 3.0 + fake + gan + regressed
        return self.simulated_forwards() + 1.0 + 3.0 * _halves(self.fake_train_scale) + 2.0 * gan

    def student_forwards(self) -> float:
        """Per image, averaged over a cycle of generator and fake-score steps with the GAN term on (:meth:`step_forwards`)."""
        cycle = range(self.gan_start, self.gan_start + self.fake_updates + 1)
        return sum(self.step_forwards(s) for s in cycle) / (self.fake_updates + 1)

    def teacher_forwards_at(self, step: int) -> float:
        """The teacher's forwards per image at training ``step``: the real score's on the generator's steps, two where
        it is guided (counted as guided at every time; the logs count them exactly) at that step's scale (a ramped
        scale that reaches 1 turns unguided), averaged over the grids' start times at their shares where the later
        ones have a scale of their own, each with its backward where the loss
        differentiates through it (:attr:`score_passes`)."""
        if self.updates(step) != "student" or not self.vsd_weight:
            return 0.0
        teacher_guided = super().teacher_forwards() == 2.0
        guided = [scale != 1.0 if scale is not None else teacher_guided for scale in self.real_scales(step)]
        return sum((2.0 if g else 1.0) * share for g, share in zip(guided, self.start_shares())) * self.score_passes

    def teacher_forwards(self) -> float:
        """The teacher's forwards per image, averaged over a cycle of updates (:meth:`teacher_forwards_at`)."""
        return sum(self.teacher_forwards_at(s) for s in range(self.fake_updates + 1)) / (self.fake_updates + 1)
