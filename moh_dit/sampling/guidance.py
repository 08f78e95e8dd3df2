"""One guided evaluation of the denoiser: the conditional and unconditional halves in one batched forward, mixed by
classifier-free guidance, optionally averaged over shifted patch grids. The sampling loop
(:class:`moh_dit.sampling.pipeline.MoHDiTPipeline`) calls it once per step.
"""

from __future__ import annotations

import torch

from moh_dit.model.network import MoHDiT

__all__ = ["grid_shifts", "guided_output"]


def grid_shifts(patch: int) -> list[int]:
    """The diagonal shifts ``(s, s)`` of the input that grid averaging runs the denoiser on: one for each
    offset of the patch grid (0 .. patch - 1 pixels), each as the roll that moves the content least
    (``-patch / 2 < s <= patch / 2``): ``[0, 1, 2, -1]`` for patch 4, ``[0, 1]`` for patch 2."""
    return [k - patch if k > patch // 2 else k for k in range(patch)]


def guided_output(
    transformer: MoHDiT,
    latents: torch.Tensor,
    t: torch.Tensor,
    labels: torch.Tensor | None,
    guidance_scale: float,
    guidance_channels: int | None = None,
    grid_average: bool = False,
) -> torch.Tensor:
    """The output of ``transformer`` for ``latents`` at time input ``t``, guided towards ``labels``.

    Conditional and unconditional halves run in one batched forward. Guidance mixes the prediction
    ``u + s (c - u)`` on the first ``guidance_channels`` channels (all by default; 3 reproduces the reference code);
    the variance channels come from the conditional half.

    ``grid_average``: run the denoiser on copies of the input rolled diagonally by each of :func:`grid_shifts`, roll
    each prediction back and average them. The transformer predicts every patch from its own token, so where it is
    imprecise its errors meet at the patch grid's lines as faint seams; each copy puts its grid's lines elsewhere on
    the image, and the average leaves no line stronger than the rest. The copies run in the same batched forward.
    """
    if not grid_average:
        return _guided_forward(transformer, latents, t, labels, guidance_scale, guidance_channels)
    shifts = grid_shifts(transformer.config.patch_size)
    copies = torch.cat([torch.roll(latents, (s, s), dims=(2, 3)) for s in shifts])  # (S*N, C, H, W)
    repeat = None if labels is None else labels.repeat(len(shifts))
    out = _guided_forward(
        transformer, copies, t if t.ndim == 0 else t.repeat(len(shifts)), repeat, guidance_scale, guidance_channels
    )
    back = [torch.roll(o, (-s, -s), dims=(2, 3)) for o, s in zip(out.chunk(len(shifts)), shifts)]
    return torch.stack(back).mean(dim=0)  # (N, C', H, W)


def _guided_forward(
    transformer: MoHDiT,
    latents: torch.Tensor,
    t: torch.Tensor,
    labels: torch.Tensor | None,
    guidance_scale: float,
    guidance_channels: int | None,
) -> torch.Tensor:
    """One batched forward of the conditional and unconditional halves, mixed (see :func:`guided_output`)."""
    c = transformer.in_channels
    do_cfg = guidance_scale != 1.0 and labels is not None
    model_in = torch.cat([latents, latents]) if do_cfg else latents
    timesteps = t.expand(model_in.shape[0]) if t.ndim == 0 else (torch.cat([t, t]) if do_cfg else t)
    y = None
    if labels is not None:
        y = torch.cat([labels, torch.full_like(labels, transformer.null_class_id)]) if do_cfg else labels
    out = transformer(model_in.to(transformer.dtype), timesteps, y).sample.float()
    if not do_cfg:
        return out
    cond, uncond = out.chunk(2)
    g = c if guidance_channels is None else guidance_channels
    eps_c, eps_u = cond[:, :c], uncond[:, :c]
    guided = eps_c.clone()
    guided[:, :g] = eps_u[:, :g] + guidance_scale * (eps_c[:, :g] - eps_u[:, :g])
    return torch.cat([guided, cond[:, c:]], dim=1)
