"""Checkpoints of willisma/SiT, sihyun-yu/REPA (and REPA-E) and hustvl/LightningDiT as moh-dit flow models, and back
to their layouts.

Both projects keep DiT's module names (``x_embedder.proj``, ``t_embedder.mlp``, ``y_embedder.embedding_table``,
``blocks.i.{attn.qkv, attn.proj, mlp.fc1, mlp.fc2, adaLN_modulation.1}``, ``final_layer``), so the weights map as
DiT's do (moh_dit.interop.official). What differs is what the network means (docs/objective.md):

- SiT feeds the raw time ``t = 1 - s`` (noise at 0) and predicts ``x - eps``; its default and its released XL/2
  checkpoint have a ``2C`` head whose second half is never used (``learn_sigma=True``);
- REPA feeds ``s`` (noise at 1) and predicts ``eps - x`` with a ``C`` head, and its checkpoints carry the
  alignment projectors (``projectors.*``), which sampling does not use.

- LightningDiT keeps SiT's time and output (raw ``t = 1 - s``, ``x - eps``, a ``C`` head) and DiT's names, and adds
  its block (RMSNorm weights, SwiGLU's ``mlp.w12``/``mlp.w3``, QK-norm's ``attn.q_norm``/``k_norm``, the RoPE tables
  ``feat_rope.freqs_cos``/``freqs_sin``); REPA and REPA-E trained with ``--qk-norm`` carry timm's LayerNorm
  ``q_norm``/``k_norm`` (weight and bias). The block is read from these tensors (``block_from_reference``).

A loaded model records its convention (``objective.convention``: ``sit`` for SiT and LightningDiT, ``repa``), so
moh-dit samples it as its own code does, fine-tunes it in its convention, and exports it back. The path (Linear or
GVP) is not in the weights: pass the one the checkpoint was trained on.
"""

from __future__ import annotations

from pathlib import Path

import torch

from moh_dit.errors import ConversionError
from moh_dit.interop.official import config_from_reference, ours_to_reference, read_checkpoint, strict_load
from moh_dit.model.network import MoHDiT
from moh_dit.objectives.noise import PATHS
from moh_dit.sampling.spec import GuidanceSpec, SamplerSpec, SamplingSpec

__all__ = ["FLOW_FORMATS", "load_flow_checkpoint", "to_flow_state_dict", "drop_sigma_half", "own_sampling"]

FLOW_FORMATS = {"sit": "willisma/SiT", "repa": "sihyun-yu/REPA", "lightningdit": "hustvl/LightningDiT"}
# each format's time convention (moh_dit.objectives.flow.CONVENTIONS): LightningDiT's is SiT's
CONVENTION_OF = {"sit": "sit", "repa": "repa", "lightningdit": "sit"}
# the block options each project's code has: (norm, qk_norm) pairs it can build, and whether SwiGLU and RoPE exist
BLOCKS_OF = {
    "sit": {("layernorm", "none")},
    "repa": {("layernorm", "none"), ("layernorm", "layernorm")},  # timm's LayerNorm QK-norm (--qk-norm)
    "lightningdit": {("layernorm", "none"), ("layernorm", "layernorm"), ("rmsnorm", "none"), ("rmsnorm", "rmsnorm")},
}
# the MLPs and RoPE each format's code builds (LightningDiT's: every one of moh-dit's; SiT's and REPA's: DiT's MLP, no
# RoPE, at RoPE's usual theta only where it has RoPE)
MLPS_OF = {"sit": {"gelu"}, "repa": {"gelu"}, "lightningdit": None}
ROPE_OF = {"sit": False, "repa": False, "lightningdit": True}


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
    sample_size: int | None = None,
) -> tuple[MoHDiT, dict]:
    """A SiT or REPA checkpoint (``.pt`` of their ``train.py``, an EMA state dict, or ``.safetensors``) as a moh-dit
    flow model in that project's convention; returns the model and a report of what was read and dropped. With
    ``repa_depth`` (REPA's ``--encoder-depth``, which its checkpoints do not record) REPA's projectors are kept as
    the model's alignment heads on that block, to continue REPA's training; else they are dropped. ``sample_size``:
    the input size the caller expects (the latent side); a checkpoint trained at another resolution is refused."""
    if fmt not in FLOW_FORMATS:
        raise ConversionError(f"the flow checkpoint format must be one of {', '.join(FLOW_FORMATS)}, got {fmt!r}")
    if flow_path not in PATHS:
        raise ConversionError(f"the path must be one of {', '.join(PATHS)}, got {flow_path!r}")
    sd, which = read_checkpoint(path, prefer_ema)
    projectors = sorted(k for k in sd if k.startswith("projectors."))
    latent_norm = sorted(k for k in sd if k.startswith("bn."))  # REPA-E's BatchNorm of the latents
    sd = {k: v for k, v in sd.items() if k not in latent_norm}
    kept = {k: v for k, v in sd.items() if k in projectors} if repa_depth is not None else {}
    if repa_depth is not None and not kept:
        raise ConversionError(f"--repa-depth keeps REPA's projectors, and {path} has none")
    sd = {k: v for k, v in sd.items() if k not in projectors}
    config = config_from_reference(sd, num_heads, None, num_classes)
    if sample_size is not None and sample_size != config["sample_size"]:
        side = config["sample_size"] // config["patch_size"]
        raise ConversionError(
            f"{path} was trained at another resolution: its position tables (sin-cos"
            f"{' and RoPE' if 'feat_rope.freqs_cos' in sd else ''}) are for a {side} x {side} token grid, inputs of "
            f"{config['sample_size']} x {config['sample_size']}, not {sample_size} x {sample_size}"
        )
    if config.get("attention_type") != "mha":
        raise ConversionError(f"{path} has MoH routers: SiT and REPA checkpoints are multi-head DiTs")
    sigma_half = bool(config["learn_sigma"])
    if sigma_half:
        sd = drop_sigma_half(sd, config["patch_size"], config["in_channels"])
    config.update(learn_sigma=False, objective={"name": "flow", "path": flow_path, "convention": CONVENTION_OF[fmt]})
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
        + ([f"{len(projectors)} REPA projector tensors"] if projectors and not kept else [])
        + (
            [f"REPA-E's latent BatchNorm ({len(latent_norm)} tensors: normalise the latents with its statistics)"]
            if latent_norm
            else []
        ),
        "block": model.block_options.describe(),
    }
    return model.eval(), report


def to_flow_state_dict(model: MoHDiT, fmt: str = "sit") -> dict[str, torch.Tensor]:
    """The state dict of ``model`` in SiT's layout (with the ``2C`` head of SiT's default model and released
    checkpoint, its variance half zero) or REPA's (``C`` head, no projectors). Only a model in that project's
    convention converts: the time input's meaning is in the weights."""
    if fmt not in FLOW_FORMATS:
        raise ConversionError(f"the flow checkpoint format must be one of {', '.join(FLOW_FORMATS)}, got {fmt!r}")
    record, convention = model.config.get("objective") or {}, CONVENTION_OF[fmt]
    if record.get("convention") != convention:  # a convention is a flow model's; DiT's DDPM records none
        from moh_dit.objectives import objective_of

        what = (
            f"a flow model in the {record['convention']} convention"
            if record.get("convention")
            else objective_of(model).describe()  # DDPM, MeanFlow (whose second time input no such code has)
        )
        raise ConversionError(
            f"{FLOW_FORMATS[fmt]}'s code feeds its own time convention ({convention}) to the network; this is {what}, "
            f"whose weights expect another time input: train in objective.convention={convention} to export to {fmt}"
        )
    if record.get("prediction", "velocity") != "velocity":
        raise ConversionError(
            f"{FLOW_FORMATS[fmt]}'s code reads the network's output as a velocity; this model predicts the clean image "
            "(objective.prediction=x), which no such code samples"
        )
    if model.config.attention_type != "mha":
        raise ConversionError(
            f"{FLOW_FORMATS[fmt]}'s code has no Mixture-of-Head attention: export a DiT-shaped model"
        )
    block = model.block_options
    has_mlp = MLPS_OF[fmt] is None or block.mlp in MLPS_OF[fmt]
    has_rope = ROPE_OF[fmt] or not block.rope
    if (block.norm, block.qk_norm) not in BLOCKS_OF[fmt] or not (has_mlp and has_rope) or block.rope_theta != 10000.0:
        raise ConversionError(f"{FLOW_FORMATS[fmt]}'s code cannot build this model's block ({block.describe()})")
    sd = ours_to_reference(model)
    if fmt == "sit":
        c, p = model.config.in_channels, model.config.patch_size
        for key in ("final_layer.linear.weight", "final_layer.linear.bias"):
            sd[key] = _final_rows(sd[key], p, c, 2 * c)
    return sd


def own_sampling(fmt: str) -> SamplingSpec | None:
    """How a converted checkpoint's own code samples it for its published numbers, recorded with the pipeline (what
    ``moh-dit sample`` and ``evaluate --model`` start from); ``None`` where moh-dit's defaults stand.

    LightningDiT (its 800-epoch FID 1.35 config): Euler on 250 grid points (249 steps) from noise to data, its time
    shift 0.3 (SD3's 1 / 0.3 in moh-dit's time, noise at 1), guidance 6.7 on the first 3 channels (DiT's channel
    choice, kept for reproduction) from its time 0.125 on (noise levels up to (1 - 0.125) / 0.125 = 7)."""
    if fmt != "lightningdit":
        return None
    return SamplingSpec(
        SamplerSpec("euler", 249, time_shift=1 / 0.3),
        GuidanceSpec(6.7, noise=(0.0, (1 - 0.125) / 0.125), channels=3),
    )
