"""Reading a packed latent file: a memory-mapped dataset of posterior means and standard deviations
(both flips of every image) whose manifest is checked against the file.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from moh_dit.errors import ArtifactError, DataError
from moh_dit.files import sibling
from moh_dit.manifests import (
    fingerprint_file,
    read_manifest,
    short,
)

logger = logging.getLogger(__name__)
FORMAT_VERSION = 3  # 3: rows of unreadable images kept (label -1); rows and count in the manifest


# ----------------------------------------------------------------------------------------------------
# Pre-extraction
# ----------------------------------------------------------------------------------------------------
def partial_path(path: Path) -> Path:
    return sibling(path, ".partial.npy")


class LatentDataset(Dataset):
    """Pre-extracted latents: item ``i`` is ``(moments (2 flips, K, c, h, w) float32, label)`` (K = 2: the posterior's
    mean and std; K = 1: a deterministic encoder's latent), or, in a file made with
    ``--keep-images``, ``({"moments": ..., "images": uint8 (C, H, W)}, label)``; rows of unreadable images (label -1)
    are skipped. The manifest beside the file is checked against the file (rows, size, shapes) when it is opened."""

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
        expected = (2, meta.get("moments_per_flip", 2), *meta["latent_shape"])
        if len(self.table) != meta["rows"] or tuple(self.table.dtype["moments"].shape) != expected:
            raise ArtifactError(
                f"{self.path} does not match its manifest ({len(self.table)} rows of "
                f"{self.table.dtype['moments'].shape}, manifest: {meta['rows']} of {expected})"
            )
        self.rows = np.flatnonzero(np.asarray(self.table["label"]) >= 0)  # unreadable images are marked -1
        self.images_kept = "image" in (self.table.dtype.names or ())
        self.vae = meta["vae"]  # the autoencoder and its latent space (moh_dit.vae.vae_record)
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

    def __getitem__(self, index: int) -> tuple[torch.Tensor | dict[str, torch.Tensor], int]:
        row = self.table[self.rows[index]]
        moments = torch.from_numpy(np.array(row["moments"], dtype=np.float32))
        if self.images_kept:
            return {"moments": moments, "images": torch.from_numpy(np.array(row["image"]))}, int(row["label"])
        return moments, int(row["label"])
