"""The documented commands that use a module of the repository (``experiments.*``) run as documented: each in a new
process, from the repository root, through the installed ``moh-dit`` command, ``python -m moh_dit`` or a top-level
script, in a short form (a few steps, a few samples). The console script once could not import them: it puts its own
folder on the import path, not the working folder (``moh_dit.user_modules``).

Every command here is one the README or docs/ shows (``tests/cli/test_documented_commands.py`` parses them all);
what makes it short is appended to it."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from moh_dit.data.fashion_mnist import find_fashion_mnist

ROOT = Path(__file__).resolve().parents[2]
MOH_DIT = str(Path(sys.executable).with_name("moh-dit"))  # the installed console script
pytestmark = pytest.mark.skipif(find_fashion_mnist() is None, reason="Fashion-MNIST IDX files not installed")

# the embedded default's model at a tiny width, two steps on two images per class
TINY = ["model.overrides.hidden_size=32", "model.overrides.head_dim=8", "data.subset_per_class=2"]
TINY += ["train.max_steps=2", "train.checkpoint_every=2", "preview.per_class=1", "log.log_every=1"]


def run(*command, env: dict | None = None) -> str:
    """Run ``command`` from the repository root in a new process with nothing on PYTHONPATH (as a user's shell)."""
    clean = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(
        [str(c) for c in command],
        cwd=ROOT,
        env=dict(clean, OMP_NUM_THREADS="1", **(env or {})),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, f"{' '.join(map(str, command))}\n{done.stdout}\n{done.stderr}"
    return done.stdout + done.stderr


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """One cache of named references (fashion-mnist-test is made once) for every command of this module."""
    return {"MOH_DIT_CACHE": str(tmp_path_factory.mktemp("cache"))}


@pytest.fixture(scope="module")
def default_run(tmp_path_factory, cache):
    """docs/training.md: `moh-dit train --config configs/fashion_mnist_moh.yaml log.eval_every=1000` (the config
    names experiments.fmnist_classifier as its features), with post-hoc EMA snapshots for `moh-dit ema`."""
    out = tmp_path_factory.mktemp("runs") / "default"
    posthoc = ["ema.posthoc_every=16", "log.eval_samples=10"]
    logged = run(
        MOH_DIT, "train", "--config", "configs/fashion_mnist_moh.yaml", "log.eval_every=2", *TINY, *posthoc,
        f"train.output_dir={out}", env=cache,
    )  # fmt: skip
    [record] = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if '"evaluation"' in x]
    assert record["extractor"] == "fmnist-classifier" and np.isfinite(record["kid"]), logged
    return out


def test_training_with_evaluation_names_the_classifier_of_the_experiments(default_run):
    assert (default_run / "samples" / "final.png").is_file() and (default_run / "pipeline").is_dir()


def test_training_with_the_repa_encoder_of_the_experiments(tmp_path):
    """docs/training.md: `python train.py --config configs/fashion_mnist_moh.yaml repa.encoder=fmnist-ae-tokens
    repa.encoder_module=experiments.fmnist_encoder repa.encoder_weights=experiments/weights/fmnist_ae.safetensors
    repa.depth=2`, here through `python -m moh_dit train`."""
    repa = ["repa.encoder=fmnist-ae-tokens", "repa.encoder_module=experiments.fmnist_encoder"]
    repa += ["repa.encoder_weights=experiments/weights/fmnist_ae.safetensors", "repa.depth=2"]
    out = tmp_path / "repa"
    run(sys.executable, "-m", "moh_dit", "train", "--config", "configs/fashion_mnist_moh.yaml", *repa, *TINY,
        f"train.output_dir={out}")  # fmt: skip
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert any("repa_loss" in r for r in records)


def test_a_module_that_does_not_import_names_the_key_the_user_set(tmp_path):
    from moh_dit.errors import ConfigError
    from moh_dit.training.config import load_config
    from moh_dit.training.trainer import Trainer

    config = load_config(
        ROOT / "configs" / "fashion_mnist_moh.yaml",
        ["repa.encoder=x", "repa.encoder_module=experiments.no_such_module", "repa.depth=2", *TINY,
         f"train.output_dir={tmp_path / 'run'}"],
    )  # fmt: skip
    with pytest.raises(ConfigError, match="^repa.encoder_module experiments.no_such_module: cannot import it"):
        Trainer(config)


def test_the_post_hoc_ema_sweep_with_the_classifier_of_the_experiments(default_run, tmp_path, cache):
    """docs/results.md: `moh-dit ema runs/fashion_mnist_moh --sweep 0.05 0.10 0.16 --sweep-cfg 1 4 --reference
    fashion-mnist-test --num-samples 1000 --extractor fmnist-classifier --extractor-module
    experiments.fmnist_classifier --out sweep`."""
    out = tmp_path / "sweep"
    run(MOH_DIT, "ema", default_run, "--sweep", "0.05", "0.10", "--sweep-cfg", "1", "--reference",
        "fashion-mnist-test", "--num-samples", "8", "--num-steps", "2", "--extractor", "fmnist-classifier",
        "--extractor-module", "experiments.fmnist_classifier", "--out", out, env=cache)  # fmt: skip
    assert len(json.loads((out / "posthoc_sweep.json").read_text())["rows"]) == 3  # two widths and the fixed EMA


def test_evaluation_and_reference_with_the_classifier_of_the_experiments(default_run, tmp_path, cache):
    """experiments/fmnist_classifier.py: `python evaluate_fid.py --samples s.npz --reference ref.npz --extractor
    fmnist-classifier --extractor-module experiments.fmnist_classifier`; `moh-dit reference` and `moh-dit evaluate
    --model` with the same option."""
    from PIL import Image

    from moh_dit.data.fashion_mnist import FashionMNIST

    classifier = ["--extractor", "fmnist-classifier", "--extractor-module", "experiments.fmnist_classifier"]
    (tmp_path / "real").mkdir()
    for i, image in enumerate(FashionMNIST(None, split="test").images[:20]):  # real images as a user has them
        Image.fromarray(np.asarray(image)).save(tmp_path / "real" / f"{i}.png")
    reference = tmp_path / "ref.npz"
    run(MOH_DIT, "reference", tmp_path / "real", "--image-size", "28", "--out", reference, *classifier)
    samples = tmp_path / "samples"
    run(MOH_DIT, "evaluate", "--model", default_run, "--reference", reference, "--num-samples", "8",
        "--num-steps", "2", "--sample-dir", samples, *classifier)  # fmt: skip
    run(sys.executable, "evaluate_fid.py", "--samples", f"{samples}.npz", "--reference", reference, *classifier)
    assert (
        json.loads(Path(f"{samples}.metrics-fmnist-classifier.json").read_text())["extractor"] == "fmnist-classifier"
    )


def test_the_classifier_training_script_runs_as_a_file(tmp_path):
    """docs/results.md: `python experiments/train_classifier.py` (here on 256 images for one epoch)."""
    out = tmp_path / "clf.safetensors"
    shown = run(sys.executable, "experiments/train_classifier.py", "--epochs", "1", "--limit", "256", "--out", out)
    assert out.is_file() and "test_accuracy" in shown
