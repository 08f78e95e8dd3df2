"""Interop: checkpoints of facebookresearch/DiT, SkyworkAI/MoH (MoH-DiT) and diffusers' DiT, both ways, and
turning a pretrained multi-head DiT into a MoH-DiT to continue training.

The command line is ``moh-dit convert`` (``moh_dit/commands/convert.py``).

Reference layout (docs/interop.md): ``x_embedder.proj``, ``t_embedder.mlp.{0,2}``,
``y_embedder.embedding_table``, ``pos_embed``, ``blocks.i.{attn.qkv, attn.proj, mlp.fc1, mlp.fc2,
adaLN_modulation.1}``, ``final_layer.{linear, adaLN_modulation.1}`` plus, for MoH-DiT, bias-free routers
``blocks.i.attn.wg`` (routed, E x D), ``wg_0`` (shared vs routed, 2 x D) and ``wg_1`` (shared, h_s x D).
Our names are the same except that the three routers are one fused ``blocks.i.attn.router``.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Optional, Sequence

import torch

from .artifacts import read_safetensors, read_torch_file
from .errors import ConversionError
from .model import MoHDiT, _per_layer
from .presets import PRESETS

__all__ = [
    "imagenet_class_names",
    "read_checkpoint",
    "config_from_reference",
    "reference_to_ours",
    "ours_to_reference",
    "load_reference_checkpoint",
    "from_diffusers",
    "to_diffusers",
    "dit_to_moh",
    "ConversionError",
]

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
    num_heads: Optional[int | Sequence[int]] = None,
    top_k: Optional[int | Sequence[int]] = None,
    num_classes: Optional[int] = None,
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
                _per_layer("num_heads", num_heads, depth)[i]
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
    if not moh:
        config.update(attention_type="mha", num_shared_heads=None, top_k=0)
        return config
    if top_k is None:
        match = [
            n
            for n, p in PRESETS.items()
            if p.get("attention_type") == "moh"
            and p["depth"] == depth
            and _per_layer("num_heads", p["num_heads"], depth) == heads
            and _per_layer("num_shared_heads", p["num_shared_heads"], depth) == shared
        ]
        if not match:
            raise ConversionError(
                f"MoH checkpoint with heads {heads} and shared heads {shared} matches no preset: pass top_k per layer"
            )
        top_k = _per_layer("top_k", PRESETS[match[0]]["top_k"], depth)
        logger.info("top-k taken from preset %s (head tables match)", match[0])
    config.update(attention_type="moh", num_shared_heads=shared, top_k=_per_layer("top_k", top_k, depth))
    return config


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
    preset: Optional[str] = None,
    num_heads=None,
    top_k=None,
    num_classes: Optional[int] = None,
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


# ----------------------------------------------------------------------------------------------------
# diffusers DiTTransformer2DModel
# ----------------------------------------------------------------------------------------------------
def _diffusers_map(depth: int) -> list[tuple[str, str]]:
    """(ours, diffusers) name pairs for everything but q/k/v (fused in ours) and the embedders."""
    pairs = [
        ("x_embedder.proj.weight", "pos_embed.proj.weight"),
        ("x_embedder.proj.bias", "pos_embed.proj.bias"),
        ("final_layer.adaLN_modulation.1.weight", "proj_out_1.weight"),
        ("final_layer.adaLN_modulation.1.bias", "proj_out_1.bias"),
        ("final_layer.linear.weight", "proj_out_2.weight"),
        ("final_layer.linear.bias", "proj_out_2.bias"),
    ]
    for i in range(depth):
        b, d = f"blocks.{i}.", f"transformer_blocks.{i}."
        for suffix in ("weight", "bias"):
            pairs += [
                (f"{b}attn.proj.{suffix}", f"{d}attn1.to_out.0.{suffix}"),
                (f"{b}mlp.fc1.{suffix}", f"{d}ff.net.0.proj.{suffix}"),
                (f"{b}mlp.fc2.{suffix}", f"{d}ff.net.2.{suffix}"),
                (f"{b}adaLN_modulation.1.{suffix}", f"{d}norm1.linear.{suffix}"),
            ]
    return pairs


def from_diffusers(dit) -> MoHDiT:
    """A diffusers ``DiTTransformer2DModel`` -> an equivalent MoHDiT (``attention_type="mha"``)."""
    cfg = dit.config
    if cfg.norm_type != "ada_norm_zero" or cfg.num_embeds_ada_norm is None:
        raise ConversionError(f"only class-conditional adaLN-Zero DiT models convert (norm_type={cfg.norm_type})")
    sd = dit.state_dict()
    inner = cfg.num_attention_heads * cfg.attention_head_dim
    emb = "transformer_blocks.0.norm1.emb."
    rows = sd[emb + "class_embedder.embedding_table.weight"].shape[0]
    model = MoHDiT(
        sample_size=cfg.sample_size,
        patch_size=cfg.patch_size,
        in_channels=cfg.in_channels,
        hidden_size=inner,
        depth=cfg.num_layers,
        num_heads=cfg.num_attention_heads,
        head_dim=cfg.attention_head_dim,
        attention_type="mha",
        num_classes=cfg.num_embeds_ada_norm,
        class_dropout_prob=0.1 if rows == cfg.num_embeds_ada_norm + 1 else 0.0,
        learn_sigma=cfg.out_channels == 2 * cfg.in_channels,
        norm_eps=1e-6,
        mlp_norm_eps=cfg.norm_eps,
        timestep_freq_shift=1.0,
        qkv_bias=cfg.attention_bias,
    )
    ours = {o: sd[d] for o, d in _diffusers_map(cfg.num_layers)}
    for i in range(cfg.num_layers):
        d = f"transformer_blocks.{i}.attn1."
        ours[f"blocks.{i}.attn.qkv.weight"] = torch.cat([sd[d + f"to_{n}.weight"] for n in "qkv"])
        if cfg.attention_bias:
            ours[f"blocks.{i}.attn.qkv.bias"] = torch.cat([sd[d + f"to_{n}.bias"] for n in "qkv"])
        for key in [k for k in sd if k.startswith(f"transformer_blocks.{i}.norm1.emb.")]:
            if not torch.equal(sd[key], sd[emb + key.split(".norm1.emb.", 1)[1]]):
                raise ConversionError(f"{key} differs from block 0's copy: per-block embedders cannot be represented")
    ours["t_embedder.mlp.0.weight"] = sd[emb + "timestep_embedder.linear_1.weight"]
    ours["t_embedder.mlp.0.bias"] = sd[emb + "timestep_embedder.linear_1.bias"]
    ours["t_embedder.mlp.2.weight"] = sd[emb + "timestep_embedder.linear_2.weight"]
    ours["t_embedder.mlp.2.bias"] = sd[emb + "timestep_embedder.linear_2.bias"]
    ours["y_embedder.embedding_table.weight"] = sd[emb + "class_embedder.embedding_table.weight"]
    ours["pos_embed"] = dit.pos_embed.pos_embed.detach().reshape(1, -1, inner)
    strict_load(model, ours, "diffusers DiTTransformer2DModel")
    return model.eval()


def to_diffusers(model: MoHDiT):
    """A multi-head MoHDiT -> diffusers ``DiTTransformer2DModel`` (diffusers has no Mixture-of-Head)."""
    from diffusers import DiTTransformer2DModel

    cfg = model.config
    if cfg.attention_type != "mha":
        raise ConversionError(
            "diffusers' DiTTransformer2DModel has no Mixture-of-Head attention; export MoH models "
            "to the reference layout instead"
        )
    if cfg.norm_eps != 1e-6 or cfg.num_classes == 0 or not isinstance(cfg.num_heads, int):
        raise ConversionError("diffusers' DiT needs norm_eps 1e-6, class labels and one head count for all layers")
    head_dim = cfg.head_dim or cfg.hidden_size // cfg.num_heads
    dit = DiTTransformer2DModel(
        num_attention_heads=cfg.num_heads,
        attention_head_dim=head_dim,
        in_channels=cfg.in_channels,
        out_channels=model.out_channels,
        num_layers=cfg.depth,
        sample_size=cfg.sample_size,
        patch_size=cfg.patch_size,
        num_embeds_ada_norm=cfg.num_classes,
        attention_bias=cfg.qkv_bias,
        norm_eps=cfg.mlp_norm_eps if cfg.mlp_norm_eps is not None else cfg.norm_eps,
    )
    if cfg.timestep_freq_shift != 1.0:
        logger.warning(
            "diffusers' DiT uses timestep frequency shift 1; this model uses %s: outputs will differ slightly",
            cfg.timestep_freq_shift,
        )
    sd = model.state_dict()
    out = {d: sd[o] for o, d in _diffusers_map(cfg.depth)}
    inner = cfg.num_heads * head_dim
    for i in range(cfg.depth):
        d = f"transformer_blocks.{i}."
        for j, n in enumerate("qkv"):
            out[d + f"attn1.to_{n}.weight"] = sd[f"blocks.{i}.attn.qkv.weight"][j * inner : (j + 1) * inner]
            if cfg.qkv_bias:
                out[d + f"attn1.to_{n}.bias"] = sd[f"blocks.{i}.attn.qkv.bias"][j * inner : (j + 1) * inner]
        e = d + "norm1.emb."
        out[e + "timestep_embedder.linear_1.weight"] = sd["t_embedder.mlp.0.weight"]
        out[e + "timestep_embedder.linear_1.bias"] = sd["t_embedder.mlp.0.bias"]
        out[e + "timestep_embedder.linear_2.weight"] = sd["t_embedder.mlp.2.weight"]
        out[e + "timestep_embedder.linear_2.bias"] = sd["t_embedder.mlp.2.bias"]
        out[e + "class_embedder.embedding_table.weight"] = sd["y_embedder.embedding_table.weight"]
    missing, unexpected = dit.load_state_dict(out, strict=False)
    missing = [k for k in missing if not k.endswith("pos_embed.pos_embed")]
    if missing or unexpected:
        raise ConversionError(f"diffusers export incomplete: missing {missing[:5]}, unexpected {unexpected[:5]}")
    return dit.eval()


# ----------------------------------------------------------------------------------------------------
# Continue-tuning a multi-head DiT into MoH-DiT
# ----------------------------------------------------------------------------------------------------
def _head_outputs(attn, h_in: torch.Tensor) -> torch.Tensor:
    """Each head's projected contribution to the attention output: (N, T, h, D)."""
    n, t, d = h_in.shape
    h, dh = attn.num_heads, attn.head_dim
    qkv = attn.qkv(h_in).reshape(n, t, 3, h, dh).permute(2, 0, 3, 1, 4)
    o = torch.nn.functional.scaled_dot_product_attention(*qkv.unbind(0)).transpose(1, 2)  # (N, T, h, dh)
    return torch.einsum("nthe,dhe->nthd", o, attn.proj.weight.reshape(d, h, dh))


@torch.no_grad()
def dit_to_moh(
    model: MoHDiT,
    shared: int | Sequence[int],
    top_k: int | Sequence[int],
    calibration: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None,
    router_logit_std: float = 0.1,
    seed: int = 0,
) -> tuple[MoHDiT, dict]:
    """Turn a multi-head MoHDiT (DiT) into a MoH-DiT that starts as close to it as possible.

    Per layer, on a calibration batch (``(x, t, y)``; Gaussian latents, random steps and classes by
    default): heads are ranked by the mean norm of their projected output; the ``shared`` most important
    ones become the shared heads (heads are permuted; the layer computes the same function); the shared
    and mixing routers start at zero (every gate 1); the routed router is fitted by least squares to
    predict each token's per-head contribution (log norm), then scaled to a small logit spread, so each
    token's top-k picks its most important routed heads with gates close to 1. With ``top_k`` equal to
    all routed heads the routers stay zero and the model is exactly the original.

    Returns the model and a report with each layer's relative output deviation on the calibration batch.
    """
    if model.config.attention_type != "mha":
        raise ConversionError("dit_to_moh expects a multi-head model (attention_type='mha')")
    depth = model.config.depth
    heads = [a.num_heads for a in model.attention_layers]
    shared_l, topk_l = _per_layer("shared", shared, depth), _per_layer("top_k", top_k, depth)
    cfg = dict(model.config)
    cfg = {k: v for k, v in cfg.items() if not k.startswith("_")}
    cfg.update(attention_type="moh", num_heads=heads, num_shared_heads=shared_l, top_k=topk_l)
    moh = MoHDiT(**cfg)  # validates the tables

    if calibration is None:
        g = torch.Generator().manual_seed(seed)
        c, s = model.in_channels, model.config.sample_size
        n = 16
        x = torch.randn(n, c, s, s, generator=g)
        t = torch.randint(0, 1000, (n,), generator=g)
        y = torch.randint(0, max(model.config.num_classes, 1), (n,), generator=g) if model.config.num_classes else None
    else:
        x, t, y = calibration
    inputs: dict[int, torch.Tensor] = {}
    hooks = [
        blk.attn.register_forward_hook(lambda m, a, o, i=i: inputs.__setitem__(i, a[0].detach()))
        for i, blk in enumerate(model.blocks)
    ]
    model.eval()
    reference_out = model(x, t, y).sample
    for hook in hooks:
        hook.remove()

    sd = {k: v.clone() for k, v in model.state_dict().items()}
    report = {"layers": []}
    for i, (src, dst) in enumerate(zip(model.attention_layers, moh.attention_layers)):
        h, dh, d = src.num_heads, src.head_dim, src.dim
        contrib = _head_outputs(src, inputs[i]).norm(dim=-1)  # (N, T, h)
        order = torch.argsort(contrib.mean(dim=(0, 1)), descending=True)
        hs = dst.num_shared_heads
        pre = f"blocks.{i}.attn."
        sd[pre + "qkv.weight"] = sd[pre + "qkv.weight"].reshape(3, h, dh, d)[:, order].reshape(3 * h * dh, d)
        if pre + "qkv.bias" in sd:
            sd[pre + "qkv.bias"] = sd[pre + "qkv.bias"].reshape(3, h, dh)[:, order].reshape(-1)
        sd[pre + "proj.weight"] = sd[pre + "proj.weight"].reshape(d, h, dh)[:, order].reshape(d, h * dh)
        if dst.router is not None:
            router = torch.zeros_like(dst.router.weight)
            e = dst.num_routed_heads
            if e and dst.top_k < e:
                feats = inputs[i].reshape(-1, d).double()
                target = contrib[..., order[hs:]].reshape(-1, e).clamp_min(1e-8).log().double()
                target = target - target.mean(dim=1, keepdim=True)
                ridge = 1e-3 * feats.square().mean() * torch.eye(d, dtype=torch.float64)
                w = torch.linalg.solve(feats.T @ feats + ridge, feats.T @ target).T  # (E, D)
                spread = (feats @ w.T).std().clamp_min(1e-12)
                router[:e] = (w * (router_logit_std / spread)).to(router.dtype)
            sd[pre + "router.weight"] = router
        report["layers"].append(
            {
                "layer": i,
                "shared_heads": [int(v) for v in order[:hs]],
                "top_k": dst.top_k,
                "routed": dst.num_routed_heads,
            }
        )
    strict_load(moh, sd, "converted DiT")
    moh.eval()
    for i, (src, dst) in enumerate(zip(model.attention_layers, moh.attention_layers)):
        a, _ = src(inputs[i])
        b, _ = dst(inputs[i])
        report["layers"][i]["relative_deviation"] = float((b - a).norm() / a.norm().clamp_min(1e-12))
    out = moh(x, t, y).sample
    report["model_relative_deviation"] = float((out - reference_out).norm() / reference_out.norm().clamp_min(1e-12))
    active, total = moh.head_counts()
    report["active_heads"] = f"{active}/{total}"
    return moh, report


# ----------------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------------
def load_any(src: str | Path, **hints) -> tuple[MoHDiT, Optional[object], dict, dict]:
    """(model, vae, id2label, report) from a reference checkpoint file, a diffusers DiT pipeline or
    transformer folder, or one of our run / checkpoint / pipeline / transformer folders."""
    src = Path(src)
    if src.is_file():
        model, report = load_reference_checkpoint(src, **hints)
        return model, None, {}, report
    index = src / "model_index.json"
    if index.is_file() and json.loads(index.read_text()).get("_class_name") == "DiTPipeline":
        from diffusers import AutoencoderKL, DiTTransformer2DModel

        meta = json.loads(index.read_text())
        model = from_diffusers(DiTTransformer2DModel.from_pretrained(src, subfolder="transformer"))
        vae = AutoencoderKL.from_pretrained(src, subfolder="vae") if (src / "vae").is_dir() else None
        id2label = {int(k): v for k, v in (meta.get("id2label") or {}).items()}
        return model, vae, id2label, {"source": str(src), "format": "diffusers DiTPipeline"}
    cfg_file = src / "config.json"
    if cfg_file.is_file() and json.loads(cfg_file.read_text()).get("_class_name") == "DiTTransformer2DModel":
        from diffusers import DiTTransformer2DModel

        return (
            from_diffusers(DiTTransformer2DModel.from_pretrained(src)),
            None,
            {},
            {"source": str(src), "format": "diffusers"},
        )
    from .generate import load_pipeline

    pipe = load_pipeline(src, device="cpu")
    return (
        pipe.transformer,
        pipe.vae,
        pipe.id2label,
        {"source": str(src), "format": "moh-dit", "provenance": pipe.provenance},
    )


if __name__ == "__main__":  # python -m moh_dit.convert: the same as `moh-dit convert`
    from moh_dit.cli import run_cli
    from moh_dit.commands.convert import main

    run_cli(main)
