"""Checkpoints of willisma/SiT and sihyun-yu/REPA as moh-dit flow models, and back to their layouts.

Both projects keep DiT's module names (``x_embedder.proj``, ``t_embedder.mlp``, ``y_embedder.embedding_table``,
``blocks.i.{attn.qkv, attn.proj, mlp.fc1, mlp.fc2, adaLN_modulation.1}``, ``final_layer``), so the weights map as
DiT's do (moh_dit.interop.official). What differs is what the network means (docs/objective.md):

- SiT feeds the raw time ``t = 1 - s`` (noise at 0) and predicts ``x - eps``; its default and its released XL/2
  checkpoint have a ``2C`` head whose second half is never used (``learn_sigma=True``);
- REPA feeds ``s`` (noise at 1) and predicts ``eps - x`` with a ``C`` head, and its checkpoints carry the
  alignment projectors (``projectors.*``), which sampling does not use.

A loaded model records its convention (``objective.convention``: ``sit`` or ``repa``), so moh-dit samples it as
its own code does, fine-tunes it in its convention, and exports it back. The path (Linear or GVP) is not in the
weights: pass the one the checkpoint was trained on.
"""

from __future__ import annotations

from pathlib import Path

import torch

from moh_dit.errors import ConversionError
from moh_dit.interop.official import config_from_reference, ours_to_reference, read_checkpoint, strict_load
from moh_dit.model.network import MoHDiT
from moh_dit.objectives.noise import PATHS

__all__ = ["FLOW_FORMATS", "load_flow_checkpoint", "to_flow_state_dict", "drop_sigma_half"]

FLOW_FORMATS = {"sit": "willisma/SiT", "repa": "sihyun-yu/REPA"}


def _final_rows(tensor: torch.Tensor, patch: int, channels: int, keep: int) -> torch.Tensor:
    """The final layer's rows (laid out per patch position, channels fastest, as DiT's unpatchify reads them)
    reshaped to ``channels`` per position and cut to the first ``keep`` (``keep`` > ``channels``: zero rows added)."""
    per = tensor.reshape(patch * patch, channels, *tensor.shape[1:])
    if keep <= channels:
        return per[:, :keep].reshape(patch * patch * keep, *tensor.shape[1:]).clone()
    pad = torch.zeros(patch * patch, keep - channels, *tensor.shape[1:], dtype=tensor.dtype)
    return torch.cat([per, pad], dim=1).reshape(patch * patch * keep, *tensor.shape[1:])


def drop_sigma_half(sd: dict[str, torch.Tensor], patch: int, in_channels: int) -> dict[str, torch.Tensor]:
    """A state dict with a ``2C`` output head cut to its first ``C`` channels (SiT's unused variance half)."""
    out = dict(sd)
    for key in ("final_layer.linear.weight", "final_layer.linear.bias"):
        out[key] = _final_rows(sd[key], patch, 2 * in_channels, in_channels)
    return out


def load_flow_checkpoint(
    path: str | Path,
    fmt: str = "sit",
    flow_path: str = "linear",
    num_heads: int | None = None,
    num_classes: int | None = None,
    prefer_ema: bool = True,
    repa_depth: int | None = None,
) -> tuple[MoHDiT, dict]:
    """A SiT or REPA checkpoint (``.pt`` of their ``train.py``, an EMA state dict, or ``.safetensors``) as a moh-dit
    flow model in that project's convention; returns the model and a report of what was read and dropped. With
    ``repa_depth`` (REPA's ``--encoder-depth``, which its checkpoints do not record) REPA's projectors are kept as
    the model's alignment heads on that block, to continue REPA's training; else they are dropped."""
    if fmt not in FLOW_FORMATS:
        raise ConversionError(f"the flow checkpoint format must be one of {', '.join(FLOW_FORMATS)}, got {fmt!r}")
    if flow_path not in PATHS:
        raise ConversionError(f"the path must be one of {', '.join(PATHS)}, got {flow_path!r}")
    sd, which = read_checkpoint(path, prefer_ema)
    projectors = sorted(k for k in sd if k.startswith("projectors."))
    qk_norm = sorted(k for k in sd if ".q_norm." in k or ".k_norm." in k)
    if qk_norm:
        raise ConversionError(f"{path} was trained with QK-norm ({qk_norm[0]}, ...), which moh-dit's attention lacks")
    kept = {k: v for k, v in sd.items() if k in projectors} if repa_depth is not None else {}
    if repa_depth is not None and not kept:
        raise ConversionError(f"--repa-depth keeps REPA's projectors, and {path} has none")
    sd = {k: v for k, v in sd.items() if k not in projectors}
    config = config_from_reference(sd, num_heads, None, num_classes)
    if config.get("attention_type") != "mha":
        raise ConversionError(f"{path} has MoH routers: SiT and REPA checkpoints are multi-head DiTs")
    sigma_half = bool(config["learn_sigma"])
    if sigma_half:
        sd = drop_sigma_half(sd, config["patch_size"], config["in_channels"])
    config.update(learn_sigma=False, objective={"name": "flow", "path": flow_path, "convention": fmt})
    if kept:  # projectors.j.{0,2,4} -> projectors.j.layers.{0,2,4}
        count = 1 + max(int(k.split(".")[1]) for k in kept)
        dims = [int(kept[f"projectors.{j}.4.weight"].shape[0]) for j in range(count)]
        width = int(kept["projectors.0.0.weight"].shape[0])
        config.update(repa_depth=repa_depth, repa_dims=dims, repa_projector_dim=width)
        sd |= {
            k.replace(f"projectors.{k.split('.')[1]}.", f"projectors.{k.split('.')[1]}.layers.", 1): v
            for k, v in kept.items()
        }
    model = MoHDiT(**config)
    strict_load(model, sd, f"{path} ({which})")
    report = {
        "source": str(path),
        "format": f"{fmt} ({FLOW_FORMATS[fmt]})",
        "weights": which,
        "config": config,
        "dropped": (["the unused variance half of the output head"] if sigma_half else [])
        + ([f"{len(projectors)} REPA projector tensors"] if projectors and not kept else []),
    }
    return model.eval(), report


def to_flow_state_dict(model: MoHDiT, fmt: str = "sit") -> dict[str, torch.Tensor]:
    """The state dict of ``model`` in SiT's layout (with the ``2C`` head of SiT's default model and released
    checkpoint, its variance half zero) or REPA's (``C`` head, no projectors). Only a model in that project's
    convention converts: the time input's meaning is in the weights."""
    if fmt not in FLOW_FORMATS:
        raise ConversionError(f"the flow checkpoint format must be one of {', '.join(FLOW_FORMATS)}, got {fmt!r}")
    record = model.config.get("objective") or {}
    if record.get("convention") != fmt:  # a convention is a flow model's; DiT's DDPM records none
        what = f"a flow model in the {record['convention']} convention" if record.get("convention") else "a DDPM model"
        raise ConversionError(
            f"{FLOW_FORMATS[fmt]}'s code feeds its own time convention ({fmt}) to the network; this is {what}, whose "
            f"weights expect another time input: train in objective.convention={fmt} to export to {fmt}"
        )
    if model.config.attention_type != "mha":
        raise ConversionError(
            f"{FLOW_FORMATS[fmt]}'s code has no Mixture-of-Head attention: export a DiT-shaped model"
        )
    sd = ours_to_reference(model)
    if fmt == "sit":
        c, p = model.config.in_channels, model.config.patch_size
        for key in ("final_layer.linear.weight", "final_layer.linear.bias"):
            sd[key] = _final_rows(sd[key], p, c, 2 * c)
    return sd
