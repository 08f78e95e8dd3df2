"""What a distilled student's network outputs (``distill.head``, recorded as the objective's ``head``): the average
velocity itself, or a DDPM teacher's own parameterization (a noise on the teacher's input scale) that makes the
untrained student its teacher. One class per head in :data:`HEADS`; the distillation objective
(``moh_dit.objectives.distill``) asks its head for the network's input and for the velocity its output stands for.
docs/objective.md#the-student-and-its-time."""

from __future__ import annotations

from typing import Any

import torch

from moh_dit.objectives.linear_path import linear_path_input, velocity_of_noise

__all__ = ["HEADS", "VelocityHead", "NoiseHead", "native_head"]


class VelocityHead:
    """The student outputs the average velocity itself, in its convention's sign (a flow teacher's own head)."""

    name = "velocity"
    conventions: tuple[str, ...] = ()  # any time convention
    options: tuple[str, ...] = ()  # the distill keys it reads (its constructor's arguments)
    noise_channels = False  # starts from a teacher's output layer only where the shapes agree (a flow teacher's)

    def network_input(self, z: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return z

    def velocity(self, output: torch.Tensor, z: torch.Tensor, t: torch.Tensor, sign: float) -> torch.Tensor:
        return sign * output

    def record(self) -> dict[str, Any]:
        return {}


class NoiseHead:
    """A DDPM teacher's own parameterization: the student sees ``z`` as the teacher does (DiT's timestep and input
    scale of the same signal-to-noise ratio) and outputs a noise ``F``; up to flow time ``noise_until`` its average
    velocity is ``(F - z_t) / (1 - t)``, so that the step to ``r`` is DDIM's step with ``F`` as the noise, and the
    untrained student with its teacher's noise channels is its teacher. Later it is ``(F - z_t) / (1 - noise_until)``:
    ``1 / (1 - t)`` has no limit at 1 and multiplies every error of ``F`` (DDIM's first step from pure noise), while
    the bounded divisor leaves ``F = z_t + (1 - noise_until) u`` a target the network can learn."""

    name = "noise"
    conventions = ("ddpm",)
    options = ("noise_until",)
    noise_channels = True  # starts from the noise channels of a learned-sigma teacher's output layer

    def __init__(self, noise_until: float) -> None:
        self.noise_until = noise_until

    def network_input(self, z: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return linear_path_input(z, t)[0]

    def velocity(self, output: torch.Tensor, z: torch.Tensor, t: torch.Tensor, sign: float) -> torch.Tensor:
        return velocity_of_noise(output, z, t.clamp(max=self.noise_until))

    def record(self) -> dict[str, Any]:
        return {"head": self.name, "noise_until": self.noise_until}


# what a student's network outputs (``distill.head``; ``teacher``: the first whose conventions name the teacher's,
# else velocity): one class each, no branching on the name
HEADS = {head.name: head for head in (VelocityHead, NoiseHead)}


def native_head(time: str) -> str:
    """The head a teacher of time convention ``time`` has itself."""
    return next((name for name, head in HEADS.items() if time in head.conventions), VelocityHead.name)
