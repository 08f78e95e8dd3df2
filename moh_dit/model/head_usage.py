"""Which heads the tokens of MoH attention layers use, recorded while the model runs (the demo's heatmap, the
studies' head-usage plots)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch

from moh_dit.model.attention import MoHAttention

__all__ = ["recording_head_usage"]


@contextlib.contextmanager
def recording_head_usage(layers: Sequence[MoHAttention]) -> Iterator[list[torch.Tensor]]:
    """Within the context, every forward pass of ``layers`` adds up which heads its tokens used. Yields one tensor per
    layer, (heads,) shares of tokens that used each head (shared heads: 1), updated as passes run."""
    counts = [torch.zeros(a.num_heads, dtype=torch.float64) for a in layers]
    tokens = [0] * len(counts)
    usage = [c.clone() for c in counts]

    def hook(layer: int, attn: MoHAttention):
        def record(module, args, output) -> None:
            x = args[0]
            used = torch.ones(*x.shape[:2], attn.num_heads, dtype=torch.float64, device=x.device)
            mask = attn.compute_gates(x)[2]  # the same routing as the forward pass (cheap: one router matmul)
            if mask is not None:
                used[..., attn.num_shared_heads :] = mask.double()
            counts[layer] += used.sum(dim=(0, 1)).cpu()
            tokens[layer] += x.shape[0] * x.shape[1]
            usage[layer].copy_(counts[layer] / tokens[layer])

        return record

    handles = [a.register_forward_hook(hook(i, a)) for i, a in enumerate(layers)]
    try:
        yield usage
    finally:
        for handle in handles:
            handle.remove()
