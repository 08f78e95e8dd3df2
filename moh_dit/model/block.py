"""The transformer block of MoH-DiT (DiT's adaLN-Zero block with MoH attention), the final layer, and the block's
options: the choices LightningDiT (Yao et al. 2025, arXiv:2501.01423) made inside DiT's block.

Every option is one field of :class:`BlockOptions` and one entry in its table below; the network records the
options in its config (``MoHDiT(block={...})``), and ``None`` is DiT's 2022 block, so every model of moh-dit 0.4
and earlier is the block it always was.

======================  ========================================================  ====================================
option                  DiT (default)                                             LightningDiT
======================  ========================================================  ====================================
``norm``                ``layernorm``: LayerNorm without affine, eps ``norm_eps`` ``rmsnorm``: RMSNorm with a weight
``mlp``                 ``gelu``: Linear, tanh-GELU, Linear (``mlp_ratio`` D)     ``swiglu``: ``w3(silu(a) * b)``,
                                                                                  ``[a, b] = w12(x)``, width
                                                                                  ``int(2/3 int(mlp_ratio D))``
``qk_norm``             ``none``                                                  ``rmsnorm`` (or ``layernorm`` as
                                                                                  timm and REPA: affine, eps 1e-5),
                                                                                  per head, shared by the heads
``rope`` (theta)        ``false``: the sin-cos table alone                        ``true``: 2-D RoPE on q and k after
                                                                                  QK-norm, beside the sin-cos table
======================  ========================================================  ====================================

Shapes: N batch, T tokens, D width.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from moh_dit.model.attention import AttentionAux, MoHAttention
from moh_dit.model.rope import RotaryEmbedding2D

__all__ = [
    "BlockOptions",
    "BlocksTrace",
    "DiTBlock",
    "FinalLayer",
    "Mlp",
    "SwiGLU",
    "modulate",
    "NORMS",
    "MLPS",
    "QK_NORMS",
]


def modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """adaLN modulation of tokens (N, T, D) by per-sample shift/scale (N, D)."""
    return x * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1)


class Mlp(nn.Module):
    """Token-wise feed-forward: Linear -> tanh-GELU -> Linear (DiT's; ``fc1``/``fc2`` as timm names them)."""

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden_dim)
        self.act = nn.GELU(approximate="tanh")
        self.fc2 = nn.Linear(hidden_dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class SwiGLU(nn.Module):
    """Token-wise gated feed-forward: ``w3(silu(a) * b)`` with ``[a, b] = w12(x)``: the first half of ``w12``'s
    output is the gated (SiLU) branch. Names, biases and layout as LightningDiT's ``SwiGLUFFN``."""

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w12 = nn.Linear(dim, 2 * hidden_dim)
        self.w3 = nn.Linear(hidden_dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gated, linear = self.w12(x).chunk(2, dim=-1)
        return self.w3(F.silu(gated) * linear)


# ----------------------------------------------------------------------------------------------------
# The options: one table per choice. A new option is an entry here (and a field of BlockOptions).
# ----------------------------------------------------------------------------------------------------
# the norm before attention, before the MLP and in the final layer: (width, eps) -> module
NORMS: dict[str, Callable[[int, float], nn.Module]] = {
    "layernorm": lambda dim, eps: nn.LayerNorm(dim, elementwise_affine=False, eps=eps),  # DiT
    # LightningDiT's (Llama's): x / rms(x) in float32, back to x's dtype, then times a learned weight; torch's
    # RMSNorm computes the same (tests/model/test_block.py holds it to LightningDiT's class)
    "rmsnorm": lambda dim, eps: nn.RMSNorm(dim, eps=eps),
}
# the feed-forward: (width, mlp_ratio) -> module
MLPS: dict[str, Callable[[int, float], nn.Module]] = {
    "gelu": lambda dim, ratio: Mlp(dim, int(dim * ratio)),  # DiT
    # LightningDiT: two thirds of DiT's hidden width (equal parameters for three matrices), no rounding
    "swiglu": lambda dim, ratio: SwiGLU(dim, int(2 / 3 * int(dim * ratio))),
}
# the per-head norm of queries and keys: head size -> module (None: none)
QK_NORMS: dict[str, Callable[[int], nn.Module] | None] = {
    "none": None,
    "layernorm": lambda head_dim: nn.LayerNorm(head_dim),  # timm's Attention (REPA's --qk-norm): affine, eps 1e-5
    "rmsnorm": lambda head_dim: nn.RMSNorm(head_dim, eps=1e-6),  # LightningDiT's with use_rmsnorm
}


@dataclass(frozen=True)
class BlockOptions:
    """What the block is made of (see the module docstring's table). ``record()`` is what a model's config keeps:
    ``None`` for DiT's block, so that older models compare equal."""

    norm: str = "layernorm"
    mlp: str = "gelu"
    qk_norm: str = "none"
    rope: bool = False
    rope_theta: float = 10000.0

    def __post_init__(self) -> None:
        for name, table in (("norm", NORMS), ("mlp", MLPS), ("qk_norm", QK_NORMS)):
            if getattr(self, name) not in table:
                raise ValueError(f"block {name} must be one of {', '.join(table)}, got {getattr(self, name)!r}")
        if not isinstance(self.rope, bool):
            raise ValueError(f"block rope must be true or false, got {self.rope!r}")
        theta = self.rope_theta
        # spelled out, not moh_dit.argtypes.is_number: the model imports nothing of the package but its errors
        if not isinstance(theta, (int, float)) or isinstance(theta, bool) or not (math.isfinite(theta) and theta > 1):
            raise ValueError(f"block rope_theta must be a finite number > 1 (RoPE's 10000), got {theta!r}")
        object.__setattr__(self, "rope_theta", float(theta))

    @classmethod
    def from_config(cls, value: dict[str, Any] | None) -> BlockOptions:
        """The options a config records (``None``: DiT's block); an unknown key is an error naming the known ones."""
        if value is None:
            return cls()
        if not isinstance(value, dict):
            raise ValueError(f"block must be a mapping such as {{norm: rmsnorm, mlp: swiglu}}, got {value!r}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"unknown block options {unknown}; the block has {sorted(known)}")
        return cls(**value)

    def record(self) -> dict[str, Any] | None:
        """The options as a config stores them: every field, or ``None`` when they are DiT's."""
        return None if self == BlockOptions() else dataclasses.asdict(self)

    def describe(self) -> str:
        """``DiT's block`` or the options that differ from it: ``RMSNorm, SwiGLU, QK-norm (rmsnorm), 2-D RoPE``."""
        words = {"rmsnorm": "RMSNorm", "swiglu": "SwiGLU"}
        parts = [words.get(self.norm, self.norm)] if self.norm != "layernorm" else []
        parts += [words.get(self.mlp, self.mlp)] if self.mlp != "gelu" else []
        parts += [f"QK-norm ({self.qk_norm})"] if self.qk_norm != "none" else []
        parts += ["2-D RoPE" + (f" (theta {self.rope_theta:g})" if self.rope_theta != 10000.0 else "")] * self.rope
        return ", ".join(parts) or "DiT's block"

    def norm_layer(self, dim: int, eps: float) -> nn.Module:
        return NORMS[self.norm](dim, eps)

    def mlp_layer(self, dim: int, ratio: float) -> nn.Module:
        return MLPS[self.mlp](dim, ratio)

    def qk_norm_layer(self) -> Callable[[int], nn.Module] | None:
        return QK_NORMS[self.qk_norm]

    def rotary(self, head_dims: list[int], grid: int) -> RotaryEmbedding2D | None:
        """The network's RoPE tables (``None`` without RoPE); every layer must have the same head size."""
        if not self.rope:
            return None
        if len(set(head_dims)) != 1:
            raise ValueError(
                f"2-D RoPE shares one table: every layer needs the same head size, got {sorted(set(head_dims))}"
            )
        return RotaryEmbedding2D(head_dims[0], grid, self.rope_theta)


class DiTBlock(nn.Module):
    """Transformer block with adaLN-Zero conditioning; the attention is MoH (or plain multi-head), the norms and
    the MLP those of ``options``."""

    def __init__(
        self,
        hidden_size: int,
        attn: MoHAttention,
        mlp_ratio: float = 4.0,
        norm_eps: float = 1e-6,
        mlp_norm_eps: float = 1e-6,
        options: BlockOptions | None = None,
    ) -> None:
        super().__init__()
        options = options or BlockOptions()
        self.norm1 = options.norm_layer(hidden_size, norm_eps)
        self.attn = attn
        self.norm2 = options.norm_layer(hidden_size, mlp_norm_eps)
        self.mlp = options.mlp_layer(hidden_size, mlp_ratio)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden_size, 6 * hidden_size))

    def forward(
        self,
        hidden_states: torch.Tensor,
        c: torch.Tensor,
        rope: RotaryEmbedding2D | None = None,
        return_head_mask: bool = False,
        return_aux: bool = True,
    ) -> tuple[torch.Tensor, AttentionAux] | torch.Tensor:
        # hidden_states: (N, T, D) tokens (diffusers' name: its caches find the block's input by it), c: (N, D);
        # returns (tokens, the attention's aux), or the tokens alone with return_aux=False (sampling: diffusers'
        # caches take a block's output as one tensor)
        x = hidden_states
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.adaLN_modulation(c).chunk(6, dim=1)
        attended = self.attn(
            modulate(self.norm1(x), shift_msa, scale_msa),
            rope=rope,
            return_head_mask=return_head_mask,
            return_aux=return_aux,
        )
        attn_out, aux = attended if return_aux else (attended, None)
        x = x + gate_msa.unsqueeze(1) * attn_out
        x = x + gate_mlp.unsqueeze(1) * self.mlp(modulate(self.norm2(x), shift_mlp, scale_mlp))
        return (x, aux) if return_aux else x


class FinalLayer(nn.Module):
    """adaLN-modulated norm (the block's) and a linear map from tokens to patches of ``out_channels``."""

    def __init__(
        self,
        hidden_size: int,
        patch_size: int,
        out_channels: int,
        norm_eps: float = 1e-6,
        options: BlockOptions | None = None,
    ) -> None:
        super().__init__()
        self.norm_final = (options or BlockOptions()).norm_layer(hidden_size, norm_eps)
        self.linear = nn.Linear(hidden_size, patch_size * patch_size * out_channels)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden_size, 2 * hidden_size))

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        shift, scale = self.adaLN_modulation(c).chunk(2, dim=1)
        return self.linear(modulate(self.norm_final(x), shift, scale))  # (N, T, p*p*C_out)


@dataclass
class BlocksTrace:
    """What a pass through the blocks reports: MoH's load-balance loss per routed layer, the head masks per layer
    (when asked), and REPA's projections (when aligned)."""

    losses: list[torch.Tensor] = field(default_factory=list)
    masks: list[torch.Tensor] = field(default_factory=list)
    aligned: tuple[torch.Tensor, ...] | None = None

    def add(self, aux: AttentionAux | None, masks: bool) -> None:
        if aux is not None and aux.load_balance_loss is not None:
            self.losses.append(aux.load_balance_loss)
        if masks:
            self.masks.append(aux.head_mask)
