"""Loading a model from whatever the user has, as a pipeline.

``load_pipeline`` accepts a training run folder (its newest weights: the exported pipeline, or a newer
checkpoint), a checkpoint folder, a pipeline folder or a transformer folder; the architecture always comes
from the saved config, recorded fingerprints are checked, and the log says which weights were loaded.
"""

from __future__ import annotations

import logging
import os
from functools import partial
from pathlib import Path

import torch
import yaml

from moh_dit.errors import ArtifactError, ConfigError, DataError, blame_the_file
from moh_dit.manifests import fingerprint_module, short
from moh_dit.run_folder import RunLayout
from moh_dit.sampling.pipeline import MoHDiTPipeline
from moh_dit.sampling.sources import (
    LOAD_ERRORS,
    ModelSource,
    check_health,
    check_recorded_weights,
    checkpoint_model,
    damaged,
    load_transformer,
    resolve_model_source,
)
from moh_dit.sampling.spec import DTYPES as DTYPE_NAMES
from moh_dit.sampling.spec import LEGACY_CONFIG_KEYS, SamplingSpec
from moh_dit.vae import check_vae, load_vae

logger = logging.getLogger(__name__)
DTYPES = dict(zip(DTYPE_NAMES, (torch.float32, torch.bfloat16, torch.float16)))  # the names the options offer


# ----------------------------------------------------------------------------------------------------
# Loading
# ----------------------------------------------------------------------------------------------------
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


def recorded_sampling(path: str | os.PathLike) -> SamplingSpec | None:
    """How the model at ``path`` (run, checkpoint, pipeline) is meant to be sampled, as recorded with it (see
    ``MoHDiTPipeline.preview_sampling``), read without loading weights; ``None`` without a record."""
    source = resolve_model_source(path)
    return _recorded(source, MoHDiTPipeline.manifest_of(source.path) if source.kind == "pipeline" else None)


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
            with blame_the_file(partial(damaged, source.path), LOAD_ERRORS):
                pipe = MoHDiTPipeline.from_pretrained(source.path, use_safetensors=True)
        finally:
            if shown:
                diffusers_logging.enable_progress_bar()
        manifest = MoHDiTPipeline.manifest_of(source.path)
    elif source.kind == "checkpoint":
        model, state = checkpoint_model(source.path)
        record = state.get("vae")
        latent = isinstance(record, dict) and record.get("spec") is not None
        # with --vae the recorded one is not needed (it may have moved); the replacement is checked below
        own = _checkpoint_vae(state, source.path) if vae is None else None
        pipe = MoHDiTPipeline.build(model, own, state.get("id2label"), latent_space=latent or None)
        trained_with = record if isinstance(record, dict) and latent else None
    else:
        model, _ = load_transformer(source.path)
        pipe = MoHDiTPipeline.build(model)
    check_health(pipe.transformer, str(source.path))
    fingerprint = check_recorded_weights(source.path, manifest, pipe.transformer)
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
    pipe.trained_lead = (((manifest or {}).get("source") or {}).get("training") or {}).get("lead")  # leads.py
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
