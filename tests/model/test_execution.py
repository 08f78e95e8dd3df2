"""Sparse (exact head skipping) and dense MoH attention: same outputs and gradients; auto mode."""

import pytest
import torch

from moh_dit.model.attention import MoHAttention
from moh_dit.model.cost_model import choose_execution, ideal_attention_ratio, ideal_block_ratio
from moh_dit.model.execution import AutoProcessor, SparseProcessor

LAYOUTS = [(6, 3, 2), (6, 0, 2), (5, 1, 3), (8, 2, 1), (12, 4, 4), (4, 4, 0)]


def layer(h, hs, k, dim=32, head_dim=8, seed=0, router_std=1.0):
    torch.manual_seed(seed)
    attn = MoHAttention(dim, h, head_dim=head_dim, num_shared_heads=hs, top_k=k)
    if attn.router is not None:
        torch.nn.init.normal_(attn.router.weight, 0, router_std)
    return attn


def run(attn, x, mode, rows_share=None, query_share=None):
    """Forward + gradients. ``rows_share`` / ``query_share`` force the per-row output-projection and
    per-row query variants of the sparse path on (1.0) or off (0.0)."""
    if mode == "sparse":
        kw = {} if rows_share is None else dict(output_rows_max_share=rows_share)
        if query_share is not None:
            kw.update(query_rows_max_share=query_share, query_rows_min_tokens_with_grad=0)
        attn.set_execution(SparseProcessor(**kw))
    else:
        attn.set_execution(mode)
    x = x.detach().clone().requires_grad_(True)
    out, aux = attn(x, return_head_mask=True)
    loss = (out * torch.linspace(-1, 1, out.shape[-1])).sum()
    if aux.load_balance_loss is not None:
        loss = loss + aux.load_balance_loss
    grads = torch.autograd.grad(loss, [x, *attn.parameters()], allow_unused=True)
    return out, aux, grads


@pytest.mark.parametrize("h,hs,k", LAYOUTS)
@pytest.mark.parametrize("rows_share", [0.0, 1.0])  # both output-projection variants
@pytest.mark.parametrize("query_share", [0.0, 1.0])  # both query variants
@pytest.mark.parametrize("n,t", [(1, 7), (3, 16), (2, 33)])  # batch 1, odd lengths
def test_sparse_equals_dense_outputs_and_gradients(h, hs, k, rows_share, query_share, n, t):
    attn = layer(h, hs, k).train()
    x = torch.randn(n, t, 32)
    out_d, aux_d, g_d = run(attn, x, "dense")
    out_s, aux_s, g_s = run(attn, x, "sparse", rows_share, query_share)
    torch.testing.assert_close(out_s, out_d, rtol=1e-5, atol=1e-5)
    assert torch.equal(aux_s.head_mask, aux_d.head_mask)
    for a, b in zip(g_d, g_s):
        if a is None:
            assert b is None
        else:
            torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)


def test_heads_that_no_token_chose():
    attn = layer(8, 2, 2)
    with torch.no_grad():  # make routed head 5 (logit index 3) never chosen
        attn.router.weight[3].fill_(0.0)
        attn.router.weight[3, 0] = -100.0
    x = torch.randn(2, 12, 32)
    x[..., 0] = x[..., 0].abs() + 1  # so that head's logit is very negative for every token
    out_d, aux, g_d = run(attn, x, "dense")
    assert not aux.head_mask[..., 5].any()
    out_s, _, g_s = run(attn, x, "sparse", 1.0)
    torch.testing.assert_close(out_s, out_d, rtol=1e-5, atol=1e-5)
    for a, b in zip(g_d, g_s):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)


def test_all_routed_heads_chosen_by_every_token():
    attn = layer(6, 2, 4)  # top-k = all routed heads: no skipping possible, still exact
    x = torch.randn(2, 9, 32)
    torch.testing.assert_close(run(attn, x, "sparse")[0], run(attn, x, "dense")[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("query_share", [0.0, 1.0])
def test_sparse_under_bf16_autocast(query_share):
    attn = layer(8, 2, 2)
    x = torch.randn(2, 16, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        attn.set_execution("dense")
        d, _ = attn(x)
        attn.set_execution(SparseProcessor(query_rows_max_share=query_share, query_rows_min_tokens_with_grad=0))
        s, _ = attn(x)
    assert s.dtype == d.dtype == torch.bfloat16
    torch.testing.assert_close(s.float(), d.float(), rtol=0.05, atol=0.05)


def test_sparse_variant_policy():
    sparse = SparseProcessor()
    with torch.no_grad():
        assert sparse.query_rows(40, 256) and not sparse.query_rows(200, 256)
    # with gradients, per-row queries only from query_rows_min_tokens_with_grad tokens on
    assert not sparse.query_rows(40, 256)
    assert sparse.query_rows(300, 1024)
    assert sparse.output_rows(40, 256) and not sparse.output_rows(200, 256)
    assert SparseProcessor(output_rows_max_share=0.1).output_rows(40, 256) is False


def test_auto_mode_is_deterministic_and_never_changes_results():
    attn = layer(12, 4, 4)
    x = torch.randn(2, 16, 32)
    attn.set_execution("dense")
    ref, _ = attn(x)
    attn.set_execution("auto")
    choices = {attn.processor.choose(attn, x) for _ in range(3)}
    assert len(choices) == 1
    out, _ = attn(x)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    # the choice depends only on the shape and configuration, not on the data or the routing
    fresh = layer(12, 4, 4, seed=5)
    assert fresh.processor.choose(fresh, torch.randn(2, 16, 32) * 100) == attn.processor.choose(attn, x)


def test_cost_model():
    cal = {"cpu/infer": {"coef": [0.1, 1.0, 0.0, 0.0, 0.0]}, "cpu/train": {"coef": [0.6, 0.6, 0.0, 0.0, 0.0]}}
    kw = dict(device_type="cpu", tokens=1024, dim=1152, num_heads=16, head_dim=72, calibration=cal)
    assert choose_execution(active_fraction=0.5, backward=False, **kw) == "sparse"  # 0.1 + 0.673 < 0.95
    assert choose_execution(active_fraction=0.5, backward=True, **kw) == "dense"  # 0.6 + 0.4 > 0.95
    assert choose_execution(active_fraction=1.0, backward=False, **kw) == "dense"
    assert (
        choose_execution(
            device_type="cuda",
            tokens=1024,
            dim=1152,
            num_heads=16,
            head_dim=72,
            calibration=cal,
            active_fraction=0.5,
            backward=False,
        )
        == "dense"
    )  # uncalibrated device
    # a calibration fitted on another feature set is ignored rather than misread
    old = {"cpu/infer": {"coef": [0.1, 1.0, 0.0, 0.0], "features": ["1", "ideal", "routed_share", "256/tokens"]}}
    assert choose_execution(active_fraction=0.5, backward=False, **{**kw, "calibration": old}) == "dense"
    # the width term: same shape, narrower layer, more bookkeeping per FLOP
    wide = {"cpu/infer": {"coef": [0.0, 1.0, 0.0, 0.0, 0.3]}}
    short = {**kw, "tokens": 256, "calibration": wide}
    assert choose_execution(active_fraction=0.5, backward=False, **short) == "sparse"  # 0.725 + 0.3/3 < 0.95
    assert choose_execution(active_fraction=0.5, backward=False, **{**short, "dim": 384, "head_dim": 24}) == "dense"
    assert ideal_attention_ratio(1.0, 256, 1152) == pytest.approx(1.0)
    assert ideal_attention_ratio(0.5, 1024, 1152) == pytest.approx((1 + 0.5 + 0.5 * 1024 / 1152) / (2 + 1024 / 1152))
    assert ideal_block_ratio(0.5, 1024, 1152) == pytest.approx((10 + 1 + 1024 / 1152) / (12 + 2 * 1024 / 1152))


def test_model_level_modes_agree():
    from moh_dit import create_model

    torch.manual_seed(0)
    model = create_model("MoH-DiT-Ti/4-50", hidden_size=32, head_dim=8).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "adaLN" in name or "final_layer.linear" in name:
                p.normal_(0, 0.2)
    x, t, y = torch.randn(2, 1, 28, 28), torch.tensor([5, 700]), torch.tensor([1, 9])
    outs = {}
    for mode in ("dense", "sparse", "auto"):
        model.set_attention_execution(mode)
        outs[mode] = model(x, t, y).sample
    torch.testing.assert_close(outs["sparse"], outs["dense"], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(outs["auto"], outs["dense"], rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="execution"):
        model.set_attention_execution("fast")


def test_auto_runs_dense_when_padding_leaves_nothing_to_skip(monkeypatch):
    """Auto picks sparse from the nominal activation; with the padded count known, unbalanced routing
    (every token choosing the same heads) falls back to the dense path, with the same result."""
    calibration = {"cpu/infer": {"coef": [0.0, 1.0, 0.0, 0.0, 0.0]}}
    attn = layer(8, 2, 2)
    calls = []
    dense = attn.dense_attention
    monkeypatch.setattr(attn, "dense_attention", lambda *a: calls.append(1) or dense(*a))
    x = torch.randn(2, 64, 32)
    with torch.no_grad():
        attn.set_execution("dense")
        ref, _ = attn(x)
        attn.set_execution(AutoProcessor(calibration))
        assert attn.processor.choose(attn, x) == "sparse"  # nominal: 4 of 8 heads active
        calls.clear()
        out, aux = attn(x, return_head_mask=True)
        balanced = aux.head_mask[..., 2:].sum(dim=1).max() < 64
        assert bool(balanced) and calls == []  # random routing: sparse ran
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)

        attn.router.weight.zero_()  # every token ties, so top-k picks the same two routed heads
        attn.set_execution("dense")
        ref, _ = attn(x)
        attn.set_execution(AutoProcessor(calibration))
        calls.clear()
        out, _ = attn(x)
        assert calls == [1]  # padded activation 1.0 leaves nothing to skip: dense ran
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
        attn.set_execution("sparse")  # an explicit sparse request is honoured regardless
        calls.clear()
        torch.testing.assert_close(attn(x)[0], ref, rtol=1e-5, atol=1e-5)
        assert calls == []


def test_every_execution_mode_is_a_processor_of_the_table():
    from moh_dit.model.execution import EXECUTION_MODES, PROCESSORS, make_processor

    assert tuple(PROCESSORS) == EXECUTION_MODES
    assert all(make_processor(mode).name == mode for mode in EXECUTION_MODES)


def test_the_shipped_cuda_calibration_is_its_measurement_refitted():
    """moh_dit/model/calibrations/cuda.json is the fit of the committed H200 measurement (bf16): refitting the rows
    gives its coefficients; the sparse path was slower than dense on every measured shape, and the calibration
    keeps auto on dense for each of them (uncalibrated, auto ran dense on CUDA by default; now by measurement)."""
    import json
    from pathlib import Path

    from benchmarks.attention import fit_calibration
    from moh_dit.model.cost_model import CALIBRATION_DIR

    root = Path(__file__).resolve().parents[2]
    measured = json.loads((root / "benchmarks/results/gpu/attention_cuda_h200_bf16_calibration_run.json").read_text())
    shipped = json.loads((CALIBRATION_DIR / "cuda.json").read_text())
    assert measured["device"] == "NVIDIA H200" and measured["dtype"] == "bf16"
    refit = fit_calibration(measured["rows"], "cuda")
    assert refit.keys() == shipped.keys() == {"cuda/infer", "cuda/train"}
    for key in shipped:
        assert refit[key]["coef"] == pytest.approx(shipped[key]["coef"], rel=1e-9)
    routed = [r for r in measured["rows"] if r["rho"] < 1]
    assert len(routed) == 46
    for r in routed:
        for pass_ in ("infer", "train"):
            assert r[pass_]["sparse_over_dense"] > 1.0  # sparse never paid on the H200
            choice = choose_execution("cuda", r["tokens"], r["dim"], r["heads"], r["head_dim"], r["rho"],
                                      backward=pass_ == "train", routed_fraction=(r["heads"] - r["shared"]) / r["heads"],
                                      calibration=shipped)  # fmt: skip
            assert choice == "dense", (r["width"], r["tokens"], pass_)
