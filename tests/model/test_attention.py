"""MoH attention against brute-force reimplementations of the gate formulas (docs/moh_attention.md)."""

import math

import pytest
import torch

from moh_dit.model.attention import MoHAttention, load_balance_loss

torch.manual_seed(0)

# (heads, shared, top_k): general, no shared heads, one shared head, dense soft-weighted, all routed active
LAYOUTS = [(6, 3, 2), (6, 0, 2), (5, 1, 3), (4, 4, 0), (6, 2, 4), (8, 3, 1)]


def _randomize_router(attn: MoHAttention, scale: float = 1.0) -> None:
    if attn.router is not None:
        with torch.no_grad():
            attn.router.weight.normal_(0, scale)


def reference_gates(attn: MoHAttention, x: torch.Tensor) -> torch.Tensor:
    """The gate formulas, written token by token with separate router matrices W_r, W_s, W_h."""
    h, h_s, e, k = attn.num_heads, attn.num_shared_heads, attn.num_routed_heads, attn.top_k
    w = attn.router.weight.double() if attn.router is not None else None
    w_r = w[:e] if e else None
    w_s = w[e : e + h_s] if h_s > 1 else None
    w_h = w[e + (h_s if h_s > 1 else 0) :] if (e and h_s) else None
    n, t, _ = x.shape
    out = torch.zeros(n, t, h, dtype=torch.float64)
    for i in range(n):
        for j in range(t):
            tok = x[i, j].double()
            s = h_s * torch.softmax(w_s @ tok, 0) if h_s > 1 else torch.ones(h_s, dtype=torch.float64)
            if e == 0:
                out[i, j] = s
                continue
            p = torch.softmax(w_r @ tok, 0)
            chosen = sorted(range(e), key=lambda m: -p[m].item())[:k]
            m = torch.zeros(e, dtype=torch.float64)
            m[chosen] = 1
            r = k * p * m / max((p * m).sum().item(), 1e-12)
            if h_s == 0:
                out[i, j] = r
            else:
                a = 2 * torch.softmax(w_h @ tok, 0)
                out[i, j] = torch.cat([a[0] * s, a[1] * r])
    return out


def brute_force_attention(attn: MoHAttention, x: torch.Tensor, gates) -> torch.Tensor:
    """softmax(q k^T / sqrt(d)) v per head with explicit loops, gated, then the output projection."""
    n, t, _ = x.shape
    h, dh = attn.num_heads, attn.head_dim
    qkv = (x.double() @ attn.qkv.weight.double().T + attn.qkv.bias.double()).reshape(n, t, 3, h, dh)
    heads = []
    for head in range(h):
        q, k, v = qkv[:, :, 0, head], qkv[:, :, 1, head], qkv[:, :, 2, head]  # (N, T, dh)
        w = torch.softmax(q @ k.transpose(1, 2) / math.sqrt(dh), dim=-1)
        o = w @ v
        if gates is not None:
            o = o * gates[:, :, head : head + 1]
        heads.append(o)
    concat = torch.cat(heads, dim=-1)
    return concat @ attn.proj.weight.double().T + attn.proj.bias.double()


# ----------------------------------------------------------------------------------------------------
# Gate formulas
# ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("h,h_s,k", LAYOUTS)
def test_gates_match_reference_formulas(h, h_s, k):
    attn = MoHAttention(16, h, head_dim=4, num_shared_heads=h_s, top_k=k)
    _randomize_router(attn)
    x = torch.randn(2, 7, 16)
    gates, _, _ = attn.compute_gates(x)
    torch.testing.assert_close(gates.double(), reference_gates(attn, x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("h,h_s,k", LAYOUTS)
def test_forward_matches_brute_force(h, h_s, k):
    attn = MoHAttention(16, h, head_dim=5, num_shared_heads=h_s, top_k=k)  # attention width != model width
    _randomize_router(attn)
    x = torch.randn(3, 9, 16)
    out, _ = attn(x)
    expected = brute_force_attention(attn, x, reference_gates(attn, x))
    torch.testing.assert_close(out.double(), expected, rtol=1e-4, atol=1e-5)


def test_multi_head_mode_matches_brute_force_and_has_no_router():
    attn = MoHAttention(24, 4, attention_type="mha")
    assert attn.router is None
    x = torch.randn(2, 5, 24)
    out, aux = attn(x, return_head_mask=True)
    torch.testing.assert_close(out.double(), brute_force_attention(attn, x, None), rtol=1e-4, atol=1e-5)
    assert aux.load_balance_loss is None and aux.head_mask.all()


@pytest.mark.parametrize("h,h_s", [(6, 3), (6, 0), (5, 1), (4, 4)])
def test_uniform_routers_all_active_equal_multi_head(h, h_s):
    """Zero router weights and top_k = all routed heads: every gate is exactly 1, i.e. plain MHA."""
    moh = MoHAttention(16, h, head_dim=4, num_shared_heads=h_s, top_k=h - h_s)
    if moh.router is not None:
        torch.nn.init.zeros_(moh.router.weight)
    mha = MoHAttention(16, h, head_dim=4, attention_type="mha")
    mha.qkv.load_state_dict(moh.qkv.state_dict())
    mha.proj.load_state_dict(moh.proj.state_dict())
    x = torch.randn(2, 6, 16)
    gates, _, _ = moh.compute_gates(x)
    if gates is not None:
        torch.testing.assert_close(gates, torch.ones_like(gates), rtol=0, atol=1e-6)
    torch.testing.assert_close(moh(x)[0], mha(x)[0], rtol=1e-5, atol=1e-6)


def test_uniform_routers_active_heads_weigh_one():
    attn = MoHAttention(16, 8, head_dim=2, num_shared_heads=3, top_k=2)
    torch.nn.init.zeros_(attn.router.weight)
    gates, _, mask = attn.compute_gates(torch.randn(4, 5, 16))
    active = gates > 0
    assert (active.sum(-1) == 5).all()
    torch.testing.assert_close(gates[active], torch.ones_like(gates[active]), rtol=0, atol=1e-6)


def test_inactive_head_contributes_exactly_zero():
    attn = MoHAttention(16, 6, head_dim=4, num_shared_heads=2, top_k=1)
    _randomize_router(attn, 3.0)
    x = torch.randn(2, 10, 16)
    out, aux = attn(x, return_head_mask=True)
    head = 4  # a routed head
    inactive = ~aux.head_mask[..., head]
    assert inactive.any() and (~inactive).any()
    with torch.no_grad():  # scramble everything that belongs to that head only
        rows = slice(head * 4, head * 4 + 4)
        for part in range(3):
            attn.qkv.weight[part * 24 :][rows].normal_(0, 10)
        attn.proj.weight[:, rows].normal_(0, 10)
    out2, _ = attn(x)
    assert torch.equal(out[inactive], out2[inactive])
    assert not torch.allclose(out[~inactive], out2[~inactive])


def test_head_mask_counts_and_shared_heads_always_on():
    attn = MoHAttention(32, 8, num_shared_heads=3, top_k=2)
    _randomize_router(attn)
    _, aux = attn(torch.randn(3, 11, 32), return_head_mask=True)
    assert aux.head_mask.shape == (3, 11, 8)
    assert aux.head_mask[..., :3].all()
    assert (aux.head_mask.sum(-1) == 5).all()


# ----------------------------------------------------------------------------------------------------
# Load-balance loss
# ----------------------------------------------------------------------------------------------------
def test_load_balance_loss_equals_k_at_perfect_balance():
    e, k, t = 4, 2, 8
    mask = torch.zeros(t, e)
    for tok in range(t):  # token t picks heads t and t+1 (mod E): every head chosen equally often
        mask[tok, [tok % e, (tok + 1) % e]] = 1
    uniform = torch.full((t, e), 1 / e)
    assert load_balance_loss(uniform, mask).item() == pytest.approx(k)
    skewed = torch.softmax(torch.randn(t, e), -1)  # any probabilities: balanced load still gives k
    assert load_balance_loss(skewed, mask).item() == pytest.approx(k, rel=1e-6)


def test_load_balance_loss_grows_with_imbalance():
    e, k, t = 4, 2, 16
    values = []
    for conc in [0.0, 0.5, 1.0, 2.0, 4.0]:
        logits = torch.tensor([conc, conc, 0.0, 0.0]).expand(t, e)
        probs = torch.softmax(logits, -1)
        mask = torch.zeros(t, e)
        n_concentrated = int(t * min(1.0, 0.5 + conc / 8))  # more tokens pick heads {0, 1}
        mask[:n_concentrated, :2] = 1
        for tok in range(n_concentrated, t):
            mask[tok, [2 + tok % 2, tok % 2]] = 1
        values.append(load_balance_loss(probs, mask).item())
    assert values[0] == pytest.approx(k, rel=0.05)
    assert all(b > a for a, b in zip(values, values[1:]))
    assert values[-1] <= e  # L <= E * max_i f_i <= E


def test_module_loss_only_in_training_and_matches_function():
    attn = MoHAttention(16, 6, head_dim=4, num_shared_heads=2, top_k=2)
    _randomize_router(attn)
    x = torch.randn(2, 9, 16)
    _, probs, mask = attn.compute_gates(x)
    attn.train()
    _, aux = attn(x)
    torch.testing.assert_close(aux.load_balance_loss, load_balance_loss(probs, mask))
    attn.eval()
    assert attn(x)[1].load_balance_loss is None
    dense = MoHAttention(16, 4, num_shared_heads=4).train()
    assert dense(x)[1].load_balance_loss is None


# ----------------------------------------------------------------------------------------------------
# Gradients
# ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("h,h_s,k", LAYOUTS)
def test_gradients_reach_every_router_row(h, h_s, k):
    attn = MoHAttention(16, h, head_dim=4, num_shared_heads=h_s, top_k=k).train()
    _randomize_router(attn)
    if attn.router is None:
        pytest.skip("layout without router")
    out, aux = attn(torch.randn(2, 12, 16))
    loss = (out * torch.randn_like(out)).sum()
    if aux.load_balance_loss is not None:
        loss = loss + aux.load_balance_loss
    loss.backward()
    grad = attn.router.weight.grad
    assert grad is not None and torch.isfinite(grad).all()
    assert (grad.abs().sum(dim=1) > 0).all(), "some router row received no gradient"


def test_top_k_selection_carries_no_gradient():
    """The mask is a constant, and autograd's gradient equals finite differences of the gate formula
    with the selection held fixed (float64 gradcheck on the router weights)."""
    attn = MoHAttention(8, 6, head_dim=2, num_shared_heads=2, top_k=2).double()
    _randomize_router(attn)
    x = torch.randn(1, 5, 8, dtype=torch.float64)
    _, probs, mask = attn.compute_gates(x)
    assert not mask.requires_grad and mask.grad_fn is None

    w0 = attn.router.weight.detach().clone()
    weights = torch.arange(6.0, dtype=torch.float64)  # a generic linear functional of the gates

    def gates_fixed_mask(weight):
        logits = x @ weight.T
        e, n_s = attn.num_routed_heads, attn.num_shared_heads
        p = logits[..., :e].softmax(-1)
        r = attn.top_k * p * mask / (p * mask).sum(-1, keepdim=True)
        s = n_s * logits[..., e : e + n_s].softmax(-1)
        a = 2 * logits[..., e + n_s :].softmax(-1)
        return torch.cat([a[..., :1] * s, a[..., 1:] * r], -1)

    attn.zero_grad()
    (attn.compute_gates(x)[0] * weights).sum().backward()
    w = w0.clone().requires_grad_(True)
    g_fixed = torch.autograd.grad((gates_fixed_mask(w) * weights).sum(), w)[0]
    torch.testing.assert_close(attn.router.weight.grad, g_fixed)
    assert torch.autograd.gradcheck(lambda wt: gates_fixed_mask(wt), (w0.clone().requires_grad_(True),))


# ----------------------------------------------------------------------------------------------------
# Validation
# ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(num_heads=4, num_shared_heads=5), "num_shared_heads=5"),
        (dict(num_heads=4, num_shared_heads=2, top_k=3), "top_k=3"),
        (dict(num_heads=4, num_shared_heads=2, top_k=0), "top_k=0"),
        (dict(num_heads=4, num_shared_heads=4, top_k=1), "no routed heads"),
        (dict(num_heads=5), "not divisible"),
        (dict(num_heads=4, num_shared_heads=2, top_k=1, attention_type="mha"), "attention_type='mha'"),
    ],
)
def test_bad_layer_configs_fail_clearly(kwargs, message):
    with pytest.raises(ValueError, match=message):
        MoHAttention(16, **kwargs)


def test_bf16_autocast_keeps_fp32_gates():
    attn = MoHAttention(16, 6, head_dim=4, num_shared_heads=2, top_k=2)
    x = torch.randn(2, 5, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, _ = attn(x)
        gates, _, _ = attn.compute_gates(x)
    assert out.dtype == torch.bfloat16 and gates.dtype == torch.float32
    torch.testing.assert_close(out.float(), attn(x)[0], rtol=0.05, atol=0.05)
