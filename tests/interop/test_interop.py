"""Interop: diffusers DiT both ways, reference-layout checkpoints (DiT, MoH-DiT, train.py dicts), exporters,
and DiT -> MoH-DiT conversion for continued training."""

import json
import os
import pickle
from pathlib import Path

import pytest
import torch
from diffusers import DiTTransformer2DModel

from moh_dit import MoHDiT, create_model
from moh_dit.diffusion import DiffusionObjective
from moh_dit.errors import ConversionError
from moh_dit.interop.diffusers_dit import from_diffusers, to_diffusers
from moh_dit.interop.dit_to_moh import dit_to_moh
from moh_dit.interop.official import (
    config_from_reference,
    load_reference_checkpoint,
    ours_to_reference,
    read_checkpoint,
)

from ..helpers.factories import give_signal, tiny_model

ROOT = Path(__file__).resolve().parents[2]


def randomize(module, std=0.05, seed=0):
    """Every trainable weight random: conversions must carry every tensor to the right place."""
    return give_signal(module, std, seed, every_weight=True)


def inputs(model_or_cfg, n=3, seed=1):
    cfg = model_or_cfg.config
    c = cfg.in_channels
    s = cfg.sample_size
    g = torch.Generator().manual_seed(seed)
    classes = cfg.num_classes if hasattr(cfg, "num_classes") else cfg.num_embeds_ada_norm
    return (
        torch.randn(n, c, s, s, generator=g),
        torch.tensor([3, 500, 999])[:n],
        torch.randint(0, classes, (n,), generator=g),
    )


# ----------------------------------------------------------------------------------------------------
# diffusers
# ----------------------------------------------------------------------------------------------------
def tiny_diffusers_dit():
    dit = DiTTransformer2DModel(
        num_attention_heads=2,
        attention_head_dim=8,
        in_channels=4,
        out_channels=8,
        num_layers=2,
        sample_size=8,
        patch_size=2,
        num_embeds_ada_norm=10,
        norm_eps=1e-5,
    )
    randomize(dit, 0.1)
    with torch.no_grad():  # diffusers' per-block embedder copies hold the same weights, as in converted hub models
        for i in range(1, 2):
            for (_n0, p0), (_, pi) in zip(
                dit.transformer_blocks[0].norm1.emb.named_parameters(),
                dit.transformer_blocks[i].norm1.emb.named_parameters(),
            ):
                pi.copy_(p0)
    return dit.eval()


def test_diffusers_dit_converts_both_ways_with_identical_outputs():
    dit = tiny_diffusers_dit()
    x, t, y = inputs(dit)
    with torch.no_grad():
        expected = dit(x, timestep=t, class_labels=y).sample
        ours = from_diffusers(dit)
        got = ours(x, t, y).sample
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        back = to_diffusers(ours)
        torch.testing.assert_close(back(x, timestep=t, class_labels=y).sample, expected, rtol=1e-5, atol=1e-5)
    assert ours.config.timestep_freq_shift == 1.0 and ours.config.mlp_norm_eps == 1e-5


def test_diffusers_export_refuses_moh_models():
    with pytest.raises(ConversionError, match="no Mixture-of-Head"):
        to_diffusers(create_model("MoH-DiT-Ti/4-75"))


def test_per_block_embedders_that_differ_are_refused():
    dit = tiny_diffusers_dit()
    with torch.no_grad():
        dit.transformer_blocks[1].norm1.emb.timestep_embedder.linear_1.weight.add_(1.0)
    with pytest.raises(ConversionError, match="per-block embedders"):
        from_diffusers(dit)


# ----------------------------------------------------------------------------------------------------
# Reference layout
# ----------------------------------------------------------------------------------------------------
def reference_keys(depth, routers):
    keys = [
        "x_embedder.proj.weight",
        "x_embedder.proj.bias",
        "t_embedder.mlp.0.weight",
        "t_embedder.mlp.0.bias",
        "t_embedder.mlp.2.weight",
        "t_embedder.mlp.2.bias",
        "y_embedder.embedding_table.weight",
        "pos_embed",
        "final_layer.linear.weight",
        "final_layer.linear.bias",
        "final_layer.adaLN_modulation.1.weight",
        "final_layer.adaLN_modulation.1.bias",
    ]
    for i in range(depth):
        for part in ("attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2", "adaLN_modulation.1"):
            keys += [f"blocks.{i}.{part}.weight", f"blocks.{i}.{part}.bias"]
        keys += [f"blocks.{i}.attn.{r}.weight" for r in routers[i]]
    return sorted(keys)


def small_moh():
    # MoH-DiT-S/2-90's head tables at a narrow width: layers 0-7 have wg (3), wg_0 (2), wg_1 (3); 8-11 wg_1 (6)
    return randomize(tiny_model("MoH-DiT-S/2-90", hidden_size=48, head_dim=8, sample_size=8, num_classes=10), 0.05)


def test_export_uses_the_reference_key_layout():
    model = small_moh()
    sd = ours_to_reference(model)
    routers = [["wg", "wg_0", "wg_1"]] * 8 + [["wg_1"]] * 4
    assert sorted(sd) == reference_keys(12, routers)
    assert sd["blocks.0.attn.wg.weight"].shape == (3, 48) and sd["blocks.0.attn.wg_1.weight"].shape == (3, 48)
    assert sd["blocks.0.attn.wg_0.weight"].shape == (2, 48) and sd["blocks.9.attn.wg_1.weight"].shape == (6, 48)
    assert sd["blocks.0.attn.qkv.weight"].shape == (3 * 6 * 8, 48)
    assert sd["y_embedder.embedding_table.weight"].shape == (11, 48)


@pytest.mark.parametrize("train_dict", [False, True])
def test_moh_reference_checkpoint_loads_strictly_and_infers_the_preset(tmp_path, train_dict):
    model = small_moh().eval()
    sd = ours_to_reference(model)
    obj = (
        {"model": {k: torch.zeros_like(v) for k, v in sd.items()}, "ema": sd, "opt": {}, "args": {}}
        if train_dict
        else sd
    )
    torch.save(obj, tmp_path / "ckpt.pt")
    loaded, report = load_reference_checkpoint(tmp_path / "ckpt.pt")
    assert report["weights"] == ("ema" if train_dict else "state dict")
    assert loaded.config.top_k == [2] * 8 + [0] * 4  # from the matching preset
    x, t, y = inputs(model)
    assert torch.equal(loaded(x, t, y).sample, model(x, t, y).sample)


def test_plain_dit_reference_checkpoint_and_exporter_round_trip(tmp_path):
    model = randomize(tiny_model("DiT-S/2", hidden_size=48, head_dim=8, sample_size=8, num_classes=10)).eval()
    sd = ours_to_reference(model)
    assert sorted(sd) == reference_keys(12, [[]] * 12)
    torch.save(sd, tmp_path / "dit.pt")
    loaded, _ = load_reference_checkpoint(tmp_path / "dit.pt", num_heads=6)
    x, t, y = inputs(model)
    assert torch.equal(loaded(x, t, y).sample, model(x, t, y).sample)
    cfg = config_from_reference(sd, num_heads=6)
    assert (cfg["hidden_size"], cfg["depth"], cfg["patch_size"], cfg["num_classes"], cfg["learn_sigma"]) == (
        48,
        12,
        2,
        10,
        True,
    )


def test_checkpoint_of_another_shape_says_what_differs(tmp_path):
    torch.save(ours_to_reference(small_moh()), tmp_path / "small.pt")
    with pytest.raises(
        ConversionError, match=r"shape mismatches.*qkv\.weight: checkpoint \(144, 48\) vs model \(1152, 384\)"
    ):
        load_reference_checkpoint(tmp_path / "small.pt", preset="MoH-DiT-S/2-90")
    with pytest.raises(ConversionError, match="missing keys|unexpected keys"):
        load_reference_checkpoint(tmp_path / "small.pt", preset="DiT-S/2")


def test_moh_checkpoint_without_matching_preset_needs_top_k(tmp_path):
    model = randomize(tiny_model(in_channels=4, num_shared_heads=[1, 2], top_k=[2, 1], num_classes=5))
    torch.save(ours_to_reference(model), tmp_path / "c.pt")
    with pytest.raises(ConversionError, match="pass top_k"):
        load_reference_checkpoint(tmp_path / "c.pt")
    loaded, _ = load_reference_checkpoint(tmp_path / "c.pt", top_k=[2, 1])
    x, t, y = inputs(model)
    assert torch.equal(loaded.eval()(x, t, y).sample, model.eval()(x, t, y).sample)


class _Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def test_checkpoints_with_pickled_code_are_refused(tmp_path):
    with open(tmp_path / "evil.pt", "wb") as f:
        pickle.dump({"model": _Evil()}, f)
    with pytest.raises(ConversionError, match="refusing"):
        read_checkpoint(tmp_path / "evil.pt")
    with pytest.raises(FileNotFoundError):
        read_checkpoint(tmp_path / "missing.pt")


def test_cli_writes_a_pipeline_that_loads(tmp_path, caplog):
    from ..helpers.factories import run_in_process

    model = small_moh().eval()
    torch.save(ours_to_reference(model), tmp_path / "moh.pt")
    (tmp_path / "labels.json").write_text(json.dumps({str(i): f"class {i}" for i in range(10)}))
    run_in_process("convert", [tmp_path / "moh.pt", tmp_path / "pipe", "--id2label", tmp_path / "labels.json"], caplog)
    from moh_dit.sampling.loading import load_pipeline

    pipe = load_pipeline(tmp_path / "pipe", device="cpu")
    assert pipe.id2label[3] == "class 3"
    x, t, y = inputs(model)
    assert torch.equal(pipe.transformer(x, t, y).sample, model(x, t, y).sample)
    run_in_process("convert", [tmp_path / "pipe", tmp_path / "back.pt", "--to", "reference-train"], caplog)
    reloaded, report = load_reference_checkpoint(tmp_path / "back.pt")
    assert report["weights"] == "ema" and torch.equal(reloaded(x, t, y).sample, model(x, t, y).sample)


# ----------------------------------------------------------------------------------------------------
# DiT -> MoH-DiT
# ----------------------------------------------------------------------------------------------------
def small_dit():
    return randomize(
        tiny_model("DiT-S/2", hidden_size=48, head_dim=8, sample_size=8, num_classes=10, depth=4), 0.08
    ).eval()


def test_all_heads_active_conversion_equals_the_original():
    dit = small_dit()
    moh, report = dit_to_moh(dit, shared=2, top_k=4)  # 2 shared + all 4 routed: every head active
    x, t, y = inputs(dit)
    torch.testing.assert_close(moh(x, t, y).sample, dit(x, t, y).sample, rtol=1e-5, atol=1e-5)
    assert report["model_relative_deviation"] < 1e-5
    assert all(layer["relative_deviation"] < 1e-5 for layer in report["layers"])


def test_75_percent_conversion_reports_deviation_and_fine_tunes(tmp_path):
    dit = small_dit()
    moh, report = dit_to_moh(dit, shared=2, top_k=2)  # 4 of 6 heads per token
    assert report["active_heads"] == "16/24"
    devs = [layer["relative_deviation"] for layer in report["layers"]]
    assert all(0 < d < 1 for d in devs) and 0 < report["model_relative_deviation"] < 1
    # routing by fitted importance beats an arbitrary choice of heads
    naive, naive_report = dit_to_moh(dit, shared=2, top_k=2, router_logit_std=0.0)
    assert report["model_relative_deviation"] <= naive_report["model_relative_deviation"] * 1.05

    obj = DiffusionObjective()
    g = torch.Generator().manual_seed(0)
    x0 = torch.randn(8, 4, 8, 8, generator=g)
    y = torch.randint(0, 10, (8,), generator=g)
    moh.train()
    opt = torch.optim.AdamW(moh.parameters(), lr=1e-3)

    def loss_at(seed):
        gen = torch.Generator().manual_seed(seed)
        t = torch.randint(0, 1000, (8,), generator=gen)
        noise = torch.randn(x0.shape, generator=gen)
        out = moh(obj.add_noise(x0, noise, t), t, y, force_drop_ids=torch.zeros_like(y))
        return obj.losses(out.sample, x0, obj.add_noise(x0, noise, t), t, noise).loss.mean() + 0.01 * out.aux_loss

    with torch.no_grad():
        before = sum(loss_at(s).item() for s in range(4)) / 4
    for step in range(25):
        loss = loss_at(100 + step)
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        after = sum(loss_at(s).item() for s in range(4)) / 4
    assert after < before

    moh.save_pretrained(tmp_path / "moh")  # what train.py --init-from reads
    assert MoHDiT.from_pretrained(tmp_path / "moh").config.attention_type == "moh"


def test_dit_to_moh_rejects_moh_input():
    with pytest.raises(ConversionError, match="multi-head"):
        dit_to_moh(small_moh(), shared=2, top_k=1)


def test_a_1000_class_checkpoint_gets_imagenet_names_and_samples_by_name(tmp_path):
    from moh_dit.cli import convert as convert_command
    from moh_dit.cli import sample as sample_command
    from moh_dit.sampling.pipeline import MoHDiTPipeline

    from ..helpers.factories import tiny_vae

    model = randomize(tiny_model("DiT-S/2", hidden_size=32, head_dim=8, depth=2, sample_size=8, in_channels=4))
    assert model.config.num_classes == 1000
    torch.save(ours_to_reference(model), tmp_path / "DiT-tiny.pt")
    tiny_vae().save_pretrained(tmp_path / "vae")  # 4 latent channels, downsampling 2
    convert_command.main(
        [str(tmp_path / "DiT-tiny.pt"), str(tmp_path / "pipe"), "--num-heads", "4", "--vae", str(tmp_path / "vae")]
    )
    from diffusers import AutoencoderKL

    from moh_dit.errors import ArtifactError

    AutoencoderKL.from_config(tiny_vae().config, latent_channels=8).save_pretrained(tmp_path / "vae8")
    with pytest.raises(ArtifactError, match="makes 8-channel latents but this model works on 4-channel"):
        convert_command.main(
            [str(tmp_path / "DiT-tiny.pt"), str(tmp_path / "p8"), "--num-heads", "4", "--vae", str(tmp_path / "vae8")]
        )
    assert not (tmp_path / "p8").exists()
    pipe = MoHDiTPipeline.from_pretrained(tmp_path / "pipe")
    assert pipe.id2label[207] == "golden retriever" and pipe.id2label[0] == "tench" and len(pipe.id2label) == 1000
    assert pipe.get_label_ids(["golden retriever", "Tench"]) == [207, 0]
    assert json.loads((tmp_path / "pipe" / "conversion_report.json").read_text())["class_names"].startswith("ImageNet")
    sample_command.main(
        [
            str(tmp_path / "pipe"),
            "--class-labels",
            "golden retriever",
            "tench",
            "--per-class",
            "2",
            "--num-steps",
            "2",
            "--out",
            str(tmp_path / "grid.png"),
        ]
    )
    assert (tmp_path / "grid.png").exists()


def test_an_existing_output_is_replaced_only_with_overwrite(tmp_path):
    from moh_dit.cli import convert as convert_command

    tiny_model(signal=0.1).save_pretrained(tmp_path / "t")
    convert_command.main([str(tmp_path / "t"), str(tmp_path / "p")])
    manifest = (tmp_path / "p" / "manifest.json").read_text()
    tiny_model(signal=0.1, seed=1).save_pretrained(tmp_path / "t2")
    with pytest.raises(ConversionError, match=r"p holds a moh-dit pipeline of .*t; pass --overwrite"):
        convert_command.main([str(tmp_path / "t2"), str(tmp_path / "p")])
    assert (tmp_path / "p" / "manifest.json").read_text() == manifest
    convert_command.main([str(tmp_path / "t2"), str(tmp_path / "p"), "--overwrite"])
    assert json.loads((tmp_path / "p" / "manifest.json").read_text())["source"]["converted_from"].endswith("t2")
    (tmp_path / "w.pt").write_bytes(b"someone's weights")
    with pytest.raises(ConversionError, match="w.pt holds a file; pass --overwrite"):
        convert_command.main([str(tmp_path / "p"), str(tmp_path / "w.pt"), "--to", "reference"])
    (tmp_path / "empty").mkdir()
    convert_command.main([str(tmp_path / "t"), str(tmp_path / "empty")])  # an empty folder holds nothing to lose
