"""Turning a pretrained multi-head DiT into a MoH-DiT to continue training: the heads become experts, and
the routers start where the MoH-DiT output equals the DiT's.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from moh_dit.errors import ConversionError
from moh_dit.interop.official import strict_load
from moh_dit.model.architecture import per_layer
from moh_dit.model.network import MoHDiT
from moh_dit.objectives import objective_of


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
    calibration: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    router_logit_std: float = 0.1,
    seed: int = 0,
) -> tuple[MoHDiT, dict]:
    """Turn a multi-head MoHDiT (DiT) into a MoH-DiT that starts as close to it as possible.

    Per layer, on a calibration batch (``(x, t, y)``; Gaussian latents, random times of the model's objective and
    classes by default): heads are ranked by the mean norm of their projected output; the ``shared`` most important
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
    shared_l, topk_l = per_layer("shared", shared, depth), per_layer("top_k", top_k, depth)
    cfg = dict(model.config)
    cfg = {k: v for k, v in cfg.items() if not k.startswith("_")}
    cfg.update(attention_type="moh", num_heads=heads, num_shared_heads=shared_l, top_k=topk_l)
    moh = MoHDiT(**cfg)  # validates the tables

    if calibration is None:
        g = torch.Generator().manual_seed(seed)
        c, s = model.in_channels, model.config.sample_size
        n = 16
        x = torch.randn(n, c, s, s, generator=g)
        t = objective_of(model).random_model_times(n, g)  # the times the network saw in training
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
