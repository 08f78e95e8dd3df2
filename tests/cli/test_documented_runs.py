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


def test_one_flag_draws_the_quality_curve_of_the_embedded_default(default_run, cache):
    """configs/fashion_mnist_moh.yaml names its reference (the Fashion-MNIST test split, by name) and features (the
    project's classifier): log.eval_every is the only flag a curve needs. The named reference is the experiments'
    own reference images, made once into the cache and reused."""
    from experiments.common import fashion_reference
    from moh_dit.evaluation.reference import resolve_reference

    assert (default_run / "samples" / "final.png").is_file() and (default_run / "pipeline").is_dir()
    [record] = [json.loads(x) for x in (default_run / "metrics.jsonl").read_text().splitlines() if '"evaluation"' in x]
    named = Path(cache["MOH_DIT_CACHE"]) / "references" / "fashion-mnist-test.npz"
    assert record["step"] == 2 and record["reference"] == str(named)
    with np.load(named) as ours, np.load(fashion_reference(default_run.parent / "experiments")) as theirs:
        assert np.array_equal(ours["arr_0"], theirs["arr_0"])
    stamp = named.stat().st_mtime_ns
    os.environ["MOH_DIT_CACHE"], before = cache["MOH_DIT_CACHE"], os.environ.get("MOH_DIT_CACHE")
    try:
        assert resolve_reference("fashion-mnist-test") == named and named.stat().st_mtime_ns == stamp  # reused
    finally:
        os.environ.pop("MOH_DIT_CACHE") if before is None else os.environ.update(MOH_DIT_CACHE=before)
    assert resolve_reference("refs/in256.npz") == Path("refs/in256.npz")


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


def test_a_module_that_does_not_import_names_the_key_the_user_set():
    from moh_dit.errors import ConfigError
    from moh_dit.training.repa import Alignment

    with pytest.raises(ConfigError, match="^repa.encoder_module experiments.no_such_module: cannot import it"):
        Alignment(["x"], [], "experiments.no_such_module", 0, 49, 28, "cpu")


@pytest.mark.slow  # the sweep itself: tests/test_posthoc_ema.py; the command parses: test_documented_commands.py
def test_the_post_hoc_ema_sweep_with_the_classifier_of_the_experiments(default_run, tmp_path, cache):
    """docs/results.md: `moh-dit ema runs/fashion_mnist_moh --sweep 0.05 0.10 0.16 --sweep-cfg 1 4 --reference
    fashion-mnist-test --num-samples 1000 --extractor fmnist-classifier --extractor-module
    experiments.fmnist_classifier --out sweep`."""
    out = tmp_path / "sweep"
    run(MOH_DIT, "ema", default_run, "--sweep", "0.05", "0.10", "--sweep-cfg", "1", "--reference",
        "fashion-mnist-test", "--num-samples", "8", "--num-steps", "2", "--extractor", "fmnist-classifier",
        "--extractor-module", "experiments.fmnist_classifier", "--out", out, env=cache)  # fmt: skip
    assert len(json.loads((out / "posthoc_sweep.json").read_text())["rows"]) == 3  # two widths and the fixed EMA


def test_reference_and_evaluation_with_the_classifier_of_the_experiments(tmp_path):
    """experiments/fmnist_classifier.py: `python evaluate_fid.py --samples s.npz --reference ref.npz --extractor
    fmnist-classifier --extractor-module experiments.fmnist_classifier`, and `moh-dit reference` with the same
    option (`moh-dit evaluate --model` samples as `moh-dit ema --sweep` above does)."""
    from PIL import Image

    from moh_dit.data.fashion_mnist import FashionMNIST

    classifier = ["--extractor", "fmnist-classifier", "--extractor-module", "experiments.fmnist_classifier"]
    images = np.asarray(FashionMNIST(None, split="test").images[:40])
    (tmp_path / "real").mkdir()
    for i, image in enumerate(images[:20]):  # real images as a user has them
        Image.fromarray(image).save(tmp_path / "real" / f"{i}.png")
    reference = tmp_path / "ref.npz"
    run(MOH_DIT, "reference", tmp_path / "real", "--image-size", "28", "--out", reference, *classifier)
    samples = tmp_path / "samples.npz"
    np.savez(samples, arr_0=np.repeat(images[20:, :, :, None], 3, axis=3))  # other images, as ADM's .npz
    run(sys.executable, "evaluate_fid.py", "--samples", samples, "--reference", reference, *classifier)
    assert json.loads((tmp_path / "samples.metrics-fmnist-classifier.json").read_text())["extractor"] == (
        "fmnist-classifier"
    )


@pytest.mark.slow  # trains the classifier for a few steps in a fresh process; its --help: test_documented_commands.py
def test_the_classifier_training_script_runs_as_a_module():
    """docs/results.md: `python -m experiments.train_classifier` starts from the repository root, as every study does
    (it trains for 12.7 minutes: the slow set runs it whole, tests/test_experiments.py)."""
    assert "usage: train_classifier.py" in run(sys.executable, "-m", "experiments.train_classifier", "--help")
