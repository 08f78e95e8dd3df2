"""diffusers' ``DiTTransformer2DModel`` (``facebook/DiT-XL-2-256``) to and from moh-dit."""

from __future__ import annotations

import logging

import torch

from moh_dit.errors import ConversionError
from moh_dit.interop.official import strict_load
from moh_dit.model.network import MoHDiT

logger = logging.getLogger(__name__)


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
