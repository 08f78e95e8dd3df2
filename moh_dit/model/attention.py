"""Mixture-of-Head attention (MoH) and its plain multi-head baseline.

MoH treats the heads of one attention layer as experts. Heads ``0 .. h_s-1`` are *shared* (always on);
the remaining ``E = h - h_s`` heads are *routed*: each token switches on the top ``k`` of them. Instead of
the plain sum of multi-head attention, each head's output is scaled by a per-token gate before the
output projection (docs/moh_attention.md derives and cites these formulas):

    p        = softmax(W_r x)                                   # (.., E) routed-head probabilities
    r_j      = k * p_j * M_j / sum_j(p_j M_j)                   # M = multi-hot top-k mask of p
    s_i      = h_s * softmax(W_s x)_i                           # shared-head weights
    [a1, a2] = 2 * softmax(W_h x)                               # shared-vs-routed balance
    g        = concat(a1 * s, a2 * r)
    out      = W_O concat_i(g_i * head_i)

The constants (k, h_s, 2) make every active head weigh exactly 1 when the routers are uniform, so a
freshly initialised MoH layer behaves like multi-head attention with the inactive heads removed. Layers
without routed heads are still soft-weighted (``g = h * softmax(W_s x)``), a single shared head has the
fixed weight 1, and layers with no shared heads use ``g = r``.

The three routers are bias-free linear maps of the same token state that enters attention; we keep them
fused in one ``Linear(dim, E + h_s' + 2')`` (``h_s'``/``2'`` present only where the formulas need them)
so that routing costs a single matmul; :meth:`MoHAttention.router_slices` says which rows are which.
*How* the gated heads are computed (every head, as the reference does, or only the chosen ones) is the
job of an attention processor (``moh_dit.model.execution``), chosen with :meth:`set_execution`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from moh_dit.model.execution import make_processor

if TYPE_CHECKING:
    from moh_dit.model.rope import RotaryEmbedding2D

__all__ = ["AttentionAux", "MoHAttention", "load_balance_loss"]


@dataclass
class AttentionAux:
    """What one attention layer reports besides its output.

    Attributes:
        load_balance_loss: scalar load-balance loss of the routed heads (``E * sum_i P_i f_i``), only in
            training mode and only for layers with routed heads; ``None`` otherwise.
        head_mask: ``(N, T, h)`` boolean, which heads each token used; only when requested.
    """

    load_balance_loss: torch.Tensor | None = None
    head_mask: torch.Tensor | None = None


def load_balance_loss(probs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Switch-style load-balance loss over all tokens: ``E * sum_i mean_t(p_i) * mean_t(M_i)``.

    ``probs`` (.., E) are the router softmax probabilities, ``mask`` (.., E) the multi-hot top-k choice.
    It equals ``k`` at perfect balance and grows as routing concentrates on fewer heads. Gradients flow
    through ``probs`` only; the mask is a constant.
    """
    num_experts = probs.shape[-1]
    mean_prob = probs.reshape(-1, num_experts).mean(dim=0)  # (E,)
    mean_load = mask.detach().reshape(-1, num_experts).to(probs.dtype).mean(dim=0)  # (E,)
    return num_experts * (mean_prob * mean_load).sum()


class MoHAttention(nn.Module):
    """Self-attention with Mixture-of-Head routing, or plain multi-head attention (``attention_type="mha"``).

    Args:
        dim: model width D (input and output size).
        num_heads: number of heads h of this layer.
        head_dim: size of each head; defaults to ``dim // num_heads``. The attention width
            ``num_heads * head_dim`` may differ from ``dim`` (MoH-DiT-XL uses 8 to 24 heads of 72).
        num_shared_heads: always-on heads h_s (head indices ``0 .. h_s-1``); defaults to ``num_heads``.
        top_k: number of routed heads each token uses among the ``h - h_s`` routed ones.
        qkv_bias: bias on the fused Q/K/V projection (DiT uses one).
        attention_type: ``"moh"`` (routers and gates) or ``"mha"`` (plain multi-head attention, the DiT
            baseline; no routers), the same switch as :class:`~moh_dit.model.network.MoHDiT`'s.
        qk_norm: a factory ``head_dim -> module`` for the per-head norm of queries and keys (``q_norm``/``k_norm``,
            shared by the heads, shared and routed alike), or ``None``. With a RoPE table given to ``forward``, queries
            and keys are rotated after it. Both act per head, before the heads are weighted and summed.
    """

    def __init__(
        self,
        dim: int,
        num_heads: int,
        head_dim: int | None = None,
        num_shared_heads: int | None = None,
        top_k: int = 0,
        qkv_bias: bool = True,
        attention_type: str = "moh",
        qk_norm: Callable[[int], nn.Module] | None = None,
    ) -> None:
        super().__init__()
        if attention_type not in ("moh", "mha"):
            raise ValueError(f"attention_type must be 'moh' or 'mha', got {attention_type!r}")
        if num_heads < 1:
            raise ValueError(f"num_heads must be >= 1, got {num_heads}")
        if head_dim is None:
            if dim % num_heads:
                raise ValueError(f"dim={dim} is not divisible by num_heads={num_heads}; pass head_dim explicitly")
            head_dim = dim // num_heads
        if head_dim < 1:
            raise ValueError(f"head_dim must be >= 1, got {head_dim}")
        if num_shared_heads is None:
            num_shared_heads = num_heads
        use_moh = attention_type == "moh"
        if not use_moh and (num_shared_heads != num_heads or top_k != 0):
            raise ValueError("plain multi-head attention (attention_type='mha') takes no shared-head count or top_k")
        if not 0 <= num_shared_heads <= num_heads:
            raise ValueError(f"num_shared_heads={num_shared_heads} must be between 0 and num_heads={num_heads}")
        num_routed = num_heads - num_shared_heads
        if num_routed == 0 and top_k != 0:
            raise ValueError(f"top_k={top_k} but the layer has no routed heads (num_shared_heads == num_heads)")
        if num_routed > 0 and not 1 <= top_k <= num_routed:
            raise ValueError(f"top_k={top_k} must be between 1 and the number of routed heads ({num_routed})")

        self.dim, self.num_heads, self.head_dim = dim, num_heads, head_dim
        self.num_shared_heads, self.num_routed_heads, self.top_k = num_shared_heads, num_routed, top_k
        self.attention_type = attention_type
        inner = num_heads * head_dim
        self.qkv = nn.Linear(dim, 3 * inner, bias=qkv_bias)  # output laid out as (3, heads, head_dim)
        self.q_norm = qk_norm(head_dim) if qk_norm is not None else None
        self.k_norm = qk_norm(head_dim) if qk_norm is not None else None
        self.proj = nn.Linear(inner, dim)
        # router rows: [routed E | shared h_s (when h_s > 1) | mix 2 (when both kinds exist)]
        sizes = {
            "routed": num_routed if use_moh else 0,
            "shared": num_shared_heads if use_moh and num_shared_heads > 1 else 0,
            "mix": 2 if use_moh and num_routed > 0 and num_shared_heads > 0 else 0,
        }
        self._router_sizes = sizes
        self.router = nn.Linear(dim, sum(sizes.values()), bias=False) if sum(sizes.values()) else None
        self.routing = None  # a RoutingTape's hook, while one holds the top-k choice fixed (moh_dit.model.routing)
        self.set_execution("auto")

    # ------------------------------------------------------------------------------------------------
    # Structure
    # ------------------------------------------------------------------------------------------------
    @property
    def num_active_heads(self) -> int:
        """Heads each token uses: shared heads plus its top-k routed heads."""
        return self.num_shared_heads + self.top_k

    @property
    def has_routed_heads(self) -> bool:
        return self.attention_type == "moh" and self.num_routed_heads > 0

    def router_slices(self) -> dict[str, slice]:
        """Rows of the fused router weight: ``routed`` (W_r, E x D), ``shared`` (W_s, h_s x D, only when
        h_s > 1) and ``mix`` (W_h, 2 x D, only when the layer has both kinds of heads)."""
        out, start = {}, 0
        for name, size in self._router_sizes.items():
            if size:
                out[name] = slice(start, start + size)
                start += size
        return out

    # ------------------------------------------------------------------------------------------------
    # Gates
    # ------------------------------------------------------------------------------------------------
    def compute_gates(self, x: torch.Tensor):
        """Per-token head gates for ``x`` of shape (N, T, D).

        Returns ``(gates, routed_probs, routed_mask)``: gates (N, T, h) in float32 (or float64), or ``None`` for plain
        multi-head attention (and for a single always-on head, whose gate is exactly 1); the routed
        softmax probabilities and top-k mask (N, T, E), or ``None`` when the layer has no routed heads.
        """
        if self.router is None:
            return None, None, None
        logits = self.router(x)  # (N, T, R)
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # softmax in >= fp32 under autocast
        rows = self.router_slices()

        shared = None
        if self.num_shared_heads > 1:
            shared = self.num_shared_heads * logits[..., rows["shared"]].softmax(dim=-1)  # (N, T, h_s)
        elif self.num_shared_heads == 1:
            shared = logits.new_ones(*logits.shape[:-1], 1)  # a lone shared head weighs 1 before a1

        if self.num_routed_heads == 0:
            return shared, None, None  # dense layer: g = h * softmax(W_s x)

        probs = logits[..., rows["routed"]].softmax(dim=-1)  # (N, T, E)
        top_p, top_i = probs.topk(self.top_k, dim=-1)  # (N, T, k)
        if self.routing is not None:  # a choice recorded or replayed (moh_dit.model.routing)
            chosen = self.routing(top_i)
            if chosen is not top_i:
                top_i, top_p = chosen, probs.gather(-1, chosen)
        # Renormalise over the chosen k and scale by k; the selection itself carries no gradient.
        top_w = self.top_k * top_p / top_p.sum(dim=-1, keepdim=True).clamp_min(1e-9)
        routed = torch.zeros_like(probs).scatter(-1, top_i, top_w)  # (N, T, E)
        mask = torch.zeros_like(probs, dtype=torch.bool).scatter(-1, top_i, True)

        if shared is None:
            return routed, probs, mask  # h_s = 0: g = r
        mix = 2.0 * logits[..., rows["mix"]].softmax(dim=-1)  # (N, T, 2)
        gates = torch.cat([mix[..., :1] * shared, mix[..., 1:] * routed], dim=-1)  # (N, T, h)
        return gates, probs, mask

    # ------------------------------------------------------------------------------------------------
    # Forward
    # ------------------------------------------------------------------------------------------------
    def forward(
        self,
        x: torch.Tensor,
        rope: RotaryEmbedding2D | None = None,
        return_head_mask: bool = False,
        return_aux: bool = True,
    ) -> tuple[torch.Tensor, AttentionAux] | torch.Tensor:
        """Attend over the T tokens of ``x`` (N, T, D), queries and keys rotated by ``rope`` (the network's table)
        when given; returns ``(out, aux)`` with ``out`` (N, T, D), or ``out`` alone with ``return_aux=False`` (sampling,
        where there is nothing to report: diffusers' caches take a module's output as one tensor)."""
        n, t, _ = x.shape
        gates, probs, mask = self.compute_gates(x)
        out = self.processor(self, x, gates, mask, rope)
        if not return_aux:
            return out

        aux = AttentionAux()
        if probs is not None and self.training:
            aux.load_balance_loss = load_balance_loss(probs, mask)
        if return_head_mask:
            head_mask = x.new_ones(n, t, self.num_heads, dtype=torch.bool)
            if mask is not None:
                head_mask[..., self.num_shared_heads :] = mask
            aux.head_mask = head_mask
        return out, aux

    def prepare_query(
        self, q: torch.Tensor, rope: RotaryEmbedding2D | None, positions: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Queries (..., T, dh) of some heads after QK-norm and RoPE (at the token ``positions`` (...,) of rows
        gathered by the sparse execution)."""
        if self.q_norm is not None:
            q = self.q_norm(q)
        return q if rope is None else rope(q, positions)

    def prepare_key(self, k: torch.Tensor, rope: RotaryEmbedding2D | None) -> torch.Tensor:
        """Keys (..., T, dh) after QK-norm and RoPE."""
        if self.k_norm is not None:
            k = self.k_norm(k)
        return k if rope is None else rope(k)

    def dense_attention(
        self, x: torch.Tensor, gates: torch.Tensor | None, rope: RotaryEmbedding2D | None = None
    ) -> torch.Tensor:
        """The reference computation: every head attends, then each is gated (inactive heads by zero)."""
        n, t, _ = x.shape
        h, dh = self.num_heads, self.head_dim
        qkv = self.qkv(x).reshape(n, t, 3, h, dh).permute(2, 0, 3, 1, 4)  # (3, N, h, T, dh)
        q, k, v = qkv.unbind(0)
        q, k = self.prepare_query(q, rope), self.prepare_key(k, rope)
        out = F.scaled_dot_product_attention(q, k, v)  # (N, h, T, dh)
        out = out.transpose(1, 2)  # (N, T, h, dh), a view
        if gates is not None:
            out = out * gates.to(out.dtype).unsqueeze(-1)  # the one copy MHA's reshape would make anyway
        return self.proj(out.reshape(n, t, h * dh))  # (N, T, D)

    # ------------------------------------------------------------------------------------------------
    # Execution
    # ------------------------------------------------------------------------------------------------
    def set_execution(self, mode: str | object) -> None:
        """``"dense"`` (reference semantics), ``"sparse"`` (exact head skipping), ``"auto"`` (the faster of
        the two by the calibrated cost model), or an attention processor instance. Results agree."""
        self.processor = make_processor(mode) if isinstance(mode, str) else mode

    @property
    def execution(self) -> str:
        return self.processor.name

    def extra_repr(self) -> str:
        if self.attention_type == "mha":
            return f"dim={self.dim}, heads={self.num_heads}x{self.head_dim}, multi-head"
        return (
            f"dim={self.dim}, heads={self.num_heads}x{self.head_dim}, shared={self.num_shared_heads}, "
            f"top_k={self.top_k} of {self.num_routed_heads}, execution={self.execution}"
        )
