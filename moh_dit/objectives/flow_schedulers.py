"""The two flow-matching samplers diffusers lacks in the form moh-dit needs (everything else comes from diffusers).

- :class:`FlowHeunScheduler`: diffusers' ``FlowMatchHeunDiscreteScheduler`` spaces its grid linearly from 1 to
  1/1000 and takes no other; this one also takes the grid as ``sigmas`` (moh-dit's grids end at 0 and may be
  time-shifted), and is otherwise diffusers' code.
- :class:`FlowSDEScheduler`: SiT's stochastic sampler (Ma et al., 2024, arXiv:2401.08740), which diffusers does
  not have: Euler-Maruyama on the reverse-time SDE whose diffusion is the path's noise coefficient (SiT's
  ``diffusion_form="sigma"``), from noise to flow time ``last_step_size``, then one step without noise to the data
  ("Mean" in SiT; REPA's ``euler_maruyama_sampler`` is the same sampler). ``n`` steps evaluate the network ``n``
  times.

Both use moh-dit's convention: flow time ``s`` runs from 1 (noise) to 0 (data) and the model output they take is
the velocity ``v = dx_s/ds`` (docs/objective.md).
"""

from __future__ import annotations

import math

import torch
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.schedulers import FlowMatchHeunDiscreteScheduler
from diffusers.schedulers.scheduling_utils import SchedulerMixin, SchedulerOutput
from diffusers.utils.torch_utils import randn_tensor

__all__ = ["FlowHeunScheduler", "FlowSDEScheduler", "MeanFlowScheduler", "path_coefficients", "noise_from_velocity"]


def path_coefficients(s: torch.Tensor, path: str) -> tuple[torch.Tensor, ...]:
    """``(a, b, da, db)`` of ``x_s = a(s) x + b(s) eps`` and their derivatives in ``s``: the linear path
    ``a = 1 - s, b = s`` or the GVP (cosine) path ``a = cos(pi s / 2), b = sin(pi s / 2)``."""
    if path == "linear":
        return 1 - s, s, -torch.ones_like(s), torch.ones_like(s)
    if path == "gvp":
        half = math.pi / 2
        return torch.cos(half * s), torch.sin(half * s), -half * torch.sin(half * s), half * torch.cos(half * s)
    raise ValueError(f"path must be linear or gvp, got {path!r}")


def noise_from_velocity(velocity: torch.Tensor, sample: torch.Tensor, s: torch.Tensor, path: str) -> torch.Tensor:
    """``E[eps | x_s]`` from the velocity ``E[v | x_s]``: the two equations ``x_s = a x + b eps`` and ``v = a' x + b'
    eps`` solved for ``eps``; the score is ``-eps / b``."""
    a, b, da, db = path_coefficients(s, path)
    return (a * velocity - da * sample) / (a * db - da * b)


class FlowHeunScheduler(FlowMatchHeunDiscreteScheduler):
    """diffusers' flow-matching Heun sampler on any grid: ``set_timesteps(sigmas=[1, ..., s_n])`` (0 is appended).
    Every step but the last (to 0) is Heun's, so ``n`` steps evaluate the network ``2n - 1`` times."""

    def set_timesteps(
        self, num_inference_steps: int | None = None, device: str | torch.device = None, sigmas: list | None = None
    ) -> None:
        if sigmas is None:
            return super().set_timesteps(num_inference_steps, device)
        # as diffusers' own set_timesteps lays its grid out, from the given sigmas instead of its linspace
        sigmas = torch.as_tensor(sigmas, dtype=torch.float32, device=device)
        self.num_inference_steps = len(sigmas)
        timesteps = sigmas * self.config.num_train_timesteps
        self.timesteps = torch.cat([timesteps[:1], timesteps[1:].repeat_interleave(2)])
        sigmas = torch.cat([sigmas, torch.zeros(1, device=sigmas.device)])
        self.sigmas = torch.cat([sigmas[:1], sigmas[1:-1].repeat_interleave(2), sigmas[-1:]])
        self.prev_derivative = None
        self.dt = None
        self._step_index = None
        self._begin_index = None


class FlowSDEScheduler(SchedulerMixin, ConfigMixin):
    """SiT's Euler-Maruyama sampler for velocity models (see the module docstring).

    Args:
        num_train_timesteps: ``timesteps`` are ``s * num_train_timesteps``, as in diffusers' flow schedulers.
        path: ``linear`` or ``gvp``: the path the model was trained on (the score is derived from the velocity
            through it).
        last_step_size: flow time of the last, noise-free step (SiT's and REPA's 0.04).
    """

    order = 1

    @register_to_config
    def __init__(self, num_train_timesteps: int = 1000, path: str = "linear", last_step_size: float = 0.04) -> None:
        if path not in ("linear", "gvp"):
            raise ValueError(f"path must be linear or gvp, got {path!r}")
        if not 0 < last_step_size < 1:
            raise ValueError(f"last_step_size must be in (0, 1), got {last_step_size}")
        self.init_noise_sigma = 1.0
        self.sigmas = torch.tensor([1.0, 0.0])
        self.timesteps = self.sigmas[:1] * num_train_timesteps
        self.num_inference_steps = None
        self._step_index = None

    def set_timesteps(
        self,
        num_inference_steps: int | None = None,
        device: str | torch.device = None,
        sigmas: list | None = None,
    ) -> None:
        """The grid: ``sigmas`` (flow times from 1 down to the last step's start), or ``num_inference_steps`` points
        spaced linearly from 1 to ``last_step_size``; 0 is appended for the last step."""
        if sigmas is None:
            if not num_inference_steps or num_inference_steps < 2:
                raise ValueError("the SDE sampler takes at least 2 steps (one stochastic step and the last one)")
            grid = torch.linspace(1.0, self.config.last_step_size, num_inference_steps, dtype=torch.float64)
            sigmas = grid.to(torch.float32)
        sigmas = torch.as_tensor(sigmas, dtype=torch.float32)
        self.num_inference_steps = len(sigmas)
        self.sigmas = torch.cat([sigmas, torch.zeros(1)])  # on the CPU, as diffusers keeps them
        self.timesteps = (sigmas * self.config.num_train_timesteps).to(device)
        self._step_index = None

    @property
    def step_index(self) -> int | None:
        return self._step_index

    def set_begin_index(self, begin_index: int = 0) -> None:
        """Start at the grid's ``begin_index``-th point (diffusers' name: a sampler taken over mid-grid)."""
        self._step_index = begin_index

    def scale_model_input(self, sample: torch.Tensor, timestep=None) -> torch.Tensor:
        return sample

    def drift(self, velocity: torch.Tensor, sample: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        """``dx/dt`` of the reverse SDE in the direction of the data (``t = -s``): ``-v + w score``, with diffusion
        ``w = b(s)`` and the score ``-E[eps | x] / b`` from the velocity through the path."""
        return -velocity - noise_from_velocity(velocity, sample, s, self.config.path)  # w * score = b * (-eps / b)

    def step(
        self,
        model_output: torch.Tensor,
        timestep: float | torch.Tensor,
        sample: torch.Tensor,
        generator: torch.Generator | list[torch.Generator] | None = None,
        return_dict: bool = True,
    ) -> SchedulerOutput | tuple:
        """One step from the current grid point: Euler-Maruyama with noise from ``generator``, or, at the last
        point, the noise-free step to 0."""
        if self._step_index is None:
            self._step_index = 0
        i = self._step_index
        s, s_next = self.sigmas[i].to(sample.device), self.sigmas[i + 1].to(sample.device)
        dt = s - s_next  # > 0: time toward the data
        x = sample.float()
        moved = x + self.drift(model_output.float(), x, s) * dt
        if i < len(self.sigmas) - 2:
            noise = randn_tensor(x.shape, generator=generator, device=x.device, dtype=x.dtype)
            _, b, _, _ = path_coefficients(s, self.config.path)
            moved = moved + torch.sqrt(2 * b * dt) * noise
        self._step_index += 1
        prev = moved.to(sample.dtype)
        return SchedulerOutput(prev_sample=prev) if return_dict else (prev,)

    def __len__(self) -> int:
        return self.config.num_train_timesteps


class MeanFlowScheduler(SchedulerMixin, ConfigMixin):
    """MeanFlow's sampler (Geng et al. 2025, arXiv:2505.13447): the network predicts the average velocity ``u`` over
    an interval, so one step crosses it: ``z_r = z_t - (t - r) u(z_t, r, t)``. ``set_timesteps(sigmas=[1, ..., s])``
    takes the grid (0 appended); ``n`` steps evaluate the network ``n`` times (one step: ``z_0 = z_1 - u(z_1, 0,
    1)``). Flow time as moh-dit counts it: 1 is noise, 0 data.

    With ``renoise`` it is the few-step sampler of a generator trained to the data (DMD2's, a consistency model's):
    each step predicts the data from ``u`` over the whole way, ``x = z_t - t u(z_t, 0, t)``, and noises it afresh to the
    next time, ``z_r = (1 - r) x + r eps`` (``eps`` from the step's generator); one step is the same as without."""

    order = 1

    @register_to_config
    def __init__(self, num_train_timesteps: int = 1000, renoise: bool = False) -> None:
        self.sigmas = torch.tensor([1.0, 0.0])
        self.timesteps = self.sigmas[:-1] * num_train_timesteps
        self._index = 0

    def set_timesteps(
        self, num_inference_steps: int | None = None, device: str | torch.device = None, sigmas: list | None = None
    ) -> None:
        if sigmas is None:
            sigmas = torch.linspace(1.0, 0.0, num_inference_steps + 1)[:-1].tolist()
        grid = torch.as_tensor(list(sigmas) + [0.0], dtype=torch.float32)
        if not (grid[:-1] > grid[1:]).all():
            raise ValueError(f"a MeanFlow grid must fall from noise to data, got {grid.tolist()}")
        self.sigmas = grid.to(device)
        self.timesteps = self.sigmas[:-1] * self.config.num_train_timesteps
        self.num_inference_steps = len(self.timesteps)
        self._index = 0

    def set_begin_index(self, begin_index: int = 0) -> None:
        """Start at the grid's ``begin_index``-th interval (diffusers' name: a sampler taken over mid-grid)."""
        self._index = begin_index

    def step(
        self,
        model_output: torch.Tensor,
        timestep,
        sample: torch.Tensor,
        generator: torch.Generator | list[torch.Generator] | None = None,
        return_dict: bool = True,
        **_,
    ):
        """One interval of the grid: from the current time ``t`` to the next ``r`` with the average velocity (or, with
        ``renoise``, to the data and back to ``r`` with fresh noise from ``generator``)."""
        t, r = self.sigmas[self._index], self.sigmas[self._index + 1]
        self._index += 1
        if not self.config.renoise:
            prev = (sample - (t - r).to(sample.dtype) * model_output).to(sample.dtype)
        else:
            prev = (sample - t.to(sample.dtype) * model_output).to(sample.dtype)  # the data it predicts
            if r > 0:
                noise = randn_tensor(sample.shape, generator=generator, device=sample.device, dtype=sample.dtype)
                prev = ((1 - r) * prev + r * noise).to(sample.dtype)
        return SchedulerOutput(prev_sample=prev) if return_dict else (prev,)
