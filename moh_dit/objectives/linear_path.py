"""DiT's DDPM seen on the linear path ``z = (1 - t) x + t eps`` (flow time ``t``, 1: noise): the fractional DiT
timestep of a noise level and back, the input a DDPM model sees at the same signal-to-noise ratio, and the linear
path's velocity from its noise prediction. What a DDPM teacher gives its students (``DDPM.linear_velocity``) and what a
student in its teacher's parameterization sees (``moh_dit.objectives.distill.heads``); docs/objective.md#the-target."""

from __future__ import annotations

import torch

from moh_dit.objectives.noise import dit_sigmas

__all__ = [
    "clean_prediction",
    "timestep_of_sigma",
    "sigma_of_timestep",
    "timestep_of_flow_time",
    "linear_path_input",
    "velocity_of_noise",
    "velocity_of_ddpm_noise",
]


def _sigma_table(device: torch.device) -> torch.Tensor:
    return torch.tensor(dit_sigmas(), dtype=torch.float64, device=device)


def timestep_of_sigma(sigma: torch.Tensor) -> torch.Tensor:
    """The fractional DiT timestep of each noise level ``sigma`` (its schedule's levels interpolated linearly, clamped
    to 0 .. 999): :func:`moh_dit.objectives.noise.ddpm_timestep` on tensors, float64, differentiable in ``sigma``."""
    table = _sigma_table(sigma.device)
    sigma = sigma.to(torch.float64).clamp(table[0], table[-1])
    high = torch.searchsorted(table, sigma.detach()).clamp(1, len(table) - 1)
    low = high - 1
    return low + (sigma - table[low]) / (table[high] - table[low])


def sigma_of_timestep(tau: torch.Tensor) -> torch.Tensor:
    """The noise level of each fractional DiT timestep ``tau`` (interpolated): the inverse of
    :func:`timestep_of_sigma`."""
    table = _sigma_table(tau.device)
    tau = tau.to(torch.float64).clamp(0, len(table) - 1)
    low = tau.detach().floor().long().clamp(0, len(table) - 2)
    return table[low] + (tau - low) * (table[low + 1] - table[low])


def timestep_of_flow_time(t: torch.Tensor) -> torch.Tensor:
    """The fractional DiT timestep (float64) of the noise level ``t / (1 - t)`` of each flow time ``t``; beyond DiT's
    schedule (``t = 1`` included) the nearest timestep."""
    t64 = t.to(torch.float64).clamp(0, 1)
    return timestep_of_sigma(t64 / (1 - t64).clamp(min=1e-12))


def linear_path_input(z: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The linear path's ``z = (1 - t) x + t eps`` at flow time ``t`` (N,) as DiT's DDPM model sees the same
    signal-to-noise ratio: the (fractional) timestep ``tau`` of the level ``sigma = t / (1 - t)`` and the input
    ``sqrt(abar) z / (1 - t) = z / sqrt((1 - t)^2 + t^2)`` (unit variance, as the model was trained on). Beyond DiT's
    schedule (``sigma`` outside timestep 0's .. 999's) the nearest timestep, the input still at unit variance (at
    ``t = 1``: the noise itself). Returns the input (``z``'s dtype) and ``tau`` (float64)."""
    t64 = t.to(torch.float64).clamp(0, 1)
    tau = timestep_of_flow_time(t64)
    scale = (1 / ((1 - t64) ** 2 + t64**2).sqrt()).reshape(-1, *([1] * (z.ndim - 1)))
    return (z.double() * scale).to(z.dtype), tau


def clean_prediction(x_t: torch.Tensor, t: torch.Tensor, velocity: torch.Tensor) -> torch.Tensor:
    """The data a velocity ``v`` of the linear path predicts from ``x_t`` at flow times ``t`` (N,): ``x_t - t v``, in
    float32 at least."""
    return x_t - t.reshape(-1, *([1] * (x_t.ndim - 1))) * velocity.to(
        torch.promote_types(velocity.dtype, torch.float32)
    )


def velocity_of_noise(eps: torch.Tensor, z: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """The linear path's velocity ``eps - x`` from a noise prediction ``eps`` at ``(z, t)``: with ``x = (z - t eps) /
    (1 - t)`` it is ``(eps - z) / (1 - t)``, in float64 (differentiable)."""
    t64 = t.to(torch.float64).clamp(max=1 - 1e-12).reshape(-1, *([1] * (z.ndim - 1)))
    return (eps.double() - z.double()) / (1 - t64)


def velocity_of_ddpm_noise(eps: torch.Tensor, z: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """The linear path's velocity from a DDPM model's noise prediction ``eps`` for ``linear_path_input(z, t)``, at any
    flow time: ``(eps - z) / (1 - t)`` inside DiT's schedule (:func:`velocity_of_noise`). Beyond its noisiest level
    (``t > 0.99369``) that divisor goes to 0 (at ``t = 1`` the velocity was infinite, and a few such samples wrecked a
    student's targets: docs/objective.md#the-diagnosis); there the model's clean estimate at timestep 999 in its own
    variables, ``x = x_999 sqrt(1 + sigma^2) - sigma eps``, gives ``v = (z - x) / t`` (at ``t = 1``: ``z - x``,
    since the noise is ``z`` itself). Float64."""
    model_in, tau = linear_path_input(z, t)
    t64 = t.to(torch.float64).clamp(0, 1).reshape(-1, *([1] * (z.ndim - 1)))
    top = _sigma_table(z.device)[-1]
    beyond = (t64 / (1 - t64).clamp(min=1e-300)) > top
    inside = velocity_of_noise(eps, z, t.clamp(max=float(top / (1 + top))))
    sigma = sigma_of_timestep(tau).reshape(t64.shape)
    x = model_in.double() * (1 + sigma**2).sqrt() - sigma * eps.double()
    return torch.where(beyond, (z.double() - x) / t64.clamp(min=1e-12), inside)
