"""2-D rotary position embedding (RoPE) of image tokens, laid out as LightningDiT lays it out (EVA-02's
``VisionRotaryEmbeddingFast``; docs/backbone.md cites the lines).

Every head of size ``d`` is split in two halves: the first ``d/2`` channels rotate with the token's row, the last
``d/2`` with its column, each half in adjacent pairs ``(2i, 2i+1)`` at the frequencies ``theta^(-2i/(d/2))`` of the
1-D RoPE. Positions are the integer grid coordinates (no interpolation), so a table belongs to one grid size: a
checkpoint of another resolution has tables of another shape, which loading refuses.

The per-axis tables are diffusers' ``get_1d_rotary_pos_embed`` (cosines and sines repeated in pairs). Its 2-D
helper is not used: it puts the column half first. The rotation is written here because the sparse MoH execution
rotates the queries of a few chosen tokens per head (gathered positions), which diffusers' ``apply_rotary_emb`` does
not take; ``tests/model/test_rope.py`` holds both to diffusers' and to LightningDiT's outputs.
"""

from __future__ import annotations

import torch
from diffusers.models.embeddings import get_1d_rotary_pos_embed
from torch import nn

__all__ = ["RotaryEmbedding2D", "rotate_pairs"]


def rotate_pairs(x: torch.Tensor) -> torch.Tensor:
    """``(x_0, x_1, x_2, x_3, ...) -> (-x_1, x_0, -x_3, x_2, ...)``: a quarter turn of every adjacent pair."""
    pairs = x.unflatten(-1, (-1, 2))
    return torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)


class RotaryEmbedding2D(nn.Module):
    """The rotation tables of a ``grid x grid`` token grid for heads of ``head_dim`` channels (a multiple of 4).

    ``freqs_cos`` and ``freqs_sin`` (``(grid**2, head_dim)``, float32) are persistent buffers, as LightningDiT keeps
    them (``feat_rope.freqs_cos`` in its checkpoints).
    """

    def __init__(self, head_dim: int, grid: int, theta: float = 10000.0) -> None:
        super().__init__()
        if head_dim % 4:
            raise ValueError(f"2-D RoPE needs a head size divisible by 4 (two axes of pairs), got {head_dim}")
        self.head_dim, self.grid, self.theta = head_dim, grid, theta
        positions = torch.arange(grid, dtype=torch.float32)
        cos, sin = get_1d_rotary_pos_embed(head_dim // 2, positions, theta=theta, use_real=True)  # (grid, d/2) each
        rows, cols = torch.meshgrid(torch.arange(grid), torch.arange(grid), indexing="ij")  # row-major tokens
        rows, cols = rows.reshape(-1), cols.reshape(-1)
        self.register_buffer("freqs_cos", torch.cat([cos[rows], cos[cols]], dim=-1).contiguous())  # (T, d)
        self.register_buffer("freqs_sin", torch.cat([sin[rows], sin[cols]], dim=-1).contiguous())

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Rotate ``x`` (..., T, d) at the tokens' positions, or (..., d) at ``positions`` (...) (token indices):
        ``x cos + rotate_pairs(x) sin``, computed in float32 and returned in ``x``'s dtype."""
        cos, sin = self.freqs_cos, self.freqs_sin
        if positions is not None:
            cos, sin = cos[positions], sin[positions]
        y = x.float()
        return (y * cos + rotate_pairs(y) * sin).to(x.dtype)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, grid={self.grid}x{self.grid}, theta={self.theta:g}"
