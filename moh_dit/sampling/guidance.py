"""One guided evaluation of the denoiser, and the rules that mix its two predictions.

A guided step evaluates two predictions of the objective's output (DDPM's noise channels, a flow model's
velocity) and mixes them by a rule:

- classifier-free guidance: the model's conditional and unconditional predictions, batched in one forward;
- autoguidance (Karras et al. 2024, arXiv:2406.02507): the main model's conditional prediction and a weaker *guide*
  model's conditional one (an earlier checkpoint of the run, a smaller model), one forward each.

The rules (:data:`RULES`), for a prediction ``c`` and the one it is pushed away from ``u`` at scale ``w``:

- ``cfg``: ``u + w (c - u)`` (the default);
- ``apg`` (Sadat et al. 2024, arXiv:2410.02416): the difference ``c - u``, averaged with momentum and its norm
  clipped, split into its parts parallel and orthogonal to ``c``, the parallel part weighted by ``eta``;
  diffusers' ``normalized_guidance``;
- ``cfg-zero-star`` (Fan et al. 2025, arXiv:2503.18886): ``u`` first scaled by the projection ``<c, u> / |u|^2`` of
  each sample, and the first ``zero_init_steps`` sampler calls predict zero; diffusers' ``cfg_zero_star_scale``. A
  zero velocity keeps the sample where it is; a zero noise prediction is not a no-op (docs/sampling.md).

diffusers' guider classes hold the same formulas for its modular pipelines (a step counter, prepared batches, hooks);
the rules here call its functions on the two predictions and are held to its classes' outputs in
``tests/sampling/test_guidance.py``. Learned-variance channels (DDPM) always come from the main model's conditional
prediction; only the first ``guidance_channels`` channels are mixed when set.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from moh_dit.model.network import MoHDiT
from moh_dit.sampling.rules import check_rule_options

__all__ = ["grid_shifts", "guided_output", "GuidanceRule", "make_rule"]


# ----------------------------------------------------------------------------------------------------
# The rules
# ----------------------------------------------------------------------------------------------------
@dataclass
class GuidanceRule:
    """How two predictions are mixed; one instance per sampling run (APG keeps a running average over its
    steps). ``combine(c, u, w, step)``: ``step`` counts the sampler's calls from 0."""

    name: str = "cfg"
    options: dict[str, float] = field(default_factory=dict)
    _momentum: Any = field(default=None, repr=False)
    _frames: list[int] | None = field(default=None, repr=False)

    def combine(
        self, cond: torch.Tensor, uncond: torch.Tensor, scale: float, step: int, shifts: list[int] | None = None
    ) -> torch.Tensor:
        """``shifts``: the diagonal rolls of the batch's copies when grid averaging runs (:func:`grid_shifts`)."""
        if self.name == "apg":
            return self._apg(cond, uncond, scale, shifts)
        if self.name == "cfg-zero-star":
            return self._zero_star(cond, uncond, scale, step)
        return uncond + scale * (cond - uncond)

    def _apg(self, cond: torch.Tensor, uncond: torch.Tensor, scale: float, shifts: list[int] | None) -> torch.Tensor:
        from diffusers.guiders.adaptive_projected_guidance import MomentumBuffer, normalized_guidance

        if self._momentum is None and self.options["momentum"] is not None:
            self._momentum = MomentumBuffer(self.options["momentum"])
        if self._momentum is not None:
            self._momentum_in_frames(shifts)
        return normalized_guidance(
            cond,
            uncond,
            scale,
            self._momentum,
            eta=self.options["eta"],
            norm_threshold=self.options["norm_threshold"],
        )

    def _momentum_in_frames(self, shifts: list[int] | None) -> None:
        """APG's running average follows each sample when grid averaging starts or stops (the batch then holds one
        rolled copy of each sample per shift): the average is rolled back to the image, averaged over its copies and
        rolled into each new copy's frame, so every copy continues the history of its own sample (diffusers'
        buffer assumes a fixed batch)."""
        old, new = self._frames or [0], shifts or [0]
        self._frames = shifts
        average = self._momentum.running_average
        if not isinstance(average, torch.Tensor) or old == new:
            return
        image = torch.stack([torch.roll(a, (-s, -s), dims=(2, 3)) for a, s in zip(average.chunk(len(old)), old)])
        image = image.mean(dim=0)
        self._momentum.running_average = torch.cat([torch.roll(image, (s, s), dims=(2, 3)) for s in new])

    def _zero_star(self, cond: torch.Tensor, uncond: torch.Tensor, scale: float, step: int) -> torch.Tensor:
        from diffusers.guiders.classifier_free_zero_star_guidance import cfg_zero_star_scale

        if step < self.options["zero_init_steps"]:
            return torch.zeros_like(cond)
        alpha = cfg_zero_star_scale(cond.flatten(1), uncond.flatten(1)).view(-1, *(1,) * (cond.ndim - 1))
        projected = uncond * alpha
        return projected + scale * (cond - projected)


def make_rule(name: str = "cfg", options: Mapping[str, Any] | None = None) -> GuidanceRule:
    """A fresh rule (its state starts empty) with its options checked and completed."""
    return GuidanceRule(name, check_rule_options(name, options))


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
    guidance_scale: float,
    guidance_channels: int | None = None,
    grid_average: bool = False,
    guide: MoHDiT | None = None,
    rule: GuidanceRule | None = None,
    step: int = 0,
    network: Callable[..., Any] | None = None,
) -> torch.Tensor:
    """The output of ``transformer`` for ``latents`` at time input ``t``, guided towards ``labels``.

    Without a ``guide``: classifier-free guidance, the conditional and unconditional halves in one batched forward.
    With one: autoguidance, the main and the guide model each conditional, one forward each (the guide runs only
    where the scale is not 1). ``rule`` mixes the pair (default: ``u + s (c - u)``) on the first
    ``guidance_channels`` channels (all by default; 3 reproduces the reference code); the variance channels come
    from the main model's conditional prediction.

    ``grid_average``: run the denoiser on copies of the input rolled diagonally by each of :func:`grid_shifts`, roll
    each prediction back and average them. The transformer predicts every patch from its own token, so where it is
    imprecise its errors meet at the patch grid's lines as faint seams; each copy puts its grid's lines elsewhere on
    the image, and the average leaves no line stronger than the rest. The copies run in the same batched forward.

    ``network(role, *inputs)`` runs the transformer's forwards (default: the transformer itself): a sampling cache
    (:class:`moh_dit.sampling.caches.CachedNetwork`) runs each batch composition (``role``: ``guided`` for CFG's
    two halves, ``plain`` for the conditional prediction alone, ``-averaged`` for grid averaging's copies) apart.
    """
    if network is None:

        def network(role: str, *inputs: Any) -> Any:
            return transformer(*inputs)

    args = (guidance_scale, guidance_channels, guide, rule or GuidanceRule(), step, network)
    if not grid_average:
        return _guided_forward(transformer, latents, t, labels, *args)
    shifts = grid_shifts(transformer.config.patch_size)
    copies = torch.cat([torch.roll(latents, (s, s), dims=(2, 3)) for s in shifts])  # (S*N, C, H, W)
    repeat = None if labels is None else labels.repeat(len(shifts))
    times = _each(t, lambda s: s if s.ndim == 0 else s.repeat(len(shifts)))
    out = _guided_forward(transformer, copies, times, repeat, *args, shifts=shifts)
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
    guidance_scale: float,
    guidance_channels: int | None,
    guide: MoHDiT | None,
    rule: GuidanceRule,
    step: int,
    network: Callable[..., Any],
    shifts: list[int] | None = None,
) -> torch.Tensor:
    """The two predictions (one batched forward for CFG, one each with a guide), mixed (see :func:`guided_output`)."""
    guided = guidance_scale != 1.0 and (guide is not None or labels is not None)
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
    g = c if guidance_channels is None else guidance_channels
    mixed = cond[:, :c].clone()
    mixed[:, :g] = rule.combine(cond[:, :g], uncond[:, :g], guidance_scale, step, shifts)
    return torch.cat([mixed, cond[:, c:]], dim=1)
