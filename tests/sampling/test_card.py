"""Model cards of saved pipelines (contents checked offline) and their upload to the Hub (mocked)."""

import json
from pathlib import Path

import numpy as np
import pytest

import evaluate_fid
from moh_dit.sampling.card import push_folder
from moh_dit.sampling.pipeline import MoHDiTPipeline

from ..helpers.factories import make_image_folder, train_tiny
from ..helpers.tiny_extractor import TINY


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("card")
    make_image_folder(root / "images")
    train_tiny(root / "run", root / "images", "preview.per_class=0")
    return root / "run"


def test_an_exported_pipeline_has_a_card_that_describes_it(run):
    card = (run / "pipeline" / "README.md").read_text()
    pipe = MoHDiTPipeline.from_pretrained(run / "pipeline")
    params = sum(p.numel() for p in pipe.transformer.parameters())
    active, total = pipe.transformer.head_counts()
    front, body = card.split("---\n", 2)[1:]
    assert "license: apache-2.0" in front and "library_name: diffusers" in front and "moh-dit" in front
    assert (
        "# MoH-DiT-Ti/4-75 (moh-dit)" in body
        and "class-conditional Diffusion Transformer with Mixture-of-Head" in body
    )
    assert f"| parameters | {params:,} |" in body
    assert f"| heads active per token | {active} of {total} ({100 * active / total:.0f}%) |" in body
    assert "| classes | 2: bright, dark |" in body and "| input | 3 x 8 x 8 pixels |" in body
    assert "| data | folder, 16 images (fingerprint" in body and "| steps | 4 of global batch 4 |" in body
    assert "AdamW, lr 0.001" in body and "decay 0.9; these are the EMA weights" in body
    assert "| 0-3 | 6 | 2 | top-2 of 4 routed |" in body and "| 4 | 6 | 3 | top-2 of 3 routed |" in body
    assert "| 5 | 6 | 6 | no routed heads |" in body
    manifest = json.loads((run / "pipeline" / "manifest.json").read_text())
    assert manifest["transformer_sha256"] in body and "Not evaluated yet" in body
    assert "pipe(['bright', 'dark'], guidance_scale=4.0" in body and "arXiv:2410.11842" in body
    assert (
        f"shown with (the default of `moh-dit sample` and the demo): guidance 4 at every step, {manifest['sampling']['scheduler']}"
        in body
    )


def test_the_card_shows_the_recorded_guidance_interval_and_grid_averaging(run):
    from moh_dit.sampling.card import render_card

    pipe = MoHDiTPipeline.from_pretrained(run / "pipeline")
    manifest = json.loads((run / "pipeline" / "manifest.json").read_text())
    manifest["sampling"] = dict(manifest["sampling"], guidance_interval=[100, 500], grid_averaging=100)
    body = render_card(pipe, manifest, [])
    assert "guidance_scale=4.0, guidance_interval=(100, 500), grid_averaging=100, num_inference_steps=250)" in body
    assert "guidance 4 at timesteps 100-500, patch grids averaged at timesteps 0-100, " in body


def test_evaluating_the_pipeline_adds_its_metrics_to_the_card(run, tmp_path):
    from ..evaluation.test_evaluation import random_images

    np.savez(tmp_path / "ref.npz", arr_0=random_images(12, size=8))
    result = evaluate_fid.main(
        [
            "--model",
            str(run / "pipeline"),
            "--reference",
            str(tmp_path / "ref.npz"),
            "--extractor",
            TINY,
            "--num-samples",
            "8",
            "--num-steps",
            "2",
            "--sample-dir",
            str(tmp_path / "s"),
            "--sample-batch-size",
            "4",
            "--grid-averaging",
            "1",
        ]
    )
    entries = json.loads((run / "pipeline" / "evaluations.json").read_text())
    assert entries[-1]["metrics"]["fid"] == result["metrics"]["fid"] and entries[-1]["num_samples"] == 8
    card = (run / "pipeline" / "README.md").read_text()
    assert f"| 8 | {result['metrics']['fid']:.2f} |" in card
    assert "DDPMScheduler 2 steps, guidance 1.5 at every step, patch grids averaged at timesteps 0-1" in card
    # another dtype is another model: its numbers do not go into this card
    evaluate_fid.main(
        [
            "--model",
            str(run / "pipeline"),
            "--reference",
            str(tmp_path / "ref.npz"),
            "--extractor",
            TINY,
            "--num-samples",
            "8",
            "--num-steps",
            "2",
            "--sample-dir",
            str(tmp_path / "b"),
            "--dtype",
            "bf16",
            "--sample-batch-size",
            "4",
        ]
    )
    assert len(json.loads((run / "pipeline" / "evaluations.json").read_text())) == len(entries)


def test_push_uploads_the_folder_as_saved(run, tmp_path, monkeypatch):
    import huggingface_hub

    calls = []
    monkeypatch.setattr(huggingface_hub, "create_repo", lambda repo_id, **kw: calls.append(("create", repo_id, kw)))
    monkeypatch.setattr(huggingface_hub, "upload_folder", lambda **kw: calls.append(("upload", kw)))
    push_folder(run / "pipeline", "someone/moh-dit-tiny", private=True)
    (create, upload) = calls
    assert create[1] == "someone/moh-dit-tiny" and create[2]["private"] is True
    uploaded = Path(upload[1]["folder_path"])
    assert {"README.md", "manifest.json", "model_index.json"} <= {p.name for p in uploaded.iterdir()}
    calls.clear()
    from moh_dit.cli import convert

    convert.main([str(run), str(tmp_path / "converted"), "--push-to-hub", "someone/other"])
    assert calls[1][1]["folder_path"] == str(tmp_path / "converted")
    assert "Converted from" in (tmp_path / "converted" / "README.md").read_text()
    calls.clear()
    images = run.parent / "images"
    train_tiny(tmp_path / "pushed", images, "preview.per_class=0", "train.max_steps=2", "train.push_to_hub=a/b")
    assert calls[0][1] == "a/b" and calls[1][1]["folder_path"] == str(tmp_path / "pushed" / "pipeline")
