"""What only a CUDA GPU can show (marked ``cuda``, skipped without one; scripts/gpu_proof.sh runs them): the
attention executions agree on the GPU in float32 and bf16, a bf16 training step of MoH-DiT is finite and matches
float32, a compiled model matches the eager one, and gradient checkpointing changes memory, not gradients."""

import pytest
import torch

from .helpers.factories import tiny_model

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (scripts/gpu_proof.sh runs these)"),
]
DEVICE = torch.device("cuda")


def inputs(model, batch: int = 4):
    gen = torch.Generator().manual_seed(0)
    size = model.config.sample_size
    x = torch.randn(batch, model.in_channels, size, size, generator=gen)
    t = torch.randint(0, 1000, (batch,), generator=gen)
    y = torch.randint(0, model.config.num_classes, (batch,), generator=gen)
    return x.to(DEVICE), t.to(DEVICE), y.to(DEVICE)


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
def test_every_execution_agrees_with_dense_on_the_gpu(dtype, tolerance):
    model = tiny_model(signal=0.1, routers=True).to(DEVICE).eval()
    x, t, y = inputs(model)
    outs = {}
    for mode in ("dense", "sparse", "auto"):
        model.set_attention_execution(mode)
        with torch.no_grad(), torch.autocast("cuda", dtype=dtype, enabled=dtype != torch.float32):
            outs[mode] = model(x, t, y).sample.float()
    for mode in ("sparse", "auto"):
        assert torch.allclose(outs[mode], outs["dense"], atol=tolerance, rtol=tolerance), mode


def gradients(model, dtype, x, t, y):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(0)  # training mode drops class labels at random (CFG's null class): the same draw each call
    with torch.autocast("cuda", dtype=dtype, enabled=dtype != torch.float32):
        out = model(x, t, y)
        loss = out.sample.float().pow(2).mean() + 0.01 * out.aux_loss
    loss.backward()
    return loss.detach(), [p.grad.detach().clone() for p in model.parameters() if p.grad is not None]


def test_a_bf16_training_step_is_finite_and_close_to_float32():
    model = tiny_model(signal=0.1, routers=True).to(DEVICE).train()
    x, t, y = inputs(model)
    loss32, grads32 = gradients(model, torch.float32, x, t, y)
    loss16, grads16 = gradients(model, torch.bfloat16, x, t, y)
    assert torch.isfinite(loss16) and all(torch.isfinite(g).all() for g in grads16)
    assert torch.allclose(loss16, loss32, rtol=5e-2, atol=1e-3)


def test_gradient_checkpointing_keeps_the_gradients():
    model = tiny_model(signal=0.1).to(DEVICE).train()
    x, t, y = inputs(model)
    _, plain = gradients(model, torch.float32, x, t, y)
    model.enable_gradient_checkpointing()
    _, checkpointed = gradients(model, torch.float32, x, t, y)
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(plain, checkpointed))


def test_a_compiled_model_matches_the_eager_one():
    model = tiny_model(signal=0.1).to(DEVICE).eval()
    x, t, y = inputs(model)
    with torch.no_grad():
        eager = model(x, t, y).sample
        compiled = torch.compile(model)(x, t, y).sample
    assert torch.allclose(compiled, eager, atol=1e-4, rtol=1e-4)
