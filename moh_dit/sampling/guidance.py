"""One guided evaluation of the denoiser: the two predictions a rule mixes, and grid averaging.

A guided step evaluates two predictions of the objective's output (DDPM's noise channels, a flow model's velocity)
and mixes them by a rule (:mod:`moh_dit.sampling.rules`):

- classifier-free guidance: the model's conditional and unconditional predictions, batched in one forward;
- autoguidance (Karras et al. 2024, arXiv:2406.02507): the main model's conditional prediction and a weaker *guide*
  model's conditional one (an earlier checkpoint of the run, a smaller model), one forward each.

Learned-variance channels (DDPM) always come from the main model's conditional prediction; only the first
``channels`` channels are mixed when set.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from moh_dit.model.network import MoHDiT
from moh_dit.sampling.rules import CFG, GuidanceRule

__all__ = ["grid_shifts", "guided_output", "StepEvaluation"]


@dataclass
class StepEvaluation:
    """How the denoiser is evaluated at one sampler call: the guidance ``scale`` there (1: the conditional prediction
    alone, one forward), the guided ``channels`` (``None``: all), the run's ``rule`` (its state is the run's), the call's
    index ``step``, whether the prediction is averaged over shifted patch grids (``average``), and the ``guide`` model of
    autoguidance (``None``: the unconditional prediction is the one guided away from)."""

    scale: float = 1.0
    channels: int | None = None
    rule: GuidanceRule = field(default_factory=CFG)
    step: int = 0
    average: bool = False
    guide: MoHDiT | None = None


# ----------------------------------------------------------------------------------------------------
# One guided evaluation
# ----------------------------------------------------------------------------------------------------
def grid_shifts(patch: int) -> list[int]:
    """The diagonal shifts ``(s, s)`` of the input that grid averaging runs the denoiser on: one for each
    offset of the patch grid (0 .. patch - 1 pixels), each as the roll that moves the content least
    (``-patch / 2 < s <= patch / 2``): ``[0, 1, 2, -1]`` for patch 4, ``[0, 1]`` for patch 2."""
    return [k - patch if k > patch // 2 else k for k in range(patch)]


def guided_output(
    transformer: MoHDiT,
    latents: torch.Tensor,
    t: torch.Tensor | tuple[torch.Tensor, ...],
    labels: torch.Tensor | None,
    how: StepEvaluation | None = None,
    network: Callable[..., Any] | None = None,
) -> torch.Tensor:
    """The output of ``transformer`` for ``latents`` at time input ``t``, guided towards ``labels`` as ``how`` says.

    Without a guide: classifier-free guidance, the conditional and unconditional halves in one batched forward. With
    one: autoguidance, the main and the guide model each conditional, one forward each (the guide runs only where the
    scale is not 1). The rule mixes the pair on the first ``channels`` channels (all by default; 3 reproduces the
    reference code); the variance channels come from the main model's conditional prediction.

    Grid averaging (``how.average``): run the denoiser on copies of the input rolled diagonally by each of
    :func:`grid_shifts`, roll each prediction back and average them. The transformer predicts every patch from its own
    token, so where it is imprecise its errors meet at the patch grid's lines as faint seams; each copy puts its grid's
    lines elsewhere on the image, and the average leaves no line stronger than the rest. The copies run in the same
    batched forward.

    ``network(role, *inputs)`` runs the transformer's forwards (default: the transformer itself): a sampling cache
    (:class:`moh_dit.sampling.caches.CachedNetwork`) runs each batch composition (``role``: ``guided`` for CFG's
    two halves, ``plain`` for the conditional prediction alone, ``-averaged`` for grid averaging's copies) apart.
    """
    how = how or StepEvaluation()
    if network is None:

        def network(role: str, *inputs: Any) -> Any:
            return transformer(*inputs)

    if not how.average:
        return _guided_forward(transformer, latents, t, labels, how, network)
    shifts = grid_shifts(transformer.config.patch_size)
    copies = torch.cat([torch.roll(latents, (s, s), dims=(2, 3)) for s in shifts])  # (S*N, C, H, W)
    repeat = None if labels is None else labels.repeat(len(shifts))
    times = _each(t, lambda s: s if s.ndim == 0 else s.repeat(len(shifts)))
    out = _guided_forward(transformer, copies, times, repeat, how, network, shifts=shifts)
    back = [torch.roll(o, (-s, -s), dims=(2, 3)) for o, s in zip(out.chunk(len(shifts)), shifts)]
    return torch.stack(back).mean(dim=0)  # (N, C', H, W)


def _each(t: torch.Tensor | tuple[torch.Tensor, ...], change: Callable[[torch.Tensor], torch.Tensor]):
    """``change`` applied to the time input, or to each of a model's several time inputs (MeanFlow's ``(t, t - r)``)."""
    return tuple(change(s) for s in t) if isinstance(t, tuple) else change(t)


def _guided_forward(
    transformer: MoHDiT,
    latents: torch.Tensor,
    t: torch.Tensor | tuple[torch.Tensor, ...],
    labels: torch.Tensor | None,
    how: StepEvaluation,
    network: Callable[..., Any],
    shifts: list[int] | None = None,
) -> torch.Tensor:
    """The two predictions (one batched forward for CFG, one each with a guide), mixed (see :func:`guided_output`)."""
    guide = how.guide
    guided = how.scale != 1.0 and (guide is not None or labels is not None)
    suffix = "-averaged" if shifts else ""
    if guide is not None or not guided:
        times = _each(t, lambda s: s.expand(latents.shape[0]) if s.ndim == 0 else s)
        cond = network("plain" + suffix, latents.to(transformer.dtype), times, labels).sample.float()
        if not guided:
            return cond
        uncond = guide(latents.to(guide.dtype), times, labels).sample.float()
    else:
        model_in = torch.cat([latents, latents])
        timesteps = _each(t, lambda s: s.expand(model_in.shape[0]) if s.ndim == 0 else torch.cat([s, s]))
        y = torch.cat([labels, torch.full_like(labels, transformer.null_class_id)])
        cond, uncond = network("guided" + suffix, model_in.to(transformer.dtype), timesteps, y).sample.float().chunk(2)
    c = transformer.in_channels
    g = c if how.channels is None else how.channels
    mixed = cond[:, :c].clone()
    mixed[:, :g] = how.rule.combine(cond[:, :g], uncond[:, :g], how.scale, how.step, shifts)
    return torch.cat([mixed, cond[:, c:]], dim=1)
