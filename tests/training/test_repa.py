"""REPA: the loss and the tapped block against the official code (recorded by tests/reference_outputs/record_flow.py
from sihyun-yu/REPA), REPA's input preprocessing against the libraries it uses, DINOv2's loading path with a
random-init encoder of DINOv2's shape from weights on disk, and runs that train with it under either objective."""

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from moh_dit.errors import ConfigError
from moh_dit.model.surgery import without_alignment
from moh_dit.training.encoders import load_dinov2, repa_input
from moh_dit.training.repa import alignment_loss

from ..helpers.factories import train_tiny

HERE = Path(__file__).resolve().parents[1] / "reference_outputs"
REC = load_file(HERE / "flow_official.safetensors")
REPA = ("repa.encoder=moh-dit-test-tokens", "repa.encoder_module=tests.helpers.tiny_encoder", "repa.depth=2")


@pytest.fixture(scope="module")
def repa_model(tmp_path_factory):
    """The official tiny REPA SiT with its two projectors on block 1, through moh-dit's loader."""
    from moh_dit.interop.sit import load_flow_checkpoint

    path = tmp_path_factory.mktemp("repa") / "repa.pt"
    torch.save({"ema": {k[len("repa.model.") :]: v for k, v in REC.items() if k.startswith("repa.model.")}}, path)
    model, report = load_flow_checkpoint(path, "repa", num_heads=4, repa_depth=1)
    assert model.config.repa_dims == [16, 8] and model.config.repa_projector_dim == 24 and not report["dropped"]
    return model


def test_the_tapped_block_and_its_projections_equal_repas(repa_model):
    x, t, y = REC["repa.forward.x"], REC["repa.forward.t"], REC["repa.forward.y"]
    with torch.no_grad():
        out = repa_model(x, t, y, return_aligned=True)
    torch.testing.assert_close(out.aligned[0], REC["repa.forward.z0"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.aligned[1], REC["repa.forward.z1"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.sample, REC["repa.forward.out"], rtol=1e-5, atol=1e-6)
    assert repa_model.eval()(x, t, y).aligned is None  # sampling never runs the projectors
    bare = without_alignment(repa_model)
    assert bare.projectors is None and torch.equal(bare(x, t, y).sample, out.sample)


@pytest.mark.parametrize("weighting", ["uniform", "lognormal"])
def test_the_alignment_loss_equals_repas_with_two_encoders_and_many_tokens(repa_model, weighting):
    from moh_dit.objectives.flow import Flow

    flow = Flow("linear", "repa")
    noised = flow.interpolate(
        REC["repa.loss.data"], REC[f"repa.loss.{weighting}.t"], REC[f"repa.loss.{weighting}.noise"]
    )
    with torch.no_grad():
        out = repa_model(noised.x_t, noised.time, REC["repa.forward.y"], return_aligned=True)
    targets = [REC["repa.loss.targets0"], REC["repa.loss.targets1"]]
    loss = alignment_loss(out.aligned, targets)
    torch.testing.assert_close(loss.reshape(1), REC[f"repa.loss.{weighting}.proj"], rtol=1e-5, atol=1e-6)
    # by hand: minus the mean cosine over encoders, images and tokens
    cosines = [F.cosine_similarity(a, b, dim=-1).mean() for a, b in zip(out.aligned, targets)]
    assert loss.item() == pytest.approx(-sum(cosines).item() / 2, abs=1e-6)


def test_repas_encoder_input_is_imagenet_normalisation_then_bicubic_resizing():
    from torchvision.transforms import Normalize

    images = torch.randint(0, 256, (2, 3, 32, 32), dtype=torch.uint8)
    expected = Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))(images.float() / 255)
    expected = F.interpolate(expected, 28, mode="bicubic")  # REPA: interpolate(x, 224 * (res // 256), "bicubic")
    torch.testing.assert_close(repa_input(images, 28), expected, rtol=0, atol=1e-6)
    gray = torch.randint(0, 256, (2, 1, 32, 32), dtype=torch.uint8)
    torch.testing.assert_close(repa_input(gray, 28), repa_input(gray.repeat(1, 3, 1, 1), 28))


def test_a_random_dinov2_of_the_real_shape_loads_from_disk_with_its_position_embedding_resampled(tmp_path):
    import timm
    from safetensors.torch import save_file
    from timm.layers import resample_abs_pos_embed

    torch.manual_seed(0)
    native = timm.create_model("vit_small_patch14_dinov2", pretrained=False, num_classes=0)  # 518 px, 37 x 37
    save_file({k: v.contiguous() for k, v in native.state_dict().items()}, tmp_path / "dinov2_s.safetensors")
    encoder = load_dinov2("dinov2-vit-s", tmp_path / "dinov2_s.safetensors", 98)  # 7 x 7 tokens
    expected = resample_abs_pos_embed(native.pos_embed.detach(), [7, 7], num_prefix_tokens=1)  # what REPA does
    torch.testing.assert_close(encoder.pos_embed, expected)
    images = torch.randint(0, 256, (2, 1, 28, 28), dtype=torch.uint8)
    with torch.no_grad():
        tokens = encoder.forward_features(repa_input(images, 98))[:, encoder.num_prefix_tokens :]
    assert tokens.shape == (2, 49, 384)
    with pytest.raises(ConfigError, match="not a multiple of dinov2-vit-s's patch 14"):
        load_dinov2("dinov2-vit-s", tmp_path / "dinov2_s.safetensors", 100)


def test_runs_train_with_repa_under_either_objective_and_export_without_the_projectors(tmp_path, image_dir):
    from moh_dit.sampling.pipeline import MoHDiTPipeline

    for objective in ("objective.name=ddpm", "objective.name=flow"):
        out = tmp_path / objective.split("=")[1]
        flow = ("train.snr_gamma=null",) if "flow" in objective else ()
        train_tiny(out, image_dir, objective, *flow, *REPA, "preview.per_class=0")
        records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        assert all(-1 <= r["repa_loss"] <= 1 and r["moh_loss"] > 0 for r in records)
        saved = json.loads((out / "checkpoints" / "step-00000004" / "model" / "config.json").read_text())
        assert saved["repa_depth"] == 2 and saved["repa_dims"] == [12]  # the projector trains and is checkpointed
        ema = load_file(out / "checkpoints" / "step-00000004" / "ema.safetensors")
        assert any(k.startswith("projectors.") for k in ema)  # and has its EMA
        pipe = MoHDiTPipeline.from_pretrained(out / "pipeline")
        assert pipe.transformer.projectors is None and pipe.transformer.config.repa_depth is None


def test_repa_errors_say_what_to_change(tmp_path, image_dir):
    with pytest.raises(ConfigError, match=r"gives 16 tokens \(4 x 4\).*the model 4 \(2 x 2\)"):
        train_tiny(tmp_path / "a", image_dir, *REPA, "model.overrides.patch_size=4")
    with pytest.raises(ConfigError, match="repa.depth=7 counts blocks from 1 to the model's 6"):
        train_tiny(tmp_path / "b", image_dir, *REPA[:2], "repa.depth=7")
    with pytest.raises(ConfigError, match=r"224 \* \(image_size // 256\) is 0 for 8 px images.*\(DINOv2: 56\)"):
        train_tiny(tmp_path / "c", image_dir, "repa.encoder=dinov2-vit-b", "repa.encoder_weights=x.pt", "repa.depth=2")
    with pytest.raises(ConfigError, match="one each"):
        train_tiny(tmp_path / "d", image_dir, *REPA, "repa.encoder_weights=[a.pt, b.pt]")
    with pytest.raises(ConfigError, match="not known"):
        train_tiny(tmp_path / "e", image_dir, "repa.encoder=dinov3", "repa.depth=2")
