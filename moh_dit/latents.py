"""Latent space: loading a diffusers ``AutoencoderKL`` and pre-extracting a data set into one packed file.

Pre-extraction stores, for every image and for *both* horizontal flips, the VAE posterior's mean and
standard deviation, so training still draws a fresh flip and a fresh posterior sample every time an
image is seen (fast-DiT freezes one of each). Everything lives in a single ``.npy`` file read through a
memory map, with a manifest (``<file>.json``) beside it that records how it was made.

    moh-dit latents --data-path /data/imagenet/train --image-size 256 \\
        --vae stabilityai/sd-vae-ft-ema --out latents/imagenet256.npy
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any, Mapping, Optional

import numpy as np
import torch
from diffusers import AutoencoderKL
from torch.utils.data import DataLoader, Dataset

from .artifacts import (
    atomic_write_json,
    differences,
    ensure_writable_dir,
    fingerprint_file,
    fingerprint_module,
    format_differences,
    read_manifest,
    short,
    sibling,
    write_manifest,
)
from .errors import ArtifactError, DataError, OutputError, blame_the_file
from .images import to_model_range
from .tracking import Progress

__all__ = [
    "load_vae",
    "resolve_vae_spec",
    "vae_record",
    "latent_space",
    "latent_space_differences",
    "check_vae",
    "encode_posterior",
    "sample_posterior",
    "extract_latents",
    "LatentDataset",
]

logger = logging.getLogger(__name__)
FORMAT_VERSION = 3  # 3: rows of unreadable images kept (label -1); rows and count in the manifest


# ----------------------------------------------------------------------------------------------------
# The VAE
# ----------------------------------------------------------------------------------------------------
def _looks_like_path(spec: str) -> bool:
    """A hub id is ``name`` or ``namespace/name``; anything absolute, relative (``./``, ``../``, ``~``) or
    deeper is a path on disk."""
    return spec.startswith(("/", ".", "~")) or spec.count("/") > 1 or (os.sep != "/" and os.sep in spec)


def resolve_vae_spec(spec: Optional[str]) -> Optional[str]:
    """``none`` -> ``None``; an existing local folder -> its absolute path (so a record stays valid from any
    working directory); a hub id -> as given. A path that does not exist is an error, not a hub lookup."""
    if spec is None or str(spec).strip().lower() in ("", "none"):
        return None
    path = Path(str(spec)).expanduser()
    if path.exists():
        if not path.is_dir():
            raise DataError(f"VAE path {path} is not a folder (expected a diffusers AutoencoderKL folder)")
        return str(path.resolve())
    if _looks_like_path(str(spec)):
        raise DataError(f"VAE folder {spec} does not exist")
    return str(spec)


def load_vae(
    spec: Optional[str],
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    local_only: bool = False,
):
    """``none`` -> None; a local folder (a VAE, or a pipeline with a ``vae/`` sub-folder) or a hub id such
    as ``stabilityai/sd-vae-ft-ema`` -> an ``AutoencoderKL`` in eval mode. Hub ids are looked up in the local
    cache first, so an offline machine that has the VAE cached does not wait on the network;
    ``local_only`` never goes to the network."""
    resolved = resolve_vae_spec(spec)
    if resolved is None:
        return None
    path = Path(resolved)

    def unreadable(err: BaseException) -> DataError:
        where = (
            "the folder is not a readable AutoencoderKL"
            if path.is_dir()
            else (
                f"it is not cached locally and could not be fetched from the hub; if you are offline, download it "
                f"elsewhere (`hf download {resolved}`) and pass the local folder"
            )
        )
        return DataError(f"could not load VAE {resolved}: {where} ({str(err).splitlines()[0]})")

    with blame_the_file(unreadable, (OSError, ValueError)):
        if path.is_dir():
            sub = "vae" if not (path / "config.json").exists() and (path / "vae" / "config.json").exists() else None
            vae = AutoencoderKL.from_pretrained(path, subfolder=sub, torch_dtype=dtype, use_safetensors=True)
        else:
            try:
                vae = AutoencoderKL.from_pretrained(resolved, torch_dtype=dtype, local_files_only=True)
            except (OSError, ValueError):
                if local_only:
                    raise
                vae = AutoencoderKL.from_pretrained(resolved, torch_dtype=dtype)
    return vae.to(device).eval().requires_grad_(False)


def latent_space(config: Mapping[str, Any]) -> dict[str, Any]:
    """The numbers that decide how a VAE maps images to latents and back, besides its weights, from its
    config (``AutoencoderKL.config``, or the ``config.json`` it was saved with)."""
    return {
        "scaling_factor": float(config.get("scaling_factor", 0.18215)),
        "downsample_factor": 2 ** (len(config["block_out_channels"]) - 1),  # diffusers' VAE scale factor
        "latent_channels": int(config.get("latent_channels", 4)),
    }


def latent_space_differences(recorded: Mapping[str, Any], current: Mapping[str, Any]) -> list[tuple[str, Any, Any]]:
    """``(key, recorded, current)`` for every latent-space number that differs; numbers the record does not
    hold are not compared."""
    return [
        (k, recorded.get(k), current[k])
        for k in ("scaling_factor", "downsample_factor", "latent_channels")
        if recorded.get(k) is not None and recorded.get(k) != current[k]
    ]


def vae_record(vae: AutoencoderKL, spec: Optional[str]) -> dict:
    """What identifies a VAE for latents and pipelines: where it came from, its weights fingerprint, and
    the numbers that change the latent space (scaling factor, downsampling, channels)."""
    return {
        "spec": resolve_vae_spec(spec) if spec else None,
        "sha256": fingerprint_module(vae),
        **latent_space(vae.config),
    }


def check_vae(vae: AutoencoderKL, spec: Optional[str], record: dict, what: str) -> None:
    """Stop when ``vae`` is not the VAE described by ``record`` (weights, scaling factor, downsampling)."""
    mine = vae_record(vae, spec)
    diffs = (
        [("sha256", record["sha256"], mine["sha256"])] if record.get("sha256") not in (None, mine["sha256"]) else []
    )
    diffs += latent_space_differences(record, mine)
    if diffs:
        raise ArtifactError(
            f"VAE {mine['spec']} is not the VAE {what} was made with ({format_differences(diffs)}); "
            f"use the recorded VAE {record.get('spec')}"
        )


@torch.no_grad()
def encode_posterior(vae: AutoencoderKL, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Images in [-1, 1] (N, C, H, W) -> posterior mean and std (N, c, h, w), unscaled."""
    dist = vae.encode(images.to(vae.dtype)).latent_dist
    return dist.mean.float(), dist.std.float()


def sample_posterior(
    mean: torch.Tensor, std: torch.Tensor, scaling_factor: float, generator: Optional[torch.Generator] = None
) -> torch.Tensor:
    """A fresh draw from N(mean, std^2), times the VAE's scaling factor."""
    eps = torch.randn(mean.shape, generator=generator, device=mean.device, dtype=mean.dtype)
    return (mean + std * eps) * scaling_factor


# ----------------------------------------------------------------------------------------------------
# Pre-extraction
# ----------------------------------------------------------------------------------------------------
def partial_path(path: Path) -> Path:
    return sibling(path, ".partial.npy")


class _MarkedImages(Dataset):
    """A data set's items with a flag: ``(image, label, True)``, or zeros and ``False`` for an image that
    cannot be read. Extraction reads every image once and marks the bad ones in the file, instead of
    scanning the data set first."""

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset
        # once: some data sets build the list on every access; only data sets with ``load`` need it
        self.targets = list(dataset.targets) if hasattr(dataset, "load") else None
        self.shape = next(shape for i in range(len(dataset)) if (shape := self._shape(i)) is not None)

    def _shape(self, index: int) -> Optional[tuple]:
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


def _size(n: int) -> str:
    return next(
        f"{n / f:.1f} {unit}" for f, unit in ((1e9, "GB"), (1e6, "MB"), (1e3, "kB"), (1, "bytes")) if n >= f or f == 1
    )


def _progress_files(tmp: Path) -> list[Path]:
    """The per-process records of finished blocks of an unfinished extraction (every attempt's)."""
    return sorted(tmp.parent.glob(f".{tmp.name}.done-*.json"))


def latent_identity(data: Optional[dict], vae: dict, shapes: dict) -> Optional[dict]:
    """What decides whether two latent files hold the same numbers: the data (its description without the
    per-run fields), the VAE's weights and latent-space numbers and the dtype it ran in (not where it was
    loaded from), and the shapes and storage dtype. ``None`` for a data set that cannot describe itself."""
    if not data or "fingerprint" not in data:
        return None
    return {
        "data": {k: v for k, v in data.items() if k not in ("count", "skipped", "id2label")},
        "vae": {k: vae.get(k) for k in ("sha256", "scaling_factor", "downsample_factor", "latent_channels", "dtype")},
        **{k: shapes.get(k) for k in ("rows", "latent_shape", "dtype", "image_size", "image_channels")},
    }


def _manifest_identity(meta: dict) -> Optional[dict]:
    return latent_identity(meta.get("data"), meta.get("vae", {}), meta)


@dataclasses.dataclass
class _Plan:
    """What an extraction does with what it finds at its output path: ``done`` (a complete file with the
    same identity), ``resume`` (an unfinished one: ``finished`` maps block -> unreadable rows) or ``fresh``."""

    action: str
    finished: dict[int, list[int]] = dataclasses.field(default_factory=dict)
    attempt: int = 0
    deviation: Optional[dict] = None


def _commit(table: np.ndarray, record: Path, finished: dict[int, list[int]]) -> None:
    """Record a process's finished blocks (and their unreadable rows); the rows reach the file first."""
    table.flush()
    atomic_write_json(record, finished)


def _plan_extraction(out: Path, identity: Optional[dict], batch_size: int, overwrite: bool) -> _Plan:
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
    vae: AutoencoderKL,
    out_path: str | os.PathLike,
    batch_size: int = 64,
    num_workers: int = 0,
    dtype: str = "float16",
    vae_name: str = "",
    id2label: Optional[dict[int, str]] = None,
    accelerator=None,
    max_bad_fraction: float = 0.01,
    fp32_vae: Optional[AutoencoderKL] = None,
    overwrite: bool = False,
    commit_every_s: float = 30.0,
) -> Optional[Path]:
    """Encode every image of ``dataset`` (unflipped and flipped) into one packed ``.npy`` file.

    Rows are ``(moments, label)`` with ``moments`` of shape (2 flips, 2 [mean, std], c, h, w). Each image is
    read once; an unreadable one keeps its row with label -1 and is listed in the manifest (more than
    ``max_bad_fraction`` of them stops the extraction). With ``accelerator`` the images are split over its
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
    factor = latent_space(vae.config)["downsample_factor"]
    if vae.config.in_channels != channels:
        raise DataError(
            f"the VAE takes {vae.config.in_channels}-channel images but the data gives {channels}-channel ones: "
            f"use --channels {vae.config.in_channels} (grayscale is repeated)"
        )
    if size % factor:
        raise DataError(f"image size {size} is not divisible by the VAE's downsampling factor {factor}")
    latent_shape = tuple(encode_posterior(vae, torch.zeros(1, *images.shape, device=device))[0].shape[1:])
    vae_info = dict(vae_record(vae, vae_name or None), dtype=str(vae.dtype).removeprefix("torch."))
    shapes = dict(
        rows=len(dataset),
        latent_shape=list(latent_shape),
        dtype=dtype,
        image_size=int(size),
        image_channels=int(channels),
    )
    describe = getattr(dataset, "describe", None)
    identity = latent_identity(describe() if describe is not None else None, vae_info, shapes)
    plan = _plan_extraction(out_path, identity, batch_size, overwrite)
    row = np.dtype([("moments", dtype, (2, 2, *latent_shape)), ("label", "<i8")])
    tmp = partial_path(out_path)
    if plan.action == "fresh":  # a full disk would stop the extraction hours in, with a bus error
        needed = len(dataset) * row.itemsize
        freed = sum(p.stat().st_size for p in (out_path, tmp) if p.is_file())
        free = shutil.disk_usage(out_path.parent).free + freed
        if needed > free:
            raise OutputError(
                f"{out_path} needs {_size(needed)} and {out_path.parent} has {_size(free)} free: make room, "
                f"choose another --out, or store float16 (--dtype)"
            )
    if accelerator:
        accelerator.wait_for_everyone()  # every process has read the records before they change
    if plan.action == "done":
        logger.info("%s already holds these latents (same data, VAE and shapes): nothing to do", out_path)
        return out_path if main else None

    blocks = -(-len(dataset) // batch_size)
    state = dict(identity=identity, batch_size=batch_size, attempt=plan.attempt, deviation=plan.deviation)
    if main:
        if plan.action == "fresh":
            for stale in [out_path, sibling(out_path, ".json"), sibling(tmp, ".json"), *_progress_files(tmp)]:
                stale.unlink(missing_ok=True)
            np.lib.format.open_memmap(tmp, mode="w+", dtype=row, shape=(len(dataset),)).flush()
        else:
            logger.info(
                "resuming the unfinished extraction %s: %d of %d blocks done (attempt %d)",
                tmp,
                len(plan.finished),
                blocks,
                plan.attempt + 1,
            )
        write_manifest(tmp, "latents-partial", **state)
    if accelerator:
        accelerator.wait_for_everyone()
    table = np.load(tmp, mmap_mode="r+")
    if table.dtype != row or len(table) != len(dataset):
        raise ArtifactError(f"{tmp} does not have the rows its record describes; pass --overwrite to start again")
    todo = [b for b in range(blocks) if b not in plan.finished][rank::world]
    sampler = [list(range(b * batch_size, min((b + 1) * batch_size, len(dataset)))) for b in todo]
    loader = DataLoader(images, batch_sampler=sampler, num_workers=num_workers)
    record = tmp.parent / f".{tmp.name}.done-a{plan.attempt}-r{rank}.json"
    finished: dict[int, list[int]] = {}
    deviation, started = plan.deviation, time.time()
    last_commit = started

    done_rows = sum(min(batch_size, len(dataset) - b * batch_size) for b in plan.finished)
    progress = Progress(len(dataset), initial=done_rows, desc="encoding latents", unit="img", enabled=main)
    for b, (x, labels, ok) in zip(todo, loader):
        x = x.to(device)
        both = torch.cat([x, x.flip(-1)])  # unflipped then flipped
        mean, std = encode_posterior(vae, both)
        if deviation is None and vae.dtype != torch.float32 and main:
            keep = ok.repeat(2).to(device)
            deviation = _deviation_from_fp32(fp32_vae or copy.deepcopy(vae).float(), both[keep], mean[keep])
            write_manifest(tmp, "latents-partial", **dict(state, deviation=deviation))
        n = x.shape[0]
        moments = torch.stack([torch.stack([mean[:n], std[:n]], 1), torch.stack([mean[n:], std[n:]], 1)], 1)
        start = b * batch_size
        table["moments"][start : start + n] = moments.cpu().numpy().astype(dtype)
        table["label"][start : start + n] = labels.numpy()
        finished[b] = [start + i for i in range(n) if not ok[i]]
        if time.time() - last_commit >= commit_every_s:
            _commit(table, record, finished)
            last_commit = time.time()
        progress.update(n * world)  # the other processes progress at about the same rate
    progress.close()
    _commit(table, record, finished)
    del table
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


def _deviation_from_fp32(reference: AutoencoderKL, images: torch.Tensor, mean: torch.Tensor) -> dict:
    """How far a half-precision VAE's posterior means ``mean`` are from those of ``reference`` (fp32)."""
    ref_mean, _ = encode_posterior(reference, images)
    diff = (mean.float() - ref_mean).abs()
    return {
        "max_abs": float(diff.max()),
        "rms": float(diff.square().mean().sqrt()),
        "rms_over_std": float(diff.square().mean().sqrt() / ref_mean.std().clamp_min(1e-12)),
        "images": int(images.shape[0] // 2),
    }


class LatentDataset(Dataset):
    """Pre-extracted latents: item ``i`` is ``(moments (2, 2, c, h, w) float32, label)``; rows of unreadable
    images (label -1) are skipped. The manifest beside the file is checked against the file (rows, size,
    shapes) when it is opened."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            hint = (
                " (an unfinished extraction left a .partial file: run it again)"
                if partial_path(self.path).exists()
                else ""
            )
            raise DataError(f"latent file {self.path} not found{hint}")
        meta = read_manifest(self.path, "latents")
        if meta is None:
            old = self.path.with_suffix(".json")
            hint = f" ({old.name} is from an older moh-dit: extract the latents again)" if old.is_file() else ""
            raise ArtifactError(f"{sibling(self.path, '.json')} (the manifest of {self.path.name}) is missing{hint}")
        if meta.get("format_version") != FORMAT_VERSION:
            raise ArtifactError(f"{self.path}: unsupported latent format {meta.get('format_version')}; extract again")
        self.meta = meta
        if self.path.stat().st_size != meta["file_size"]:
            raise ArtifactError(
                f"{self.path} has {self.path.stat().st_size} bytes but its manifest says "
                f"{meta['file_size']}: the file was changed or truncated; extract again"
            )
        self._check_unchanged()
        try:
            self.table = np.load(self.path, mmap_mode="r")
        except (OSError, ValueError) as err:
            raise ArtifactError(f"{self.path} is not a readable latent file ({err}); extract again") from None
        expected = (2, 2, *meta["latent_shape"])
        if len(self.table) != meta["rows"] or tuple(self.table.dtype["moments"].shape) != expected:
            raise ArtifactError(
                f"{self.path} does not match its manifest ({len(self.table)} rows of "
                f"{self.table.dtype['moments'].shape}, manifest: {meta['rows']} of {expected})"
            )
        self.rows = np.flatnonzero(np.asarray(self.table["label"]) >= 0)  # unreadable images are marked -1
        self.vae = meta["vae"]
        self.scaling_factor = float(self.vae["scaling_factor"])
        self.latent_shape = tuple(meta["latent_shape"])

    def _check_unchanged(self) -> None:
        """The file's time is the fast check that it still holds what the manifest describes (hashing tens of
        gigabytes at every start would take minutes); when the time differs, or the manifest predates this
        record, the SHA-256 decides."""
        recorded = self.meta.get("file_mtime_ns")
        if recorded is not None and self.path.stat().st_mtime_ns == recorded:
            return
        started = time.time()
        digest = fingerprint_file(self.path)
        if digest != self.meta["file_sha256"]:
            raise ArtifactError(
                f"{self.path} was changed after extraction (SHA-256 {short(digest)}, recorded "
                f"{short(self.meta['file_sha256'])}); extract it again"
            )
        why = "its time differs from the record" if recorded is not None else "its manifest records no file time"
        logger.info(
            "%s: %s, so its SHA-256 was checked (%.0f s): it matches. Copies made with `cp -p` or `rsync -t` "
            "keep the time and skip this check",
            self.path,
            why,
            time.time() - started,
        )

    @property
    def id2label(self) -> dict[int, str]:
        return {int(k): v for k, v in self.meta["data"].get("id2label", {}).items()}

    @property
    def targets(self) -> list[int]:
        return np.asarray(self.table["label"])[self.rows].tolist()

    def describe(self) -> dict:
        """What identifies this data set: the latent file's fingerprint (recorded at extraction)."""
        return {
            "name": "latents",
            "fingerprint": self.meta["file_sha256"],
            "count": len(self),
            "source": self.meta["data"],
        }

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        row = self.table[self.rows[index]]
        return torch.from_numpy(np.array(row["moments"], dtype=np.float32)), int(row["label"])


if __name__ == "__main__":  # python -m moh_dit.latents: the same as `moh-dit latents`
    from moh_dit.cli import run_cli
    from moh_dit.commands.latents import main

    run_cli(main)
