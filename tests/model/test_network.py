"""MoHDiT: DiT structure and initialisation, labels, auxiliary loss, save/load, validation."""

import math

import numpy as np
import pytest
import torch

from moh_dit import MoHDiT, create_model
from moh_dit.model.embeddings import TimestepEmbedder, sincos_pos_embed_2d

from ..helpers.factories import give_signal, tiny_model

# three layers: routed with 2 shared + top-1 of 2, routed with 3 shared + top-2 of 3, dense
LAYOUT = dict(in_channels=3, depth=3, num_heads=[4, 6, 4], num_shared_heads=[2, 3, 4], top_k=[1, 2, 0], num_classes=5)


def tiny(**overrides) -> MoHDiT:
    return tiny_model(**(LAYOUT | overrides))


def randomize(model: MoHDiT, std: float = 0.2) -> MoHDiT:
    """Give the zero-initialised adaLN and output layers and the routers weights, so every path carries signal."""
    return give_signal(model, std, seed=1, routers=True)


def inputs(model: MoHDiT, n: int = 3, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    c, s = model.config.in_channels, model.config.sample_size
    x = torch.randn(n, c, s, s, generator=g)
    t = torch.randint(0, 1000, (n,), generator=g)
    y = torch.randint(0, max(model.config.num_classes, 1), (n,), generator=g) if model.config.num_classes else None
    return x, t, y


# ----------------------------------------------------------------------------------------------------
# Structure and initialisation
# ----------------------------------------------------------------------------------------------------
def test_output_shape_learned_sigma_and_zero_at_init():
    model = tiny().eval()
    x, t, y = inputs(model)
    out = model(x, t, y)
    assert out.sample.shape == (3, 6, 8, 8)
    assert torch.count_nonzero(out.sample) == 0  # final layer is zero-initialised
    assert tiny(learn_sigma=False).out_channels == 3


def test_blocks_start_as_identity():
    model = tiny().eval()
    x, t, y = inputs(model)
    tokens = model.x_embedder(x) + model.pos_embed
    c = model.t_embedder(t) + model.y_embedder(y, train=False)
    for block in model.blocks:
        out, _ = block(tokens, c)
        assert torch.equal(out, tokens)


def test_initialisation_follows_dit():
    model = tiny()
    for name, p in model.named_parameters():
        if "adaLN_modulation" in name or name.startswith("final_layer.linear") or name.endswith("bias"):
            assert torch.count_nonzero(p) == 0, name
    assert model.y_embedder.embedding_table.weight.std().item() == pytest.approx(0.02, rel=0.3)
    assert model.t_embedder.mlp[0].weight.std().item() == pytest.approx(0.02, rel=0.2)
    router = model.blocks[0].attn.router.weight
    bound = math.sqrt(6 / (router.shape[0] + router.shape[1]))  # xavier-uniform, not zero
    assert router.abs().max() <= bound and router.abs().max() > bound / 2
    assert not model.pos_embed.requires_grad


def test_pos_embed_matches_dit_layout():
    """Independent numpy version of DiT's fixed 2D sin-cos embedding (width coordinate first)."""
    dim, grid = 16, 4

    def one_d(d, pos):
        omega = 1.0 / 10000 ** (np.arange(d // 2, dtype=np.float64) / (d / 2.0))
        out = np.outer(pos.reshape(-1), omega)
        return np.concatenate([np.sin(out), np.cos(out)], axis=1)

    ys, xs = np.meshgrid(np.arange(grid), np.arange(grid), indexing="ij")
    expected = np.concatenate([one_d(dim // 2, xs), one_d(dim // 2, ys)], axis=1)
    np.testing.assert_allclose(sincos_pos_embed_2d(dim, grid).numpy(), expected, atol=1e-6)


def test_timestep_embedding_is_cos_first_sinusoid_of_raw_step():
    emb = TimestepEmbedder(8, frequency_embedding_size=6)
    seen = []
    emb.mlp[0].register_forward_hook(lambda module, args, out: seen.append(args[0]))
    t = torch.tensor([0, 3, 999])
    emb(t)
    freqs = torch.exp(-math.log(10000) * torch.arange(3) / 3)
    expected = torch.cat([torch.cos(t[:, None] * freqs), torch.sin(t[:, None] * freqs)], dim=1)
    torch.testing.assert_close(seen[0], expected, rtol=1e-5, atol=1e-5)


def test_unpatchify_inverts_patch_layout():
    model = tiny(sample_size=4, patch_size=2, in_channels=1, learn_sigma=True)  # C_out = 2
    p, c, g = 2, 2, 2
    tokens = torch.arange(g * g * p * p * c, dtype=torch.float32).reshape(1, g * g, p * p * c)
    img = model.unpatchify(tokens)
    for i in range(g):
        for j in range(g):
            for a in range(p):
                for b in range(p):
                    for ch in range(c):
                        assert img[0, ch, i * p + a, j * p + b] == tokens[0, i * g + j, (a * p + b) * c + ch]


# ----------------------------------------------------------------------------------------------------
# Auxiliary loss and head usage
# ----------------------------------------------------------------------------------------------------
def test_aux_loss_positive_in_training_zero_in_eval_and_head_masks():
    model = randomize(tiny()).train()
    x, t, y = inputs(model)
    out = model(x, t, y, return_head_masks=True)
    assert model.num_routed_layers == 2
    assert out.aux_loss.ndim == 0 and out.aux_loss.item() > 0
    assert [m.shape for m in out.head_masks] == [(3, 16, 4), (3, 16, 6), (3, 16, 4)]
    assert [int(m.sum(-1).unique()) for m in out.head_masks] == [3, 5, 4]
    model.eval()
    assert model(x, t, y).aux_loss.item() == 0.0


def test_aux_loss_equals_layer_average_computed_by_hand():
    model = randomize(tiny()).train()
    x, t, y = inputs(model)
    force = torch.zeros(3, dtype=torch.long)  # no random label dropout
    out = model(x, t, y, force_drop_ids=force)
    h = model.x_embedder(x) + model.pos_embed
    c = model.t_embedder(t) + model.y_embedder(y, train=False)
    losses = []
    for block in model.blocks:
        h, aux = block(h, c)
        if aux.load_balance_loss is not None:
            losses.append(aux.load_balance_loss)
    torch.testing.assert_close(out.aux_loss, torch.stack(losses).mean())


def test_dit_mode_has_zero_aux_loss_and_no_router():
    model = tiny(attention_type="mha", num_shared_heads=None, top_k=0).train()
    x, t, y = inputs(model)
    assert model(x, t, y).aux_loss.item() == 0.0
    assert not any("router" in n for n, _ in model.named_parameters())


# ----------------------------------------------------------------------------------------------------
# Labels
# ----------------------------------------------------------------------------------------------------
def test_null_class_and_forced_dropout():
    model = randomize(tiny()).eval()
    x, t, y = inputs(model)
    null = torch.full_like(y, model.null_class_id)
    assert model.null_class_id == 5 and model.y_embedder.num_embeddings == 6
    dropped = model(x, t, y, force_drop_ids=torch.ones_like(y)).sample
    torch.testing.assert_close(dropped, model(x, t, null).sample)


def test_random_label_dropout_rate_in_training():
    model = tiny(class_dropout_prob=0.25)
    torch.manual_seed(0)
    labels = torch.zeros(20000, dtype=torch.long)
    dropped = model.y_embedder.drop_labels(labels)
    rate = (dropped == 5).float().mean().item()
    assert rate == pytest.approx(0.25, abs=0.02)


def test_unconditional_and_single_class_models():
    unc = randomize(tiny(num_classes=0)).eval()
    x, t, _ = inputs(unc)
    assert unc.y_embedder is None and unc.null_class_id is None
    assert unc(x, t).sample.shape == (3, 6, 8, 8)
    with pytest.raises(ValueError, match="unconditional"):
        unc(x, t, torch.zeros(3, dtype=torch.long))
    one = tiny(num_classes=1)
    assert one.null_class_id == 1
    one(x, t, torch.tensor([0, 1, 0]))


@pytest.mark.parametrize("labels", [[0, 6, 1], [-1, 0, 0]])
def test_out_of_range_labels_fail_at_forward(labels):
    model = tiny()
    x, t, _ = inputs(model)
    with pytest.raises(ValueError, match=r"class labels must be in \[0, 5\]"):
        model(x, t, torch.tensor(labels))


def test_null_label_rejected_without_class_dropout():
    model = tiny(class_dropout_prob=0.0)
    x, t, _ = inputs(model)
    with pytest.raises(ValueError, match=r"\[0, 4\]"):
        model(x, t, torch.tensor([0, 5, 1]))


def test_missing_or_float_labels_and_wrong_input_shape():
    model = tiny()
    x, t, y = inputs(model)
    with pytest.raises(ValueError, match="required"):
        model(x, t)
    with pytest.raises(ValueError, match="integer"):
        model(x, t, y.float())
    with pytest.raises(ValueError, match="shape"):
        model(x[:, :2], t, y)


# ----------------------------------------------------------------------------------------------------
# Configuration validation, save/load, checkpointing
# ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "overrides,message",
    [
        (dict(num_heads=[4, 4]), "num_heads has 2 entries but depth is 3"),
        (dict(top_k=[1, 2]), "top_k has 2 entries"),
        (dict(top_k=[3, 2, 0]), "layer 0: top_k=3"),
        (dict(num_shared_heads=[5, 3, 4]), "layer 0: num_shared_heads=5"),
        (dict(sample_size=9), "not divisible by patch_size"),
        (dict(attention_type="flash"), "attention_type"),
        (dict(attention_type="mha"), "no routing"),
        (dict(hidden_size=30, head_dim=8), "divisible by 4"),
    ],
)
def test_bad_configs_fail_at_construction(overrides, message):
    with pytest.raises(ValueError, match=message):
        tiny(**overrides)


def test_save_pretrained_round_trip(tmp_path):
    model = randomize(tiny()).eval()
    model.save_pretrained(tmp_path / "m")
    assert (tmp_path / "m" / "diffusion_pytorch_model.safetensors").exists()
    loaded = MoHDiT.from_pretrained(tmp_path / "m").eval()
    assert loaded.config.num_shared_heads == [2, 3, 4] and loaded.config.top_k == [1, 2, 0]
    x, t, y = inputs(model)
    assert torch.equal(model(x, t, y).sample, loaded(x, t, y).sample)
    for (n1, p1), (n2, p2) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert n1 == n2 and torch.equal(p1, p2)


def test_preset_round_trip_needs_no_preset_name(tmp_path):
    model = create_model("MoH-DiT-Ti/4-75").eval()
    model.save_pretrained(tmp_path)
    loaded = MoHDiT.from_pretrained(tmp_path).eval()
    assert loaded.head_counts() == (27, 36)
    x, t, y = inputs(model, n=2)
    assert torch.equal(model(x, t, y).sample, loaded(x, t, y).sample)


def test_gradient_checkpointing_gives_same_gradients():
    torch.manual_seed(0)
    x, t, y = inputs(tiny())

    def grads(checkpoint: bool):
        torch.manual_seed(0)  # identical weights in both runs
        model = randomize(tiny()).train()
        if checkpoint:
            model.enable_gradient_checkpointing()
        out = model(x, t, y, force_drop_ids=torch.zeros_like(y))
        (out.sample.square().mean() + out.aux_loss).backward()
        return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}

    plain, ckpt = grads(False), grads(True)
    assert plain.keys() == ckpt.keys() and any("router" in n for n in plain)
    for name in plain:
        torch.testing.assert_close(plain[name], ckpt[name], msg=name)
