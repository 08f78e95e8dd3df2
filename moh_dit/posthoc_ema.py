"""Post-hoc EMA (Karras et al., "Analyzing and Improving the Training Dynamics of Diffusion Models", CVPR 2024,
arXiv:2312.02696): track power-function EMAs of the weights during training, keep snapshots of them, and rebuild
an EMA of any length afterwards as a linear combination of the snapshots.

A power-function EMA at training time ``t`` (counted in training images, so that every process and every
accumulation setting agrees) averages the weights with the profile ``p(tau) ~ tau^gamma`` on ``0 <= tau <= t``; its
relative standard deviation ``sigma_rel`` (the width of the profile over ``t``) is what a user chooses:

    sigma_rel(gamma) = sqrt((gamma + 1) / ((gamma + 2)^2 (gamma + 3)))       gamma: the largest real root of
    gamma^3 + 7 gamma^2 + (16 - sigma_rel^-2) gamma + (12 - sigma_rel^-2) = 0

Tracked by the recursion ``ema <- ema + (1 - beta) (net - ema)`` with ``beta = (1 - batch / t)^(gamma + 1)`` after
each step of ``batch`` images (the first step copies the weights), which approximates the profile. Any profile
``(t_out, sigma_out)`` is reconstructed from snapshots ``(t_i, sigma_i)`` by least squares in the space of profiles:
``A x = b`` with ``A_ij = <p_i, p_j>`` and ``b_i = <p_i, p_out>`` (closed-form inner products of two power
functions), solved in float64, each column normalised to sum to 1. The coefficients alternate in sign and reach
about 1, so the snapshots are kept in float32 by default: a float16 snapshot's rounding (about 5e-4 relative) goes
straight into the reconstruction.

``tests/test_posthoc_ema.py`` checks the functions against values the official ``training/phema.py`` of NVlabs/edm2
computed (recorded by tests/reference_outputs/record_phema.py). This module imports nothing of the package: training
tracks the EMAs with it, and :mod:`moh_dit.snapshots` writes them to a run folder and rebuilds weights from them
(which sampling does for autoguidance's guides and ``moh-dit ema``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import numpy as np
import torch

__all__ = [
    "sigma_rel_to_gamma",
    "gamma_to_sigma_rel",
    "power_function_beta",
    "power_function_correlation",
    "posthoc_coefficients",
    "profile_error",
    "PowerFunctionEMAs",
    "MAX_SIGMA_REL",
]

# sigma_rel of gamma -> 0 (a flat profile): larger values have no power function
MAX_SIGMA_REL = math.sqrt(1 / 12)


def gamma_to_sigma_rel(gamma: float | np.ndarray) -> np.ndarray:
    """The relative standard deviation of the profile ``tau^gamma``."""
    gamma = np.float64(gamma)
    return np.sqrt((gamma + 1) / ((gamma + 2) ** 2 * (gamma + 3)))


def sigma_rel_to_gamma(sigma_rel: float | np.ndarray) -> np.ndarray:
    """The exponent of the power function whose relative standard deviation is ``sigma_rel`` (0 < sigma_rel <
    :data:`MAX_SIGMA_REL`): the largest real root of the cubic above."""
    sigma_rel = np.float64(sigma_rel)
    if np.any(sigma_rel <= 0) or np.any(sigma_rel >= MAX_SIGMA_REL):
        raise ValueError(f"sigma_rel must be in (0, {MAX_SIGMA_REL:.4f}), got {sigma_rel}")
    inv = np.atleast_1d(sigma_rel).ravel() ** -2
    roots = [np.roots([1.0, 7.0, 16.0 - c, 12.0 - c]) for c in inv]
    gamma = np.float64([r[np.abs(r.imag) < 1e-9].real.max() for r in roots])
    return gamma.reshape(np.shape(sigma_rel))


def power_function_beta(sigma_rel: float, t_next: float, t_delta: float) -> float:
    """The EMA decay of a step of ``t_delta`` images that ends at image ``t_next``."""
    return float((1 - t_delta / t_next) ** (sigma_rel_to_gamma(sigma_rel) + 1))


def power_function_correlation(a_t, a_sigma, b_t, b_sigma) -> np.ndarray:
    """The inner product of the normalised profiles ``(a_t, a_sigma)`` and ``(b_t, b_sigma)`` (broadcast): with
    exponents ``ga, gb``, ``(ga + 1)(gb + 1) (min/max ratio)^(exponent of the shorter one's partner) / ((ga + gb +
    1) max(a_t, b_t))``."""
    a_t, b_t = np.float64(a_t), np.float64(b_t)
    ga, gb = sigma_rel_to_gamma(a_sigma), sigma_rel_to_gamma(b_sigma)
    ratio = a_t / b_t
    exponent = np.where(a_t < b_t, gb, -ga)
    return (ga + 1) * (gb + 1) * ratio**exponent / ((ga + gb + 1) * np.maximum(a_t, b_t))


def posthoc_coefficients(
    in_t: Sequence[float],
    in_sigma: Sequence[float],
    out_t: float | Sequence[float],
    out_sigma: float | Sequence[float],
) -> np.ndarray:
    """Coefficients ``X[input, output]`` that rebuild each output profile from the input snapshots' profiles
    (least squares in float64; columns normalised to sum to 1)."""
    in_t, in_sigma = np.broadcast_arrays(np.float64(in_t), np.float64(in_sigma))
    out_t, out_sigma = np.broadcast_arrays(np.float64(out_t), np.float64(out_sigma))
    rows = lambda v: v.reshape(-1, 1)  # noqa: E731
    cols = lambda v: v.reshape(1, -1)  # noqa: E731
    a = power_function_correlation(rows(in_t), rows(in_sigma), cols(in_t), cols(in_sigma))
    b = power_function_correlation(rows(in_t), rows(in_sigma), cols(out_t), cols(out_sigma))
    x = np.linalg.solve(a, b)
    return x / x.sum(axis=0)


def profile_error(
    in_t: Sequence[float], in_sigma: Sequence[float], coefficients: Sequence[float], out_t: float, out_sigma: float
) -> float:
    """How far the combination ``sum_i coefficients_i p_i`` of the snapshots' profiles is from the wanted profile
    ``p_out``: ``||sum_i x_i p_i - p_out|| / ||p_out||`` in L2 over time (0 for a tracked width at a snapshot's time).
    EDM2 gives no such number; a width outside the tracked ones is fitted less well the farther out it lies, so
    ``moh-dit ema`` records it beside the coefficients."""
    in_t, in_sigma = np.broadcast_arrays(np.float64(in_t), np.float64(in_sigma))
    x = np.float64(coefficients)
    a = power_function_correlation(in_t[:, None], in_sigma[:, None], in_t[None], in_sigma[None])
    b = power_function_correlation(in_t, in_sigma, out_t, out_sigma)
    c = float(power_function_correlation(out_t, out_sigma, out_t, out_sigma))
    squared = c - 2 * float(x @ b) + float(x @ a @ x)
    return math.sqrt(max(squared, 0.0) / c)


class PowerFunctionEMAs:
    """Power-function EMAs of a list of parameters, one per ``sigma_rel``, updated after every optimizer step
    with the number of training images seen (see the module docstring). Float32 copies on the parameters' device;
    ``state_dict`` / ``load_state_dict`` hold them for an exact resume."""

    def __init__(self, parameters: Iterable[torch.nn.Parameter], sigma_rels: Sequence[float]) -> None:
        self.parameters = list(parameters)
        self.sigma_rels = [float(s) for s in sigma_rels]
        for s in self.sigma_rels:
            sigma_rel_to_gamma(s)  # a ValueError for one out of range
        self.emas = [[p.detach().float().clone() for p in self.parameters] for _ in self.sigma_rels]

    @torch.no_grad()
    def update(self, images_seen: int, batch_images: int) -> None:
        """After a step of ``batch_images`` images ending at ``images_seen``: ``ema <- lerp(ema, net, 1 - beta)``
        (the first step, ``images_seen == batch_images``, copies the weights)."""
        for sigma_rel, ema in zip(self.sigma_rels, self.emas):
            weight = 1 - power_function_beta(sigma_rel, images_seen, batch_images)
            for p_ema, p in zip(ema, self.parameters):
                p_ema.lerp_(p.detach().float(), weight)

    def tensors(self, index: int) -> list[torch.Tensor]:
        """The EMA of ``sigma_rels[index]``, one tensor per parameter."""
        return self.emas[index]

    def state_dict(self, names: Sequence[str]) -> dict[str, torch.Tensor]:
        """Every EMA under ``<sigma_rel>/<parameter name>`` (what a checkpoint saves)."""
        return {
            f"{sigma_rel:.6g}/{name}": t.detach().cpu().contiguous()
            for sigma_rel, ema in zip(self.sigma_rels, self.emas)
            for name, t in zip(names, ema)
        }

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, torch.Tensor], names: Sequence[str]) -> None:
        for sigma_rel, ema in zip(self.sigma_rels, self.emas):
            for name, t in zip(names, ema):
                key = f"{sigma_rel:.6g}/{name}"
                if key not in state:
                    raise KeyError(f"the post-hoc EMA state has no {key}: tracked with other sigma_rels?")
                t.copy_(state[key])
