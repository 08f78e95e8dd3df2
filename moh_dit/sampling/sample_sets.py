"""Sample folders on disk: where a folder's ``.npz`` and metrics go, and preparing a folder for a
resume (its manifest must match, stale temporary files go).
"""

from __future__ import annotations

import json
import os
import zipfile
from pathlib import Path
from typing import Any

import numpy as np

from moh_dit.errors import ArtifactError, unreadable_array
from moh_dit.files import TMP_MARK, ensure_writable_dir, ensure_writable_file, sibling
from moh_dit.manifests import MANIFEST_NAME, differences, format_differences, read_manifest, write_manifest


# ----------------------------------------------------------------------------------------------------
# Sample folders
# ----------------------------------------------------------------------------------------------------
def sample_npz_path(sample_dir: str | os.PathLike) -> Path:
    """The ADM ``.npz`` beside a sample folder: ``out/cfg1.5`` -> ``out/cfg1.5.npz``."""
    return sibling(sample_dir, ".npz")


def metrics_path_for(samples: str | os.PathLike, extractor: str = "inception") -> Path:
    """Default metrics JSON beside the samples (``x.npz`` -> ``x.metrics.json``; other extractors than
    Inception get their name in it, so evaluations with different features do not overwrite each other)."""
    path = Path(str(samples).rstrip("/"))
    base = path.with_name(path.name[: -len(".npz")]) if path.name.endswith(".npz") else path
    tag = "" if extractor in ("inception", "inception-v3-compat") else f"-{extractor.replace('/', '-')}"
    return sibling(base, f".metrics{tag}.json")


def read_npz_manifest(npz: str | os.PathLike) -> dict[str, Any] | None:
    """The sample manifest stored inside a moh-dit ``.npz`` (``None`` for other files)."""
    try:
        with np.load(npz) as data:
            if "moh_dit_manifest" not in data.files:
                return None
            return json.loads(str(data["moh_dit_manifest"]))
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as err:
        raise ArtifactError(unreadable_array(npz, err)) from None


def _png_files(sample_dir: Path) -> list[Path]:
    return sorted(p for p in sample_dir.glob("*.png") if p.stem.isdigit())


def prepare_sample_folder(sample_dir: Path, manifest: dict[str, Any], overwrite: bool, write: bool) -> None:
    """Check a sample folder (and its ``.npz``) against the manifest of the samples about to be made.

    A folder is resumed only when its recorded ``identity`` (model and VAE fingerprints and every setting
    that changes the pixels) equals the new one. Images without a manifest, or from other settings, stop
    with one line naming the difference, unless ``overwrite`` (then they are removed). With ``write``
    (the main process) the manifest is written; every process calls this so that all raise alike.
    """
    npz = sample_npz_path(sample_dir)
    new = manifest["identity"]
    problems = []
    if sample_dir.is_dir():
        old = read_manifest(sample_dir, "samples")
        pngs = _png_files(sample_dir)
        if old is not None and not pngs and not npz.is_file():
            old = None  # a set that holds no image yet (its first block failed) takes the new settings
        if old is not None and differences(old.get("identity", {}), new):
            problems.append(
                f"{sample_dir} holds samples made with other settings "
                f"({format_differences(differences(old.get('identity', {}), new))})"
            )
        elif old is None and pngs:
            problems.append(
                f"{sample_dir} holds {len(pngs)} images without a moh-dit manifest "
                f"(from another tool or an older version)"
            )
    if npz.is_file():
        old_npz = read_npz_manifest(npz)
        if old_npz is None or differences(old_npz.get("identity", {}), new):
            what = (
                "no manifest" if old_npz is None else format_differences(differences(old_npz.get("identity", {}), new))
            )
            problems.append(f"{npz} was made by something else ({what})")
    if problems and not overwrite:
        raise ArtifactError(f"{'; '.join(problems)}: use a new --sample-dir, or pass --overwrite to replace them")
    if not write:
        return
    if problems:  # overwrite: clear what would otherwise be mixed in
        for p in _png_files(sample_dir) if sample_dir.is_dir() else []:
            p.unlink()
        for stale in (sample_dir / MANIFEST_NAME, sample_dir / "settings.json", npz):
            if stale.exists():
                stale.unlink()
    ensure_writable_dir(sample_dir, "sample folder")
    # images a killed process was writing (not yet renamed); *.png.tmp from moh-dit 0.2
    for partial in [*sample_dir.glob(f".*.png{TMP_MARK}*"), *sample_dir.glob("*.png.tmp")]:
        partial.unlink()
    ensure_writable_file(npz, "the samples' .npz")
    write_manifest(sample_dir, "samples", **{k: v for k, v in manifest.items() if k not in ("kind", "format")})
