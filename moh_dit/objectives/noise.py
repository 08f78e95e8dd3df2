"""Noise levels shared by every objective, in pure Python (no torch), so that sampling options can be checked and
carried between objectives before a model is loaded.

The common currency is ``sigma``: the noise's standard deviation over the signal's, ``x_t = a (x + sigma eps)``,
EDM's noise level. A DDPM timestep ``t`` of DiT's schedule has ``sigma = sqrt((1 - abar_t) / abar_t)``; a flow
time ``s`` (moh-dit's convention: ``s = 1`` is pure noise) has ``sigma = s / (1 - s)`` on the linear path and
``tan(pi s / 2)`` on the GVP (cosine) path. Two samplers at the same ``sigma`` see inputs of the same signal to
noise ratio, which is what makes a guidance interval mean the same thing for both objectives.
"""

from __future__ import annotations

import bisect
import functools
import math

__all__ = ["DIT_SCHEDULE", "dit_sigmas", "ddpm_sigma", "ddpm_timestep", "flow_sigma", "flow_time", "PATHS"]

# DiT's noise schedule (training and every DDPM sampler): 1000 steps, betas linear from 1e-4 to 0.02.
DIT_SCHEDULE = dict(num_train_timesteps=1000, beta_start=1e-4, beta_end=0.02, beta_schedule="linear")
PATHS = ("linear", "gvp")


@functools.cache  # a constant: DiT's table, computed once
def dit_sigmas() -> tuple[float, ...]:
    """The noise level of each of DiT's 1000 training timesteps."""
    n, lo, hi = DIT_SCHEDULE["num_train_timesteps"], DIT_SCHEDULE["beta_start"], DIT_SCHEDULE["beta_end"]
    abar, sigmas = 1.0, []
    for i in range(n):
        abar *= 1.0 - (lo + (hi - lo) * i / (n - 1))
        sigmas.append(math.sqrt((1.0 - abar) / abar))
    return tuple(sigmas)


def ddpm_sigma(t: float) -> float:
    """The noise level of DDPM timestep ``t`` (0 .. 999) of DiT's schedule; fractional ``t`` interpolates."""
    sigmas = dit_sigmas()
    if not 0 <= t <= len(sigmas) - 1:
        raise ValueError(f"a DDPM timestep is between 0 and {len(sigmas) - 1}, got {t}")
    low = int(math.floor(t))
    if low == t:
        return sigmas[low]
    return sigmas[low] + (t - low) * (sigmas[low + 1] - sigmas[low])


def ddpm_timestep(sigma: float) -> float:
    """The (fractional) DDPM timestep of DiT's schedule at noise level ``sigma``, clamped to 0 .. 999."""
    sigmas = dit_sigmas()
    if sigma <= sigmas[0]:
        return 0.0
    if sigma >= sigmas[-1]:
        return float(len(sigmas) - 1)
    high = bisect.bisect_left(sigmas, sigma)
    return high - 1 + (sigma - sigmas[high - 1]) / (sigmas[high] - sigmas[high - 1])


def flow_sigma(s: float, path: str = "linear") -> float:
    """The noise level of flow time ``s`` (0 = data, 1 = noise) on ``path``; ``inf`` at ``s = 1``."""
    if not 0 <= s <= 1:
        raise ValueError(f"a flow time is between 0 and 1, got {s}")
    if s == 1:
        return math.inf
    return s / (1 - s) if path == "linear" else math.tan(math.pi * s / 2)


def flow_time(sigma: float, path: str = "linear") -> float:
    """The flow time of noise level ``sigma`` on ``path`` (the inverse of :func:`flow_sigma`)."""
    if sigma < 0:
        raise ValueError(f"a noise level is >= 0, got {sigma}")
    if math.isinf(sigma):
        return 1.0
    return sigma / (1 + sigma) if path == "linear" else 2 / math.pi * math.atan(sigma)
