"""FLOPs counted from the architecture, against torch's FlopCounterMode running the model."""

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from moh_dit import create_model
from moh_dit.model.flops import forward_flops


@pytest.mark.parametrize("preset", ["MoH-DiT-Ti/4-75", "MoH-DiT-Ti/4-50", "DiT-Ti/4"])
def test_the_dense_count_is_what_torch_counts(preset):
    model = create_model(preset, hidden_size=64, head_dim=16).eval()
    model.set_attention_execution("dense")
    x, t, y = torch.randn(3, 1, 28, 28), torch.randint(0, 1000, (3,)), torch.tensor([0, 1, 2])
    # the math backend of attention runs as batched matmuls, which the counter counts
    with FlopCounterMode(display=False) as counter, torch.no_grad(), sdpa_kernel(SDPBackend.MATH):
        model(x, t, y)
    assert forward_flops(model).total * 3 == counter.get_total_flops()


def test_the_active_count_takes_each_tokens_heads_only():
    model = create_model("MoH-DiT-Ti/4-50", hidden_size=64, head_dim=16)
    dense, active = forward_flops(model), forward_flops(model, active_heads=True)
    tokens, saved = 49, 0
    for block in model.blocks:
        attn = block.attn
        inactive = 1 - attn.num_active_heads / attn.num_heads
        inner = attn.num_heads * attn.head_dim
        # queries, QK^T and AV, and the output projection of the heads a token does not use
        saved += inactive * (2 * tokens * 64 * inner + 4 * tokens * tokens * inner + 2 * tokens * inner * 64)
    assert dense.total - active.total == pytest.approx(saved, abs=len(model.blocks) * 3)
    assert active.mlp == dense.mlp and active.embed == dense.embed and active.training_step() == 3 * active.total
    plain = create_model("DiT-Ti/4", hidden_size=64, head_dim=16)
    assert forward_flops(plain, active_heads=True) == forward_flops(plain)
