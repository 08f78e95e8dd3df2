"""The layout of a training run folder and the read side of its checkpoints.

Training writes run folders (``moh_dit.training``); sampling, evaluation and conversion read them. The
layout lives here, below both, so that reading a run's newest weights does not import the trainer.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from moh_dit.errors import ArtifactError
from moh_dit.files import read_safetensors, read_torch_file
from moh_dit.manifests import MANIFEST_NAME, read_manifest

CHECKPOINT_PREFIX = "step-"


# ----------------------------------------------------------------------------------------------------
# Run folders and checkpoints
# ----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RunLayout:
    """Paths inside a training run folder."""

    root: Path

    def __post_init__(self) -> None:
        object.__setattr__(self, "root", Path(self.root))

    @property
    def manifest(self) -> Path:
        return self.root / MANIFEST_NAME

    @property
    def config(self) -> Path:
        return self.root / "config.yaml"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def pipeline(self) -> Path:
        return self.root / "pipeline"

    @property
    def best(self) -> Path:
        """The pipeline of the best evaluation so far (``log.eval_keep_best``)."""
        return self.root / "best"

    @property
    def samples(self) -> Path:
        return self.root / "samples"

    @property
    def evaluations(self) -> Path:
        """The evaluations during training: ``step-N.metrics.json`` (and their samples while they are made)."""
        return self.root / "eval"

    @property
    def posthoc(self) -> Path:
        """The post-hoc EMA snapshots: ``step-N.safetensors`` (every tracked EMA at step N)."""
        return self.root / "posthoc-ema"

    def list_snapshots(self) -> list[tuple[int, Path]]:
        """Post-hoc EMA snapshots as ``(step, file)``, oldest first."""
        if not self.posthoc.is_dir():
            return []
        found = [
            (checkpoint_step(p.name.removesuffix(".safetensors")), p) for p in self.posthoc.glob("step-*.safetensors")
        ]
        return sorted((step, p) for step, p in found if step is not None)

    @property
    def tracker_state(self) -> Path:
        return self.root / "trackers.json"

    def checkpoint(self, step: int) -> Path:
        return self.checkpoints / f"{CHECKPOINT_PREFIX}{step:08d}"

    def checkpoint_tmp(self, step: int) -> Path:
        return self.checkpoints / f".tmp-{CHECKPOINT_PREFIX}{step:08d}"

    def list_checkpoints(self) -> list[tuple[int, Path]]:
        """Complete checkpoints as ``(step, folder)``, oldest first (by step number, not by name)."""
        if not self.checkpoints.is_dir():
            return []
        found = []
        for p in self.checkpoints.iterdir():
            step = checkpoint_step(p)
            if step is not None and p.is_dir() and (p / "trainer_state.json").is_file():
                found.append((step, p))
        return sorted(found)

    def latest_checkpoint(self) -> Path | None:
        found = self.list_checkpoints()
        return found[-1][1] if found else None

    def existing_contents(self) -> list[Path]:
        """What an earlier run left here (the things a new run would mix with or overwrite)."""
        names = [
            self.manifest,
            self.config,
            self.metrics,
            self.checkpoints,
            self.pipeline,
            self.samples,
            self.evaluations,
            self.posthoc,
            self.root / "model_config.json",
            self.tracker_state,
        ]
        return (
            [p for p in names if p.exists()] + sorted(self.root.glob("tensorboard*")) + sorted(self.root.glob("wandb"))
        )

    def describe_existing(self) -> str | None:
        """One phrase about an earlier run in this folder, or ``None`` when there is none."""
        latest = self.latest_checkpoint()
        if latest is not None:
            return f"a run with checkpoints up to step {checkpoint_step(latest)}"
        if self.metrics.is_file() and self.metrics.stat().st_size:
            lines = [ln for ln in self.metrics.read_text().splitlines() if ln.strip()]
            last = json.loads(lines[-1]).get("step") if lines else None
            return f"a run that logged up to step {last} (no complete checkpoint)"
        if self.manifest.is_file() or self.pipeline.exists():
            return "an earlier run"
        return None

    def clear(self) -> list[Path]:
        """Remove what moh-dit wrote here (unknown files are left alone); returns what was removed."""
        removed = self.existing_contents()
        for p in removed:
            shutil.rmtree(p) if p.is_dir() else p.unlink()
        return removed


def checkpoint_step(path: str | os.PathLike) -> int | None:
    """The step of a checkpoint folder named ``step-N``, else ``None``."""
    name = Path(path).name
    if not name.startswith(CHECKPOINT_PREFIX):
        return None
    digits = name[len(CHECKPOINT_PREFIX) :]
    return int(digits) if digits.isdigit() else None


def find_checkpoint(output_dir: str | os.PathLike, which: str = "latest") -> Path | None:
    """``latest`` -> the newest complete checkpoint of the run in ``output_dir`` (or ``None``); a path ->
    that checkpoint, which must be complete."""
    if which != "latest":
        path = Path(which)
        if not (path / "trainer_state.json").is_file():
            raise ArtifactError(f"{path} is not a complete checkpoint (no trainer_state.json)")
        return path
    return RunLayout(Path(output_dir)).latest_checkpoint()


# ----------------------------------------------------------------------------------------------------
# Checkpoint files
# ----------------------------------------------------------------------------------------------------
@dataclass
class CheckpointContents:
    """Everything one process reads back from a checkpoint."""

    path: Path
    model_state: dict[str, torch.Tensor]
    ema_state: dict[str, torch.Tensor]
    optimizer_state: Any
    scaler_state: Any
    rank_tensors: dict[str, torch.Tensor]
    rank_python: dict[str, Any]
    trainer_state: dict[str, Any]
    manifest: dict[str, Any] | None


def read_trainer_state(path: Path) -> dict[str, Any]:
    """A checkpoint's ``trainer_state.json`` (step, data position, process layout, VAE, class names)."""
    try:
        return json.loads((Path(path) / "trainer_state.json").read_text())
    except (OSError, ValueError) as err:
        raise ArtifactError(f"{path}/trainer_state.json is unreadable ({err})") from None


def read_checkpoint(path: Path, rank: int) -> CheckpointContents:
    """Read a checkpoint written by the trainer, on the CPU (``load_state_dict`` and ``copy_`` put each tensor
    where its parameter lives); damaged or missing files stop with one line."""
    path = Path(path)
    trainer_state = read_trainer_state(path)
    model_state = read_safetensors(path / "model" / "diffusion_pytorch_model.safetensors")
    ema_state = read_safetensors(path / "ema.safetensors")
    optimizer_state = read_torch_file(path / "optimizer.pt")
    scaler_state = read_torch_file(path / "scaler.pt") if (path / "scaler.pt").is_file() else None
    rank_file = path / f"rng-rank{rank}.safetensors"
    rank_tensors = read_safetensors(rank_file) if rank_file.is_file() else {}
    rank_json = path / f"rng-rank{rank}.json"
    rank_python = json.loads(rank_json.read_text()) if rank_json.is_file() else {}
    return CheckpointContents(
        path,
        model_state,
        ema_state,
        optimizer_state,
        scaler_state,
        rank_tensors,
        rank_python,
        trainer_state,
        read_manifest(path, "checkpoint"),
    )
