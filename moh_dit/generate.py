r"""Loading a model from whatever the user has, and generating many samples reproducibly.

``load_pipeline`` accepts a training run folder (its newest weights: the exported pipeline, or a newer
checkpoint), a checkpoint folder, a pipeline folder or a transformer folder; the architecture always comes
from the saved config, and the log says which weights were loaded. ``generate_samples`` writes N images
(PNG, named by index) and an ADM-style ``.npz``. Each image's label and noise depend only on (seed,
index), and images are computed in fixed blocks of ``batch_size`` indices, so every image is bit-identical
for any number of processes; an interrupted run fills in only the missing blocks, and a folder is resumed
only when its manifest matches the model and settings.

    accelerate launch --num_processes 8 sample.py runs/imagenet/pipeline --num-samples 50000 \
        --sample-dir samples/xl --cfg-scale 1.5 --guidance-channels 3
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
import yaml
from PIL import Image

from .artifacts import (
    RunLayout,
    checkpoint_step,
    fingerprint_module,
    prepare_sample_folder,
    read_safetensors,
    sample_npz_path,
    short,
    sibling,
    weight_health,
)
from .errors import ArtifactError, ConfigError, DataError, blame_the_file
from .latents import check_vae, latent_space, load_vae
from .model import MoHDiT
from .options import (
    EVAL_GUIDANCE,
    EVAL_STEPS,
    LABEL_MODES,
    check_grid_averaging,
    check_guidance_interval,
    describe_guidance,
)
from .pipeline import MoHDiTPipeline, check_sampling_record
from .seeding import index_generator, label_for_index
from .tracking import Progress

__all__ = [
    "DTYPES",
    "GenerationSettings",
    "ModelSource",
    "resolve_model_source",
    "load_pipeline",
    "load_transformer",
    "generate_samples",
    "sample_manifest",
    "index_generator",
    "label_for_index",
    "pack_npz",
    "describe_samples",
    "sample_to_folder",
    "recorded_sampling",
]

logger = logging.getLogger(__name__)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}  # keys: moh_dit.options.DTYPES


# ----------------------------------------------------------------------------------------------------
# Which weights a path means
# ----------------------------------------------------------------------------------------------------
@dataclass
class ModelSource:
    """Where weights come from: ``kind`` is ``pipeline``, ``checkpoint`` or ``transformer``; ``step`` is
    the training step when known; ``run`` the run folder it belongs to."""

    kind: str
    path: Path
    step: Optional[int] = None
    run: Optional[Path] = None
    note: str = ""

    def describe(self) -> str:
        step = f" (step {self.step})" if self.step is not None else ""
        what = {
            "pipeline": "exported pipeline",
            "checkpoint": "EMA weights of checkpoint",
            "transformer": "transformer folder",
        }[self.kind]
        return f"{what} {self.path}{step}{self.note}"


def _pipeline_step(folder: Path) -> Optional[int]:
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


def _run_preview_sampling(source: ModelSource) -> Optional[dict]:
    """For weights inside a run folder: the preview settings in the run's config.yaml (``None`` without one;
    pipelines exported by moh-dit 0.2 and later carry their own record)."""
    if source.run is None or not RunLayout(source.run).config.is_file():
        return None
    import dataclasses

    from .config import LogSection

    log = (yaml.safe_load(RunLayout(source.run).config.read_text()) or {}).get("log") or {}
    known = {f.name for f in dataclasses.fields(LogSection)}  # keys of other versions are not ours to read
    return LogSection(**{k: v for k, v in log.items() if k in known}).preview_sampling()


def _recorded(source: ModelSource, manifest: Optional[dict]) -> Optional[dict]:
    """The sampling record of a pipeline's manifest, else of its run's config; checked."""
    return check_sampling_record((manifest or {}).get("sampling") or _run_preview_sampling(source))


def recorded_sampling(path: str | os.PathLike) -> Optional[dict]:
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


def _check_recorded_weights(folder: Path, manifest: Optional[dict], model: MoHDiT) -> str:
    """The transformer's fingerprint, after checking it against a pipeline manifest's record."""
    fingerprint = fingerprint_module(model)
    if manifest is not None and manifest.get("transformer_sha256") not in (None, fingerprint):
        raise ArtifactError(
            f"the weights in {folder} are not those its manifest records (fingerprint "
            f"{fingerprint[:12]} vs {manifest['transformer_sha256'][:12]}): the folder was modified; "
            f"export it again"
        )
    return fingerprint


def source_vae_record(source: ModelSource) -> Optional[dict]:
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
    device: Optional[str | torch.device] = None,
    dtype: str = "fp32",
    scheduler: Optional[str] = None,
    vae: Optional[str] = None,
) -> MoHDiTPipeline:
    """Load a pipeline from a run folder (its newest weights), a checkpoint folder (EMA weights), a pipeline
    folder or a bare transformer folder, and log which weights were loaded.

    Args:
        device: defaults to CUDA when available, else CPU.
        dtype: ``fp32``, ``bf16`` or ``fp16`` for the transformer (the VAE stays in fp32).
        scheduler: replace the saved scheduler (``ddpm``, ``ddim``, ``dpm-solver``).
        vae: replace or add the VAE (hub id or folder).

    The pipeline carries ``provenance`` (source, step, fingerprint), which sample manifests record.
    """
    if dtype not in DTYPES:
        raise ConfigError(f"dtype must be one of {list(DTYPES)}, got {dtype!r}")
    if isinstance(device, str) or device is None:
        from .cli import resolve_device

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


# ----------------------------------------------------------------------------------------------------
# Reproducible N-sample generation
# ----------------------------------------------------------------------------------------------------
@dataclass
class GenerationSettings:
    """What to generate. ``batch_size`` is also the block size: images are always computed with the same
    block-mates, which is what makes them bit-identical for any number of processes."""

    num_samples: int = 50_000
    seed: int = 0
    batch_size: int = 32
    guidance_scale: float = EVAL_GUIDANCE
    num_inference_steps: int = EVAL_STEPS
    guidance_channels: Optional[int] = None
    label_mode: str = "uniform"
    guidance_interval: Optional[tuple[int, int]] = None  # guided timesteps [first, last]; None: every step
    grid_averaging: Optional[int] = None  # average over shifted patch grids at timesteps <= this; None: nowhere

    @classmethod
    def from_args(cls, args, batch_size: int) -> "GenerationSettings":
        """From the sampling options of ``sample.py`` / ``evaluate_fid.py`` (see ``cli.add_sampling_arguments``)."""
        return cls(
            num_samples=args.num_samples,
            seed=args.seed,
            batch_size=batch_size,
            guidance_scale=args.cfg_scale,
            num_inference_steps=args.num_steps,
            guidance_channels=args.guidance_channels,
            label_mode=args.label_mode,
            guidance_interval=getattr(args, "guidance_interval", None),
            grid_averaging=getattr(args, "grid_averaging", None),
        )

    def validate(self) -> None:
        for name in ("num_samples", "batch_size", "num_inference_steps"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not math.isfinite(self.guidance_scale):
            raise ConfigError(f"guidance_scale must be a finite number, got {self.guidance_scale}")
        self.guidance_interval = check_guidance_interval(self.guidance_interval)
        self.grid_averaging = check_grid_averaging(self.grid_averaging)
        if self.label_mode not in LABEL_MODES:
            raise ConfigError(f"label_mode must be one of {', '.join(LABEL_MODES)}, got {self.label_mode!r}")

    def to_dict(self) -> dict:
        return asdict(self)


def sample_manifest(pipe: MoHDiTPipeline, settings: GenerationSettings, world_size: int = 1) -> dict[str, Any]:
    """What makes a set of samples: ``identity`` holds everything that changes the pixels (weights of the
    transformer and the VAE, their dtype, the scheduler, steps, guidance, seed, labels); the rest is a record
    (source, step, count, batch, processes, device), which does not stop a resume."""
    transformer = pipe.transformer
    conditional = transformer.config.num_classes > 0
    scheduler = {k: v for k, v in dict(pipe.scheduler.config).items() if not k.startswith("_")}
    identity = {
        "transformer_sha256": fingerprint_module(transformer),
        "dtype": str(transformer.dtype).removeprefix("torch."),
        "vae_sha256": fingerprint_module(pipe.vae) if pipe.vae is not None else None,
        "scheduler": dict(scheduler, name=type(pipe.scheduler).__name__),
        "num_inference_steps": settings.num_inference_steps,
        "guidance_scale": settings.guidance_scale if conditional else 1.0,
        "guidance_channels": settings.guidance_channels,
        "seed": settings.seed,
        "label_mode": settings.label_mode if conditional else None,
        "num_classes": transformer.config.num_classes,
    }
    if conditional and settings.guidance_interval is not None:
        # only when set: folders made before intervals existed guided every step and keep their identity
        identity["guidance_interval"] = list(settings.guidance_interval)
    if settings.grid_averaging is not None:  # likewise: only when set
        identity["grid_averaging"] = settings.grid_averaging
    return {
        "identity": identity,
        "model": getattr(pipe, "provenance", None),
        "id2label": {str(k): v for k, v in pipe.id2label.items()},
        "count": settings.num_samples,
        "batch_size": settings.batch_size,
        "world_size": world_size,
        "device": transformer.device.type,
    }


def _png_path(sample_dir: Path, index: int) -> Path:
    return sample_dir / f"{index:06d}.png"


def _save_png(image: np.ndarray, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    Image.fromarray(image[:, :, 0] if image.shape[2] == 1 else image).save(tmp, format="PNG")
    os.replace(tmp, path)  # a PNG that exists is complete


def missing_indices(sample_dir: Path, num_samples: int) -> list[int]:
    return [i for i in range(num_samples) if not _png_path(sample_dir, i).is_file()]


def generate_samples(
    pipe: MoHDiTPipeline,
    sample_dir: str | os.PathLike,
    settings: GenerationSettings,
    accelerator=None,
    overwrite: bool = False,
) -> Optional[Path]:
    """Generate ``settings.num_samples`` images into ``sample_dir`` (resuming a folder whose manifest
    matches), then pack them into the ADM-style ``.npz`` beside it (``arr_0`` uint8 NHWC RGB, ``arr_1``
    labels, ``moh_dit_manifest``). Returns the ``.npz`` path on the main process. With ``accelerator`` the
    missing blocks are split over its processes."""
    settings.validate()
    if pipe.config.get("latent_space", False) and pipe.vae is None:
        raise ConfigError("this model generates latents and the pipeline has no VAE: pass the VAE it was trained with")
    sample_dir = Path(str(sample_dir).rstrip("/"))
    rank, world = (accelerator.process_index, accelerator.num_processes) if accelerator else (0, 1)
    is_main = rank == 0
    manifest = sample_manifest(pipe, settings, world)
    prepare_sample_folder(sample_dir, manifest, overwrite, write=is_main)
    if accelerator:
        accelerator.wait_for_everyone()

    n, block = settings.num_samples, settings.batch_size
    missing = set(missing_indices(sample_dir, n))
    todo = [b for b in range(-(-n // block)) if any(i in missing for i in range(b * block, min((b + 1) * block, n)))]
    if is_main:
        source = (getattr(pipe, "provenance", None) or {}).get("source", "an in-memory model")
        logger.info(
            "sampling from %s: %d of %d images present in %s; generating %d on %d process(es)",
            source,
            n - len(missing),
            n,
            sample_dir,
            len(missing),
            world,
        )
    num_classes = pipe.transformer.config.num_classes
    progress = Progress(len(todo) * block, desc="sampling", unit="img", enabled=is_main)
    pipe.set_progress_bar_config(disable=True)
    for b in todo[rank::world]:
        # the whole block, also indices past N: an image's block-mates fix its numerics, so any N, process
        # count or resume gives the same bits
        batch = list(range(b * block, (b + 1) * block))
        kwargs: dict[str, Any] = dict(num_images=len(batch))
        if num_classes > 0:
            kwargs = dict(
                class_labels=[label_for_index(settings.seed, i, num_classes, settings.label_mode) for i in batch]
            )
        images = pipe(
            **kwargs,
            guidance_scale=settings.guidance_scale if num_classes > 0 else 1.0,
            num_inference_steps=settings.num_inference_steps,
            generator=[index_generator(settings.seed, i) for i in batch],
            guidance_channels=settings.guidance_channels,
            output_type="uint8",
            progress=False,
            guidance_interval=settings.guidance_interval if num_classes > 0 else None,
            grid_averaging=settings.grid_averaging,
        ).images
        for i, img in zip(batch, images):
            if i in missing:
                _save_png(img, _png_path(sample_dir, i))
        progress.update(block * world)  # the other processes progress at about the same rate
    progress.close()
    if accelerator:
        accelerator.wait_for_everyone()
    if not is_main:
        return None
    still = missing_indices(sample_dir, n)
    if still:
        raise ArtifactError(
            f"{len(still)} samples are missing in {sample_dir} after generation (e.g. index {still[0]})"
        )
    return pack_npz(sample_dir, dict(manifest, count=n), sample_npz_path(sample_dir))


def sample_to_folder(
    model: str | os.PathLike,
    sample_dir: str | os.PathLike,
    settings: GenerationSettings,
    device: Optional[str] = None,
    dtype: str = "fp32",
    scheduler: Optional[str] = None,
    vae: Optional[str] = None,
    overwrite: bool = False,
):
    """What ``sample.py --num-samples`` and ``evaluate_fid.py --model`` do: start accelerate (all processes of
    an ``accelerate launch`` / ``torchrun``), log how many there are, load the model and generate. Returns
    ``(accelerator, npz path on the main process, pipeline)``."""
    from accelerate import Accelerator

    from .cli import resolve_device

    settings.validate()
    accelerator = Accelerator(cpu=resolve_device(device).type == "cpu")
    logger.info("%d process(es) on %s", accelerator.num_processes, accelerator.device)
    pipe = load_pipeline(model, accelerator.device, dtype, scheduler, vae)
    return accelerator, generate_samples(pipe, sample_dir, settings, accelerator, overwrite=overwrite), pipe


def pack_npz(sample_dir: Path, manifest: dict[str, Any], npz_path: Path) -> Path:
    """Read PNGs 0..N-1 back into one ``.npz`` (grayscale repeated to RGB, as the ADM evaluator expects),
    with the samples' manifest stored inside, so the file says what made it wherever it is copied."""
    n, identity = manifest["count"], manifest["identity"]
    first = np.asarray(Image.open(_png_path(sample_dir, 0)))
    h, w = first.shape[:2]
    arr = np.empty((n, h, w, 3), dtype=np.uint8)
    for i in range(n):
        img = np.asarray(Image.open(_png_path(sample_dir, i)))
        if img.shape[:2] != (h, w):
            raise ArtifactError(f"{_png_path(sample_dir, i)} has shape {img.shape}, but image 0 has {first.shape}")
        arr[i] = img[:, :, None] if img.ndim == 2 else img[:, :, :3]
    k = identity["num_classes"]
    labels = np.array(
        [label_for_index(identity["seed"], i, k, identity["label_mode"]) if k else -1 for i in range(n)],
        dtype=np.int64,
    )
    tmp = sibling(npz_path, ".tmp.npz")
    record = dict(manifest, kind="samples", images_sha256=images_fingerprint(arr))
    np.savez(tmp, arr_0=arr, arr_1=labels, moh_dit_manifest=np.array(json.dumps(record)))
    os.replace(tmp, npz_path)
    return npz_path


def images_fingerprint(images: np.ndarray) -> str:
    """SHA-256 of an image array's shape and bytes (no copy of a contiguous array)."""
    h = hashlib.sha256(str(images.shape).encode())
    h.update(memoryview(np.ascontiguousarray(images)).cast("B"))
    return h.hexdigest()


def check_samples(path: Path, manifest: Optional[dict], images: Optional[np.ndarray] = None) -> None:
    """Stop before samples are scored as something they are not: a sample folder must hold every image its
    manifest counts (an interrupted sampling leaves fewer), and an ``.npz`` the images it was packed with
    (``images``: its ``arr_0``). Files without a moh-dit manifest are images from elsewhere, taken as they are."""
    if not manifest:
        return
    n = int(manifest["count"])
    if path.is_dir():
        missing = missing_indices(path, n)
        if missing:
            names = ", ".join(_png_path(path, i).name for i in missing[:3])
            raise ArtifactError(
                f"{path} holds {n - len(missing)} of the {n} samples its manifest counts (missing {names}"
                f"{' and more' if len(missing) > 3 else ''}): run the same sample.py command again to finish it"
            )
        return
    if images is None:
        return
    recorded = manifest.get("images_sha256")  # absent from .npz files packed before this record existed
    if len(images) != n:
        found = f"{len(images)} images but its manifest records {n}"
    elif recorded is not None and images_fingerprint(images) != recorded:
        found = "other images than sample.py packed into it"
    else:
        return
    raise ArtifactError(
        f"{path} holds {found}: it was changed afterwards; remove it and run the same sample.py command "
        f"again to pack it from its folder"
    )


def describe_samples(manifest: Optional[dict]) -> str:
    if not manifest:
        return "samples without a moh-dit manifest"
    ident, model = manifest["identity"], manifest.get("model") or {}
    step = f" step {model['step']}" if model.get("step") is not None else ""
    return (
        f"{manifest.get('count')} samples of {model.get('source', 'a model')}{step}, "
        f"{ident['scheduler']['name']} {ident['num_inference_steps']} steps, "
        + describe_guidance(ident["guidance_scale"], ident.get("guidance_interval"), ident.get("grid_averaging"))
    )
