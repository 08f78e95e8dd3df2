r"""The losses of distribution matching distillation (DMD2, Yin et al. 2024, arXiv:2405.14867), per sample, as
NVlabs/FastGen's ``fastgen/methods/common_loss.py`` computes them (``tests/objectives/distill/test_dmd2.py`` checks each, with
its gradient, against outputs recorded from it):

    variational score distillation, the generator's loss (x: its sample, x0_real / x0_fake: the two scores' clean
    predictions at a noised copy of x, no gradient):
        w = 1 / (mean over pixels |x - x0_real| + 1e-6)          (no gradient; times an optional per-sample scale)
        L = 0.5 * mean over pixels (x - sg(x - w (x0_fake - x0_real)))^2
    its gradient in x is w (x0_fake - x0_real) / numel: the fake score's view pulled towards the real one's

    GAN, non-saturating: the generator's softplus(-D(fake)); the discriminator's softplus(D(fake)) + softplus(-D(real))

Each returns one value per sample; their mean over the batch is FastGen's (mean-reduced) loss.

Score identity distillation's generator loss (SiD, Zhou et al. 2024, arXiv:2404.04057; mingyuanzhou/SiD's
``training/sid_loss.py``, checked with its gradient against outputs recorded from it), with the same inputs but the
two clean predictions *with* their gradient through the scores' inputs (the scores' weights frozen):

        w = 1 / max(mean over pixels |x - x0_real|, 1e-5)          (no gradient)
        L = w * mean over pixels (x0_real - x0_fake) * ((x0_real - x) - alpha (x0_real - x0_fake))

SiD sums over pixels and scales by 100 / batch (its fp16 loss scaling); the mean over pixels here is that loss divided
by a constant, which Adam's update does not see (only its epsilon does).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["vsd_loss", "sid_loss", "gan_generator_loss", "gan_discriminator_loss"]


def _per_sample(x: torch.Tensor) -> torch.Tensor:
    return x.flatten(1).mean(dim=1)


def vsd_loss(
    generated: torch.Tensor, real_x0: torch.Tensor, fake_x0: torch.Tensor, scale: torch.Tensor | None = None
) -> torch.Tensor:
    """Per sample, the variational score distillation loss of ``generated`` (with gradient) given the real score's
    (the guided teacher's) and the fake score's clean predictions (without), normalised by the mean absolute gap
    between the sample and the real score's prediction; the weight in float32 (FastGen's: fp16 overflows it)."""
    with torch.no_grad():
        gap = _per_sample((generated.float() - real_x0.float()).abs())
        weight = 1 / (gap + 1e-6)
        if scale is not None:
            weight = weight * scale.float()
        weight = weight.to(generated.dtype).reshape(-1, *([1] * (generated.ndim - 1)))
        target = generated - weight * (fake_x0 - real_x0)
    return 0.5 * _per_sample((generated - target) ** 2)


def sid_loss(generated: torch.Tensor, real_x0: torch.Tensor, fake_x0: torch.Tensor, alpha: float) -> torch.Tensor:
    """Per sample, SiD's generator loss of ``generated`` given the real score's and the fake score's clean predictions
    at its noised copy, each differentiated (through the scores' inputs) where it carries a gradient; normalised by
    the mean absolute gap between the sample and the real prediction, in float32 at least (see the module docstring)."""
    dtype = torch.promote_types(generated.dtype, torch.float32)  # half precision up, float64 kept
    generated, real_x0, fake_x0 = (v.to(dtype) for v in (generated, real_x0, fake_x0))
    with torch.no_grad():
        weight = 1 / _per_sample((generated - real_x0).abs()).clamp(min=1e-5)
    gap = real_x0 - fake_x0
    return weight * _per_sample(gap * ((real_x0 - generated) - alpha * gap))


def gan_generator_loss(fake_logits: torch.Tensor) -> torch.Tensor:
    """Per sample, the non-saturating generator loss ``softplus(-D(fake))``."""
    return _per_sample(F.softplus(-fake_logits))


def gan_discriminator_loss(real_logits: torch.Tensor, fake_logits: torch.Tensor) -> torch.Tensor:
    """Per sample, the discriminator's ``softplus(D(fake)) + softplus(-D(real))``."""
    return _per_sample(F.softplus(fake_logits)) + _per_sample(F.softplus(-real_logits))
