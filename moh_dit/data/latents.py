r"""Pre-extracting a data set into one packed latent file (``moh-dit latents``).

Pre-extraction stores, for every image and for *both* horizontal flips, the VAE posterior's mean and
standard deviation, so training still draws a fresh flip and a fresh posterior sample every time an
image is seen (fast-DiT freezes one of each). Everything lives in a single ``.npy`` file, written in
resumable chunks, with a manifest (``<file>.json``) beside it that records how it was made.

    moh-dit latents --data-path /data/imagenet/train --image-size 256 \
        --vae stabilityai/sd-vae-ft-ema --out latents/imagenet256.npy
"""

from __future__ import annotations

import copy
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from moh_dit.data.latent_dataset import FORMAT_VERSION, partial_path
from moh_dit.data.latent_progress import (
    commit_blocks,
    latent_identity,
    open_partial,
    plan_extraction,
    progress_files,
    read_finished,
)
from moh_dit.errors import ArtifactError, DataError
from moh_dit.files import check_free_space, ensure_writable_dir, sibling
from moh_dit.images import to_model_range
from moh_dit.manifests import (
    fingerprint_file,
    write_manifest,
)
from moh_dit.progress import Progress
from moh_dit.vae import encode_posterior, latent_space_of, vae_record

logger = logging.getLogger(__name__)


class _MarkedImages(Dataset):
    """A data set's items with a flag: ``(image, label, True)``, or zeros and ``False`` for an image that
    cannot be read. Extraction reads every image once and marks the bad ones in the file, instead of
    scanning the data set first."""

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset
        # once: some data sets build the list on every access; only data sets with ``load`` need it
        self.targets = list(dataset.targets) if hasattr(dataset, "load") else None
        self.shape = next(shape for i in range(len(dataset)) if (shape := self._shape(i)) is not None)

    def _shape(self, index: int) -> tuple | None:
        """The shape of item ``index`` as the model sees it, or ``None`` if it cannot be read."""
        load = getattr(self.dataset, "load", None)
        try:
            return tuple(to_model_range(load(index)).shape if load is not None else self.dataset[index][0].shape)
        except (OSError, ValueError, SyntaxError):
            return None

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int):
        load = getattr(self.dataset, "load", None)
        if load is None:
            x, y = self.dataset[index]
            return x, y, True
        try:
            return to_model_range(load(index)), self.targets[index], True
        except (OSError, ValueError, SyntaxError):
            return torch.zeros(self.shape), -1, False


@torch.no_grad()
def extract_latents(
    dataset: Dataset,
    vae: torch.nn.Module,
    out_path: str | os.PathLike,
    batch_size: int = 64,
    num_workers: int = 0,
    dtype: str = "float16",
    vae_name: str = "",
    id2label: dict[int, str] | None = None,
    accelerator=None,
    max_bad_fraction: float = 0.01,
    fp32_vae: torch.nn.Module | None = None,
    overwrite: bool = False,
    commit_every_s: float = 30.0,
    keep_images: bool = False,
) -> Path | None:
    """Encode every image of ``dataset`` (unflipped and flipped) into one packed ``.npy`` file.

    With ``keep_images`` each row also holds the image itself (uint8, as read and center-cropped), for REPA's
    encoders, which see the images the latents were made from (REPA stores them beside its latents too).

    Rows are ``(moments, label)`` with ``moments`` of shape (2 flips, K, c, h, w): K = 2 (the posterior's mean
    and std) for a Gaussian encoder (AutoencoderKL), K = 1 (the latent) for a deterministic one (AutoencoderDC).
    Each image is read once; an unreadable one keeps its row with label -1 and is listed in the manifest (more
    than ``max_bad_fraction`` of them stops the extraction). With ``accelerator`` the images are split over its
    processes in fixed blocks of ``batch_size``, each process writing its own rows of the one file; the
    blocks are the same for any process count, so the file is bit-identical too. The VAE may run in half
    precision (its dtype); the deviation of the posterior means from ``fp32_vae`` (the same VAE in fp32;
    default: ``vae``'s rounded weights in fp32) is then measured on the first block and recorded.

    The file is written as ``.partial.npy``, and every ``commit_every_s`` seconds each process records the
    blocks it has finished: an interrupted extraction run again with the same data, VAE and batch size
    resumes with the blocks not yet done (on any number of processes). When complete, the manifest
    (``<file>.json``: the data, the VAE by resolved path or hub id and fingerprint, the shapes, the file's
    size, time and SHA-256) is written and the file renamed into place. A complete file of the same latents
    is left as it is; one of other latents is replaced only with ``overwrite``. Returns the path on the
    main process.
    """
    out_path = Path(out_path)
    rank, world = (accelerator.process_index, accelerator.num_processes) if accelerator else (0, 1)
    main = rank == 0
    ensure_writable_dir(out_path.parent, "latent output folder")
    device = next(vae.parameters()).device
    images = _MarkedImages(dataset)
    channels, size = images.shape[0], images.shape[-1]
    _check_vae_fits(vae, channels, size)
    probe_mean, probe_std = encode_posterior(vae, torch.zeros(1, *images.shape, device=device))
    latent_shape, per_flip = tuple(probe_mean.shape[1:]), 1 if probe_std is None else 2  # (latent) or (mean, std)
    vae_info = dict(vae_record(vae, vae_name or None), dtype=str(vae.dtype).removeprefix("torch."))
    shapes = dict(
        rows=len(dataset),
        latent_shape=list(latent_shape),
        dtype=dtype,
        image_size=int(size),
        image_channels=int(channels),
    )
    if keep_images:  # recorded only when kept: files made before the option keep their identity
        shapes["images_kept"] = True
    if per_flip == 1:  # a deterministic encoder (AutoencoderDC): one latent per flip, no std
        shapes["moments_per_flip"] = 1
    describe = getattr(dataset, "describe", None)
    identity = latent_identity(describe() if describe is not None else None, vae_info, shapes)
    plan = plan_extraction(out_path, identity, batch_size, overwrite)
    fields = [("moments", dtype, (2, per_flip, *latent_shape)), ("label", "<i8")]
    row = np.dtype(fields + ([("image", "u1", (channels, size, size))] if keep_images else []))
    tmp = partial_path(out_path)
    if plan.action == "fresh":  # a full disk would stop the extraction hours in, with a bus error
        check_free_space(  # the files a fresh extraction replaces count as free
            out_path.parent,
            len(dataset) * row.itemsize,
            out_path.name,
            freed=sum(p.stat().st_size for p in (out_path, tmp) if p.is_file()),
            advice="make room, choose another --out, or store float16 (--dtype)",
        )
    if accelerator:
        accelerator.wait_for_everyone()  # every process has read the records before they change
    if plan.action == "done":
        logger.info("%s already holds these latents (same data, VAE and shapes): nothing to do", out_path)
        return out_path if main else None

    blocks = -(-len(dataset) // batch_size)
    state = dict(identity=identity, batch_size=batch_size, attempt=plan.attempt, deviation=plan.deviation)
    if main:
        open_partial(out_path, plan, row, len(dataset), blocks, state)
    if accelerator:
        accelerator.wait_for_everyone()
    table = np.load(tmp, mmap_mode="r+")
    if table.dtype != row or len(table) != len(dataset):
        raise ArtifactError(f"{tmp} does not have the rows its record describes; pass --overwrite to start again")
    todo = [b for b in range(blocks) if b not in plan.finished][rank::world]
    done_rows = sum(min(batch_size, len(dataset) - b * batch_size) for b in plan.finished)
    progress = Progress(len(dataset), initial=done_rows, desc="encoding latents", unit="img", enabled=main)
    started, deviation = time.time(), plan.deviation
    # the posterior's deviation from fp32 is measured once, on the main process's first block, and recorded at once
    # (a resumed extraction keeps the number it measured first)
    measure = main and bool(todo) and deviation is None and vae.dtype != torch.float32
    measured = _encode_blocks(
        images,
        vae,
        table,
        todo,
        batch_size=batch_size,
        num_workers=num_workers,
        record=tmp.parent / f".{tmp.name}.done-a{plan.attempt}-r{rank}.json",
        progress=progress,
        world=world,
        commit_every_s=commit_every_s,
        fp32_vae=(fp32_vae or copy.deepcopy(vae).float()) if measure else None,
        on_deviation=lambda found: write_manifest(tmp, "latents-partial", **dict(state, deviation=found)),
    )
    progress.close()
    del table
    deviation = measured if measured is not None else deviation
    seconds = time.time() - started
    if accelerator:
        accelerator.wait_for_everyone()
    if not main:
        return None
    finished = read_finished(tmp)
    missing = sorted(set(range(blocks)) - set(finished))
    if missing:
        raise ArtifactError(f"{tmp}: blocks {missing[:5]} were not written (a process failed?); run it again")
    bad = sorted(i for rows in finished.values() for i in rows)
    skipped = [getattr(dataset, "samples", [[str(i)]] * len(dataset))[i][0] for i in bad]
    if len(bad) > max(1, int(max_bad_fraction * len(dataset))):
        raise DataError(f"{len(bad)} of {len(dataset)} images are unreadable (e.g. {skipped[:3]}); fix or remove them")
    for path in skipped:
        logger.warning("unreadable image %s: its row is marked and skipped in training", path)
    data_record = {"count": len(dataset) - len(bad), "id2label": {str(k): v for k, v in (id2label or {}).items()}}
    if describe is not None:
        data_record.update(describe(), count=len(dataset) - len(bad), skipped=skipped)
    if deviation is not None:
        vae_info["deviation_from_fp32"] = deviation
        logger.info(
            "%s VAE: posterior means deviate from fp32 by %.3g at most (rms %.3g, %.2f%% of their std)",
            vae_info["dtype"],
            deviation["max_abs"],
            deviation["rms"],
            100 * deviation["rms_over_std"],
        )
    # the manifest first, then the file: a crash in between leaves a finished .partial that the next run
    # renames, never a file beside a manifest that describes other latents
    stat = tmp.stat()
    write_manifest(
        out_path,
        "latents",
        format_version=FORMAT_VERSION,
        **shapes,
        count=len(dataset) - len(bad),
        vae=vae_info,
        data=data_record,
        world_size=world,
        attempts=plan.attempt + 1,
        encode_seconds=seconds,
        file_sha256=fingerprint_file(tmp),
        file_size=stat.st_size,
        file_mtime_ns=stat.st_mtime_ns,
    )
    os.replace(tmp, out_path)
    for leftover in [sibling(tmp, ".json"), *progress_files(tmp)]:
        leftover.unlink(missing_ok=True)
    return out_path


def _check_vae_fits(vae: torch.nn.Module, channels: int, size: int) -> None:
    """The VAE takes images of this many channels, and its downsampling divides their size."""
    factor = latent_space_of(vae)["downsample_factor"]
    if vae.config.in_channels != channels:
        raise DataError(
            f"the VAE takes {vae.config.in_channels}-channel images but the data gives {channels}-channel ones: "
            f"use --channels {vae.config.in_channels} (grayscale is repeated)"
        )
    if size % factor:
        raise DataError(f"image size {size} is not divisible by the VAE's downsampling factor {factor}")


def _encode_blocks(
    images: Dataset,
    vae: torch.nn.Module,
    table: np.ndarray,
    todo: list[int],
    *,
    batch_size: int,
    num_workers: int,
    record: Path,
    progress: Progress,
    world: int,
    commit_every_s: float,
    fp32_vae: torch.nn.Module | None,
    on_deviation: Callable[[dict], None],
) -> dict | None:
    """Encode this process's blocks ``todo`` (unflipped and flipped) into ``table``'s rows, recording the finished
    blocks (and their unreadable rows) in ``record`` every ``commit_every_s`` seconds and at the end. With
    ``fp32_vae``, the deviation of the first block's posterior means from it goes to ``on_deviation`` as soon as
    it is measured, and is returned."""
    device, rows = next(vae.parameters()).device, len(table)
    sampler = [list(range(b * batch_size, min((b + 1) * batch_size, rows))) for b in todo]
    loader = DataLoader(images, batch_sampler=sampler, num_workers=num_workers)
    finished: dict[int, list[int]] = {}
    deviation, last_commit = None, time.time()
    for b, (x, labels, ok) in zip(todo, loader):
        x = x.to(device)
        both = torch.cat([x, x.flip(-1)])  # unflipped then flipped
        mean, std = encode_posterior(vae, both)
        if fp32_vae is not None and deviation is None:
            keep = ok.repeat(2).to(device)
            deviation = _deviation_from_fp32(fp32_vae, both[keep], mean[keep])
            on_deviation(deviation)
        n = x.shape[0]
        per_image = torch.stack([mean] if std is None else [mean, std], 1)  # (2n, K, c, h, w)
        moments = torch.stack([per_image[:n], per_image[n:]], 1)  # (n, 2 flips, K, c, h, w)
        start = b * batch_size
        table["moments"][start : start + n] = moments.cpu().numpy().astype(table["moments"].dtype)
        table["label"][start : start + n] = labels.numpy()
        if "image" in table.dtype.names:  # the uint8 values the model range came from (u / 127.5 - 1)
            table["image"][start : start + n] = (
                ((x.float().cpu() + 1) * 127.5).round().clamp(0, 255).to(torch.uint8).numpy()
            )
        finished[b] = [start + i for i in range(n) if not ok[i]]
        if time.time() - last_commit >= commit_every_s:
            commit_blocks(table, record, finished)
            last_commit = time.time()
        progress.update(n * world)  # the other processes progress at about the same rate
    commit_blocks(table, record, finished)
    return deviation


def _deviation_from_fp32(reference: torch.nn.Module, images: torch.Tensor, mean: torch.Tensor) -> dict:
    """How far a half-precision VAE's posterior means ``mean`` are from those of ``reference`` (fp32)."""
    ref_mean, _ = encode_posterior(reference, images)
    diff = (mean.float() - ref_mean).abs()
    return {
        "max_abs": float(diff.max()),
        "rms": float(diff.square().mean().sqrt()),
        "rms_over_std": float(diff.square().mean().sqrt() / ref_mean.std().clamp_min(1e-12)),
        "images": int(images.shape[0] // 2),
    }
