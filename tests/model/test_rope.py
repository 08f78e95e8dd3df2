"""2-D RoPE: the tables and the rotation equal LightningDiT's (recorded from its code at two grid sizes) and
diffusers' rotary helpers; the rotation of gathered rows (the sparse MoH path) equals the rotation of all of them."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from moh_dit.model.rope import RotaryEmbedding2D, rotate_pairs

RECORDS = Path(__file__).resolve().parents[1] / "reference_outputs"
REC = load_file(RECORDS / "lightningdit_official.safetensors")


@pytest.mark.parametrize("grid", [4, 3])
def test_tables_and_rotation_equal_lightningdits_at_two_grid_sizes(grid):
    rope = RotaryEmbedding2D(head_dim=8, grid=grid)
    torch.testing.assert_close(rope.freqs_cos, REC[f"rope{grid}.cos"], rtol=0, atol=1e-6)
    torch.testing.assert_close(rope.freqs_sin, REC[f"rope{grid}.sin"], rtol=0, atol=1e-6)
    torch.testing.assert_close(rope(REC[f"rope{grid}.x"]), REC[f"rope{grid}.out"], rtol=1e-6, atol=1e-6)


def test_the_first_half_of_a_head_turns_with_the_row_and_the_second_with_the_column():
    rope = RotaryEmbedding2D(head_dim=8, grid=3)
    cos = rope.freqs_cos.reshape(3, 3, 8)
    assert torch.equal(cos[0, :, :4], cos[0, :1, :4].expand(3, 4)) and not torch.equal(
        cos[:, 0, :4], cos[:1, 0, :4].expand(3, 4)
    )
    assert torch.equal(cos[:, 0, 4:], cos[:1, 0, 4:].expand(3, 4)) and not torch.equal(
        cos[0, :, 4:], cos[0, :1, 4:].expand(3, 4)
    )
    # adjacent pairs share a frequency: a pair turns as one complex number
    assert torch.equal(rope.freqs_cos[:, 0::2], rope.freqs_cos[:, 1::2])
    assert torch.equal(rotate_pairs(torch.tensor([1.0, 2.0, 3.0, 4.0])), torch.tensor([-2.0, 1.0, -4.0, 3.0]))


def test_the_rotation_equals_diffusers_apply_rotary_emb():
    from diffusers.models.embeddings import apply_rotary_emb

    rope = RotaryEmbedding2D(head_dim=8, grid=4, theta=100.0)
    q = torch.randn(2, 3, 16, 8)
    theirs = apply_rotary_emb(q, (rope.freqs_cos, rope.freqs_sin), use_real=True, use_real_unbind_dim=-1)
    torch.testing.assert_close(rope(q), theirs, rtol=1e-6, atol=1e-6)


def test_gathered_rows_rotate_at_their_own_positions_and_norms_are_kept():
    rope = RotaryEmbedding2D(head_dim=8, grid=4)
    q = torch.randn(2, 3, 16, 8)
    positions = torch.randint(0, 16, (2, 3, 5))
    rows = torch.gather(q, 2, positions.unsqueeze(-1).expand(2, 3, 5, 8))
    expected = torch.gather(rope(q), 2, positions.unsqueeze(-1).expand(2, 3, 5, 8))
    torch.testing.assert_close(rope(rows, positions), expected)
    torch.testing.assert_close(rope(q).norm(dim=-1), q.norm(dim=-1))  # a rotation
    assert rope(q.bfloat16()).dtype == torch.bfloat16


def test_a_head_size_that_two_axes_of_pairs_cannot_split_is_an_error():
    with pytest.raises(ValueError, match="divisible by 4"):
        RotaryEmbedding2D(head_dim=6, grid=4)
    assert json.loads((RECORDS / "lightningdit_official.json").read_text())["commit"] == "2725fed"
