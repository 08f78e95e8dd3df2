"""LDM-layout autoencoders (CompVis' ``AutoencoderKL``: LightningDiT's VA-VAE, its ``tokenizer/autoencoder.py``) as
diffusers ``AutoencoderKL`` folders, with their per-channel latent statistics.

diffusers converts the LDM layout (``convert_ldm_vae_checkpoint``) for the SD VAE's shape: attention only in the
middle block. VA-VAE (f16, 32 channels) also attends inside its lowest-resolution level (``attn_resolutions=(16,)``
at 256 px: the encoder's last level, the decoder's first), which diffusers' ``AttnDownEncoderBlock2D`` and
``AttnUpDecoderBlock2D`` hold but its converter does not map; those keys are renamed here with diffusers' own
attention helper, everything else goes through its converter.

    moh-dit convert vavae-imagenet256-f16d32-dinov2.pt vae/vavae --format ldm-vae --latent-stats latents_stats.pt
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch

from moh_dit.errors import ConversionError

__all__ = ["VAVAE_LAYOUT", "infer_ldm_layout", "ldm_layout_config", "convert_ldm_autoencoder", "read_latent_stats"]

# LightningDiT's VA-VAE (tokenizer/configs/vavae_f16d32.yaml; its AutoencoderKL builds Encoder/Decoder with these)
VAVAE_LAYOUT: dict[str, Any] = dict(
    ch=128, ch_mult=(1, 1, 2, 2, 4), num_res_blocks=2, resolution=256, attn_resolutions=(16,), z_channels=32
)


def infer_ldm_layout(sd: dict[str, torch.Tensor], resolution: int = 256) -> dict[str, Any]:
    """The layout of an LDM encoder/decoder from its tensors: the base width (``encoder.conv_in``), each level's
    multiplier (its first resnet's output), the resnets per level, the levels that attend (``encoder.down.i.attn``,
    given as the resolutions they run at for ``resolution`` px inputs) and the latent channels."""
    level = re.compile(r"^encoder\.down\.(\d+)\.")
    levels = 1 + max(int(m.group(1)) for k in sd if (m := level.match(k)))
    ch = int(sd["encoder.conv_in.weight"].shape[0])
    ch_mult = tuple(int(sd[f"encoder.down.{i}.block.0.conv1.weight"].shape[0]) // ch for i in range(levels))
    blocks = {int(k.split(".")[4]) for k in sd if k.startswith("encoder.down.0.block.")}
    attends = [any(k.startswith(f"encoder.down.{i}.attn.") for k in sd) for i in range(levels)]
    return dict(
        ch=ch,
        ch_mult=ch_mult,
        num_res_blocks=len(blocks),
        resolution=resolution,
        attn_resolutions=tuple(resolution // 2**i for i in range(levels) if attends[i]),
        z_channels=int(sd["post_quant_conv.weight"].shape[0]),
    )


def ldm_layout_config(layout: dict[str, Any]) -> dict[str, Any]:
    """The diffusers ``AutoencoderKL`` config of an LDM encoder/decoder layout (``ch``, ``ch_mult``,
    ``num_res_blocks``, ``resolution``, ``attn_resolutions``, ``z_channels``): a level whose resolution is in
    ``attn_resolutions`` attends after every resnet, in the encoder and the decoder alike."""
    levels = len(layout["ch_mult"])
    attends = [layout["resolution"] // 2**i in tuple(layout["attn_resolutions"]) for i in range(levels)]
    return dict(
        in_channels=3,
        out_channels=3,
        down_block_types=["AttnDownEncoderBlock2D" if a else "DownEncoderBlock2D" for a in attends],
        up_block_types=["AttnUpDecoderBlock2D" if a else "UpDecoderBlock2D" for a in reversed(attends)],
        block_out_channels=[layout["ch"] * m for m in layout["ch_mult"]],
        layers_per_block=layout["num_res_blocks"],
        latent_channels=layout["z_channels"],
        norm_num_groups=32,
        sample_size=layout["resolution"],
        scaling_factor=1.0,
    )


def convert_ldm_autoencoder(
    state_dict: dict[str, torch.Tensor],
    layout: dict[str, Any] | None = None,
    latents_mean: list[float] | None = None,
    latents_std: list[float] | None = None,
):
    """A diffusers ``AutoencoderKL`` with the weights of an LDM-layout state dict, loaded strictly. The layout
    (widths, levels, which levels attend, latent channels) is read from the tensors unless given (VA-VAE's is
    :data:`VAVAE_LAYOUT`); ``latents_mean`` / ``latents_std`` (per channel) go into its config, so moh-dit
    normalises its latents as LightningDiT does (``(z - mean) / std``, multiplier 1)."""
    from diffusers import AutoencoderKL
    from diffusers.loaders.single_file_utils import convert_ldm_vae_checkpoint, update_vae_attentions_ldm_to_diffusers

    sd = {k: v for k, v in state_dict.items() if k.startswith(("encoder.", "decoder.", "quant_conv.", "post_quant"))}
    if not any(k.startswith("encoder.down.") for k in sd) or "post_quant_conv.weight" not in sd:
        raise ConversionError("not an LDM-layout autoencoder: no encoder.down.* or post_quant_conv weights")
    layout = dict(layout) if layout is not None else infer_ldm_layout(sd)
    config = ldm_layout_config(layout)
    if latents_mean is not None:
        if len(latents_mean) != layout["z_channels"]:
            raise ConversionError(
                f"the latent statistics have {len(latents_mean)} channels, the autoencoder {layout['z_channels']}"
            )
        config.update(latents_mean=[float(v) for v in latents_mean], latents_std=[float(v) for v in latents_std])
    level_attention = re.compile(r"^(encoder\.down|decoder\.up)\.(\d+)\.attn\.(\d+)\.")
    attention = {k for k in sd if level_attention.match(k)}
    converted = convert_ldm_vae_checkpoint({k: v for k, v in sd.items() if k not in attention}, config)
    levels = len(layout["ch_mult"])
    for prefix, level, index in sorted({level_attention.match(k).groups() for k in attention}):
        old = f"{prefix}.{level}.attn.{index}"
        new = (
            f"encoder.down_blocks.{level}.attentions.{index}"
            if prefix == "encoder.down"
            else f"decoder.up_blocks.{levels - 1 - int(level)}.attentions.{index}"
        )
        keys = [k for k in attention if k.startswith(old + ".")]
        update_vae_attentions_ldm_to_diffusers(keys, converted, sd, {"old": old, "new": new})
    vae = AutoencoderKL(**config)
    missing, unexpected = vae.load_state_dict(converted, strict=False)
    if missing or unexpected:
        raise ConversionError(
            f"the autoencoder does not match the layout {layout}: missing {missing[:4]}, unexpected {unexpected[:4]}"
        )
    return vae.eval()


def read_latent_stats(path: str | Path) -> tuple[list[float], list[float]]:
    """LightningDiT's ``latents_stats.pt`` (``{"mean": (1, C, 1, 1), "std": (1, C, 1, 1)}``, read as plain
    tensors): the per-channel mean and std of the latents."""
    from moh_dit.files import read_torch_file

    stats = read_torch_file(Path(path), ConversionError, "latent statistics")
    if not isinstance(stats, dict) or not {"mean", "std"} <= set(stats):
        raise ConversionError(f"{path} holds no 'mean' and 'std' of the latents (LightningDiT's latents_stats.pt)")
    mean, std = (torch.as_tensor(stats[k]).flatten().tolist() for k in ("mean", "std"))
    if len(mean) != len(std) or min(std) <= 0:
        raise ConversionError(f"{path}: {len(mean)} means and {len(std)} stds, or a std <= 0")
    return mean, std
