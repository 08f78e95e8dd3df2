"""Scoring samples the way the DiT and MoH-DiT papers do: FID, sFID, IS, precision and recall against an
ADM reference batch, with features from torch-fidelity's TF-compatible Inception (REFERENCE.md section 5).

Pieces:
- :func:`load_images` reads an ADM ``.npz`` (``arr_0``) or a folder of PNGs and validates it.
- Feature extractors return ``pool`` (FID, precision/recall), ``logits`` (IS) and ``spatial`` (sFID)
  features. :class:`InceptionFeatures` is the paper protocol; :class:`RegisteredFeatures` wraps any
  extractor registered with torch-fidelity's ``register_feature_extractor`` (tests, small domains).
- :func:`reference_statistics` reads an ADM reference batch, or computes statistics for any folder /
  ``.npz`` of real images once and caches them in a compact ``.npz`` with a record of how they were made.
- :func:`evaluate` puts it together and returns every number plus the settings that produced it.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Callable, Optional, Protocol

import numpy as np
import torch
from PIL import Image
from tqdm.auto import tqdm

from .metrics import feature_statistics, frechet_distance, inception_score, precision_recall

__all__ = [
    "load_images",
    "InceptionFeatures",
    "RegisteredFeatures",
    "find_inception_weights",
    "extract_features",
    "reference_statistics",
    "evaluate",
    "INCEPTION_WEIGHTS_FILE",
    "INCEPTION_WEIGHTS_URL",
]

logger = logging.getLogger(__name__)
INCEPTION_WEIGHTS_FILE = "weights-inception-2015-12-05-6726825d.pth"
INCEPTION_WEIGHTS_URL = "https://github.com/toshas/torch-fidelity/releases/download/v0.2.0/" + INCEPTION_WEIGHTS_FILE
INCEPTION_WEIGHTS_ENV = "MOH_DIT_INCEPTION_WEIGHTS"
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".webp")


class EvaluationError(ValueError):
    """Inputs that cannot be evaluated: wrong dtype, shape or range, missing files or weights."""


# ----------------------------------------------------------------------------------------------------
# Images
# ----------------------------------------------------------------------------------------------------
def validate_images(arr: np.ndarray, source: str) -> np.ndarray:
    """uint8 (N, H, W, C) with C in {1, 3}; grayscale repeated to RGB."""
    if not isinstance(arr, np.ndarray):
        raise EvaluationError(f"{source}: expected a numpy array, got {type(arr).__name__}")
    if arr.dtype != np.uint8:
        hint = " (floats in [0, 1] or [-1, 1] must be quantised: clamp(127.5 x + 128, 0, 255) for [-1, 1])" if arr.dtype.kind == "f" else ""
        raise EvaluationError(f"{source}: images must be uint8, got {arr.dtype}{hint}")
    if arr.ndim == 3:
        arr = arr[..., None]
    if arr.ndim != 4:
        raise EvaluationError(f"{source}: images must be (N, H, W, C), got shape {arr.shape}")
    if arr.shape[-1] not in (1, 3):
        if arr.shape[1] in (1, 3):
            raise EvaluationError(f"{source}: images look channels-first {arr.shape}; ADM arrays are NHWC")
        raise EvaluationError(f"{source}: images must have 1 or 3 channels (NHWC), got shape {arr.shape}")
    if len(arr) == 0:
        raise EvaluationError(f"{source}: no images")
    if arr.shape[-1] == 1:
        arr = np.repeat(arr, 3, axis=-1)
    return arr


def load_images(path: str | os.PathLike, limit: Optional[int] = None) -> np.ndarray:
    """An ADM-style ``.npz`` (``arr_0``), a ``.npy``, or a folder of images (sorted by name) -> uint8 NHWC RGB."""
    path = Path(path)
    if not path.exists():
        raise EvaluationError(f"{path} does not exist")
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)
        if not files:
            raise EvaluationError(f"{path} holds no images ({', '.join(IMAGE_SUFFIXES)})")
        files = files[:limit] if limit else files
        first = np.asarray(Image.open(files[0]).convert("RGB"))
        arr = np.empty((len(files), *first.shape), dtype=np.uint8)
        for i, f in enumerate(tqdm(files, desc=f"reading {path.name}", unit="img", leave=False)):
            try:
                img = np.asarray(Image.open(f).convert("RGB"))
            except OSError as err:
                raise EvaluationError(f"{f} is not a readable image: {err}") from None
            if img.shape != first.shape:
                raise EvaluationError(f"{f} has shape {img.shape}, but {files[0].name} has {first.shape}")
            arr[i] = img
        return arr
    if path.suffix == ".npz":
        with np.load(path) as data:
            if "arr_0" not in data:
                raise EvaluationError(f"{path} has no 'arr_0' array (keys: {list(data.keys())})")
            arr = data["arr_0"]
    elif path.suffix == ".npy":
        arr = np.load(path)
    else:
        raise EvaluationError(f"{path}: expected a folder of images, an .npz (arr_0) or an .npy")
    return validate_images(arr[:limit] if limit else arr, str(path))


# ----------------------------------------------------------------------------------------------------
# Feature extractors
# ----------------------------------------------------------------------------------------------------
class FeatureExtractor(Protocol):
    name: str
    weights_sha256: Optional[str]

    def __call__(self, images: torch.Tensor) -> dict[str, torch.Tensor]: ...


def find_inception_weights(path: Optional[str] = None) -> Path:
    """``path``, else $MOH_DIT_INCEPTION_WEIGHTS, else the torch hub cache; a clear error if none exists."""
    hub = Path(torch.hub.get_dir()) / "checkpoints" / INCEPTION_WEIGHTS_FILE
    for cand, origin in ((path, "--inception-weights"), (os.environ.get(INCEPTION_WEIGHTS_ENV), INCEPTION_WEIGHTS_ENV), (str(hub), "torch hub cache")):
        if not cand:
            continue
        if Path(cand).is_file():
            return Path(cand)
        if origin != "torch hub cache":
            raise EvaluationError(f"Inception weights given by {origin} not found: {cand}")
    raise EvaluationError(
        f"TF-compatible Inception weights not found. Download {INCEPTION_WEIGHTS_URL} and either put it at "
        f"{hub}, set {INCEPTION_WEIGHTS_ENV}=/path/to/{INCEPTION_WEIGHTS_FILE}, or pass --inception-weights PATH."
    )


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


class InceptionFeatures:
    """torch-fidelity's ``inception-v3-compat`` (the 2015-12-05 TF Inception): pool_3 (2048), unbiased
    logits (1008) and, through a hook, ``Mixed_6d.branch1x1``'s first 7 channels flattened in (h, w, c)
    order (7 * 17 * 17 = 2023) -- ADM's ``mixed_6/conv`` features for sFID.

    The weights file is first opened with ``torch.load(weights_only=True)``: torch-fidelity itself unpickles
    it unrestricted, so a file that is not a plain state dict is refused before it gets there.
    """

    name = "inception-v3-compat"

    def __init__(self, weights_path: Optional[str] = None, device: Optional[str] = None) -> None:
        from torch_fidelity.feature_extractor_inceptionv3 import FeatureExtractorInceptionV3

        path = find_inception_weights(weights_path)
        try:
            torch.load(path, map_location="cpu", weights_only=True)
        except Exception as err:  # noqa: BLE001 - any failure means we do not trust the file
            raise EvaluationError(f"{path} is not a plain tensor state dict; refusing to unpickle it ({err})") from None
        self.weights_sha256 = _sha256(path)
        self.net = FeatureExtractorInceptionV3(self.name, ["2048", "logits_unbiased"], feature_extractor_weights_path=str(path))
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.net.to(self.device).eval()
        self._spatial: list[torch.Tensor] = []
        self.net.Mixed_6d.branch1x1.register_forward_hook(lambda m, a, out: self._spatial.append(out))

    @staticmethod
    def spatial_features(mixed_6d_branch1x1: torch.Tensor) -> torch.Tensor:
        """(N, 192, 17, 17) -> (N, 2023): the first 7 channels, flattened in (h, w, c) order like TF."""
        return mixed_6d_branch1x1[:, :7].permute(0, 2, 3, 1).reshape(len(mixed_6d_branch1x1), -1)

    @torch.no_grad()
    def __call__(self, images: torch.Tensor) -> dict[str, torch.Tensor]:
        self._spatial.clear()
        pool, logits = self.net(images.to(self.device))
        return {"pool": pool.float(), "logits": logits.float(), "spatial": self.spatial_features(self._spatial.pop()).float()}


class RegisteredFeatures:
    """Any torch-fidelity-registered extractor: ``pool_feature`` for FID and precision/recall, optionally
    ``logits_feature`` for IS and ``spatial_feature`` for sFID."""

    def __init__(self, name: str, pool_feature: str, logits_feature: Optional[str] = None,
                 spatial_feature: Optional[str] = None, device: Optional[str] = None,
                 weights_sha256: Optional[str] = None, **kwargs) -> None:  # fmt: skip
        from torch_fidelity.registry import FEATURE_EXTRACTORS_REGISTRY
        from torch_fidelity.utils import create_feature_extractor

        if name not in FEATURE_EXTRACTORS_REGISTRY:
            raise EvaluationError(f"feature extractor {name!r} is not registered with torch-fidelity; known: {sorted(FEATURE_EXTRACTORS_REGISTRY)}")
        self.name = name
        self.weights_sha256 = weights_sha256
        self.kinds = {"pool": pool_feature, "logits": logits_feature, "spatial": spatial_feature}
        self.kinds = {kind: feat for kind, feat in self.kinds.items() if feat}
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.net = create_feature_extractor(name, list(self.kinds.values()), cuda=False, verbose=False, **kwargs)
        self.net.to(self.device)

    @torch.no_grad()
    def __call__(self, images: torch.Tensor) -> dict[str, torch.Tensor]:
        out = self.net(images.to(self.device))
        out = out if isinstance(out, (tuple, list)) else (out,)
        return {kind: value.float().flatten(1) for kind, value in zip(self.kinds, out)}


@contextlib.contextmanager
def tf32_disabled():
    """Features must not depend on TF32 matmuls (ADM ran them in full fp32)."""
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


def extract_features(extractor: FeatureExtractor, images: np.ndarray, batch_size: int = 100,
                     desc: str = "features") -> dict[str, np.ndarray]:  # fmt: skip
    """Run ``extractor`` over uint8 NHWC images in batches; returns float32 arrays per feature kind."""
    images = validate_images(images, desc)
    parts: dict[str, list[np.ndarray]] = {}
    with tf32_disabled():
        for start in tqdm(range(0, len(images), batch_size), desc=desc, unit="batch", leave=False):
            batch = torch.from_numpy(np.ascontiguousarray(images[start : start + batch_size].transpose(0, 3, 1, 2)))
            for key, value in extractor(batch).items():
                parts.setdefault(key, []).append(value.cpu().numpy().astype(np.float32))
    return {k: np.concatenate(v) for k, v in parts.items()}


# ----------------------------------------------------------------------------------------------------
# Reference statistics
# ----------------------------------------------------------------------------------------------------
def _cache_path(ref: Path, extractor: FeatureExtractor) -> Path:
    tag = extractor.name.replace("/", "-")
    return ref.with_name(f"{ref.name}.moh-dit-stats.{tag}.npz")


def reference_statistics(reference: str | os.PathLike, extractor: FeatureExtractor, batch_size: int = 100,
                         cache: bool = True, max_pr_images: int = 10000) -> dict:  # fmt: skip
    """Statistics of the reference set: ``mu``/``sigma`` (FID), ``mu_s``/``sigma_s`` (sFID), ``pool``
    features of up to ``max_pr_images`` images (precision/recall) and ``info`` (how they were made).

    An ADM reference batch (``arr_0`` plus ``mu``, ``sigma``, ``mu_s``, ``sigma_s``) is used as the ADM
    evaluator uses it: the stored statistics for FID and sFID (computed on the whole training set), the
    images only for precision/recall. Any other folder or ``.npz`` of real images gets everything computed
    from its images. Results are cached beside the reference, keyed by extractor and weights hash.
    """
    ref = Path(reference)
    cache_file = _cache_path(ref, extractor)
    if cache and cache_file.is_file():
        with np.load(cache_file) as data:
            info = json.loads(str(data["info"]))
            if info.get("weights_sha256") == extractor.weights_sha256 and info.get("source_size") == _size(ref):
                return {k: data[k] for k in data.files if k != "info"} | {"info": info}
        logger.info("cached statistics %s are stale; recomputing", cache_file)

    stored: dict[str, np.ndarray] = {}
    if ref.suffix == ".npz" and ref.is_file():
        with np.load(ref) as data:
            stored = {k: data[k] for k in ("mu", "sigma", "mu_s", "sigma_s") if k in data}
    images = load_images(ref)
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
        "reference": str(ref),
        "source_size": _size(ref),
        "extractor": extractor.name,
        "weights_sha256": extractor.weights_sha256,
        "num_images": int(len(images)),
        "num_pr_images": int(len(stats["pool"])),
        "statistics": origin,
    }
    if cache:
        tmp = cache_file.with_name(cache_file.name + ".tmp.npz")
        np.savez(tmp, info=np.array(json.dumps(info)), **stats)
        os.replace(tmp, cache_file)
    return stats | {"info": info}


def _size(path: Path) -> int:
    if path.is_dir():
        return sum(p.stat().st_size for p in path.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)
    return path.stat().st_size


# ----------------------------------------------------------------------------------------------------
# Putting it together
# ----------------------------------------------------------------------------------------------------
def evaluate(samples: np.ndarray, reference: str | os.PathLike, extractor: FeatureExtractor,
             batch_size: int = 100, fp16_distances: bool = False, pr_k: int = 3, pr_block: int = 10000,
             is_split_size: int = 5000, cache: bool = True) -> dict:  # fmt: skip
    """FID, sFID, IS, precision and recall of uint8 NHWC ``samples`` against ``reference``."""
    ref = reference_statistics(reference, extractor, batch_size, cache)
    feats = extract_features(extractor, samples, batch_size, "sample features")
    results: dict = {}
    mu, sigma = feature_statistics(feats["pool"])
    results["fid"] = frechet_distance(mu, sigma, ref["mu"], ref["sigma"])
    if "spatial" in feats and "mu_s" in ref:
        mu_s, sigma_s = feature_statistics(feats["spatial"])
        results["sfid"] = frechet_distance(mu_s, sigma_s, ref["mu_s"], ref["sigma_s"])
    if "logits" in feats:
        results["inception_score"] = inception_score(feats["logits"], is_split_size)
    results["precision"], results["recall"] = precision_recall(ref["pool"], feats["pool"], k=pr_k, block=pr_block,
                                                               fp16=fp16_distances)  # fmt: skip
    return {"metrics": results, "reference": ref["info"], "num_samples": int(len(samples)),
            "extractor": extractor.name, "weights_sha256": extractor.weights_sha256,
            "settings": {"fp16_distances": fp16_distances, "pr_k": pr_k, "is_split_size": is_split_size}}  # fmt: skip


def format_table(metrics: dict) -> str:
    names = {"fid": "FID", "sfid": "sFID", "inception_score": "Inception Score", "precision": "Precision", "recall": "Recall"}
    width = max(len(v) for v in names.values())
    rows = [f"{names[k]:<{width}}  {metrics[k]:.4f}" for k in names if k in metrics]
    rule = "-" * (width + 12)
    return "\n".join([rule, *rows, rule])


def resolve_extractor(name: str, weights: Optional[str], device: Optional[str],
                      factories: Optional[dict[str, Callable[[], FeatureExtractor]]] = None) -> FeatureExtractor:  # fmt: skip
    """``inception`` (the paper protocol) or the name of a torch-fidelity-registered extractor, whose
    pool feature is its FID default, whose logits (if provided) give the IS and whose ``spatial`` feature
    (if provided) gives the sFID."""
    if factories and name in factories:
        return factories[name]()
    if name in ("inception", "inception-v3-compat"):
        return InceptionFeatures(weights, device)
    from torch_fidelity.registry import FEATURE_EXTRACTORS_REGISTRY

    if name not in FEATURE_EXTRACTORS_REGISTRY:
        raise EvaluationError(f"unknown extractor {name!r}; use 'inception' or one of {sorted(FEATURE_EXTRACTORS_REGISTRY)}")
    cls = FEATURE_EXTRACTORS_REGISTRY[name]
    provided = cls.get_provided_features_list()
    pool = cls.get_default_feature_layer_for_metric("fid")
    logits = "logits_unbiased" if "logits_unbiased" in provided else ("logits" if "logits" in provided else None)
    spatial = "spatial" if "spatial" in provided else None
    kwargs = {"feature_extractor_weights_path": weights} if weights else {}
    sha = _sha256(Path(weights)) if weights else None
    return RegisteredFeatures(name, pool, logits, spatial, device, sha, **kwargs)
