"""Where a resumable latent extraction stands (:mod:`moh_dit.data.latents`): what decides that two latent files hold
the same numbers, whether the work at an output path is done, can be resumed or starts afresh, the blocks each
process has finished, and the partial file they write into."""

from __future__ import annotations

import dataclasses
import errno
import json
import logging
import os
from pathlib import Path

import numpy as np

from moh_dit.data.latent_dataset import LatentDataset, partial_path
from moh_dit.errors import ArtifactError, OutputError
from moh_dit.files import atomic_write_json, sibling, size_text, writing
from moh_dit.manifests import differences, format_differences, read_manifest, write_manifest
from moh_dit.vae import SPACE_DEFAULTS, space_of

__all__ = [
    "latent_identity",
    "manifest_identity",
    "Plan",
    "plan_extraction",
    "read_finished",
    "commit_blocks",
    "open_partial",
    "progress_files",
]

logger = logging.getLogger("moh_dit.data.latents")


def progress_files(tmp: Path) -> list[Path]:
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


def manifest_identity(meta: dict) -> dict | None:
    return latent_identity(meta.get("data"), meta.get("vae", {}), meta)


@dataclasses.dataclass
class Plan:
    """What an extraction does with what it finds at its output path: ``done`` (a complete file with the
    same identity), ``resume`` (an unfinished one: ``finished`` maps block -> unreadable rows) or ``fresh``."""

    action: str
    finished: dict[int, list[int]] = dataclasses.field(default_factory=dict)
    attempt: int = 0
    deviation: dict | None = None


def commit_blocks(table: np.ndarray, record: Path, finished: dict[int, list[int]]) -> None:
    """Record a process's finished blocks (and their unreadable rows); the rows reach the file first."""
    table.flush()
    atomic_write_json(record, finished)


def plan_extraction(out: Path, identity: dict | None, batch_size: int, overwrite: bool) -> Plan:
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
        diffs = differences(manifest_identity(meta) or {}, identity)
        if diffs:
            raise OutputError(f"{out} holds other latents ({format_differences(diffs)}); {way_out}")
        return Plan("done")
    tmp = partial_path(out)
    state = read_manifest(tmp, "latents-partial") if tmp.exists() else None
    if overwrite or state is None:
        if tmp.exists() and state is None and not overwrite:
            logger.warning("%s is an unfinished extraction without a record: starting again", tmp)
        return Plan("fresh")
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
    return Plan("resume", read_finished(tmp), int(state["attempt"]) + 1, state.get("deviation"))


def read_finished(tmp: Path) -> dict[int, list[int]]:
    """Every finished block of an unfinished extraction and its unreadable rows, from all processes'
    records of all attempts."""
    finished: dict[int, list[int]] = {}
    for record in progress_files(tmp):
        try:
            finished.update({int(b): rows for b, rows in json.loads(record.read_text()).items()})
        except (OSError, ValueError) as err:
            raise ArtifactError(f"{record} is damaged ({err}); pass --overwrite to start again") from None
    return finished


def reserve(path: Path) -> None:
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


def open_partial(out_path: Path, plan, row: np.dtype, rows: int, blocks: int, state: dict) -> None:
    """On the main process: a fresh ``.partial.npy`` (stale files of an older extraction removed), or the log
    line of a resumed one; then the partial file's record."""
    tmp = partial_path(out_path)
    if plan.action == "fresh":
        for stale in [out_path, sibling(out_path, ".json"), sibling(tmp, ".json"), *progress_files(tmp)]:
            stale.unlink(missing_ok=True)
        np.lib.format.open_memmap(tmp, mode="w+", dtype=row, shape=(rows,)).flush()
        reserve(tmp)
    else:
        logger.info(
            "resuming the unfinished extraction %s: %d of %d blocks done (attempt %d)",
            tmp,
            len(plan.finished),
            blocks,
            plan.attempt + 1,
        )
    write_manifest(tmp, "latents-partial", **state)
