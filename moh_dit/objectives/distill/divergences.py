r"""The divergence a DMD2 generator follows (``distill.vsd_divergence``; docs/objective.md#dmd2). One class each, one
entry each in :data:`DIVERGENCES`.

VSD's gradient at a noised sample x_t is the gap between the fake and the real score there: the gradient of the
reverse KL divergence KL(q_t || p_t) of the generator's noised distribution q_t from the teacher's p_t, which seeks
modes. f-distill (Xu, Nie and Vahdat 2025, arXiv:2502.15681) shows that the gradient of any f-divergence
D_f(p_t || q_t) is the same gap weighted, sample by sample, by h(r) = f''(r) r^2 of the density ratio r = p_t / q_t at
x_t; the weight is larger where the teacher has more mass than the generator, which covers modes the generator misses:

    reverse_kl  f(r) = -log r                              h(r) = 1             VSD itself (DMD, DMD2)
    js          f(r) = r log r - (r + 1) log((r + 1) / 2)  h(r) = r / (1 + r)   Jensen-Shannon: bounded, f-distill's best
    forward_kl  f(r) = r log r                             h(r) = r             mode-covering; unbounded weights

The ratio is read from the GAN term's discriminator (``distill.gan_weight`` > 0): trained with the non-saturating loss
on real images against the generator's samples, both noised to the VSD loss's times, its logit estimates log r at its
optimum (real data stands in for the teacher's distribution, as in f-distill). Until the discriminator trains
(``distill.gan_start``) every weight is 1: VSD. The weights carry no gradient and are divided by their mean over the
batch (f-distill's normalisation; DMD's own normalisation of the score gap stays), so only their relative size moves
the generator; in a run of several processes each normalises over its own batch. ``tests/objectives/distill/
test_divergences.py`` checks each h against f''(r) r^2 differentiated from f.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moh_dit.errors import ConfigError

__all__ = ["Divergence", "ReverseKL", "JensenShannon", "ForwardKL", "DIVERGENCES", "DEFAULT", "vsd_divergence"]


class Divergence:
    """A divergence of the generator's distribution from the teacher's: the log of its weight h(r) per sample, given
    the log density ratio ``log r`` (N,) at the VSD loss's noised samples."""

    name = ""
    needs_ratio = True  # whether its weight reads the discriminator's density ratio

    def log_weight(self, log_ratio: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def weights(self, log_ratio: torch.Tensor) -> torch.Tensor:
        """Per sample, h(r) divided by its mean over the batch (float32, no gradient): ``N * softmax(log h)``, which
        is that ratio without overflow where h is exp(logit)."""
        with torch.no_grad():
            log_h = self.log_weight(log_ratio.float().flatten())
            return log_h.numel() * torch.softmax(log_h, dim=0)

    def describe(self) -> str:
        return self.name


class ReverseKL(Divergence):
    """KL(q || p): VSD's own gradient, every sample weighted alike (DMD's, DMD2's)."""

    name = "reverse_kl"
    needs_ratio = False

    def log_weight(self, log_ratio: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(log_ratio)


class JensenShannon(Divergence):
    """The Jensen-Shannon divergence: h(r) = r / (1 + r), the sigmoid of the discriminator's logit."""

    name = "js"

    def log_weight(self, log_ratio: torch.Tensor) -> torch.Tensor:
        return F.logsigmoid(log_ratio)

    def describe(self) -> str:
        return "Jensen-Shannon (f-distill's weights from the discriminator's density ratio)"


class ForwardKL(Divergence):
    """KL(p || q): h(r) = r, the exponential of the discriminator's logit."""

    name = "forward_kl"

    def log_weight(self, log_ratio: torch.Tensor) -> torch.Tensor:
        return log_ratio

    def describe(self) -> str:
        return "forward KL (f-distill's weights from the discriminator's density ratio)"


DEFAULT = ReverseKL.name
DIVERGENCES: dict[str, type[Divergence]] = {cls.name: cls for cls in (ReverseKL, JensenShannon, ForwardKL)}


def vsd_divergence(name: str = DEFAULT, gan_weight: float = 0.0, gan_time: object = None) -> Divergence:
    """The divergence ``name``; an unknown name, or one that reads the density ratio without the discriminator that
    estimates it (``gan_weight`` 0) or with that discriminator noised at times of its own (``gan_time``: the ratio is
    wanted at the VSD loss's samples), is a :class:`ConfigError` naming the key."""
    if name not in DIVERGENCES:
        raise ConfigError(f"unknown distill.vsd_divergence {name!r}; choose one of {', '.join(DIVERGENCES)}")
    divergence = DIVERGENCES[name]()
    if divergence.needs_ratio and not gan_weight:
        raise ConfigError(
            f"distill.vsd_divergence={name} weighs VSD by the GAN discriminator's density ratio: it needs the GAN "
            "term on (distill.gan_weight > 0)"
        )
    if divergence.needs_ratio and gan_time is not None:
        raise ConfigError(
            f"distill.vsd_divergence={name} reads the density ratio at the VSD loss's own noised samples: leave "
            "distill.gan_time unset (null)"
        )
    return divergence
