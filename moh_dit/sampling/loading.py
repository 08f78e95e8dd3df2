"""Loading a model from whatever the user has.

``load_pipeline`` accepts a training run folder (its newest weights: the exported pipeline, or a newer
checkpoint), a checkpoint folder, a pipeline folder or a transformer folder; the architecture always comes
from the saved config, recorded fingerprints are checked, and the log says which weights were loaded.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
import yaml

from moh_dit.errors import ArtifactError, ConfigError, DataError, blame_the_file
from moh_dit.files import read_safetensors
from moh_dit.manifests import fingerprint_module, short, weight_health
from moh_dit.model.network import MoHDiT
from moh_dit.objectives import objective_name
from moh_dit.run_folder import RunLayout, checkpoint_step
from moh_dit.sampling.pipeline import MoHDiTPipeline
from moh_dit.sampling.spec import DTYPES as DTYPE_NAMES
from moh_dit.sampling.spec import LEGACY_CONFIG_KEYS, SamplingSpec
from moh_dit.vae import check_vae, latent_space, load_vae

logger = logging.getLogger(__name__)
DTYPES = dict(zip(DTYPE_NAMES, (torch.float32, torch.bfloat16, torch.float16)))  # the names the options offer


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
    manifest = MoHDiTPipeline.manifest_of(folder)
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


# ----------------------------------------------------------------------------------------------------
# Loading
# ----------------------------------------------------------------------------------------------------
# what diffusers' from_pretrained raises for a damaged or mismatched folder (it wraps safetensors' own errors
# in OSError/ValueError; a weight of the wrong shape is torch's RuntimeError)
LOAD_ERRORS = (OSError, ValueError, RuntimeError)


def _damaged(path: Path, err: BaseException) -> ArtifactError:
    return ArtifactError(
        f"{path} cannot be loaded: {str(err).strip().splitlines()[0]} (damaged files, or "
        f"weights that are not safetensors?)"
    )


def _check_health(model: torch.nn.Module, where: str) -> None:
    sane, peak = weight_health(model.state_dict().values())
    if not sane:
        raise ArtifactError(
            f"the weights in {where} are not finite or have exploded (max |w| = {peak:.3g}); was the "
            f"run stopped for a non-finite loss? Use an earlier checkpoint"
        )


def _checkpoint_model(ckpt: Path, prefer_ema: bool = True) -> tuple[MoHDiT, dict]:
    """A training checkpoint's model (with its EMA weights by default) and its trainer state."""
    with blame_the_file(partial(_damaged, ckpt / "model"), LOAD_ERRORS):
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


def _checkpoint_vae(state: dict, ckpt: Path):
    """The VAE recorded in a checkpoint (a record with a fingerprint; older checkpoints: a spec), checked
    against the record."""
    record = state.get("vae")
    spec = record.get("spec") if isinstance(record, dict) else record
    if spec in (None, "none"):
        return None
    try:
        vae = load_vae(spec)
    except DataError as err:
        raise DataError(
            f"{err} (the VAE checkpoint {ckpt} was trained with): pass it, or a copy, with --vae"
        ) from None
    if isinstance(record, dict):
        check_vae(vae, spec, record, f"checkpoint {ckpt}")
    return vae


def _run_preview_sampling(source: ModelSource) -> SamplingSpec | None:
    """For weights inside a run folder: the preview spec in the run's config.yaml (``None`` without one;
    pipelines exported by moh-dit 0.2 and later carry their own record)."""
    if source.run is None or not RunLayout(source.run).config.is_file():
        return None
    saved = yaml.safe_load(RunLayout(source.run).config.read_text()) or {}
    preview = saved.get("preview")
    if preview is None:  # a run of moh-dit 0.2: log.sample_*
        log = saved.get("log") or {}
        preview = {new: log[old] for old, new in LEGACY_CONFIG_KEYS.items() if old in log}
    try:
        return SamplingSpec.from_config(preview)
    except ConfigError as err:
        raise ArtifactError(f"the preview settings in {RunLayout(source.run).config} are not valid ({err})") from None


def _recorded(source: ModelSource, manifest: dict | None) -> SamplingSpec | None:
    """The sampling spec of a pipeline's manifest, else of its run's config; checked."""
    return SamplingSpec.from_record((manifest or {}).get("sampling")) or _run_preview_sampling(source)


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


def recorded_sampling(path: str | os.PathLike) -> SamplingSpec | None:
    """How the model at ``path`` (run, checkpoint, pipeline) is meant to be sampled, as recorded with it (see
    ``MoHDiTPipeline.preview_sampling``), read without loading weights; ``None`` without a record."""
    source = resolve_model_source(path)
    return _recorded(source, MoHDiTPipeline.manifest_of(source.path) if source.kind == "pipeline" else None)


def load_transformer(path: str | os.PathLike) -> tuple[MoHDiT, ModelSource]:
    """The transformer of a run (newest weights), checkpoint (EMA), pipeline or transformer folder; a
    pipeline's weights must still have the fingerprint its manifest records."""
    source = resolve_model_source(path)
    if source.kind == "checkpoint":
        model, _ = _checkpoint_model(source.path)
    else:
        sub = "transformer" if source.kind == "pipeline" else None
        with blame_the_file(partial(_damaged, source.path), LOAD_ERRORS):
            model = MoHDiT.from_pretrained(source.path, subfolder=sub, use_safetensors=True)
        if source.kind == "pipeline":
            _check_recorded_weights(source.path, MoHDiTPipeline.manifest_of(source.path), model)
    _check_health(model, str(source.path))
    return model.eval(), source


def _check_recorded_weights(folder: Path, manifest: dict | None, model: MoHDiT) -> str:
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
        "sha256": (MoHDiTPipeline.manifest_of(source.path) or {}).get("vae_sha256"),
        **latent_space(config),
    }


def load_pipeline(
    path: str | os.PathLike,
    device: str | torch.device | None = None,
    dtype: str = "fp32",
    scheduler: str | None = None,
    vae: str | None = None,
    log: bool = True,
) -> MoHDiTPipeline:
    """Load a pipeline from a run folder (its newest weights), a checkpoint folder (EMA weights), a pipeline
    folder or a bare transformer folder, and log which weights were loaded (unless ``log`` is off: a caller that
    replaces the weights says what it made).

    Args:
        device: defaults to CUDA when available, else CPU.
        dtype: ``fp32``, ``bf16`` or ``fp16`` for the transformer (the VAE stays in fp32).
        scheduler: replace the saved scheduler by one of the objective's (DDPM: ``ddpm``, ``ddim``, ``dpm-solver``,
            ...; flow: ``euler``, ``heun``, ``sde``, ...).
        vae: replace or add the VAE (hub id or folder).

    The pipeline carries ``provenance`` (source, step, fingerprint), which sample manifests record.
    """
    if dtype not in DTYPES:
        raise ConfigError(f"dtype must be one of {list(DTYPES)}, got {dtype!r}")
    if isinstance(device, str) or device is None:
        from moh_dit.devices import resolve_device

        device = resolve_device(device)  # a missing device fails before anything is loaded
    source = resolve_model_source(path)
    manifest, trained_with = None, None
    if source.kind == "pipeline":
        from diffusers.utils import logging as diffusers_logging

        shown = diffusers_logging.is_progress_bar_enabled()
        diffusers_logging.disable_progress_bar()  # a bar for loading two components is noise in logs
        try:
            with blame_the_file(partial(_damaged, source.path), LOAD_ERRORS):
                pipe = MoHDiTPipeline.from_pretrained(source.path, use_safetensors=True)
        finally:
            if shown:
                diffusers_logging.enable_progress_bar()
        manifest = MoHDiTPipeline.manifest_of(source.path)
    elif source.kind == "checkpoint":
        model, state = _checkpoint_model(source.path)
        record = state.get("vae")
        latent = isinstance(record, dict) and record.get("spec") is not None
        # with --vae the recorded one is not needed (it may have moved); the replacement is checked below
        own = _checkpoint_vae(state, source.path) if vae is None else None
        pipe = MoHDiTPipeline.build(model, own, state.get("id2label"), latent_space=latent or None)
        trained_with = record if isinstance(record, dict) and latent else None
    else:
        model, _ = load_transformer(source.path)
        pipe = MoHDiTPipeline.build(model)
    _check_health(pipe.transformer, str(source.path))
    fingerprint = _check_recorded_weights(source.path, manifest, pipe.transformer)
    recorded_vae = manifest.get("vae_sha256") if manifest is not None else None
    if recorded_vae is not None and pipe.vae is not None:
        found = fingerprint_module(pipe.vae)
        if found != recorded_vae and vae is None:
            raise ArtifactError(
                f"the VAE in {source.path / 'vae'} is not the one its manifest records (fingerprint {short(found)} "
                f"vs {short(recorded_vae)}): the folder was modified; export it again, or choose a VAE with --vae"
            )
        if found != recorded_vae:  # replaced below; a changed VAE is no reference for the replacement
            pipe.register_modules(vae=None)
    pipe.set_preview_sampling(_recorded(source, manifest))
    if vae is not None:
        pipe.replace_vae(load_vae(vae), vae, trained_with)
    if scheduler is not None:
        pipe.with_scheduler(scheduler)
    if log:
        logger.info("loaded %s", source.describe())
    pipe.provenance = {
        "source": str(source.path.resolve()),
        "kind": source.kind,
        "step": source.step,
        "run": str(source.run.resolve()) if source.run else None,
        "transformer_sha256": fingerprint,
    }
    pipe.to(device)
    if dtype != "fp32":
        pipe.transformer.to(DTYPES[dtype])
    return pipe
