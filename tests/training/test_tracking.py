"""What a run reports: TensorBoard scalars, hyperparameters and preview images; a wandb run (offline) that a
resume continues; progress a log file can hold; the loss window."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moh_dit.errors import ConfigError
from moh_dit.training.config import load_config
from moh_dit.training.tracking import LossWindow, flat_config
from moh_dit.training.trainer import Trainer

from ..helpers.factories import tiny_train_config, tiny_train_overrides, train_tiny

ROOT = Path(__file__).resolve().parents[2]


def _events(folder: Path) -> dict:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder), size_guidance={"scalars": 0, "images": 0})  # not the hparams sub-folders
    acc.Reload()
    return acc


def test_tensorboard_gets_losses_config_and_preview_images_and_a_resume_continues(tmp_path, image_dir):
    out = tmp_path / "run"
    common = ("log.trackers=[tensorboard]", "preview.every=2", "preview.per_class=1", "train.checkpoint_every=2")
    train_tiny(out, image_dir, "train.max_steps=4", *common)
    train_tiny(out, image_dir, "train.max_steps=6", "train.resume=latest", *common)
    acc = _events(out / "tensorboard" / "moh-dit")
    logged = [(e.step, e.value) for e in acc.Scalars("train/diffusion_loss")]
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [s for s, _ in logged] == [m["step"] for m in metrics] == list(range(1, 7))
    assert [v for _, v in logged] == pytest.approx([m["diffusion_loss"] for m in metrics])
    assert [e.step for e in acc.Images("samples")] == [2, 4, 6]
    hparams = next((out / "tensorboard").rglob("hparams.yml")).read_text()
    assert "optim.lr: 0.001" in hparams and "model.preset: MoH-DiT-Ti/4-75" in hparams


def test_wandb_offline_run_is_continued_after_a_resume(tmp_path, image_dir, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = tmp_path / "run"
    common = ("log.trackers=[wandb]", "log.project=moh-dit-test", "train.checkpoint_every=2", "preview.per_class=0")
    train_tiny(out, image_dir, "train.max_steps=2", *common)
    run_id = json.loads((out / "trackers.json").read_text())["wandb"]["id"]
    train_tiny(out, image_dir, "train.max_steps=4", "train.resume=latest", *common)
    assert json.loads((out / "trackers.json").read_text())["wandb"]["id"] == run_id
    runs = sorted((out / "wandb").glob("offline-run-*"))
    # wandb names a folder offline-run-<second>-<id>; a second start within the same second gets a "-1" suffix
    pattern = re.compile(rf"offline-run-\d{{8}}_\d{{6}}-{re.escape(run_id)}(-\d+)?")
    assert len(runs) == 2 and all(pattern.fullmatch(r.name) for r in runs), [r.name for r in runs]


def test_trackers_are_checked_before_training(tmp_path, image_dir):
    with pytest.raises(ConfigError, match="unknown tracker"):
        load_config(tiny_train_config(tmp_path / "a", image_dir), ["log.trackers=[tensorbored]"])
    with pytest.raises(ConfigError, match="log.tensorboard was replaced by log.trackers"):
        load_config(tiny_train_config(tmp_path / "a", image_dir), ["log.tensorboard=false"])
    with pytest.raises(ConfigError, match="aim not installed; pip install aim"):
        Trainer(load_config(tiny_train_config(tmp_path / "b", image_dir), ["log.trackers=[aim]"]))


def test_progress_in_a_log_file_is_plain_lines(tmp_path, image_dir):
    """Not a terminal: no carriage-return redraws of a progress bar, which flood a scheduler's log."""
    cmd = [
        sys.executable,
        str(ROOT / "train.py"),
        *tiny_train_overrides(
            tmp_path / "run", image_dir, "train.max_steps=30", "log.log_every=10", "preview.per_class=0"
        ),
    ]
    result = subprocess.run(
        cmd, capture_output=True, text=True, timeout=300, env={"PYTHONPATH": str(ROOT), "PATH": ""}
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "\r" not in result.stderr and "\r" not in result.stdout
    progress = [ln for ln in result.stderr.splitlines() if ln.startswith("train: ")]
    assert progress and progress[-1].startswith("train: 30/30 step (100%)") and len(progress) <= 5


def test_loss_window_means_and_state():
    window = LossWindow(torch.device("cpu"), 8)
    for d, m in ((1.0, 2.0), (3.0, 4.0)):
        window.add(torch.tensor(d), torch.tensor(m))
    window.steps = 2

    class One:
        num_processes = 1

    record = window.record(One(), step=2, lr=0.1, samples_seen=16, close=False)
    assert (record["diffusion_loss"], record["moh_loss"], record["samples_seen"]) == (2.0, 3.0, 16)
    restored = LossWindow(torch.device("cpu"), 8)
    restored.load(window.state())
    assert torch.equal(restored.sums, window.sums)
    window.record(One(), step=2, lr=0.1, samples_seen=16, close=True)
    assert window.sums.sum() == 0


def test_flat_config():
    assert flat_config({"a": {"b": 1, "c": [1, 2]}, "d": None}) == {"a.b": 1, "a.c": "[1, 2]", "d": "null"}
