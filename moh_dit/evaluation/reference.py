r"""Build an ADM-style reference batch from a tree of real images.

The ADM evaluator compares samples against a reference ``.npz``: ``arr_0`` holds real images (uint8 NHWC,
10,000 for ImageNet) used for precision and recall, and ``mu``/``sigma`` (pool features) and
``mu_s``/``sigma_s`` (spatial features, for sFID) hold statistics of the whole training set. This module
makes such a file from any folder or class-per-folder tree of images, center-cropped the way ADM prepares
ImageNet, streaming the statistics so that a training set of any size fits in memory.

    moh-dit reference /data/imagenet/train --image-size 256 --out refs/imagenet256.npz
    moh-dit reference /data/faces --image-size 64 --out refs/faces64.npz --extractor inception \
        --extractor-weights weights-inception-2015-12-05-6726825d.pth

Without ``--extractor`` only the images are stored; evaluation then computes the statistics from them.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

import numpy as np

from moh_dit.data.image_folder import list_images, load_image
from moh_dit.errors import ArtifactError, DataError, OutputError
from moh_dit.files import atomic_path, ensure_writable_file
from moh_dit.manifests import code_version, utc_now
from moh_dit.sampling.sample_sets import read_npz_manifest

__all__ = ["build_reference", "RunningMoments", "NAMED_REFERENCES", "resolve_reference"]

logger = logging.getLogger(__name__)


# ----------------------------------------------------------------------------------------------------
# Named references: a data set's held-out split, made into a reference .npz once and cached
# ----------------------------------------------------------------------------------------------------
def _fashion_mnist_test() -> np.ndarray:
    """The 10,000 Fashion-MNIST test images, gray repeated to RGB (uint8 NHWC), in their order."""
    from moh_dit.data.fashion_mnist import FashionMNIST

    return np.repeat(FashionMNIST(split="test").images[:, :, :, None], 3, axis=3)


def _fashion_mnist_train() -> np.ndarray:
    """10,000 Fashion-MNIST training images, the first 1000 of each class in the split's order (as many per class as
    the test split holds), gray repeated to RGB: a reference for choosing among a run's evaluations
    (``log.eval_keep_best``) that never shows the choice the test images the final score is measured on."""
    from moh_dit.data.fashion_mnist import FashionMNIST

    data = FashionMNIST(split="train")
    rows = np.sort(np.concatenate([np.flatnonzero(data.labels == c)[:1000] for c in range(len(data.classes))]))
    return np.repeat(data.images[rows][:, :, :, None], 3, axis=3)


# name -> the images of the reference (a name is short to type: log.eval_reference=fashion-mnist-test)
NAMED_REFERENCES = {"fashion-mnist-test": _fashion_mnist_test, "fashion-mnist-train": _fashion_mnist_train}


def resolve_reference(spec: str | os.PathLike) -> Path:
    """A reference given by name (:data:`NAMED_REFERENCES`: ``fashion-mnist-test``, ``fashion-mnist-train``) -> its
    ``.npz`` in ``$MOH_DIT_CACHE/references`` (default ``~/.cache/moh-dit``), made on first use and checked against
    the data on every use; anything else is a path, returned as it is."""
    make = NAMED_REFERENCES.get(str(spec))
    if make is None:
        return Path(spec)
    from moh_dit.evaluation.statistics import CACHE_ENV

    path = Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "moh-dit") / "references" / f"{spec}.npz"
    images = make()
    if path.is_file():
        with np.load(path) as stored:
            if "arr_0" in stored.files and np.array_equal(stored["arr_0"], images):
                return path
        logger.warning("%s does not hold the %s images: making it again", path, spec)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path, ".npz") as tmp:
        np.savez(tmp, arr_0=images)
    logger.info("reference %s: %d images in %s", spec, len(images), path)
    return path


class RunningMoments:
    """Mean and covariance (N - 1 normalisation, as ``numpy.cov``) accumulated over batches in float64."""

    def __init__(self) -> None:
        self.n = 0
        self.total: np.ndarray | None = None
        self.outer: np.ndarray | None = None

    def add(self, features: np.ndarray) -> None:
        x = np.asarray(features, dtype=np.float64)
        if self.total is None:
            self.total, self.outer = np.zeros(x.shape[1]), np.zeros((x.shape[1], x.shape[1]))
        self.n += len(x)
        self.total += x.sum(axis=0)
        self.outer += x.T @ x

    def statistics(self) -> tuple[np.ndarray, np.ndarray]:
        if self.n < 2:
            raise DataError(f"need at least 2 images for statistics, got {self.n}")
        mu = self.total / self.n
        return mu, (self.outer - self.n * np.outer(mu, mu)) / (self.n - 1)


def build_reference(
    source: str | os.PathLike,
    image_size: int,
    out: str | os.PathLike,
    extractor=None,
    batch_images: int = 10_000,
    seed: int = 0,
    batch_size: int = 100,
    max_bad_fraction: float = 0.01,
    overwrite: bool = False,
) -> Path:
    """Write an ADM-style reference ``.npz`` for the images below ``source``; an existing ``out`` (a
    downloaded ADM batch, or one built earlier) is replaced only with ``overwrite``.

    ``arr_0``: ``batch_images`` images (all if fewer) chosen by a seeded permutation, center-cropped to
    ``image_size``; ``arr_1``: their class ids when ``source`` has one sub-folder per class; with an
    ``extractor``, ``mu``/``sigma`` (and ``mu_s``/``sigma_s`` when it has spatial features) over *all* images.
    The manifest inside records the source, a fingerprint of every file's bytes, the crop and the extractor.
    Unreadable images are skipped and listed; more than ``max_bad_fraction`` of them is an error.
    """
    source, out = Path(source), Path(out)
    ensure_writable_file(out, "--out")
    if out.exists() and not overwrite:
        try:
            made = read_npz_manifest(out)
        except ArtifactError:
            made = None
        built = made is not None and made.get("kind") == "reference"
        what = f"a reference built from {made.get('source')}" if built else "a file moh-dit did not build"
        raise OutputError(f"{out} exists ({what}); pass --overwrite to replace it, or choose another --out")
    files = list_images(source) if source.is_dir() else []
    if not files:
        raise DataError(f"{source} holds no images (it must be a folder; sub-folders are read too)")
    classes = sorted(
        {Path(f).relative_to(source).parts[0] for f in files if len(Path(f).relative_to(source).parts) > 1}
    )
    class_of = {name: i for i, name in enumerate(classes)}
    # arr_0 takes the first ``batch_images`` readable files in a seeded random order; files ranked a little
    # further are held too, to stand in for unreadable ones
    bad_limit = max(1, int(max_bad_fraction * len(files)))
    rank = np.empty(len(files), dtype=np.int64)
    rank[np.random.default_rng(seed).permutation(len(files))] = np.arange(len(files))
    candidates: list[tuple[int, np.ndarray, int]] = []
    bad: list[str] = []
    pool, spatial = RunningMoments(), RunningMoments()
    content = hashlib.sha256()
    pending: list[np.ndarray] = []

    def flush() -> None:
        if extractor is not None and pending:
            from moh_dit.evaluation.features import extract_features

            feats = extract_features(extractor, np.stack(pending), batch_size, "reference features")
            pool.add(feats["pool"])
            if "spatial" in feats:
                spatial.add(feats["spatial"])
        pending.clear()

    from moh_dit.progress import progress

    for i, f in enumerate(progress(files, "reading reference images", "img")):
        rel = Path(f).relative_to(source)
        try:
            data = Path(f).read_bytes()
            img = load_image(f, image_size, channels=3)
        except (OSError, ValueError, SyntaxError) as err:
            bad.append(str(rel))
            logger.warning("skipping unreadable image %s (%s)", f, err)
            if len(bad) > bad_limit:
                raise DataError(
                    f"{len(bad)} of {len(files)} images under {source} are unreadable (e.g. {bad[:3]})"
                ) from None
            continue
        content.update(rel.as_posix().encode() + b"\0" + hashlib.sha256(data).digest())
        if rank[i] < batch_images + bad_limit:
            candidates.append((int(rank[i]), img, class_of.get(rel.parts[0], -1) if len(rel.parts) > 1 else -1))
        pending.append(img)
        if len(pending) >= batch_size * 10:
            flush()
    flush()
    kept = sorted(candidates, key=lambda c: c[0])[:batch_images]
    arrays: dict[str, np.ndarray] = {"arr_0": np.stack([img for _, img, _ in kept])}
    if classes:
        arrays["arr_1"] = np.array([label for _, _, label in kept], dtype=np.int64)
    if extractor is not None:
        arrays["mu"], arrays["sigma"] = pool.statistics()
        if spatial.n:
            arrays["mu_s"], arrays["sigma_s"] = spatial.statistics()
    manifest = {
        "kind": "reference",
        "created": utc_now(),
        "code": code_version(),
        "source": str(source.resolve()),
        "content_sha256": content.hexdigest(),
        "num_source_images": len(files) - len(bad),
        "skipped": bad,
        "image_size": image_size,
        "crop": "ADM center crop",
        "num_batch_images": len(kept),
        "seed": seed,
        "classes": classes,
        "statistics_over": pool.n if extractor is not None else 0,
        "extractor": getattr(extractor, "name", None),
        "weights_sha256": getattr(extractor, "weights_sha256", None),
    }
    arrays["moh_dit_manifest"] = np.array(json.dumps(manifest))
    with atomic_path(out, ".npz") as tmp:
        np.savez(tmp, **arrays)
    return out
