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
