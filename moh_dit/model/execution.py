"""How a :class:`~moh_dit.model.attention.MoHAttention` layer computes its gated heads, in the spirit of
diffusers' attention processors: the layer owns the weights and the gates (the paper), a processor owns
the execution. All three give the same results up to floating-point rounding.

- :class:`DenseProcessor`: the reference computation, every head computed and gated; no host sync.
- :class:`SparseProcessor`: exact skipping. Routed heads compute attention rows (and, where it pays,
  queries and output-projection rows) only for the tokens that chose them; shared heads and all keys and
  values stay dense (any token may attend to them). One host synchronisation per layer.
- :class:`AutoProcessor`: per shape, the calibrated cost model of ``moh_dit.model.cost_model`` picks dense or sparse;
  a layer sent to sparse checks again with the padded head count and runs dense when unbalanced routing
  leaves nothing to skip. Uncalibrated devices run dense, so the default is never slower than the
  reference computation.

    model.set_attention_execution("sparse")
    layer.set_execution(SparseProcessor(output_rows_max_share=0.2))
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F

from moh_dit.model.cost_model import DEFAULT_MARGIN, choose_execution, load_calibration


class GatedHeads(Protocol):
    """What a processor reads of its attention layer (:class:`~moh_dit.model.attention.MoHAttention`). Stated here
    so that this module does not import the layer that imports it (the layer picks its processor)."""

    dim: int
    head_dim: int
    num_heads: int
    num_shared_heads: int
    num_routed_heads: int
    num_active_heads: int
    qkv: torch.nn.Linear
    proj: torch.nn.Linear

    def dense_attention(self, x: torch.Tensor, gates: torch.Tensor | None, rope=None) -> torch.Tensor: ...

    def prepare_query(self, q: torch.Tensor, rope, positions: torch.Tensor | None = None) -> torch.Tensor: ...

    def prepare_key(self, k: torch.Tensor, rope) -> torch.Tensor: ...


__all__ = [
    "DenseProcessor",
    "SparseProcessor",
    "AutoProcessor",
    "make_processor",
    "padded_rows",
    "padded_active_fraction",
    "EXECUTION_MODES",
    "PROCESSORS",
]

EXECUTION_MODES = ("auto", "dense", "sparse")  # the names of PROCESSORS (below), known before the classes


def padded_rows(mask: torch.Tensor) -> int:
    """Rows every routed head is padded to in the sparse path: the busiest (sample, head) count of the
    (N, T, E) top-k mask. Reading it synchronises with the device."""
    return int(mask.sum(dim=1).max())


def padded_active_fraction(attn: GatedHeads, rows_per_head: int, tokens: int) -> float:
    """Share of (token, head) pairs the sparse path computes when every routed head is padded to
    ``rows_per_head`` rows: the activation the cost model should see, not the nominal one."""
    return (attn.num_shared_heads + attn.num_routed_heads * rows_per_head / tokens) / attn.num_heads


class DenseProcessor:
    """Every head computed, then gated: the reference semantics."""

    name = "dense"

    def __call__(self, attn: GatedHeads, x: torch.Tensor, gates, mask, rope=None) -> torch.Tensor:
        return attn.dense_attention(x, gates, rope)


@dataclass
class SparseProcessor:
    """Exact head skipping.

    Tokens are sorted per (sample, routed head) so the chosen ones come first and padded to the largest
    count C; padded rows are unchosen tokens, whose routed gate is exactly 0, so they add nothing. C also
    picks how queries and output rows are handled. The thresholds were measured with
    ``benchmarks/attention.py`` on CPU (fp32): with more than ~40% of the tokens per routed head, gathers
    and scatters cost more than the skipped FLOPs; in the backward, per-row queries (a head_dim-deep
    matmul plus a scatter of E*C*D into dx) only paid from 1024 tokens on.

    Args:
        query_rows_max_share: project queries per chosen row (else gather rows of the dense Q projection)
            when each routed head is used by at most this share of tokens.
        query_rows_min_tokens_with_grad: ... and, under autograd, only from this many tokens on.
        output_rows_max_share: project only the chosen rows through W_O at most at this share.
    """

    query_rows_max_share: float = 0.4
    query_rows_min_tokens_with_grad: int = 1024
    output_rows_max_share: float = 0.4
    name: str = field(default="sparse", init=False)

    def query_rows(self, rows_per_head: int, tokens: int) -> bool:
        if torch.is_grad_enabled() and tokens < self.query_rows_min_tokens_with_grad:
            return False
        return rows_per_head <= self.query_rows_max_share * tokens

    def output_rows(self, rows_per_head: int, tokens: int) -> bool:
        return rows_per_head <= self.output_rows_max_share * tokens

    def __call__(self, attn: GatedHeads, x: torch.Tensor, gates, mask, rope=None) -> torch.Tensor:
        if mask is None:
            return attn.dense_attention(x, gates, rope)
        return self.attend(attn, x, gates, mask, padded_rows(mask), rope)

    def attend(
        self, attn: GatedHeads, x: torch.Tensor, gates: torch.Tensor, mask: torch.Tensor, c: int, rope=None
    ) -> torch.Tensor:
        """The sparse computation with every routed head padded to ``c`` rows. QK-norm and RoPE act on each query
        row at its own token's position, as in the dense computation."""
        n, t, d = x.shape
        h, hs, e, dh = attn.num_heads, attn.num_shared_heads, attn.num_routed_heads, attn.head_dim
        inner = h * dh
        w, b = attn.qkv.weight, attn.qkv.bias
        wo, bo = attn.proj.weight, attn.proj.bias

        # the tokens that chose each routed head, sorted first and padded to the largest count C
        chosen = mask.transpose(1, 2)  # (N, E, T)
        idx = torch.argsort(chosen.to(torch.uint8), dim=-1, descending=True, stable=True)[..., :c]  # (N, E, C)
        rows = (idx + t * torch.arange(n, device=x.device).view(n, 1, 1)).reshape(-1)  # rows of (N*T, D)

        if self.query_rows(c, t):
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
            q_s = None if q_s is None else attn.prepare_query(q_s, rope)
            q_r = attn.prepare_query(q_r, rope, positions=idx)  # each row at its token's position
        else:
            # one fused Q/K/V matmul as in the dense path, then gather only the chosen query rows
            q, k_all, v_all = attn.qkv(x).reshape(n, t, 3, h, dh).permute(2, 0, 3, 1, 4).unbind(0)  # (N, h, T, dh)
            q = attn.prepare_query(q, rope)
            q_s = q[:, :hs] if hs > 0 else None
            q_r = torch.gather(q[:, hs:], 2, idx.unsqueeze(-1).expand(n, e, c, dh))  # (N, E, C, dh)
        k_all = attn.prepare_key(k_all, rope)

        # shared heads: ordinary dense attention, gated
        o_s = None
        if q_s is not None:
            o_s = F.scaled_dot_product_attention(q_s, k_all[:, :hs], v_all[:, :hs]).transpose(1, 2)
            o_s = o_s * gates[..., :hs].to(o_s.dtype).unsqueeze(-1)  # (N, T, hs, dh)

        # routed heads: C query rows each against all keys
        o_r = F.scaled_dot_product_attention(q_r, k_all[:, hs:].to(q_r.dtype), v_all[:, hs:].to(q_r.dtype))
        g_r = torch.gather(gates[..., hs:].transpose(1, 2), 2, idx)  # (N, E, C); exactly 0 on padded rows
        o_r = o_r * g_r.to(o_r.dtype).unsqueeze(-1)  # (N, E, C, dh)

        if self.output_rows(c, t):
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
        return attn.proj(heads_out.reshape(n, t, h * dh))


class AutoProcessor:
    """Dense or sparse per shape, by the calibrated cost model (``moh_dit.model.cost_model``).

    The choice is made once per (device type, tokens, grad mode) with the nominal activation, so it is
    deterministic and never depends on the routing. That nominal activation is a best case (routing is
    never better balanced than "every head used by its share of tokens"), so a layer sent to sparse checks
    again once it knows the padded count, and runs dense when the model no longer expects a gain.

    Args:
        calibration: cost-model coefficients; default: those of :func:`moh_dit.model.cost_model.load_calibration`,
            read once when the processor is made.
        sparse: the sparse processor used when sparse is chosen.
        margin: sparse must be predicted faster than dense by this fraction.
    """

    name = "auto"

    def __init__(
        self,
        calibration: dict | None = None,
        sparse: SparseProcessor | None = None,
        margin: float = DEFAULT_MARGIN,
    ) -> None:
        self.calibration = load_calibration() if calibration is None else calibration
        self.sparse = sparse or SparseProcessor()
        self.margin = margin
        self._choices: dict[tuple, str] = {}

    def predict(self, attn: GatedHeads, x: torch.Tensor, active_fraction: float) -> str:
        return choose_execution(
            device_type=x.device.type,
            tokens=x.shape[1],
            dim=attn.dim,
            num_heads=attn.num_heads,
            head_dim=attn.head_dim,
            active_fraction=active_fraction,
            backward=torch.is_grad_enabled(),
            routed_fraction=attn.num_routed_heads / attn.num_heads,
            calibration=self.calibration,
            margin=self.margin,
        )

    def choose(self, attn: GatedHeads, x: torch.Tensor) -> str:
        """``dense`` or ``sparse`` for inputs shaped like ``x`` (decided once per shape)."""
        key = (x.device.type, x.shape[1], torch.is_grad_enabled())
        if key not in self._choices:
            self._choices[key] = self.predict(attn, x, attn.num_active_heads / attn.num_heads)
        return self._choices[key]

    def __call__(self, attn: GatedHeads, x: torch.Tensor, gates, mask, rope=None) -> torch.Tensor:
        if mask is None or self.choose(attn, x) == "dense":
            return attn.dense_attention(x, gates, rope)
        c = padded_rows(mask)  # the one host sync of the sparse path
        if self.predict(attn, x, padded_active_fraction(attn, c, x.shape[1])) != "sparse":
            return attn.dense_attention(x, gates, rope)
        return self.sparse.attend(attn, x, gates, mask, c, rope)


# every execution by name (a new one is a processor class and an entry here)
PROCESSORS = {"auto": AutoProcessor, "dense": DenseProcessor, "sparse": SparseProcessor}


def make_processor(mode: str):
    """A new processor for ``auto``, ``dense`` or ``sparse`` (:data:`PROCESSORS`)."""
    if mode not in PROCESSORS:
        raise ValueError(f"execution mode must be one of {', '.join(EXECUTION_MODES)}, got {mode!r}")
    return PROCESSORS[mode]()
