"""Reference statistics: an ADM reference batch, or statistics of any folder or ``.npz`` of real
images computed once and cached, keyed by the reference's content, the extractor, its weights and the
crop, so that a changed reference is never scored against stale statistics.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import zipfile
from pathlib import Path

import numpy as np

from moh_dit.data.image_folder import list_images
from moh_dit.errors import EvaluationError, unreadable_array
from moh_dit.evaluation.features import FeatureExtractor, extract_features, load_images
from moh_dit.evaluation.metrics import (
    feature_statistics,
)
from moh_dit.files import atomic_path, ensure_writable_dir
from moh_dit.manifests import fingerprint_file, fingerprint_files

logger = logging.getLogger(__name__)
CACHE_ENV = "MOH_DIT_CACHE"
STATS_FORMAT = 2


# ----------------------------------------------------------------------------------------------------
# Reference statistics
# ----------------------------------------------------------------------------------------------------
def reference_fingerprint(ref: Path) -> str:
    """SHA-256 of a reference's content: the file's bytes, or every image file below a folder."""
    if ref.is_dir():
        return fingerprint_files(ref, list_images(ref))
    return fingerprint_file(ref)


def _cache_dirs(ref: Path) -> list[Path]:
    """Where cached statistics live: beside the reference, and a user cache for read-only references."""
    user = Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "moh-dit") / "reference-stats"
    return [ref.parent, user]


def _cache_name(ref: Path, extractor: FeatureExtractor, key: str) -> str:
    return f"{ref.name}.moh-dit-stats.{extractor.name.replace('/', '-')}.{key[:16]}.npz"


def reference_statistics(
    reference: str | os.PathLike,
    extractor: FeatureExtractor,
    batch_size: int = 100,
    cache: bool = True,
    max_pr_images: int = 10000,
    image_size: int | None = None,
) -> dict:
    """Statistics of the reference set: ``mu``/``sigma`` (FID), ``mu_s``/``sigma_s`` (sFID), ``pool``
    features of up to ``max_pr_images`` images (precision/recall) and ``info`` (how they were made).

    An ADM reference batch (``arr_0`` plus ``mu``, ``sigma``, ``mu_s``, ``sigma_s``) is used as the ADM
    evaluator uses it: the stored statistics for FID and sFID (computed on the whole training set), the
    images only for precision/recall. Any other folder, image tree or ``.npz`` of real images gets
    everything computed from its images (center-cropped to ``image_size`` when given). Results are cached
    under a key of the reference's content, the extractor, its weights, the crop and the P/R subset size;
    beside the reference, or in ``$MOH_DIT_CACHE`` (default ``~/.cache/moh-dit``) when that folder is
    read-only.
    """
    ref = Path(reference)
    if not ref.exists():
        raise EvaluationError(f"reference {ref} does not exist")
    content = reference_fingerprint(ref)
    crop = image_size if ref.is_dir() else None  # arrays are used as they are
    recipe = {
        "format": STATS_FORMAT,
        "content_sha256": content,
        "extractor": extractor.name,
        "weights_sha256": extractor.weights_sha256,
        "image_size": crop,
        "max_pr_images": max_pr_images,
    }
    key = hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()
    name = _cache_name(ref, extractor, key)
    if cache:
        for folder in _cache_dirs(ref):
            cached = folder / name
            if cached.is_file():
                try:
                    with np.load(cached) as data:
                        info = json.loads(str(data["info"]))
                        if info.get("recipe") == recipe:
                            logger.info("reference statistics from cache %s", cached)
                            return {k: data[k] for k in data.files if k != "info"} | {"info": info}
                except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile):
                    logger.warning("ignoring damaged cache %s", cached)

    stored: dict[str, np.ndarray] = {}
    if ref.suffix == ".npz" and ref.is_file():
        try:
            with np.load(ref) as data:
                stored = {k: data[k] for k in ("mu", "sigma", "mu_s", "sigma_s") if k in data}
        except (OSError, ValueError, EOFError, zipfile.BadZipFile) as err:
            raise EvaluationError(f"reference {unreadable_array(ref, err)}") from None
    images = load_images(ref, image_size=crop)
    if len(images) < 2:
        raise EvaluationError(f"reference {ref} has {len(images)} images; need at least 2")
    pr_images = images[:max_pr_images]
    stats: dict = {}
    if "mu" in stored and "sigma" in stored:
        feats = extract_features(extractor, pr_images, batch_size, "reference features")
        stats.update(mu=stored["mu"], sigma=stored["sigma"])
        if "mu_s" in stored:
            stats.update(mu_s=stored["mu_s"], sigma_s=stored["sigma_s"])
        origin = "ADM reference batch (stored statistics)"
    else:
        feats = extract_features(extractor, images, batch_size, "reference features")
        stats["mu"], stats["sigma"] = feature_statistics(feats["pool"])
        if "spatial" in feats:
            stats["mu_s"], stats["sigma_s"] = feature_statistics(feats["spatial"])
        origin = "computed from the reference images"
    stats["pool"] = feats["pool"][:max_pr_images]
    info = {
        "reference": str(ref.resolve()),
        "content_sha256": content,
        "extractor": extractor.name,
        "weights_sha256": extractor.weights_sha256,
        "image_size": int(images.shape[1]),
        "center_crop": crop is not None,
        "num_images": int(len(images)),
        "num_pr_images": int(len(stats["pool"])),
        "statistics": origin,
        "recipe": recipe,
    }
    if cache:
        _write_cache(ref, name, stats, info)
    return stats | {"info": info}


def _write_cache(ref: Path, name: str, stats: dict, info: dict) -> None:
    for folder in _cache_dirs(ref):
        try:
            ensure_writable_dir(folder, "cache folder")
            with atomic_path(folder / name, ".npz") as tmp:
                np.savez(tmp, info=np.array(json.dumps(info)), **stats)
            logger.info("cached reference statistics in %s", folder / name)
            return
        except OSError:
            continue
    logger.warning("could not cache the reference statistics (no writable cache folder)")
