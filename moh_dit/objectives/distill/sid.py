r"""Score identity distillation, SiD (Zhou et al. 2024, arXiv:2404.04057; mingyuanzhou/SiD): DMD2's generator, fake
score, grids and GAN term (:class:`~moh_dit.objectives.distill.dmd2.DMD2Distill`) with another loss pulling the
generator towards the teacher's distribution (``distill.method: sid``; docs/objective.md#sid).

DMD's VSD follows the gradient of the reverse KL divergence: the fake score's clean prediction pulled towards the
real one's, neither differentiated. SiD's loss comes from a score identity instead: it estimates the Fisher divergence
between the generator's and the teacher's noised distributions, and its gradient runs through both scores' inputs
(their weights frozen):

    generator   x_t = (1 - t) x + t eps at a flow time t drawn per sample
                x0_real, x0_fake = the real and the fake score's clean predictions at (x_t, t), differentiated in x_t
                loss = w * mean over pixels (x0_real - x0_fake) * ((x0_real - x) - alpha (x0_real - x0_fake))
                       [moh_dit/objectives/distill/dmd_losses.py: sid_loss; w = 1 / mean |x - x0_real|, no gradient]
    fake score  DMD2's: the teacher's objective on the generator's samples

``alpha`` (``distill.sid_alpha``) weighs the fake score's own gap against the data's: SiD's 1.2 on every data set. A
generator step costs the two scores' backwards beside their forwards (three passes each instead of one: counted in
the logs and the budget). SiD's reference runs are data-free and long; its adversarial extension (SiDA) adds the GAN
term on real data through the fake score's features, which here is DMD2's ``distill.gan_weight``.
"""

from __future__ import annotations

from typing import Any

import torch

from moh_dit.argtypes import is_number
from moh_dit.errors import ConfigError
from moh_dit.objectives.distill.dmd2 import DMD2Distill
from moh_dit.objectives.distill.dmd_losses import sid_loss
from moh_dit.objectives.linear_path import clean_prediction

__all__ = ["SiDDistill"]


class SiDDistill(DMD2Distill):
    """SiD (see the module docstring).

    Args:
        sid_alpha: the weight of the fake score's gap against the data's in SiD's loss (SiD's 1.2), a number >= 0.
        **options: DMD2's (the fake score's rate and updates, the grids and backward simulation, the real score's
            guidance, the GAN term; ``vsd_weight`` weighs SiD's loss here).
    """

    method = "sid"
    title = "A SiD generator"
    distribution_term = "sid_loss"
    score_passes = 3.0  # each score's forward and its backward to the generator's sample

    def __init__(self, sid_alpha: float = 1.2, **options: Any) -> None:
        super().__init__(**options)
        if not is_number(sid_alpha) or not 0 <= sid_alpha < float("inf"):
            raise ConfigError(f"distill.sid_alpha must be a number >= 0 (SiD's 1.2), got {sid_alpha!r}")
        self.sid_alpha = float(sid_alpha)

    def describe_distribution(self) -> str:
        return (
            f"SiD's score-identity loss (alpha {self.sid_alpha:g}) through the teacher's and a fake score's clean "
            "predictions"
        )

    def distribution_loss(self, x, x_t, t, labels, drop, autocast, teacher, fake, start, step=0) -> torch.Tensor:
        """Per sample, SiD's loss of the generator's samples ``x`` (made from grid times ``start``) at their noised
        copy ``x_t``: both scores' clean predictions differentiated through their inputs (their weights frozen on a
        generator step), the real score's at its scale for each sample's grid step and at training ``step``
        (:meth:`real_velocity`)."""
        real = self.real_velocity(teacher, x_t, t, labels, drop, autocast, start, True, step)
        real_x0 = clean_prediction(x_t, t, real)
        fake_x0 = clean_prediction(x_t, t, self.fake_velocity(fake, teacher, x_t, t, labels, drop, autocast))
        return sid_loss(x, real_x0, fake_x0, self.sid_alpha)
