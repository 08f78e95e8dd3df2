"""Which weights a path means, and reading them without building a pipeline.

A user's path is a training run folder (its newest weights: the exported pipeline, or a newer checkpoint), a checkpoint
folder (its EMA weights), a pipeline folder or a bare transformer folder (:func:`resolve_model_source`). This module
reads their transformer, the objective and autoencoder they record, and checks the recorded fingerprints;
:mod:`moh_dit.sampling.loading` builds pipelines on it, and autoguidance's guides (:mod:`moh_dit.sampling.guides`)
load through it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from moh_dit.errors import ArtifactError, ConfigError, blame_the_file
from moh_dit.files import read_safetensors
from moh_dit.manifests import fingerprint_module, read_manifest, weight_health
from moh_dit.model.network import MoHDiT
from moh_dit.objectives import objective_name
from moh_dit.run_folder import RunLayout, checkpoint_step
from moh_dit.vae import latent_space

__all__ = [
    "ModelSource",
    "resolve_model_source",
    "load_transformer",
    "checkpoint_model",
    "check_health",
    "check_recorded_weights",
    "recorded_objective",
    "source_vae_record",
    "pipeline_manifest",
    "LOAD_ERRORS",
    "damaged",
]


def pipeline_manifest(folder: str | os.PathLike) -> dict | None:
    """A pipeline folder's manifest (``None`` without one)."""
    return read_manifest(folder, "pipeline")


# ----------------------------------------------------------------------------------------------------
# Which weights a path means
# ----------------------------------------------------------------------------------------------------
@dataclass
class ModelSource:
    """Where weights come from: ``kind`` is ``pipeline``, ``checkpoint`` or ``transformer``; ``step`` is
    the training step when known; ``run`` the run folder it belongs to."""

    kind: str
    path: Path
    step: int | None = None
    run: Path | None = None
    note: str = ""

    def describe(self) -> str:
        step = f" (step {self.step})" if self.step is not None else ""
        what = {
            "pipeline": "exported pipeline",
            "checkpoint": "EMA weights of checkpoint",
            "transformer": "transformer folder",
        }[self.kind]
        return f"{what} {self.path}{step}{self.note}"


def _pipeline_step(folder: Path) -> int | None:
    manifest = pipeline_manifest(folder)
    return (manifest or {}).get("source", {}).get("step")


def resolve_model_source(path: str | os.PathLike) -> ModelSource:
    """What a user's path means. For a run folder: the newest weights, i.e. the latest checkpoint when it is
    newer than the exported pipeline (a run trained on after its export), else the pipeline."""
    path = Path(path)
    if not path.exists():
        raise ArtifactError(f"{path} does not exist (expected a run, checkpoint, pipeline or transformer folder)")
    if (path / "model_index.json").is_file():
        return ModelSource("pipeline", path, _pipeline_step(path))
    if (path / "trainer_state.json").is_file():
        return ModelSource("checkpoint", path, checkpoint_step(path), path.parent.parent)
    layout = RunLayout(path)
    pipe = layout.pipeline if (layout.pipeline / "model_index.json").is_file() else None
    latest = layout.latest_checkpoint()
    if pipe is not None or latest is not None:
        pipe_step = _pipeline_step(pipe) if pipe is not None else None
        ckpt_step = checkpoint_step(latest) if latest is not None else None
        if latest is not None and (pipe is None or pipe_step is None or ckpt_step > pipe_step):
            note = (
                f"; newer than the exported pipeline (step {pipe_step})"
                if pipe is not None and pipe_step is not None
                else ""
            )
            return ModelSource("checkpoint", latest, ckpt_step, path, note)
        return ModelSource("pipeline", pipe, pipe_step, path)
    if layout.checkpoints.is_dir():
        raise ArtifactError(f"{path} is a run folder without any complete checkpoint or exported pipeline")
    if (path / "config.json").is_file():
        cfg = json.loads((path / "config.json").read_text())
        if cfg.get("_class_name") != "MoHDiT":
            raise ArtifactError(f"{path}/config.json describes a {cfg.get('_class_name')!r}, not a MoHDiT")
        return ModelSource("transformer", path)
    raise ArtifactError(
        f"{path} holds no model_index.json, pipeline/, checkpoints/, trainer_state.json or config.json: "
        f"not a moh-dit run, checkpoint, pipeline or transformer folder"
    )


# what diffusers' from_pretrained raises for a damaged or mismatched folder (it wraps safetensors' own errors
# in OSError/ValueError; a weight of the wrong shape is torch's RuntimeError)
LOAD_ERRORS = (OSError, ValueError, RuntimeError)


def damaged(path: Path, err: BaseException) -> ArtifactError:
    return ArtifactError(
        f"{path} cannot be loaded: {str(err).strip().splitlines()[0]} (damaged files, or "
        f"weights that are not safetensors?)"
    )


def check_health(model: torch.nn.Module, where: str) -> None:
    sane, peak = weight_health(model.state_dict().values())
    if not sane:
        raise ArtifactError(
            f"the weights in {where} are not finite or have exploded (max |w| = {peak:.3g}); was the "
            f"run stopped for a non-finite loss? Use an earlier checkpoint"
        )


def checkpoint_model(ckpt: Path, prefer_ema: bool = True) -> tuple[MoHDiT, dict]:
    """A training checkpoint's model (with its EMA weights by default) and its trainer state."""
    with blame_the_file(partial(damaged, ckpt / "model"), LOAD_ERRORS):
        model = MoHDiT.from_pretrained(ckpt / "model", use_safetensors=True)
    if prefer_ema:
        ema = read_safetensors(ckpt / "ema.safetensors", "cpu")
        missing = [n for n, _ in model.named_parameters() if n not in ema]
        if missing:
            raise ArtifactError(f"{ckpt / 'ema.safetensors'} does not match the model: missing {missing[:5]}")
        with torch.no_grad():
            for name, param in model.named_parameters():
                param.copy_(ema[name])
    return model, json.loads((ckpt / "trainer_state.json").read_text())


def _config_file(source: ModelSource) -> Path:
    """The transformer's ``config.json`` of a source."""
    if source.kind == "pipeline":
        return source.path / "transformer" / "config.json"
    return source.path / ("model" if source.kind == "checkpoint" else "") / "config.json"


def recorded_objective(path: str | os.PathLike) -> dict:
    """The objective record of the model at ``path`` (run, checkpoint, pipeline, transformer), read from its config
    without loading weights: which samplers and protocols apply to it (``{"name": "ddpm"}`` for DiT's DDPM, which
    records none)."""
    config = _config_file(resolve_model_source(path))
    try:
        record = json.loads(config.read_text()).get("objective")
    except (OSError, ValueError) as err:
        raise ArtifactError(f"{config} cannot be read ({err}): damaged model folder?") from None
    try:
        return dict(record or {}, name=objective_name(record))
    except (ConfigError, TypeError) as err:
        raise ArtifactError(f"{config} records an objective this moh-dit does not know ({err})") from None


def load_transformer(path: str | os.PathLike) -> tuple[MoHDiT, ModelSource]:
    """The transformer of a run (newest weights), checkpoint (EMA), pipeline or transformer folder; a
    pipeline's weights must still have the fingerprint its manifest records."""
    source = resolve_model_source(path)
    if source.kind == "checkpoint":
        model, _ = checkpoint_model(source.path)
    else:
        sub = "transformer" if source.kind == "pipeline" else None
        with blame_the_file(partial(damaged, source.path), LOAD_ERRORS):
            model = MoHDiT.from_pretrained(source.path, subfolder=sub, use_safetensors=True)
        if source.kind == "pipeline":
            check_recorded_weights(source.path, pipeline_manifest(source.path), model)
    check_health(model, str(source.path))
    return model.eval(), source


def check_recorded_weights(folder: Path, manifest: dict | None, model: MoHDiT) -> str:
    """The transformer's fingerprint, after checking it against a pipeline manifest's record."""
    fingerprint = fingerprint_module(model)
    if manifest is not None and manifest.get("transformer_sha256") not in (None, fingerprint):
        raise ArtifactError(
            f"the weights in {folder} are not those its manifest records (fingerprint "
            f"{fingerprint[:12]} vs {manifest['transformer_sha256'][:12]}): the folder was modified; "
            f"export it again"
        )
    return fingerprint


def source_vae_record(source: ModelSource) -> dict | None:
    """What the weights at ``source`` were trained with, as far as it says: the VAE's fingerprint and
    latent-space numbers (``None`` for pixel space or a bare transformer folder, which does not say)."""
    if source.kind == "checkpoint":
        record = json.loads((source.path / "trainer_state.json").read_text()).get("vae")
        return record if isinstance(record, dict) and record.get("spec") else None
    if source.kind != "pipeline" or not (source.path / "vae" / "config.json").is_file():
        return None
    config = json.loads((source.path / "vae" / "config.json").read_text())
    return {
        "sha256": (pipeline_manifest(source.path) or {}).get("vae_sha256"),
        **latent_space(config),
    }
