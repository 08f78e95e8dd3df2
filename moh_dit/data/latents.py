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
import dataclasses
import errno
import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from moh_dit.data.latent_dataset import FORMAT_VERSION, LatentDataset, partial_path
from moh_dit.errors import ArtifactError, DataError, OutputError
from moh_dit.files import atomic_write_json, check_free_space, ensure_writable_dir, sibling, size_text, writing
from moh_dit.images import to_model_range
from moh_dit.manifests import (
    differences,
    fingerprint_file,
    format_differences,
    read_manifest,
    write_manifest,
)
from moh_dit.progress import Progress
from moh_dit.vae import SPACE_DEFAULTS, encode_posterior, latent_space_of, space_of, vae_record

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


def _progress_files(tmp: Path) -> list[Path]:
    """The per-process records of finished blocks of an unfinished extraction (every attempt's)."""
    return sorted(tmp.parent.glob(f".{tmp.name}.done-*.json"))


def latent_identity(data: dict | None, vae: dict, shapes: dict) -> dict | None:
    """What decides whether two latent files hold the same numbers: the data (its description without the
    per-run fields), the VAE's weights and latent-space numbers and the dtype it ran in (not where it was
    loaded from), and the shapes and storage dtype. ``None`` for a data set that cannot describe itself."""
    if not data or "fingerprint" not in data:
        return None
    # what 0.3 recorded, then the latent-space numbers it did not know, only where they differ from what it assumed
    # (an SD-VAE's latents keep their identity, and are not extracted again)
    space = space_of(vae)
    newer = {k: space[k] for k, assumed in SPACE_DEFAULTS.items() if space[k] != assumed}
    return {
        "data": {k: v for k, v in data.items() if k not in ("count", "skipped", "id2label")},
        "vae": {k: vae.get(k) for k in ("sha256", "scaling_factor", "downsample_factor", "latent_channels", "dtype")}
        | newer,
        **{k: shapes.get(k) for k in ("rows", "latent_shape", "dtype", "image_size", "image_channels")},
        **({"images_kept": True} if shapes.get("images_kept") else {}),
        **({"moments_per_flip": 1} if shapes.get("moments_per_flip") == 1 else {}),
    }


def _manifest_identity(meta: dict) -> dict | None:
    return latent_identity(meta.get("data"), meta.get("vae", {}), meta)


@dataclasses.dataclass
class _Plan:
    """What an extraction does with what it finds at its output path: ``done`` (a complete file with the
    same identity), ``resume`` (an unfinished one: ``finished`` maps block -> unreadable rows) or ``fresh``."""

    action: str
    finished: dict[int, list[int]] = dataclasses.field(default_factory=dict)
    attempt: int = 0
    deviation: dict | None = None


def _commit(table: np.ndarray, record: Path, finished: dict[int, list[int]]) -> None:
    """Record a process's finished blocks (and their unreadable rows); the rows reach the file first."""
    table.flush()
    atomic_write_json(record, finished)


def _plan_extraction(out: Path, identity: dict | None, batch_size: int, overwrite: bool) -> _Plan:
    """Decide, from the records beside ``out``, whether the work is done, can be resumed or starts afresh.
    Every process reaches the same answer; nothing is changed here. Anything that would be replaced
    without ``overwrite`` is an error naming the way out."""
    way_out = "pass --overwrite to replace it, or choose another --out"
    if out.exists() and not overwrite:
        meta = read_manifest(out, "latents")
        if meta is None:
            raise OutputError(f"{out} exists without a latent manifest; {way_out}")
        try:
            LatentDataset(out)
        except ArtifactError as err:
            raise OutputError(f"{out} cannot be reused ({err}); {way_out}") from None
        if identity is None:
            raise OutputError(f"{out} exists and this data set cannot describe itself to compare; {way_out}")
        diffs = differences(_manifest_identity(meta) or {}, identity)
        if diffs:
            raise OutputError(f"{out} holds other latents ({format_differences(diffs)}); {way_out}")
        return _Plan("done")
    tmp = partial_path(out)
    state = read_manifest(tmp, "latents-partial") if tmp.exists() else None
    if overwrite or state is None:
        if tmp.exists() and state is None and not overwrite:
            logger.warning("%s is an unfinished extraction without a record: starting again", tmp)
        return _Plan("fresh")
    if identity is None or state.get("identity") is None:
        raise OutputError(f"{tmp} is an unfinished extraction that cannot be compared with this data set; {way_out}")
    diffs = differences(state["identity"], identity)
    if diffs:
        raise OutputError(
            f"{tmp} is an unfinished extraction of other latents ({format_differences(diffs)}): finish it with "
            f"its settings, or {way_out}"
        )
    if state["batch_size"] != batch_size:
        raise OutputError(
            f"{tmp} is an unfinished extraction in blocks of {state['batch_size']}: pass --batch-size "
            f"{state['batch_size']} to finish it, or --overwrite to start again"
        )
    return _Plan("resume", _read_finished(tmp), int(state["attempt"]) + 1, state.get("deviation"))


def _read_finished(tmp: Path) -> dict[int, list[int]]:
    """Every finished block of an unfinished extraction and its unreadable rows, from all processes'
    records of all attempts."""
    finished: dict[int, list[int]] = {}
    for record in _progress_files(tmp):
        try:
            finished.update({int(b): rows for b, rows in json.loads(record.read_text()).items()})
        except (OSError, ValueError) as err:
            raise ArtifactError(f"{record} is damaged ({err}); pass --overwrite to start again") from None
    return finished


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
    plan = _plan_extraction(out_path, identity, batch_size, overwrite)
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
        _open_partial(out_path, plan, row, len(dataset), blocks, state)
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
    finished = _read_finished(tmp)
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
    for leftover in [sibling(tmp, ".json"), *_progress_files(tmp)]:
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


def _reserve(path: Path) -> None:
    """Allocate the blocks of a fresh (sparse) latents file now: memory-mapped writes into a file whose disk fills
    later die with SIGBUS, hours in and without a word; a reservation that does not fit fails at once, as one line."""
    if not hasattr(os, "posix_fallocate"):  # not on macOS or Windows: the check of the free space above must do
        return
    with writing(f"the latents file ({size_text(path.stat().st_size)})", path.parent, path):
        fd = os.open(path, os.O_RDWR)
        try:
            os.posix_fallocate(fd, 0, path.stat().st_size)
        except OSError as err:
            if err.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):  # a filesystem that cannot reserve
                raise
        finally:
            os.close(fd)


def _open_partial(out_path: Path, plan, row: np.dtype, rows: int, blocks: int, state: dict) -> None:
    """On the main process: a fresh ``.partial.npy`` (stale files of an older extraction removed), or the log
    line of a resumed one; then the partial file's record."""
    tmp = partial_path(out_path)
    if plan.action == "fresh":
        for stale in [out_path, sibling(out_path, ".json"), sibling(tmp, ".json"), *_progress_files(tmp)]:
            stale.unlink(missing_ok=True)
        np.lib.format.open_memmap(tmp, mode="w+", dtype=row, shape=(rows,)).flush()
        _reserve(tmp)
    else:
        logger.info(
            "resuming the unfinished extraction %s: %d of %d blocks done (attempt %d)",
            tmp,
            len(plan.finished),
            blocks,
            plan.attempt + 1,
        )
    write_manifest(tmp, "latents-partial", **state)


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
            _commit(table, record, finished)
            last_commit = time.time()
        progress.update(n * world)  # the other processes progress at about the same rate
    _commit(table, record, finished)
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
