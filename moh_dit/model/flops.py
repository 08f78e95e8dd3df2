"""FLOPs of a MoHDiT forward pass, counted from its architecture (for throughput and MFU in training logs).

A FLOP here is one multiply or one add: a matrix product of (m x k) and (k x n) costs 2 m k n, as
``torch.utils.flop_counter`` counts it. Only the matrix products count (patch embedder, timestep MLP, adaLN,
routers, q/k/v, attention, output projection, MLP, final layer); norms, activations and gates are a few
percent at most and are left out, as model-FLOPs-utilisation conventions do (PaLM, Appendix B).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

__all__ = ["FlopCount", "forward_flops"]


@dataclass(frozen=True)
class FlopCount:
    """FLOPs of one image's forward pass, by part. ``attention_core`` is QK^T and the weighting of V."""

    embed: int
    adaln: int
    router: int
    qkv: int
    attention_core: int
    proj: int
    mlp: int
    final: int

    @property
    def total(self) -> int:
        return (
            self.embed + self.adaln + self.router + self.qkv + self.attention_core + self.proj + self.mlp + self.final
        )

    def training_step(self, forwards: float = 3.0) -> int:
        """One image's training step: ``forwards`` forward passes' worth. A forward and backward pass is 3 (the
        backward costs two forwards: gradients of the inputs and of the weights); an objective says its own
        (:meth:`moh_dit.objectives.base.Objective.training_forwards`: MeanFlow's JVP and guidance passes)."""
        return round(forwards * self.total)


def _linear(layer: nn.Linear, rows: int) -> int:
    return 2 * rows * layer.in_features * layer.out_features


def forward_flops(
    model: nn.Module, active_heads: bool = False, routed: tuple[tuple[int, int], int] | None = None
) -> FlopCount:
    """FLOPs of one image's forward pass through ``model`` (a :class:`~moh_dit.model.network.MoHDiT`).

    ``active_heads=False`` counts what dense execution computes: every head, inactive ones multiplied by zero
    (what ``FlopCounterMode`` measures). ``active_heads=True`` counts the useful work of MoH: the queries,
    attention and output projection of the heads a token uses (shared plus top-k routed), with keys and
    values of every head (a routed head's keys serve every token that picks it).

    ``routed``: TREAD's ``((start, stop), kept)``: the blocks ``[start, stop)`` see only ``kept`` tokens.
    """
    config = model.config
    every = (config.sample_size // config.patch_size) ** 2
    tokens = every
    proj = model.x_embedder.proj  # a patch-sized convolution with stride = kernel: one matrix product per patch
    embed = 2 * tokens * proj.in_channels * proj.kernel_size[0] * proj.kernel_size[1] * proj.out_channels
    embed += sum(_linear(m, 1) for m in model.t_embedder.mlp if isinstance(m, nn.Linear))
    adaln = router = qkv = core = out = mlp = 0
    for index, block in enumerate(model.blocks):
        attn = block.attn
        tokens = routed[1] if routed is not None and routed[0][0] <= index < routed[0][1] else every
        adaln += _linear(block.adaLN_modulation[1], 1)
        mlp += sum(_linear(m, tokens) for m in block.mlp.modules() if isinstance(m, nn.Linear))  # GELU or SwiGLU
        if attn.router is not None:
            router += _linear(attn.router, tokens)
        share = attn.num_active_heads / attn.num_heads if active_heads else 1.0
        per_part = _linear(attn.qkv, tokens) // 3  # q, k and v each
        qkv += round(per_part * share) + 2 * per_part
        core += round(2 * 2 * tokens * tokens * attn.head_dim * attn.num_heads * share)
        out += round(_linear(attn.proj, tokens) * share)
    final = _linear(model.final_layer.adaLN_modulation[1], 1) + _linear(model.final_layer.linear, every)
    return FlopCount(embed, adaln, router, qkv, core, out, mlp, final)
