"""The finite-difference derivative of a distilled student (``distill.derivative: finite-difference``, NVlabs/FastGen's
``use_jvp_finite_diff``): ``du/dt`` along the teacher's velocity in float64, central where it fits, else one-sided,
with MoH's routing held at the primal input's choice (docs/objective.md#the-derivative)."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch

from moh_dit.model.token_routing import rows_of_route
from moh_dit.objectives.base import Noised

__all__ = ["FiniteDifference", "finite_difference_times", "default_fd_eps", "X1000"]

X1000 = 1000.0  # the scale of a time convention that feeds the network 1000 t (moh-dit's flow models, DDPM)


def default_fd_eps(scale: float) -> float:
    """The finite difference's step when the config gives none: FastGen's 1e-4 where the network sees raw times in
    [0, 1] (REPA's, SiT's); 5e-3 where it sees them times 1000 (moh-dit's, DDPM's timesteps), whose timestep sinusoid
    turns over within a few thousandths of ``t``: a step of 1e-4 there follows those wiggles, and the student's targets
    grew until it diverged (docs/objective.md#the-derivative; FastGen's Wan recipe, also x1000, takes 5e-3)."""
    return 5e-3 if scale == X1000 else 1e-4


def finite_difference_times(
    t: torch.Tensor, r: torch.Tensor, eps: float, low: float = 0.0, high: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(t_plus, t_minus, 1 / (t_plus - t_minus))`` in float64 for each sample: a central difference where both
    ``t + eps <= high`` and ``t - eps`` stays above ``low`` and ``r``; forward where only the first holds, backward
    where only the second does (FastGen's cases); neither: zeros (a derivative of 0)."""
    t, r = t.to(torch.float64), r.to(torch.float64)
    forward_ok = t + eps <= high
    backward_ok = (t - eps >= low) & (t - eps > r)
    t_plus = torch.where(forward_ok, t + eps, torch.where(backward_ok, t, torch.zeros_like(t)))
    t_minus = torch.where(backward_ok, t - eps, torch.where(forward_ok, t, torch.zeros_like(t)))
    width = t_plus - t_minus
    return t_plus, t_minus, torch.where(width > 0, 1 / width.clamp(min=1e-300), torch.zeros_like(width))


class FiniteDifference:
    """``du/dt`` by finite differences, for a student objective that has ``average_velocity``, ``fd_eps`` and
    ``jvp_autocast`` (:class:`moh_dit.objectives.distill.MeanFlowDistill`)."""

    def finite_difference(
        self,
        net: torch.nn.Module,
        noised: Noised,
        velocity: torch.Tensor,
        labels: torch.Tensor | None,
        drop: torch.Tensor | None,
        autocast: Callable[[], AbstractContextManager],
        bounds: tuple[float, float] = (0.0, 1.0),
    ) -> tuple[Any, torch.Tensor]:
        """The network's output at ``(z_t, t, r)`` with gradient, then ``du/dt`` (of the average velocity ``u``, in the
        convention's sign) by a finite difference along ``velocity`` in float64, the shifted inputs evaluated without
        gradient and with the primal's routing (:func:`finite_difference_times`; ``bounds``: the times' range)."""
        from moh_dit.model.network import MoHDiTOutput
        from moh_dit.model.routing import RoutingTape

        z, t, r = noised.x_t, noised.terms["t"], noised.terms["r"]
        precision = autocast() if self.jvp_autocast else torch.autocast(z.device.type, enabled=False)
        devices = [z.device] if z.device.type == "cuda" else []
        with RoutingTape(getattr(net, "attention_layers", [])) as tape, precision:
            random_state = [torch.get_rng_state(), *(torch.cuda.get_rng_state(d) for d in devices)]
            out = self.average_velocity(net, z, t, r, labels, drop)
            u = out.sample.float()
            # only the samples with r < t need du/dt (it is multiplied by t - r): the shifted forwards skip the others
            rows = (t > r).nonzero().flatten()
            dudt = torch.zeros_like(u, dtype=torch.float64)
            if rows.numel():
                if tape.layers:
                    tape.replay(rows)
                moving = (z[rows], t[rows], r[rows], velocity[rows])
                dudt[rows] = self._difference(net, *moving, labels, drop, rows, random_state, devices, bounds)
        aligned = out.aligned if net.projectors is not None and net.training else None
        return MoHDiTOutput(sample=u, aux_loss=out.aux_loss, aligned=aligned), dudt.to(z.dtype)

    @torch.no_grad()
    def _difference(self, net, z, t, r, velocity, labels, drop, rows, random_state, devices, bounds) -> torch.Tensor:
        """``du/dt`` (in the convention's sign) of the batch's ``rows`` by the finite difference, each shifted forward
        with the primal's random draws (a network's dropout) and its recorded routing."""
        shape = (-1, *([1] * (z.ndim - 1)))
        t_plus, t_minus, norm = finite_difference_times(t, r, self.fd_eps, *bounds)
        z64, v64 = z.to(torch.float64), velocity.to(torch.float64)
        labels = labels[rows] if labels is not None else None
        drop = drop[rows] if drop is not None else None
        shifted = []
        for moved in (t_plus, t_minus):
            z_moved = z64 + (moved - t.to(torch.float64)).reshape(shape) * v64
            with torch.random.fork_rng(devices=devices), rows_of_route(net, rows):  # the primal's draws and route
                torch.set_rng_state(random_state[0])
                for device, state in zip(devices, random_state[1:]):
                    torch.cuda.set_rng_state(state, device)
                out = self.average_velocity(net, z_moved.to(z.dtype), moved.to(t.dtype), r, labels, drop)
                shifted.append(out.sample.to(torch.float64))
        return (shifted[0] - shifted[1]) * norm.reshape(shape)
