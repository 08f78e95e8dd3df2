"""The transformer block of MoH-DiT (DiT's adaLN-Zero block with MoH attention) and the final layer.

Shapes: N batch, T tokens, D width.
"""

from __future__ import annotations

import torch
from torch import nn

from moh_dit.model.attention import AttentionAux, MoHAttention

__all__ = ["DiTBlock", "FinalLayer", "Mlp", "modulate"]


def modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """adaLN modulation of tokens (N, T, D) by per-sample shift/scale (N, D)."""
    return x * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1)


class Mlp(nn.Module):
    """Token-wise feed-forward: Linear -> tanh-GELU -> Linear."""

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden_dim)
        self.act = nn.GELU(approximate="tanh")
        self.fc2 = nn.Linear(hidden_dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class DiTBlock(nn.Module):
    """Transformer block with adaLN-Zero conditioning; the attention is MoH (or plain multi-head)."""

    def __init__(
        self,
        hidden_size: int,
        attn: MoHAttention,
        mlp_ratio: float = 4.0,
        norm_eps: float = 1e-6,
        mlp_norm_eps: float = 1e-6,
    ) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=norm_eps)
        self.attn = attn
        self.norm2 = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=mlp_norm_eps)
        self.mlp = Mlp(hidden_size, int(hidden_size * mlp_ratio))
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden_size, 6 * hidden_size))

    def forward(
        self, x: torch.Tensor, c: torch.Tensor, return_head_mask: bool = False
    ) -> tuple[torch.Tensor, AttentionAux]:
        # x: (N, T, D) tokens, c: (N, D) condition
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.adaLN_modulation(c).chunk(6, dim=1)
        attn_out, aux = self.attn(modulate(self.norm1(x), shift_msa, scale_msa), return_head_mask=return_head_mask)
        x = x + gate_msa.unsqueeze(1) * attn_out
        x = x + gate_mlp.unsqueeze(1) * self.mlp(modulate(self.norm2(x), shift_mlp, scale_mlp))
        return x, aux


class FinalLayer(nn.Module):
    """adaLN-modulated LayerNorm and a linear map from tokens to patches of ``out_channels``."""

    def __init__(self, hidden_size: int, patch_size: int, out_channels: int, norm_eps: float = 1e-6) -> None:
        super().__init__()
        self.norm_final = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=norm_eps)
        self.linear = nn.Linear(hidden_size, patch_size * patch_size * out_channels)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden_size, 2 * hidden_size))

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        shift, scale = self.adaLN_modulation(c).chunk(2, dim=1)
        return self.linear(modulate(self.norm_final(x), shift, scale))  # (N, T, p*p*C_out)
