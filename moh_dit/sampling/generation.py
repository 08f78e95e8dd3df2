r"""Generating N samples reproducibly (PNG, named by index, and an ADM-style ``.npz``).

Each image's label and noise depend only on (seed, index), drawn from a generator of its own, and the network
treats the rows of a batch apart, so an image is the same for any count, batch size, number of processes or resume
(bit-identical on CPU in the tests; MoH's automatic execution or a GPU's kernels may pick another kernel for
another batch shape, which moves a float's last bits and almost never a uint8 pixel). Only the
images asked for are drawn; an interrupted run draws only the missing ones, and a folder is resumed only when its
manifest matches the model and settings. With a cache, which decides for a whole batch, images are drawn in fixed
blocks of ``batch_size`` indices, so that their batch-mates are fixed too.

    accelerate launch --num_processes 8 sample.py runs/imagenet/pipeline --num-samples 50000 \
        --sample-dir samples/xl --cfg-scale 1.5 --guidance-channels 3
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from moh_dit.errors import ArtifactError, ConfigError
from moh_dit.files import atomic_path
from moh_dit.logs import plural
from moh_dit.manifests import fingerprint_module
from moh_dit.progress import Progress
from moh_dit.sampling.caches import describe_cache
from moh_dit.sampling.guides import Guide
from moh_dit.sampling.loading import load_pipeline
from moh_dit.sampling.pipeline import MoHDiTPipeline
from moh_dit.sampling.sample_sets import prepare_sample_folder, sample_npz_path
from moh_dit.sampling.spec import EVAL_GUIDANCE, EVAL_STEPS, LABEL_MODES, SamplingSpec
from moh_dit.seeding import index_generator, label_for_index

logger = logging.getLogger(__name__)


# ----------------------------------------------------------------------------------------------------
# Reproducible N-sample generation
# ----------------------------------------------------------------------------------------------------
@dataclass
class GenerationSettings:
    """What to generate: how many images, their seed and labels, and how to sample them (``sampling``; its
    ``scheduler`` ``None`` keeps the pipeline's own). ``batch_size`` is also the block size in which the
    processes share the work (and, with a cache, an image's fixed batch-mates)."""

    num_samples: int = 50_000
    seed: int = 0
    batch_size: int = 32
    label_mode: str = "uniform"
    sampling: SamplingSpec = field(
        default_factory=lambda: SamplingSpec.create(
            scheduler=None, num_inference_steps=EVAL_STEPS, guidance_scale=EVAL_GUIDANCE
        )
    )

    @classmethod
    def from_args(cls, args, sampling: SamplingSpec, batch_size: int) -> GenerationSettings:
        """From the options of ``sample.py`` / ``evaluate_fid.py`` (``cli.common.add_sampling_arguments``)."""
        return cls(args.num_samples, args.seed, batch_size, args.label_mode, sampling)

    def validate(self) -> None:
        for name in ("num_samples", "batch_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.label_mode not in LABEL_MODES:
            raise ConfigError(f"label_mode must be one of {', '.join(LABEL_MODES)}, got {self.label_mode!r}")
        if not isinstance(self.sampling, SamplingSpec):
            raise ConfigError(f"sampling must be a SamplingSpec, got {type(self.sampling).__name__}")

    def to_dict(self) -> dict:
        return asdict(self)


def sample_manifest(
    pipe: MoHDiTPipeline, settings: GenerationSettings, world_size: int = 1, guide: Guide | None = None
) -> dict[str, Any]:
    """What makes a set of samples: ``identity`` holds everything that changes the pixels (weights of the
    transformer and the VAE, their dtype, the scheduler, steps, guidance, the ``guide``'s weights, a hand-off's lead's,
    seed, labels); the
    rest is a record (source, step, count, batch, processes, device), which does not stop a resume."""
    transformer, spec = pipe.transformer, settings.sampling
    sampler, guidance = spec.sampler, spec.guidance
    conditional = transformer.config.num_classes > 0
    guided = conditional or spec.guide is not None
    scheduler = {k: v for k, v in dict(pipe.scheduler.config).items() if not k.startswith("_")}
    identity = {
        "transformer_sha256": fingerprint_module(transformer),
        "dtype": str(transformer.dtype).removeprefix("torch."),
        "vae_sha256": pipe.space.fingerprint(),
        "scheduler": dict(scheduler, name=type(pipe.scheduler).__name__),
        "num_inference_steps": sampler.num_steps,
        "guidance_scale": guidance.scale if guided else 1.0,
        "guidance_channels": guidance.channels,
        "seed": settings.seed,
        "label_mode": settings.label_mode if conditional else None,
        "num_classes": transformer.config.num_classes,
    }
    # the keys below only when set: folders made before they existed keep their identity
    record = spec.record()
    if guided and guidance.interval is not None:
        identity["guidance_interval"] = list(guidance.interval)
    if sampler.grid_averaging is not None:
        identity["grid_averaging"] = sampler.grid_averaging
    if guided and guidance.noise is not None:
        identity["guidance_noise"] = record["guidance_noise"]
    if sampler.time_shift != 1.0:
        identity["time_shift"] = sampler.time_shift
    if transformer.config.get("objective") is not None:  # DiT's DDPM records none (the folders of moh-dit 0.3)
        identity["objective"] = dict(transformer.config.objective)
    if "guidance_rule" in record:  # the rule and its options, only when not CFG
        identity["guidance_rule"], identity["rule_options"] = record["guidance_rule"], record["rule_options"]
    if spec.cache is not None:  # a cache changes the images
        identity["cache"], identity["cache_options"] = record["cache"], record["cache_options"]
    if guide is not None:  # autoguidance (the guide the settings name): its weights are part of what made the images
        identity["guide"] = guide.identity()
    lead = pipe.lead_for(spec)
    if lead is not None:  # a hand-off: the lead's weights and steps made the images as much as the model's
        identity["lead"] = lead.identity()
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
    with atomic_path(path) as tmp:  # a PNG that exists is complete
        Image.fromarray(image[:, :, 0] if image.shape[2] == 1 else image).save(tmp, format="PNG")


def missing_indices(sample_dir: Path, num_samples: int) -> list[int]:
    return [i for i in range(num_samples) if not _png_path(sample_dir, i).is_file()]


def generate_samples(
    pipe: MoHDiTPipeline,
    sample_dir: str | os.PathLike,
    settings: GenerationSettings,
    accelerator=None,
    overwrite: bool = False,
    guide: Guide | None = None,
) -> Path | None:
    """Generate ``settings.num_samples`` images into ``sample_dir`` (resuming a folder whose manifest
    matches), then pack them into the ADM-style ``.npz`` beside it (``arr_0`` uint8 NHWC RGB, ``arr_1``
    labels, ``moh_dit_manifest``). Returns the ``.npz`` path on the main process. With ``accelerator`` the
    missing blocks are split over its processes; ``guide``: autoguidance's guide for the one the settings name
    (default: loaded by the pipeline)."""
    settings.validate()
    if pipe.config.get("latent_space", False) and pipe.vae is None:
        raise ConfigError("this model generates latents and the pipeline has no VAE: pass the VAE it was trained with")
    sample_dir = Path(str(sample_dir).rstrip("/"))
    rank, world = (accelerator.process_index, accelerator.num_processes) if accelerator else (0, 1)
    is_main = rank == 0
    pipe.use_sampling_scheduler(settings.sampling)  # the identity names the sampler that draws the images
    # settings the model cannot sample (a guide that cannot guide) stop before anything is written
    guide = pipe.check_sampling(settings.sampling, guide=guide)
    manifest = sample_manifest(pipe, settings, world, guide)
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
    spec = settings.sampling
    # each image is drawn from its own generator and the network treats the rows of a batch apart, so an image is
    # the same whatever its batch-mates: only the images asked for (and missing) are drawn. A cache is the exception:
    # it decides for the whole batch at once, so with one a block is drawn whole (also past N), its mates fixed.
    whole_blocks = spec.cache is not None

    def drawn(b: int) -> list[int]:
        indices = range(b * block, (b + 1) * block)
        return list(indices) if whole_blocks else [i for i in indices if i < n and i in missing]

    progress = Progress(sum(len(drawn(b)) for b in todo), desc="sampling", unit="img", enabled=is_main)
    pipe.set_progress_bar_config(disable=True)
    for b in todo[rank::world]:
        batch = drawn(b)
        kwargs: dict[str, Any] = dict(num_images=len(batch))
        if num_classes > 0:
            kwargs = dict(
                class_labels=[label_for_index(settings.seed, i, num_classes, settings.label_mode) for i in batch]
            )
        images = pipe(
            **kwargs,
            sampling=spec,
            guide=guide,
            generator=[index_generator(settings.seed, i) for i in batch],
            output_type="uint8",
            progress=False,
        ).images
        for i, img in zip(batch, images):
            if i in missing:
                _save_png(img, _png_path(sample_dir, i))
        progress.update(len(batch) * world)  # the other processes progress at about the same rate
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


def open_for_sampling(
    model: str | os.PathLike,
    settings: GenerationSettings,
    device: str | None = None,
    dtype: str = "fp32",
    vae: str | None = None,
):
    """Start accelerate (all processes of an ``accelerate launch`` / ``torchrun``), log how many there are, and
    load the model for ``settings`` (and the guide they name, checked before anything is drawn). Returns
    ``(accelerator, pipeline)``."""
    from accelerate import Accelerator

    from moh_dit.devices import resolve_device

    settings.validate()
    accelerator = Accelerator(cpu=resolve_device(device).type == "cpu")
    logger.info("%d process(es) on %s", accelerator.num_processes, accelerator.device)
    pipe = load_pipeline(model, accelerator.device, dtype, settings.sampling.sampler.scheduler, vae)
    pipe.check_sampling(settings.sampling)
    return accelerator, pipe


def sample_to_folder(
    model: str | os.PathLike,
    sample_dir: str | os.PathLike,
    settings: GenerationSettings,
    device: str | None = None,
    dtype: str = "fp32",
    vae: str | None = None,
    overwrite: bool = False,
):
    """What ``sample.py --num-samples`` does: :func:`open_for_sampling`, then :func:`generate_samples`. Returns
    ``(accelerator, npz path on the main process, pipeline)``."""
    accelerator, pipe = open_for_sampling(model, settings, device, dtype, vae)
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
    record = dict(manifest, kind="samples", images_sha256=images_fingerprint(arr))
    with atomic_path(npz_path, ".npz") as tmp:
        np.savez(tmp, arr_0=arr, arr_1=labels, moh_dit_manifest=np.array(json.dumps(record)))
    return npz_path


def images_fingerprint(images: np.ndarray) -> str:
    """SHA-256 of an image array's shape and bytes (no copy of a contiguous array)."""
    h = hashlib.sha256(str(images.shape).encode())
    h.update(memoryview(np.ascontiguousarray(images)).cast("B"))
    return h.hexdigest()


def check_samples(path: Path, manifest: dict | None, images: np.ndarray | None = None) -> None:
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


def describe_samples(manifest: dict | None) -> str:
    if not manifest:
        return "samples without a moh-dit manifest"
    ident, model = manifest["identity"], manifest.get("model") or {}
    step = f" step {model['step']}" if model.get("step") is not None else ""
    return (
        f"{manifest.get('count')} samples of {model.get('source', 'a model')}{step}, "
        f"{ident['scheduler']['name']} {plural(ident['num_inference_steps'], 'step')}, "
        + SamplingSpec.create(
            scheduler=None,
            guidance_scale=ident["guidance_scale"],
            guidance_interval=ident.get("guidance_interval"),
            grid_averaging=ident.get("grid_averaging"),
            guidance_noise=ident.get("guidance_noise"),
            guidance_rule=ident.get("guidance_rule", "cfg"),
            rule_options=ident.get("rule_options"),
        ).describe_guidance()
        + (f", {describe_cache(ident['cache'], ident['cache_options'])}" if ident.get("cache") else "")
        + (f", guided by weights {ident['guide']['transformer_sha256'][:12]}" if ident.get("guide") else "")
    )
