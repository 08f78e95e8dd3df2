"""Checkpoints of facebookresearch/DiT and SkyworkAI/MoH (MoH-DiT), both ways.

Reference layout (docs/interop.md): ``x_embedder.proj``, ``t_embedder.mlp.{0,2}``,
``y_embedder.embedding_table``, ``pos_embed``, ``blocks.i.{attn.qkv, attn.proj, mlp.fc1, mlp.fc2,
adaLN_modulation.1}``, ``final_layer.{linear, adaLN_modulation.1}`` plus, for MoH-DiT, bias-free routers
``blocks.i.attn.wg`` (routed, E x D), ``wg_0`` (shared vs routed, 2 x D) and ``wg_1`` (shared, h_s x D).
Our names are the same except that the three routers are one fused ``blocks.i.attn.router``.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from pathlib import Path

import torch

from moh_dit.errors import ConversionError
from moh_dit.files import read_safetensors, read_torch_file
from moh_dit.model.architecture import per_layer
from moh_dit.model.network import MoHDiT
from moh_dit.model.presets import PRESETS

logger = logging.getLogger(__name__)
DIT_HEADS_BY_WIDTH = {384: 6, 768: 12, 1024: 16, 1152: 16}  # DiT-S/B/L/XL


def imagenet_class_names() -> dict[int, str]:
    """ImageNet-1k's class names by id, from the metadata torchvision ships with its weight definitions (no
    download): the names of DiT's 1000 classes."""
    from torchvision.models import ResNet50_Weights

    return dict(enumerate(ResNet50_Weights.IMAGENET1K_V1.meta["categories"]))


# ----------------------------------------------------------------------------------------------------
# Reading
# ----------------------------------------------------------------------------------------------------
def read_checkpoint(path: str | Path, prefer_ema: bool = True) -> tuple[dict[str, torch.Tensor], str]:
    """A state dict from ``.pt``/``.pth``/``.bin`` (``torch.load(weights_only=True)``; a ``train.py`` dict's
    ``ema`` is preferred over ``model``) or ``.safetensors``. Returns ``(state_dict, which)``."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {path} not found")
    if path.suffix == ".safetensors":
        return read_safetensors(path), "safetensors"
    obj = read_torch_file(path, ConversionError, "plain tensor checkpoint")
    which = "state dict"
    if (
        isinstance(obj, dict)
        and any(k in obj for k in ("ema", "model"))
        and not any(isinstance(v, torch.Tensor) for v in obj.values())
    ):
        which = "ema" if prefer_ema and "ema" in obj else "model"
        if which not in obj:
            raise ConversionError(f"{path} holds {sorted(obj)}; expected 'ema' or 'model'")
        obj = obj[which]
    if not isinstance(obj, dict) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise ConversionError(f"{path} does not hold a state dict of tensors")
    return {k.removeprefix("module.").removeprefix("_orig_mod."): v for k, v in obj.items()}, which


# ----------------------------------------------------------------------------------------------------
# Reference layout (facebookresearch/DiT, SkyworkAI/MoH)
# ----------------------------------------------------------------------------------------------------
def config_from_reference(
    sd: dict[str, torch.Tensor],
    num_heads: int | Sequence[int] | None = None,
    top_k: int | Sequence[int] | None = None,
    num_classes: int | None = None,
) -> dict:
    """Infer the MoHDiT config from reference tensor shapes.

    Width, depth, patch size, input channels, latent size, learned sigma, head counts of MoH layers
    (from the router shapes) and the number of classes come from the shapes. Two things cannot: the
    head count of a plain DiT (taken from DiT's sizes unless ``num_heads`` is given) and MoH's top-k
    (taken from the preset whose head tables match unless ``top_k`` is given).
    """
    missing = [k for k in ("x_embedder.proj.weight", "pos_embed", "final_layer.linear.weight") if k not in sd]
    if missing:
        raise ConversionError(f"not a DiT/MoH-DiT reference checkpoint: missing {missing}")
    w = sd["x_embedder.proj.weight"]
    hidden, in_ch, patch = w.shape[0], w.shape[1], w.shape[2]
    tokens = sd["pos_embed"].shape[1]
    grid = int(round(tokens**0.5))
    depth = 1 + max(int(m.group(1)) for k in sd if (m := re.match(r"blocks\.(\d+)\.", k)))
    out_ch = sd["final_layer.linear.weight"].shape[0] // (patch * patch)
    rows = sd["y_embedder.embedding_table.weight"].shape[0] if "y_embedder.embedding_table.weight" in sd else 0
    classes = num_classes if num_classes is not None else max(rows - 1, 0)
    moh = any(k.endswith(("attn.wg.weight", "attn.wg_1.weight")) for k in sd)
    heads, shared, dims = [], [], []
    head_size = _head_size_from_tensors(sd)  # QK-norm weights and RoPE tables are per head
    if num_heads is None and head_size is not None:
        num_heads = sd["blocks.0.attn.proj.weight"].shape[1] // head_size
    for i in range(depth):
        inner = sd[f"blocks.{i}.attn.proj.weight"].shape[1]
        e = sd[f"blocks.{i}.attn.wg.weight"].shape[0] if f"blocks.{i}.attn.wg.weight" in sd else 0
        if f"blocks.{i}.attn.wg_1.weight" in sd:
            hs = sd[f"blocks.{i}.attn.wg_1.weight"].shape[0]
        elif e:
            hs = 1 if f"blocks.{i}.attn.wg_0.weight" in sd else 0
        else:
            hs = None
        if moh and hs is not None:
            h = hs + e
        else:
            h = (
                per_layer("num_heads", num_heads, depth)[i]
                if num_heads is not None
                else DIT_HEADS_BY_WIDTH.get(hidden)
            )
            if h is None:
                raise ConversionError(
                    f"cannot infer the number of heads of layer {i} (width {hidden}); pass num_heads"
                )
        if inner % h:
            raise ConversionError(f"layer {i}: attention width {inner} is not divisible by {h} heads")
        heads.append(h)
        shared.append(hs if moh else None)
        dims.append(inner // h)
    if len(set(dims)) != 1:
        raise ConversionError(f"layers have different head sizes {sorted(set(dims))}; not supported")
    config = dict(
        sample_size=grid * patch,
        patch_size=patch,
        in_channels=in_ch,
        hidden_size=hidden,
        depth=depth,
        num_heads=heads if len(set(heads)) > 1 or moh else heads[0],
        head_dim=dims[0],
        num_classes=classes,
        class_dropout_prob=0.1 if rows == classes + 1 and classes > 0 else 0.0,
        learn_sigma=out_ch == 2 * in_ch,
    )
    block = block_from_reference(sd, hidden, dims[0])
    if block is not None:
        config["block"] = block
    if not moh:
        config.update(attention_type="mha", num_shared_heads=None, top_k=0)
        return config
    if top_k is None:
        match = [
            n
            for n, p in PRESETS.items()
            if p.get("attention_type") == "moh"
            and p["depth"] == depth
            and per_layer("num_heads", p["num_heads"], depth) == heads
            and per_layer("num_shared_heads", p["num_shared_heads"], depth) == shared
        ]
        if not match:
            raise ConversionError(
                f"MoH checkpoint with heads {heads} and shared heads {shared} matches no preset: pass top_k per layer"
            )
        top_k = per_layer("top_k", PRESETS[match[0]]["top_k"], depth)
        logger.info("top-k taken from preset %s (head tables match)", match[0])
    config.update(attention_type="moh", num_shared_heads=shared, top_k=per_layer("top_k", top_k, depth))
    return config


def _head_size_from_tensors(sd: dict[str, torch.Tensor]) -> int | None:
    """The head size where a tensor states it: a QK-norm weight (per head) or a RoPE table (head size wide)."""
    if "blocks.0.attn.q_norm.weight" in sd:
        return int(sd["blocks.0.attn.q_norm.weight"].shape[0])
    if "feat_rope.freqs_cos" in sd:
        return int(sd["feat_rope.freqs_cos"].shape[1])
    return None


def block_from_reference(sd: dict[str, torch.Tensor], hidden: int, head_dim: int) -> dict | None:
    """The block options a DiT-layout state dict's tensors show (LightningDiT's names; REPA's timm QK-norm):
    RMSNorm (``norm1.weight``), SwiGLU (``mlp.w12``), QK-norm (``attn.q_norm``: RMSNorm, or LayerNorm when it has a
    bias), 2-D RoPE (``feat_rope`` tables). ``None``: DiT's block. LightningDiT's ``wo_shift`` (scale-only adaLN,
    in none of its released configs) is refused."""
    from moh_dit.model.block import BlockOptions

    adaln = sd.get("blocks.0.adaLN_modulation.1.weight")
    if adaln is not None and adaln.shape[0] == 4 * hidden:
        raise ConversionError(
            "the checkpoint's adaLN has no shift (LightningDiT's wo_shift, in none of its released configs); moh-dit's "
            "block keeps DiT's shift, scale and gate"
        )
    options = dict(
        norm="rmsnorm" if "blocks.0.norm1.weight" in sd else "layernorm",
        mlp="swiglu" if "blocks.0.mlp.w12.weight" in sd else "gelu",
        qk_norm="none"
        if "blocks.0.attn.q_norm.weight" not in sd
        else ("layernorm" if "blocks.0.attn.q_norm.bias" in sd else "rmsnorm"),
        rope="feat_rope.freqs_cos" in sd,
    )
    if options["rope"] and sd["feat_rope.freqs_cos"].shape[1] != head_dim:
        raise ConversionError(
            f"the RoPE table is {sd['feat_rope.freqs_cos'].shape[1]} channels wide, the heads {head_dim}: not one model"
        )
    return BlockOptions(**options).record()


# our router rows (MoHAttention.router_slices) -> the reference code's router names
REFERENCE_ROUTERS = {"routed": "wg", "shared": "wg_1", "mix": "wg_0"}


def _router_slices(attn) -> dict[str, slice]:
    """The layer's fused router rows under the reference names, in the reference's order."""
    return {REFERENCE_ROUTERS[name]: rows for name, rows in attn.router_slices().items()}


def reference_to_ours(sd: dict[str, torch.Tensor], model: MoHDiT) -> dict[str, torch.Tensor]:
    """Rename reference keys: each layer's ``wg``/``wg_1``/``wg_0`` fused into ``router`` where ``model`` has
    one. Router keys the model has no place for are passed through, so strict loading reports them."""
    out, fused = {}, set()
    for i, block in enumerate(model.blocks):
        slices = _router_slices(block.attn)
        if not slices:
            continue
        keys = [f"blocks.{i}.attn.{name}.weight" for name in ("wg", "wg_1", "wg_0") if name in slices]
        absent = [k for k in keys if k not in sd]
        if absent:
            raise ConversionError(f"the model expects routers {absent} that the checkpoint does not have")
        out[f"blocks.{i}.attn.router.weight"] = torch.cat([sd[k] for k in keys], 0)
        fused.update(keys)
    out.update({k: v for k, v in sd.items() if k not in fused})
    return out


def check_ddpm_export(model: MoHDiT, target: str) -> None:
    """``target``'s code (DiT's, MoH-DiT's, diffusers' ``DiTPipeline``) samples every checkpoint as DiT's DDPM: a
    model trained with another objective (it records one; DDPM records none) would load there without a word and
    draw noise. A :class:`ConversionError` that says where it can go instead."""
    if model.block_options.record() is not None:
        raise ConversionError(f"{target} builds DiT's block; this model's is {model.block_options.describe()}")
    record = model.config.get("objective")
    if record is not None:
        from moh_dit.objectives import objective_from_record

        raise ConversionError(
            f"{target} samples every checkpoint as DiT's DDPM (noise prediction); this model is "
            f"{objective_from_record(record, learn_sigma=model.config.learn_sigma).describe()}: export a flow model "
            f"with --to sit or --to repa (in that convention), or keep it as a moh-dit pipeline"
        )


def ours_to_reference(model: MoHDiT) -> dict[str, torch.Tensor]:
    """Our state dict in the reference layout (routers split back into ``wg``, ``wg_1``, ``wg_0``)."""
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    for i, block in enumerate(model.blocks):
        key = f"blocks.{i}.attn.router.weight"
        if key in sd:
            fused = sd.pop(key)
            for name, sl in _router_slices(block.attn).items():
                sd[f"blocks.{i}.attn.{name}.weight"] = fused[sl].clone()
    return sd


def strict_load(model: MoHDiT, sd: dict[str, torch.Tensor], source: str) -> None:
    """Load with exact key and shape matching; the error lists every difference."""
    target = model.state_dict()
    missing = sorted(set(target) - set(sd))
    unexpected = sorted(set(sd) - set(target))
    shapes = [
        f"{k}: checkpoint {tuple(sd[k].shape)} vs model {tuple(target[k].shape)}"
        for k in sorted(set(sd) & set(target))
        if sd[k].shape != target[k].shape
    ]
    # tables of another token count at the same width: the same network trained at another resolution
    grids = [
        k
        for k in ("pos_embed", "feat_rope.freqs_cos")
        if k in sd
        and k in target
        and sd[k].shape[-2] != target[k].shape[-2]
        and sd[k].shape[-1] == target[k].shape[-1]
    ]
    if grids:
        have, want = (int(t[grids[0]].shape[-2]) for t in (sd, target))
        raise ConversionError(
            f"{source} was trained at another resolution: its position tables ({', '.join(grids)}) are for "
            f"{have} tokens ({round(have**0.5)} x {round(have**0.5)}), the model's for {want} "
            f"({round(want**0.5)} x {round(want**0.5)}); the sin-cos and RoPE tables belong to the token grid they "
            f"were trained on: load it at its own size"
        )
    if missing or unexpected or shapes:
        lines = [f"{source} does not match the model:"]
        if shapes:
            lines.append(f"  {len(shapes)} shape mismatches, e.g. " + "; ".join(shapes[:6]))
        if missing:
            lines.append(f"  {len(missing)} missing keys, e.g. {missing[:6]}")
        if unexpected:
            lines.append(f"  {len(unexpected)} unexpected keys, e.g. {unexpected[:6]}")
        raise ConversionError("\n".join(lines))
    model.load_state_dict({k: v.to(target[k].dtype) for k, v in sd.items()})


def load_reference_checkpoint(
    path: str | Path,
    preset: str | None = None,
    num_heads=None,
    top_k=None,
    num_classes: int | None = None,
    prefer_ema: bool = True,
) -> tuple[MoHDiT, dict]:
    """Build a MoHDiT from a reference checkpoint (shapes inferred, or ``preset`` enforced); returns the
    model and a report (which weights, inferred config)."""
    sd, which = read_checkpoint(path, prefer_ema)
    if preset is not None:
        if preset not in PRESETS:
            raise ConversionError(f"unknown preset {preset!r}")
        config = dict(PRESETS[preset])
        inferred = None
    else:
        config = config_from_reference(sd, num_heads, top_k, num_classes)
        inferred = config
    model = MoHDiT(**config)
    strict_load(model, reference_to_ours(sd, model), f"{path} ({which})")
    return model.eval(), {"source": str(path), "weights": which, "config": inferred or config}
