"""Token routing in training (TREAD, moh_dit/model/token_routing.py): the routed tokens skip the span unchanged and
the kept ones go through it as a sequence of their own, at their own RoPE positions, in the dense and the sparse MoH
execution alike; no route (sampling, evaluation) is the plain network; the span, the draw and the FLOPs."""

import pytest
import torch

from moh_dit.model.flops import forward_flops
from moh_dit.model.token_routing import TokenRoute, draw_route, resolve_span

from ..helpers.factories import tiny_model

EVERY_OPTION = {"norm": "rmsnorm", "mlp": "swiglu", "qk_norm": "rmsnorm", "rope": True}


def routed_model(**config):
    return tiny_model(signal=0.3, depth=4, num_shared_heads=[2, 1, 1, 4], top_k=[1, 2, 2, 0], **config).train()


def by_hand(model, x, t, y, route):
    """The routed pass written out per image: blocks before the span on every token; the span on that image's kept
    tokens alone, each rotating at its grid position (a one-image batch, RoPE's table sliced); blocks after it on every
    token, the skipped ones as they were before the span."""
    h = model.x_embedder(x) + model.pos_embed
    c, c_end = model.condition(t, y, torch.zeros_like(y), x)
    rope = model.feat_rope
    for block in model.blocks[: route.start]:
        h, _ = block(h, c, rope, False)
    rows = []
    for i in range(x.shape[0]):
        kept = route.kept[i]
        hi = h[i : i + 1, kept]
        if rope is not None:
            sliced = type(rope)(rope.head_dim, rope.grid, rope.theta)
            sliced.freqs_cos, sliced.freqs_sin = rope.freqs_cos[kept], rope.freqs_sin[kept]
        for block in model.blocks[route.start : route.stop]:
            hi, _ = block(hi, c[i : i + 1], sliced if rope is not None else None, False)
        row = h[i].clone()
        row[kept] = hi[0]
        rows.append(row)
    h = torch.stack(rows)
    for block in model.blocks[route.stop :]:
        h, _ = block(h, c, rope, False)
    return model.unpatchify(model.final_layer(h, c_end))


@pytest.mark.parametrize("execution", ["dense", "sparse"])
@pytest.mark.parametrize("block", [{}, EVERY_OPTION], ids=["dit", "every-option"])
def test_a_routed_pass_is_the_span_run_on_the_kept_tokens_alone(execution, block):
    model = routed_model(block=block)
    model.set_attention_execution(execution)
    g = torch.Generator().manual_seed(0)
    x, t, y = torch.randn(3, 1, 8, 8, generator=g), torch.tensor([10.0, 500.0, 900.0]), torch.tensor([0, 1, 2])
    route = draw_route(3, model.num_tokens, 0.5, (1, 3), g, "cpu")
    assert route.kept.shape == (3, 8) and all(row.unique().numel() == 8 for row in route.kept)  # 8 of 16 kept
    with model.routed_tokens(route):
        out = model(x, t, y, force_drop_ids=torch.zeros_like(y))
    torch.testing.assert_close(out.sample, by_hand(model, x, t, y, route), rtol=1e-5, atol=1e-5)
    plain = model(x, t, y, force_drop_ids=torch.zeros_like(y))  # the route ends with the block
    assert not torch.allclose(plain.sample, out.sample) and model._token_route is None
    # the gradient flows through the kept tokens' span and around it
    out.sample.square().mean().backward()
    assert all(p.grad is not None for p in model.blocks[1].parameters() if p.requires_grad)


def test_the_span_counts_from_either_end_and_is_checked():
    assert (
        resolve_span(2, -3, 12) == (2, 10) and resolve_span(-4, -1, 12) == (8, 12) and resolve_span(0, 0, 4) == (0, 1)
    )
    for first, last in ((5, 2), (0, 12), (-13, 3)):
        with pytest.raises(ValueError, match="the routed span must be blocks first <= last"):
            resolve_span(first, last, 12)


def test_a_route_is_drawn_from_the_generator_and_gathers_and_scatters_back():
    a = draw_route(4, 16, 0.25, (1, 3), torch.Generator().manual_seed(5), "cpu")
    b = draw_route(4, 16, 0.25, (1, 3), torch.Generator().manual_seed(5), "cpu")
    assert torch.equal(a.kept, b.kept) and a.kept.shape == (4, 12)
    assert torch.all(a.kept[:, 1:] > a.kept[:, :-1])  # ascending: the sequence keeps its order
    h = torch.randn(4, 16, 5)
    kept = a.gather(h)
    assert torch.equal(a.scatter(h, kept), h) and (a.scatter(h, kept * 0).count_nonzero(1) == 4).all()
    assert TokenRoute(a.kept, 1, 3).aligns_kept_tokens(2) and not TokenRoute(a.kept, 1, 3).aligns_kept_tokens(3)


def test_the_flop_count_of_a_routed_step_drops_by_the_skipped_tokens_work():
    model = routed_model()
    full, routed = forward_flops(model, True), forward_flops(model, True, routed=((1, 3), 8))
    assert routed.embed == full.embed and routed.final == full.final and routed.adaln == full.adaln
    assert full.mlp - routed.mlp == 2 * (full.mlp // 4) // 2  # two of four blocks at half their tokens
    assert routed.total < full.total
