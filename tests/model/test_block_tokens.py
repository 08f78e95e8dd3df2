"""tokens_after_blocks (moh_dit/model/block_tokens.py): the tokens after the blocks asked for equal those of a pass run
block by block by hand, the pass stops after the deepest one, and blocks outside the network are refused."""

from __future__ import annotations

import pytest
import torch

from moh_dit.model.block_tokens import tokens_after_blocks

from ..helpers.factories import tiny_model


def by_hand(model, x, t, y):
    """Every block's tokens, the network's own pieces run one after another (eval mode: no aux)."""
    h = model.x_embedder(x) + model.pos_embed
    c, c_end = model.condition(t, y, None, x)
    out = []
    for block, cond in zip(model.blocks, model.block_conditions(c, c_end)):
        h = block(h, cond, model.feat_rope, False, False)
        out.append(h)
    return out


def test_the_tokens_after_each_block_asked_for_are_the_blocks_own_and_the_pass_stops_after_the_deepest():
    model = tiny_model(signal=0.1, depth=3, num_shared_heads=[2, 4, 2], top_k=[1, 0, 1]).eval()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, model.config.in_channels, model.config.sample_size, model.config.sample_size, generator=g)
    t, y = torch.tensor([10.0, 500.0]), torch.tensor([1, 2])
    expected = by_hand(model, x, t, y)
    depth = len(model.blocks)
    ran = []
    model.final_layer.register_forward_hook(lambda *a: ran.append("final"))
    got = tokens_after_blocks(model, [depth, 1], lambda: model(x, t, y))
    torch.testing.assert_close(got[0], expected[depth - 1])
    torch.testing.assert_close(got[1], expected[0])
    assert ran == []  # stopped after the deepest block (the last): the final layer never ran
    later = []
    for block in model.blocks[1:]:
        block.register_forward_hook(lambda *a: later.append(1))
    (first,) = tokens_after_blocks(model, [1], lambda: model(x, t, y))
    torch.testing.assert_close(first, expected[0])
    assert later == [] and ran == []  # nothing after block 1 ran
    assert len(model.blocks[0]._forward_hooks) == 0  # its hook removed


@pytest.mark.parametrize("blocks", [[], [0], [99]])
def test_blocks_outside_the_network_are_refused(blocks):
    with pytest.raises(ValueError, match="blocks must be from 1 to"):
        tokens_after_blocks(tiny_model(), blocks, lambda: None)
