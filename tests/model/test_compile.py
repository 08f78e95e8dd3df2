"""torch.compile on the MoH attention paths (slow: inductor compiles C++ on CPU; run with -m slow)."""

import pytest
import torch

from moh_dit.model.attention import MoHAttention


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["dense", "sparse", "auto"])
def test_compiled_attention_matches_eager_with_backward(mode):
    torch.manual_seed(0)
    attn = MoHAttention(32, 6, head_dim=8, num_shared_heads=2, top_k=2).train()
    attn.set_execution(mode)
    compiled = torch.compile(attn)
    x = torch.randn(2, 16, 32, requires_grad=True)
    out_e, _ = attn(x)
    (g_e,) = torch.autograd.grad(out_e.square().sum(), x)
    out_c, aux = compiled(x)
    (g_c,) = torch.autograd.grad(out_c.square().sum(), x)
    torch.testing.assert_close(out_c, out_e, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(g_c, g_e, rtol=1e-4, atol=1e-4)
    assert aux.load_balance_loss is not None


@pytest.mark.slow
def test_a_compiled_network_with_every_block_option_matches_eager_with_backward():
    from moh_dit.model.network import MoHDiT

    torch.manual_seed(0)
    block = {"norm": "rmsnorm", "mlp": "swiglu", "qk_norm": "rmsnorm", "rope": True}
    model = MoHDiT(
        sample_size=8, patch_size=2, in_channels=3, hidden_size=32, depth=2, num_heads=4, head_dim=8,
        num_shared_heads=[2, 4], top_k=[1, 0], num_classes=2, block=block,
    ).train()  # fmt: skip
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    x, t, y = torch.randn(2, 3, 8, 8), torch.tensor([3.0, 700.0]), torch.tensor([0, 1])
    eager = model(x, t, y, force_drop_ids=torch.zeros(2)).sample
    (g_e,) = torch.autograd.grad(eager.square().sum(), model.blocks[0].attn.qkv.weight)
    compiled = torch.compile(model)(x, t, y, force_drop_ids=torch.zeros(2)).sample
    (g_c,) = torch.autograd.grad(compiled.square().sum(), model.blocks[0].attn.qkv.weight)
    torch.testing.assert_close(compiled, eager, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(g_c, g_e, rtol=1e-4, atol=1e-4)
