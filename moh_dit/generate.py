"""Loading a model from whatever the user has, and generating many samples reproducibly.

``load_pipeline`` accepts a training run folder, a checkpoint folder, a pipeline folder or a transformer
folder; the architecture always comes from the saved config. ``generate_samples`` writes N images (PNG,
named by index) and an ADM-style ``.npz``; each image's label and noise depend only on (seed, index), so
the result is the same for any number of processes or batch size, and an interrupted run fills in only
the missing indices.

    accelerate launch --num_processes 8 sample.py runs/imagenet/pipeline --num-samples 50000 \
        --sample-dir samples/xl --cfg-scale 1.5 --guidance-channels 3
"""
from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import torch
from PIL import Image
from safetensors.torch import load_file
from tqdm.auto import tqdm

from .latents import load_vae
from .model import MoHDiT
from .pipeline import MoHDiTPipeline, make_scheduler, to_uint8

__all__ = ["load_pipeline", "generate_samples", "GenerationSettings", "index_generator", "label_for_index"]

logger = logging.getLogger(__name__)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


# ----------------------------------------------------------------------------------------------------
# Loading
# ----------------------------------------------------------------------------------------------------
def _pipeline_from_checkpoint(ckpt: Path, prefer_ema: bool = True) -> MoHDiTPipeline:
    """A training checkpoint (``model/``, ``ema.safetensors``, ``trainer_state.json``) -> pipeline."""
    model = MoHDiT.from_pretrained(ckpt / "model")
    ema_file = ckpt / "ema.safetensors"
    if prefer_ema and ema_file.is_file():
        ema = load_file(ema_file)
        missing = [n for n, _ in model.named_parameters() if n not in ema]
        if missing:
            raise ValueError(f"{ema_file} does not match the model: missing {missing[:5]}")
        with torch.no_grad():
            for name, param in model.named_parameters():
                param.copy_(ema[name])
    state = json.loads((ckpt / "trainer_state.json").read_text())
    vae = load_vae(state.get("vae")) if state.get("vae") not in (None, "none") else None
    return MoHDiTPipeline(model.eval(), make_scheduler("ddpm", model.config.learn_sigma), vae, state.get("id2label"))


def load_pipeline(
    path: str | os.PathLike,
    device: Optional[str | torch.device] = None,
    dtype: str = "fp32",
    scheduler: Optional[str] = None,
    vae: Optional[str] = None,
) -> MoHDiTPipeline:
    """Load a pipeline from a run folder (its exported ``pipeline/``, else its latest checkpoint, EMA
    weights), a checkpoint folder, a pipeline folder or a bare transformer folder.

    Args:
        device: defaults to CUDA when available, else CPU.
        dtype: ``fp32``, ``bf16`` or ``fp16`` for the transformer (the VAE stays in fp32).
        scheduler: replace the saved scheduler (``ddpm``, ``ddim``, ``dpm-solver``).
        vae: replace or add the VAE (hub id or folder).
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist (expected a run, checkpoint, pipeline or transformer folder)")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {list(DTYPES)}, got {dtype!r}")
    if (path / "model_index.json").is_file():
        pipe = MoHDiTPipeline.from_pretrained(path)
    elif (path / "pipeline" / "model_index.json").is_file():
        pipe = MoHDiTPipeline.from_pretrained(path / "pipeline")
    elif (path / "trainer_state.json").is_file():
        pipe = _pipeline_from_checkpoint(path)
    elif (path / "checkpoints").is_dir():
        from .training import find_checkpoint

        ckpt = find_checkpoint(path)
        if ckpt is None:
            raise FileNotFoundError(f"{path} is a run folder without any complete checkpoint or exported pipeline")
        pipe = _pipeline_from_checkpoint(ckpt)
    elif (path / "config.json").is_file():
        cfg = json.loads((path / "config.json").read_text())
        if cfg.get("_class_name") != "MoHDiT":
            raise ValueError(f"{path}/config.json describes a {cfg.get('_class_name')!r}, not a MoHDiT")
        model = MoHDiT.from_pretrained(path)
        pipe = MoHDiTPipeline(model.eval(), make_scheduler("ddpm", model.config.learn_sigma), None, {})
    else:
        raise FileNotFoundError(
            f"{path} holds no model_index.json, pipeline/, checkpoints/, trainer_state.json or config.json: "
            f"not a moh-dit run, checkpoint, pipeline or transformer folder"
        )
    if vae is not None:
        pipe.register_modules(vae=load_vae(vae))
    if scheduler is not None:
        pipe.with_scheduler(scheduler)
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    pipe.to(device)
    if dtype != "fp32":
        pipe.transformer.to(DTYPES[dtype])
    return pipe


# ----------------------------------------------------------------------------------------------------
# Reproducible N-sample generation
# ----------------------------------------------------------------------------------------------------
def index_generator(seed: int, index: int) -> torch.Generator:
    """The generator of image ``index``: its label, initial noise and every ancestral noise draw."""
    return torch.Generator().manual_seed((seed * 1_000_003 + index) % (2**63))


def label_for_index(seed: int, index: int, num_classes: int, mode: str) -> int:
    """Uniform at random (from a generator independent of the noise) or class-balanced (index mod K)."""
    if mode == "balanced":
        return index % num_classes
    if mode == "uniform":
        g = torch.Generator().manual_seed((seed * 7_919 + index * 104_729 + 17) % (2**63))
        return int(torch.randint(0, num_classes, (1,), generator=g))
    raise ValueError(f"label mode must be 'uniform' or 'balanced', got {mode!r}")


@dataclass
class GenerationSettings:
    num_samples: int = 50_000
    seed: int = 0
    batch_size: int = 32
    guidance_scale: float = 1.5
    num_inference_steps: int = 250
    guidance_channels: Optional[int] = None
    label_mode: str = "uniform"

    def to_dict(self) -> dict:
        return dict(self.__dict__)


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
    npz_path: Optional[str | os.PathLike] = None,
) -> Optional[Path]:
    """Generate ``settings.num_samples`` images into ``sample_dir`` (resuming), then pack them into an
    ADM-style ``.npz`` (``arr_0`` uint8 NHWC RGB, ``arr_1`` labels). Returns the ``.npz`` path on the main
    process. With ``accelerator`` the missing indices are split over its processes."""
    sample_dir = Path(sample_dir)
    rank, world = (accelerator.process_index, accelerator.num_processes) if accelerator else (0, 1)
    is_main = rank == 0
    num_classes = pipe.transformer.config.num_classes
    if is_main:
        sample_dir.mkdir(parents=True, exist_ok=True)
        (sample_dir / "settings.json").write_text(json.dumps(settings.to_dict(), indent=2))
    if accelerator:
        accelerator.wait_for_everyone()
    todo = missing_indices(sample_dir, settings.num_samples)
    mine = todo[rank::world]
    if is_main:
        logger.info("%d of %d samples present; generating %d over %d processes", settings.num_samples - len(todo),
                    settings.num_samples, len(todo), world)  # fmt: skip
    bar = tqdm(total=len(todo), disable=not is_main, desc="sampling", unit="img", dynamic_ncols=True)
    start = time.time()
    pipe.set_progress_bar_config(disable=True)
    for b in range(0, len(mine), settings.batch_size):
        batch = mine[b : b + settings.batch_size]
        gens = [index_generator(settings.seed, i) for i in batch]
        kwargs = dict(num_images=len(batch))
        if num_classes > 0:
            kwargs = dict(class_labels=[label_for_index(settings.seed, i, num_classes, settings.label_mode) for i in batch])
        images = pipe(**kwargs, guidance_scale=settings.guidance_scale if num_classes > 0 else 1.0,
                      num_inference_steps=settings.num_inference_steps, generator=gens,
                      guidance_channels=settings.guidance_channels, output_type="uint8", progress=False).images  # fmt: skip
        for i, img in zip(batch, images):
            _save_png(img, _png_path(sample_dir, i))
        bar.update(len(batch) * world)  # the other ranks progress at about the same rate
        bar.set_postfix(img_s=f"{(b + len(batch)) * world / (time.time() - start):.2f}")
    bar.close()
    if accelerator:
        accelerator.wait_for_everyone()
    if not is_main:
        return None
    still = missing_indices(sample_dir, settings.num_samples)
    if still:
        raise RuntimeError(f"{len(still)} samples are missing after generation (e.g. index {still[0]})")
    return pack_npz(sample_dir, settings, npz_path or sample_dir.with_suffix(".npz"), num_classes)


def pack_npz(sample_dir: Path, settings: GenerationSettings, npz_path, num_classes: int) -> Path:
    """Read PNGs 0..N-1 back into one ``.npz`` (grayscale repeated to RGB, as the ADM evaluator expects)."""
    npz_path = Path(npz_path)
    first = np.asarray(Image.open(_png_path(sample_dir, 0)))
    h, w = first.shape[:2]
    arr = np.empty((settings.num_samples, h, w, 3), dtype=np.uint8)
    for i in tqdm(range(settings.num_samples), desc="packing npz", unit="img", leave=False):
        img = np.asarray(Image.open(_png_path(sample_dir, i)))
        arr[i] = img[:, :, None] if img.ndim == 2 else img[:, :, :3]
    labels = np.array([label_for_index(settings.seed, i, num_classes, settings.label_mode) if num_classes else -1
                       for i in range(settings.num_samples)], dtype=np.int64)  # fmt: skip
    tmp = npz_path.with_name(npz_path.name + ".tmp.npz")
    np.savez(tmp, arr_0=arr, arr_1=labels)
    os.replace(tmp, npz_path)
    return npz_path


def sample_grid(
    pipe: MoHDiTPipeline,
    class_labels: Sequence,
    per_class: int,
    seed: int,
    guidance_scale: float,
    num_inference_steps: int,
    guidance_channels: Optional[int] = None,
    batch_size: int = 64,
):
    """Images for a labelled grid: ``per_class`` samples of every requested class, one row per class."""
    ids = pipe.get_label_ids(class_labels) if pipe.transformer.config.num_classes else [None]
    labels = [c for c in ids for _ in range(per_class)]
    out = []
    for b in range(0, len(labels), batch_size):
        chunk = labels[b : b + batch_size]
        gens = [index_generator(seed, b + j) for j in range(len(chunk))]
        kwargs = dict(class_labels=chunk) if ids[0] is not None else dict(num_images=len(chunk))
        out.append(pipe(**kwargs, guidance_scale=guidance_scale if ids[0] is not None else 1.0,
                        num_inference_steps=num_inference_steps, generator=gens,
                        guidance_channels=guidance_channels, output_type="uint8").images)  # fmt: skip
    names = [pipe.id2label.get(c, str(c)) for c in ids] if ids[0] is not None else None
    return np.concatenate(out), names
