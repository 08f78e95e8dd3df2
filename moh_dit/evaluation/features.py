"""Features for scoring: reading samples and references, and the extractors.

- :func:`load_images` reads an ADM ``.npz`` (``arr_0``), a folder of samples, or a tree of real images
  (center-cropped as ADM does to a given size) and validates it.
- Feature extractors return ``pool`` (FID, precision/recall), ``logits`` (IS) and ``spatial`` (sFID)
  features. :class:`InceptionFeatures` is the paper protocol, torch-fidelity's TF-compatible Inception;
  :class:`RegisteredFeatures` wraps any extractor registered with torch-fidelity's
  ``register_feature_extractor`` (tests, small domains).
"""

from __future__ import annotations

import contextlib
import os
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from moh_dit.data.image_folder import list_images, load_image
from moh_dit.errors import EvaluationError, unreadable_array
from moh_dit.manifests import fingerprint_file
from moh_dit.progress import progress

INCEPTION_WEIGHTS_FILE = "weights-inception-2015-12-05-6726825d.pth"
INCEPTION_WEIGHTS_URL = "https://github.com/toshas/torch-fidelity/releases/download/v0.2.0/" + INCEPTION_WEIGHTS_FILE
INCEPTION_WEIGHTS_ENV = "MOH_DIT_INCEPTION_WEIGHTS"


# ----------------------------------------------------------------------------------------------------
# Images
# ----------------------------------------------------------------------------------------------------
def validate_images(arr: np.ndarray, source: str) -> np.ndarray:
    """uint8 (N, H, W, C) with C in {1, 3}; grayscale repeated to RGB."""
    if not isinstance(arr, np.ndarray):
        raise EvaluationError(f"{source}: expected a numpy array, got {type(arr).__name__}")
    if arr.dtype != np.uint8:
        hint = (
            " (floats in [0, 1] or [-1, 1] must be quantised: clamp(127.5 x + 128, 0, 255) for [-1, 1])"
            if arr.dtype.kind == "f"
            else ""
        )
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


def load_images(path: str | os.PathLike, limit: int | None = None, image_size: int | None = None) -> np.ndarray:
    """An ADM-style ``.npz`` (``arr_0``), a ``.npy``, or a folder of images -> uint8 NHWC RGB.

    Folders are read recursively (a class-per-folder tree works), in path order. With ``image_size`` every
    image is center-cropped and resized as ADM prepares references; without it all images must already
    have the same size.
    """
    path = Path(path)
    if not path.exists():
        raise EvaluationError(f"{path} does not exist")
    if path.is_dir():
        files = list_images(path)
        if not files:
            raise EvaluationError(f"{path} holds no images (looked for image files in it and its sub-folders)")
        files = files[:limit] if limit else files
        arr = None
        for i, f in enumerate(progress(files, f"reading {path.name}", "img")):
            try:
                img = load_image(f, image_size, channels=3)
            except (OSError, ValueError, SyntaxError) as err:
                raise EvaluationError(f"{f} is not a readable image: {err}") from None
            if arr is None:
                arr = np.empty((len(files), *img.shape), dtype=np.uint8)
            if img.shape != arr.shape[1:]:
                raise EvaluationError(
                    f"{f} has shape {img.shape}, but {Path(files[0]).name} has {arr.shape[1:]}: "
                    f"give a crop size (--reference-size) to center-crop them alike"
                )
            arr[i] = img
        return arr
    try:
        if path.suffix == ".npz":
            with np.load(path) as data:
                if "arr_0" not in data:
                    raise EvaluationError(f"{path} has no 'arr_0' array (keys: {list(data.keys())})")
                arr = data["arr_0"]
        elif path.suffix == ".npy":
            arr = np.load(path)
        else:
            raise EvaluationError(f"{path}: expected a folder of images, an .npz (arr_0) or an .npy")
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as err:
        if isinstance(err, EvaluationError):
            raise
        raise EvaluationError(unreadable_array(path, err)) from None
    return validate_images(arr[:limit] if limit else arr, str(path))


# ----------------------------------------------------------------------------------------------------
# Feature extractors
# ----------------------------------------------------------------------------------------------------
class FeatureExtractor(Protocol):
    name: str
    weights_sha256: str | None

    def __call__(self, images: torch.Tensor) -> dict[str, torch.Tensor]: ...


def find_inception_weights(path: str | None = None) -> Path:
    """``path``, else $MOH_DIT_INCEPTION_WEIGHTS, else the torch hub cache; a clear error if none exists."""
    hub = Path(torch.hub.get_dir()) / "checkpoints" / INCEPTION_WEIGHTS_FILE
    for cand, origin in (
        (path, "--inception-weights"),
        (os.environ.get(INCEPTION_WEIGHTS_ENV), INCEPTION_WEIGHTS_ENV),
        (str(hub), "torch hub cache"),
    ):
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


def check_plain_tensor_file(path: str | os.PathLike, what: str = "weights") -> str:
    """Open a weights file with ``torch.load(weights_only=True)`` before any third-party loader sees it
    (torch-fidelity unpickles weights files unrestricted, which runs whatever code a crafted file holds).
    Returns its SHA-256; anything but plain tensors is refused."""
    path = Path(path)
    if not path.is_file():
        raise EvaluationError(f"{what} file {path} not found")
    from moh_dit.files import read_safetensors, read_torch_file

    if path.suffix == ".safetensors":  # no pickle inside by construction; just check it is readable
        read_safetensors(path)
    else:  # anything but plain tensors means we do not trust the file
        read_torch_file(path, EvaluationError, "plain tensor state dict")
    return fingerprint_file(path)


class InceptionFeatures:
    """torch-fidelity's ``inception-v3-compat`` (the 2015-12-05 TF Inception): pool_3 (2048), unbiased
    logits (1008) and, through a hook, ``Mixed_6d.branch1x1``'s first 7 channels flattened in (h, w, c)
    order (7 * 17 * 17 = 2023) -- ADM's ``mixed_6/conv`` features for sFID.

    The weights file is first opened with ``torch.load(weights_only=True)``: torch-fidelity itself unpickles
    it unrestricted, so a file that is not a plain state dict is refused before it gets there.
    """

    name = "inception-v3-compat"

    def __init__(self, weights_path: str | None = None, device: str | None = None) -> None:
        from torch_fidelity.feature_extractor_inceptionv3 import FeatureExtractorInceptionV3

        path = find_inception_weights(weights_path)
        self.weights_sha256 = check_plain_tensor_file(path, "Inception weights")
        self.net = FeatureExtractorInceptionV3(
            self.name, ["2048", "logits_unbiased"], feature_extractor_weights_path=str(path)
        )
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
        return {
            "pool": pool.float(),
            "logits": logits.float(),
            "spatial": self.spatial_features(self._spatial.pop()).float(),
        }


class RegisteredFeatures:
    """Any torch-fidelity-registered extractor: ``pool_feature`` for FID and precision/recall, optionally
    ``logits_feature`` for IS and ``spatial_feature`` for sFID."""

    def __init__(
        self,
        name: str,
        pool_feature: str,
        logits_feature: str | None = None,
        spatial_feature: str | None = None,
        device: str | None = None,
        weights_sha256: str | None = None,
        **kwargs,
    ) -> None:
        from torch_fidelity.registry import FEATURE_EXTRACTORS_REGISTRY
        from torch_fidelity.utils import create_feature_extractor

        if name not in FEATURE_EXTRACTORS_REGISTRY:
            raise EvaluationError(
                f"feature extractor {name!r} is not registered with torch-fidelity; known: {sorted(FEATURE_EXTRACTORS_REGISTRY)}"
            )
        self.name = name
        self.weights_sha256 = weights_sha256
        self.kinds = {"pool": pool_feature, "logits": logits_feature, "spatial": spatial_feature}
        self.kinds = {kind: feat for kind, feat in self.kinds.items() if feat}
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.net = create_feature_extractor(name, list(self.kinds.values()), cuda=False, verbose=False, **kwargs)
        self.net.to(self.device)
        if self.weights_sha256 is None:  # extractors that load their own default weights may say which
            self.weights_sha256 = getattr(self.net, "weights_sha256", None)

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


def extract_features(
    extractor: FeatureExtractor, images: np.ndarray, batch_size: int = 100, desc: str = "features"
) -> dict[str, np.ndarray]:
    """Run ``extractor`` over uint8 NHWC images in batches; returns float32 arrays per feature kind."""
    images = validate_images(images, desc)
    parts: dict[str, list[np.ndarray]] = {}
    with tf32_disabled():
        for start in progress(range(0, len(images), batch_size), desc, "batch"):
            batch = torch.from_numpy(np.ascontiguousarray(images[start : start + batch_size].transpose(0, 3, 1, 2)))
            for key, value in extractor(batch).items():
                parts.setdefault(key, []).append(value.cpu().numpy().astype(np.float32))
    return {k: np.concatenate(v) for k, v in parts.items()}


def resolve_extractor(
    name: str,
    weights: str | None,
    device: str | None,
    factories: dict[str, Callable[[], FeatureExtractor]] | None = None,
) -> FeatureExtractor:
    """``inception`` (the paper protocol) or the name of a torch-fidelity-registered extractor, whose
    pool feature is its FID default, whose logits (if provided) give the IS and whose ``spatial`` feature
    (if provided) gives the sFID."""
    if factories and name in factories:
        return factories[name]()
    if name in ("inception", "inception-v3-compat"):
        return InceptionFeatures(weights, device)
    from torch_fidelity.registry import FEATURE_EXTRACTORS_REGISTRY

    if name not in FEATURE_EXTRACTORS_REGISTRY:
        raise EvaluationError(
            f"unknown extractor {name!r}; use 'inception' or one of {sorted(FEATURE_EXTRACTORS_REGISTRY)}"
        )
    cls = FEATURE_EXTRACTORS_REGISTRY[name]
    provided = cls.get_provided_features_list()
    pool = cls.get_default_feature_layer_for_metric("fid")
    logits = "logits_unbiased" if "logits_unbiased" in provided else ("logits" if "logits" in provided else None)
    spatial = "spatial" if "spatial" in provided else None
    # every weights file that reaches a third-party loader is checked first (see check_plain_tensor_file)
    sha = check_plain_tensor_file(weights, f"{name} weights") if weights else None
    kwargs = {"feature_extractor_weights_path": str(weights)} if weights else {}
    try:
        return RegisteredFeatures(name, pool, logits, spatial, device, sha, **kwargs)
    except OSError as err:  # URLError, HTTPError, no route: torch-fidelity downloads weights it does not have
        raise EvaluationError(
            f"the weights of extractor {name!r} could not be downloaded ({str(err).splitlines()[0]}); if you are "
            f"offline, fetch them elsewhere and pass --extractor-weights PATH"
        ) from None


def import_extractor_module(name: str | None, option: str = "--extractor-module") -> None:
    """Import a module that provides feature extractors (``--extractor-module``, or the config key ``option``
    names) and call its ``register()`` if it has one (modules may also register with torch-fidelity when imported).
    A module of the working folder imports as ``python -m`` would import it (:func:`import_user_module`)."""
    if not name:
        return
    from moh_dit.user_modules import import_user_module

    module = import_user_module(name, option)
    if callable(getattr(module, "register", None)):
        module.register()
