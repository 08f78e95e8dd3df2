"""Mixture-of-Head attention (MoH) and its plain multi-head baseline.

MoH treats the heads of one attention layer as experts. Heads ``0 .. h_s-1`` are *shared* (always on);
the remaining ``E = h - h_s`` heads are *routed*: each token switches on the top ``k`` of them. Instead of
the plain sum of multi-head attention, each head's output is scaled by a per-token gate before the
output projection:

    p        = softmax(W_r x)                                   # (.., E) routed-head probabilities
    r_j      = k * p_j * M_j / sum_j(p_j M_j)                   # M = multi-hot top-k mask of p
    s_i      = h_s * softmax(W_s x)_i                           # shared-head weights
    [a1, a2] = 2 * softmax(W_h x)                               # shared-vs-routed balance
    g        = concat(a1 * s, a2 * r)
    out      = W_O concat_i(g_i * head_i)

The constants (k, h_s, 2) make every active head weigh exactly 1 when the routers are uniform, so a
freshly initialised MoH layer behaves like multi-head attention with the inactive heads removed. Layers
without routed heads are still soft-weighted (``g = h * softmax(W_s x)``), a single shared head has the
fixed weight 1, and layers with no shared heads use ``g = r``. See REFERENCE.md section 1.

The three routers are bias-free linear maps of the same token state that enters attention; we keep them
fused in one ``Linear(dim, E + h_s' + 2')`` (``h_s'``/``2'`` present only where the formulas need them)
so that routing costs a single matmul.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["AttentionAux", "MoHAttention", "load_balance_loss"]


@dataclass
class AttentionAux:
    """What one attention layer reports besides its output.

    Attributes:
        load_balance_loss: scalar load-balance loss of the routed heads (``E * sum_i P_i f_i``), only in
            training mode and only for layers with routed heads; ``None`` otherwise.
        head_mask: ``(N, T, h)`` boolean, which heads each token used; only when requested.
    """

    load_balance_loss: Optional[torch.Tensor] = None
    head_mask: Optional[torch.Tensor] = None


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
    """Self-attention with Mixture-of-Head routing, or plain multi-head attention when ``use_moh=False``.

    Args:
        dim: model width D (input and output size).
        num_heads: number of heads h of this layer.
        head_dim: size of each head; defaults to ``dim // num_heads``. The attention width
            ``num_heads * head_dim`` may differ from ``dim`` (MoH-DiT-XL uses 8 to 24 heads of 72).
        num_shared_heads: always-on heads h_s (head indices ``0 .. h_s-1``); defaults to ``num_heads``.
        top_k: number of routed heads each token uses among the ``h - h_s`` routed ones.
        qkv_bias: bias on the fused Q/K/V projection (DiT uses one).
        use_moh: ``False`` gives plain multi-head attention with no routers (the DiT baseline).
    """

    def __init__(
        self,
        dim: int,
        num_heads: int,
        head_dim: Optional[int] = None,
        num_shared_heads: Optional[int] = None,
        top_k: int = 0,
        qkv_bias: bool = True,
        use_moh: bool = True,
    ) -> None:
        super().__init__()
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
        if not use_moh and (num_shared_heads != num_heads or top_k != 0):
            raise ValueError("plain multi-head attention (use_moh=False) takes no shared-head count or top_k")
        if not 0 <= num_shared_heads <= num_heads:
            raise ValueError(f"num_shared_heads={num_shared_heads} must be between 0 and num_heads={num_heads}")
        num_routed = num_heads - num_shared_heads
        if num_routed == 0 and top_k != 0:
            raise ValueError(f"top_k={top_k} but the layer has no routed heads (num_shared_heads == num_heads)")
        if num_routed > 0 and not 1 <= top_k <= num_routed:
            raise ValueError(f"top_k={top_k} must be between 1 and the number of routed heads ({num_routed})")

        self.dim = dim
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.num_shared_heads = num_shared_heads
        self.num_routed_heads = num_routed
        self.top_k = top_k
        self.use_moh = use_moh
        self.execution = "auto"  # runtime choice, not architecture: "dense" | "sparse" | "auto"
        self._auto_choice: dict[tuple, str] = {}

        inner = num_heads * head_dim
        self.qkv = nn.Linear(dim, 3 * inner, bias=qkv_bias)  # output laid out as (3, heads, head_dim)
        self.proj = nn.Linear(inner, dim)

        # Router output slices: [routed E | shared h_s (when h_s > 1) | mix 2 (when both kinds exist)].
        self._n_routed_logits = num_routed if use_moh else 0
        self._n_shared_logits = num_shared_heads if (use_moh and num_shared_heads > 1) else 0
        self._n_mix_logits = 2 if (use_moh and num_routed > 0 and num_shared_heads > 0) else 0
        n_router = self._n_routed_logits + self._n_shared_logits + self._n_mix_logits
        self.router = nn.Linear(dim, n_router, bias=False) if n_router > 0 else None

    # ------------------------------------------------------------------------------------------------
    # Properties
    # ------------------------------------------------------------------------------------------------
    @property
    def num_active_heads(self) -> int:
        """Heads each token uses: shared heads plus its top-k routed heads."""
        return self.num_shared_heads + self.top_k

    @property
    def has_routed_heads(self) -> bool:
        return self.use_moh and self.num_routed_heads > 0

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
        n_r, n_s = self._n_routed_logits, self._n_shared_logits

        shared = None
        if self.num_shared_heads > 1:
            shared = self.num_shared_heads * logits[..., n_r : n_r + n_s].softmax(dim=-1)  # (N, T, h_s)
        elif self.num_shared_heads == 1:
            shared = logits.new_ones(*logits.shape[:-1], 1)  # a lone shared head weighs 1 before a1

        if self.num_routed_heads == 0:
            return shared, None, None  # dense layer: g = h * softmax(W_s x)

        probs = logits[..., :n_r].softmax(dim=-1)  # (N, T, E)
        top_p, top_i = probs.topk(self.top_k, dim=-1)  # (N, T, k)
        # Renormalise over the chosen k and scale by k; the selection itself carries no gradient.
        top_w = self.top_k * top_p / top_p.sum(dim=-1, keepdim=True).clamp_min(1e-9)
        routed = torch.zeros_like(probs).scatter(-1, top_i, top_w)  # (N, T, E)
        mask = torch.zeros_like(probs, dtype=torch.bool).scatter(-1, top_i, True)

        if shared is None:
            return routed, probs, mask  # h_s = 0: g = r
        mix = 2.0 * logits[..., n_r + n_s :].softmax(dim=-1)  # (N, T, 2)
        gates = torch.cat([mix[..., :1] * shared, mix[..., 1:] * routed], dim=-1)  # (N, T, h)
        return gates, probs, mask

    # ------------------------------------------------------------------------------------------------
    # Forward
    # ------------------------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, return_head_mask: bool = False) -> tuple[torch.Tensor, AttentionAux]:
        """Attend over the T tokens of ``x`` (N, T, D); returns ``(out, aux)`` with ``out`` (N, T, D)."""
        n, t, _ = x.shape
        gates, probs, mask = self.compute_gates(x)
        out = None
        if mask is not None and self.resolve_execution(x) == "sparse":
            out = self._forward_sparse(x, gates, mask, dense_if_unprofitable=self.execution == "auto")
        if out is None:
            out = self._forward_dense(x, gates)

        aux = AttentionAux()
        if probs is not None and self.training:
            aux.load_balance_loss = load_balance_loss(probs, mask)
        if return_head_mask:
            head_mask = x.new_ones(n, t, self.num_heads, dtype=torch.bool)
            if mask is not None:
                head_mask[..., self.num_shared_heads :] = mask
            aux.head_mask = head_mask
        return out, aux

    # ------------------------------------------------------------------------------------------------
    # Execution paths
    # ------------------------------------------------------------------------------------------------
    def resolve_execution(self, x: torch.Tensor) -> str:
        """``dense`` or ``sparse`` for this input. ``auto`` asks the calibrated cost model once per shape
        (device type, tokens, grad mode) with the nominal activation, so the choice is deterministic and never
        depends on the routing. That nominal activation is a best case: routing is never better balanced
        than "every head used by its share of tokens", so a layer ``auto`` sends to sparse checks again once
        it knows the padded count (see ``_forward_sparse``)."""
        if self.execution != "auto":
            return self.execution
        key = (x.device.type, x.shape[1], torch.is_grad_enabled())
        choice = self._auto_choice.get(key)
        if choice is None:
            choice = self._predicted_execution(x, self.num_active_heads / self.num_heads)
            self._auto_choice[key] = choice
        return choice

    def _predicted_execution(self, x: torch.Tensor, active_fraction: float) -> str:
        from .perf import choose_execution

        return choose_execution(
            device_type=x.device.type, tokens=x.shape[1], dim=self.dim, num_heads=self.num_heads,
            head_dim=self.head_dim, active_fraction=active_fraction, backward=torch.is_grad_enabled(),
            routed_fraction=self.num_routed_heads / self.num_heads,
        )  # fmt: skip

    @staticmethod
    def padded_rows(mask: torch.Tensor) -> int:
        """Rows every routed head is padded to in the sparse path: the busiest (sample, head) count of the
        (N, T, E) top-k mask. Reading it synchronises with the device."""
        return int(mask.sum(dim=1).max())

    def padded_active_fraction(self, rows_per_head: int, tokens: int) -> float:
        """Share of (token, head) pairs the sparse path computes when every routed head is padded to
        ``rows_per_head`` rows: the activation the cost model should see, not the nominal one."""
        return (self.num_shared_heads + self.num_routed_heads * rows_per_head / tokens) / self.num_heads

    def _forward_dense(self, x: torch.Tensor, gates: Optional[torch.Tensor]) -> torch.Tensor:
        """Reference semantics: every head computed, then gated (inactive heads multiplied by zero)."""
        n, t, _ = x.shape
        h, dh = self.num_heads, self.head_dim
        qkv = self.qkv(x).reshape(n, t, 3, h, dh).permute(2, 0, 3, 1, 4)  # (3, N, h, T, dh)
        q, k, v = qkv.unbind(0)
        out = F.scaled_dot_product_attention(q, k, v)  # (N, h, T, dh)
        out = out.transpose(1, 2)  # (N, T, h, dh), a view
        if gates is not None:
            out = out * gates.to(out.dtype).unsqueeze(-1)  # the one copy MHA's reshape would make anyway
        return self.proj(out.reshape(n, t, h * dh))  # (N, T, D)

    def _forward_sparse(
        self, x: torch.Tensor, gates: torch.Tensor, mask: torch.Tensor, dense_if_unprofitable: bool = False
    ) -> Optional[torch.Tensor]:
        """Exact skipping: routed heads compute attention rows (and, where it pays, queries and
        output-projection rows) only for the tokens that chose them; shared heads run as ordinary dense
        attention; keys and values stay dense (any token may attend to them).

        Tokens are sorted per (sample, routed head) so the chosen ones come first and padded to the
        largest count C; padded rows are unchosen tokens, whose routed gate is exactly 0, so they add
        nothing. One host synchronisation reads C, which also picks how queries and output rows are
        handled (see ``sparse_query_rows`` / ``sparse_output_rows``). With ``dense_if_unprofitable`` (auto
        mode) it returns ``None`` when, with C known, the cost model no longer expects a gain: unbalanced
        routing (one head chosen by nearly every token, as in freshly initialised models) leaves little to
        skip after padding, and the caller then runs the dense path.
        """
        n, t, d = x.shape
        h, hs, e, dh = self.num_heads, self.num_shared_heads, self.num_routed_heads, self.head_dim
        inner = h * dh
        w, b = self.qkv.weight, self.qkv.bias
        wo, bo = self.proj.weight, self.proj.bias

        # the tokens that chose each routed head, sorted first and padded to the largest count C
        chosen = mask.transpose(1, 2)  # (N, E, T)
        c = self.padded_rows(mask)  # the one host sync of this path
        if dense_if_unprofitable and self._predicted_execution(x, self.padded_active_fraction(c, t)) != "sparse":
            return None
        idx = torch.argsort(chosen.to(torch.uint8), dim=-1, descending=True, stable=True)[..., :c]  # (N, E, C)
        rows = (idx + t * torch.arange(n, device=x.device).view(n, 1, 1)).reshape(-1)  # rows of (N*T, D)

        if self.sparse_query_rows(c, t):
            # project queries of routed heads only for their chosen rows (saves those FLOPs, pays a gather
            # of E*C*D and, in the backward, a scatter of the same size)
            kv = F.linear(x, w[inner:], None if b is None else b[inner:])  # (N, T, 2*h*dh)
            k_all, v_all = kv.reshape(n, t, 2, h, dh).permute(2, 0, 3, 1, 4).unbind(0)  # (N, h, T, dh) each
            q_s = None
            if hs > 0:
                q_s = F.linear(x, w[: hs * dh], None if b is None else b[: hs * dh])
                q_s = q_s.reshape(n, t, hs, dh).transpose(1, 2)  # (N, hs, T, dh)
            x_sel = x.reshape(n * t, d).index_select(0, rows).reshape(n, e, c, d)
            q_r = torch.einsum("necd,ehd->nech", x_sel, w[hs * dh : inner].reshape(e, dh, d))  # (N, E, C, dh)
            if b is not None:
                q_r = q_r + b[hs * dh : inner].reshape(1, e, 1, dh).to(q_r.dtype)
        else:
            # one fused Q/K/V matmul as in the dense path, then gather only the chosen query rows
            q, k_all, v_all = self.qkv(x).reshape(n, t, 3, h, dh).permute(2, 0, 3, 1, 4).unbind(0)  # (N, h, T, dh)
            q_s = q[:, :hs] if hs > 0 else None
            q_r = torch.gather(q[:, hs:], 2, idx.unsqueeze(-1).expand(n, e, c, dh))  # (N, E, C, dh)

        # shared heads: ordinary dense attention, gated
        o_s = None
        if q_s is not None:
            o_s = F.scaled_dot_product_attention(q_s, k_all[:, :hs], v_all[:, :hs]).transpose(1, 2)
            o_s = o_s * gates[..., :hs].to(o_s.dtype).unsqueeze(-1)  # (N, T, hs, dh)

        # routed heads: C query rows each against all keys
        o_r = F.scaled_dot_product_attention(q_r, k_all[:, hs:].to(q_r.dtype), v_all[:, hs:].to(q_r.dtype))
        g_r = torch.gather(gates[..., hs:].transpose(1, 2), 2, idx)  # (N, E, C); exactly 0 on padded rows
        o_r = o_r * g_r.to(o_r.dtype).unsqueeze(-1)  # (N, E, C, dh)

        if self.sparse_output_rows(c, t):
            # output projection only for the chosen rows, summed into the tokens (saves its FLOPs; pays in
            # memory traffic, so it wins only when few tokens use each routed head)
            y_r = torch.einsum("nech,deh->necd", o_r, wo[:, hs * dh :].reshape(d, e, dh)).reshape(n * e * c, d)
            if o_s is not None:
                y = F.linear(o_s.reshape(n, t, hs * dh), wo[:, : hs * dh], bo).to(y_r.dtype)
            else:
                y = (bo if bo is not None else y_r.new_zeros(d)).to(y_r.dtype).expand(n, t, d)
            return torch.index_add(y.reshape(n * t, d), 0, rows, y_r).reshape(n, t, d)

        # otherwise: place the routed rows into the dense (token, head) layout and project once
        heads = torch.arange(hs, h, device=x.device).view(1, e, 1).expand(n, e, c).reshape(-1)
        if o_s is not None:
            base = torch.cat([o_s.to(o_r.dtype), o_r.new_zeros(n, t, e, dh)], dim=2).reshape(n * t, h, dh)
        else:
            base = o_r.new_zeros(n * t, h, dh)
        # (row, head) pairs are unique: padded rows are other tokens of the same head
        heads_out = base.index_put((rows, heads), o_r.reshape(-1, dh))
        return self.proj(heads_out.reshape(n, t, h * dh))

    # Where per-row projections pay off, measured with benchmarks/attention.py on CPU (fp32): with more
    # than ~40% of the tokens per routed head, the gathers/scatters cost more than the skipped FLOPs. In
    # the backward, per-row queries (a head_dim-deep matmul plus a scatter of E*C*D into dx) only paid
    # from 1024 tokens on; at 256 and 512 tokens gathering rows of the dense Q was faster.
    SPARSE_QUERY_ROWS_MAX_SHARE = 0.4
    SPARSE_QUERY_ROWS_MIN_TOKENS_WITH_GRAD = 1024
    SPARSE_OUTPUT_ROWS_MAX_SHARE = 0.4

    def sparse_query_rows(self, rows_per_head: int, tokens: int) -> bool:
        """Project queries only for the chosen rows (else gather rows of the dense Q projection)."""
        if torch.is_grad_enabled() and tokens < self.SPARSE_QUERY_ROWS_MIN_TOKENS_WITH_GRAD:
            return False
        return rows_per_head <= self.SPARSE_QUERY_ROWS_MAX_SHARE * tokens

    def sparse_output_rows(self, rows_per_head: int, tokens: int) -> bool:
        """Project only the chosen rows when each routed head is used by at most this share of tokens."""
        return rows_per_head <= self.SPARSE_OUTPUT_ROWS_MAX_SHARE * tokens

    def extra_repr(self) -> str:
        if not self.use_moh:
            return f"dim={self.dim}, heads={self.num_heads}x{self.head_dim}, multi-head"
        return (
            f"dim={self.dim}, heads={self.num_heads}x{self.head_dim}, shared={self.num_shared_heads}, "
            f"top_k={self.top_k} of {self.num_routed_heads}"
        )
