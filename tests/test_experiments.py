"""The quality experiment end to end on a tiny setting, and the Fashion-MNIST classifier it relies on."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from experiments.fmnist_classifier import DEFAULT_WEIGHTS, accuracy, load_classifier, register, train_classifier
from moh_dit.data import find_fashion_mnist

needs_data = pytest.mark.skipif(find_fashion_mnist() is None, reason="Fashion-MNIST IDX files not installed")


@needs_data
def test_shipped_classifier_reaches_its_recorded_test_accuracy():
    from moh_dit.data import FashionMNIST

    info = json.loads(DEFAULT_WEIGHTS.with_suffix(".json").read_text())
    assert info["test_accuracy"] >= 0.90
    test = FashionMNIST(split="test")
    acc = accuracy(load_classifier(), test.images, test.labels)
    assert acc == pytest.approx(info["test_accuracy"], abs=1e-4)


def test_classifier_is_registered_and_gives_features():
    from moh_dit.evaluation import resolve_extractor

    ext = resolve_extractor(register(), None, "cpu")
    images = torch.randint(0, 256, (5, 3, 28, 28), dtype=torch.uint8)
    feats = ext(images)
    assert feats["pool"].shape == (5, 128) and feats["logits"].shape == (5, 10)


def test_missing_classifier_weights_explain_how_to_make_them(tmp_path):
    with pytest.raises(FileNotFoundError, match="train_classifier.py"):
        load_classifier(tmp_path / "none.safetensors")


@needs_data
def test_quality_experiment_runs_end_to_end_on_a_tiny_setting(tmp_path):
    from experiments.quality import run_experiment

    result = run_experiment("tiny", tmp_path, models=("DiT-Ti/4", "MoH-DiT-Ti/4-50"), seeds=(0, 1))
    assert len(result["records"]) == 4
    rec = result["records"][0]
    for key in (
        "clf_fid@cfg1",
        "clf_fid@cfg1.5",
        "clf_precision@cfg1.5",
        "clf_recall@cfg1.5",
        "final_diffusion_loss",
        "train_images_per_s",
        "sampling_images_per_s@cfg1.5",
    ):
        assert np.isfinite(rec[key]), key
    assert set(result["summary"]["MoH-DiT-Ti/4-50"]["clf_fid@cfg1.5"]) == {"mean", "std", "values"}
    usage = np.array(result["head_usage"]["MoH-DiT-Ti/4-50"])
    assert usage.shape == (6, 6, 6) and np.allclose(usage[:, :2], 1.0)  # shared heads always on
    assert "DiT-Ti/4" not in result["head_usage"]
    text = (tmp_path / "RESULTS.md").read_text()
    assert "| MoH-DiT-Ti/4-50 |" in text and "Conclusion" in text
    assert (tmp_path / "loss_curves.png").exists() and (tmp_path / "head_usage_MoH-DiT-Ti_4-50.png").exists()
    again = run_experiment("tiny", tmp_path, models=("DiT-Ti/4",), seeds=(0,))  # finished runs are reused
    assert again["records"][0]["clf_fid@cfg1"] == pytest.approx(rec["clf_fid@cfg1"])


@pytest.mark.slow
@needs_data
def test_classifier_training_script_reaches_stated_accuracy(tmp_path):
    info = train_classifier(tmp_path / "clf.safetensors", seed=0, epochs=5)
    assert info["test_accuracy"] >= 0.90
    assert Path(tmp_path / "clf.json").exists()
