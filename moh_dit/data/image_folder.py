"""Class-per-folder images with DiT's ADM preprocessing (center crop, resize).

Every dataset returns ``(image, label)`` with the image a float32 tensor (C, H, W) in [-1, 1], un-flipped:
random horizontal flips are drawn by the training loop from its per-step generator, so augmentation is
reproducible after a resume and identical whether images come from disk or from pre-extracted latents.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError
from torch.utils.data import Dataset

from moh_dit.errors import DataError
from moh_dit.images import to_model_range
from moh_dit.logs import PER_RANK
from moh_dit.manifests import fingerprint_files

if TYPE_CHECKING:
    pass
logger = logging.getLogger(__name__)

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".webp", ".tif", ".tiff", ".gif", ".jpe", ".ppm")


# ----------------------------------------------------------------------------------------------------
# Preprocessing
# ----------------------------------------------------------------------------------------------------
def center_crop_arr(image: Image.Image, image_size: int) -> Image.Image:
    """ADM/DiT center crop: halve with a box filter while the short side is >= 2x the target, resize the
    short side to ``image_size`` with bicubic filtering, then crop the center square."""
    while min(image.size) >= 2 * image_size:
        image = image.resize(tuple(s // 2 for s in image.size), resample=Image.BOX)
    scale = image_size / min(image.size)
    image = image.resize(tuple(round(s * scale) for s in image.size), resample=Image.BICUBIC)
    arr = np.asarray(image)
    top = (arr.shape[0] - image_size) // 2
    left = (arr.shape[1] - image_size) // 2
    return Image.fromarray(arr[top : top + image_size, left : left + image_size])


# ----------------------------------------------------------------------------------------------------
# Image folder
# ----------------------------------------------------------------------------------------------------
def list_images(folder: str | os.PathLike) -> list[str]:
    """Image files anywhere below ``folder``, by folder then name; hidden files and folders are skipped."""
    found = []
    for dirpath, dirnames, files in os.walk(folder, followlinks=True):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        found.append(
            (dirpath, sorted(f for f in files if not f.startswith(".") and f.lower().endswith(IMAGE_EXTENSIONS)))
        )
    return [os.path.join(dirpath, f) for dirpath, files in sorted(found) for f in files]


def load_image(path: str | os.PathLike, image_size: int | None = None, channels: int = 3) -> np.ndarray:
    """Decode one image to uint8 (H, W) or (H, W, 3), ADM-center-cropped to ``image_size`` when given;
    raises ``OSError``/``ValueError`` for a corrupt file."""
    with Image.open(path) as img:
        img = img.convert("L" if channels == 1 else "RGB")
        return np.asarray(center_crop_arr(img, image_size) if image_size else img)


class ImageFolderDataset(Dataset):
    """One sub-folder per class (sorted names -> ids 0..K-1), images anywhere below it; a folder without
    sub-folders is one class.

    Args:
        root: the folder holding the class folders.
        image_size: output size (ADM center crop).
        channels: 3 for RGB, 1 for grayscale (images are converted).
        max_bad_fraction: corrupt files are skipped with a warning (the next readable image is returned in
            their place); once more than this fraction of the data set (at least one file) has failed, a
            :class:`DataError` names them instead.
    """

    def __init__(self, root: str | os.PathLike, image_size: int, channels: int = 3, max_bad_fraction: float = 0.01):
        self.root = Path(root).expanduser()
        if not self.root.is_dir():
            raise DataError(f"image folder {self.root} does not exist")
        if channels not in (1, 3):
            raise ValueError(f"channels must be 1 or 3, got {channels}")
        self.classes = sorted(d.name for d in self.root.iterdir() if d.is_dir() and not d.name.startswith("."))
        if self.classes:
            self.samples = [
                (p, label) for label, name in enumerate(self.classes) for p in list_images(self.root / name)
            ]
        else:  # a flat folder of images is one class (e.g. for an unconditional model)
            self.classes, self.samples = [self.root.name], [(p, 0) for p in list_images(self.root)]
        if not self.samples:
            raise DataError(
                f"no images with extensions {', '.join(IMAGE_EXTENSIONS)} under {self.root} (expected class "
                f"sub-folders {self.root}/<class>/<images>, or images directly in it)"
            )
        self.image_size = image_size
        self.channels = channels
        self.max_bad_fraction = max_bad_fraction
        self.bad_files: set[str] = set()

    @property
    def id2label(self) -> dict[int, str]:
        return dict(enumerate(self.classes))

    @property
    def targets(self) -> list[int]:
        return [label for _, label in self.samples]

    def __len__(self) -> int:
        return len(self.samples)

    def describe(self) -> dict:
        """What identifies this data set: a listing fingerprint (class folders and relative file names; not
        the bytes, which would mean reading every image at every start), the preprocessing and the count."""
        return {
            "name": "folder",
            "source": str(self.root.resolve()),
            "count": len(self.samples),
            "fingerprint": fingerprint_files(self.root, [p for p, _ in self.samples], content=False),
            "image_size": self.image_size,
            "channels": self.channels,
            "skipped": sorted(self.bad_files),
        }

    def load(self, index: int) -> np.ndarray:
        """Decode and preprocess one image to uint8 (H, W[, C]); raises on a corrupt file."""
        return load_image(self.samples[index][0], self.image_size, self.channels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        limit = max(1, int(self.max_bad_fraction * len(self.samples)))
        for attempt in range(len(self.samples)):
            i = (index + attempt) % len(self.samples)  # a corrupt file is replaced by the next readable one
            path, label = self.samples[i]
            try:
                return to_model_range(self.load(i)), label
            except (OSError, UnidentifiedImageError, ValueError, SyntaxError) as err:
                if path not in self.bad_files:
                    self.bad_files.add(path)
                    logger.warning(
                        "skipping unreadable image %s (%s); %d bad so far",
                        path,
                        err,
                        len(self.bad_files),
                        extra=PER_RANK,
                    )
                if len(self.bad_files) > limit:
                    shown = ", ".join(sorted(self.bad_files)[:5])
                    raise DataError(
                        f"{len(self.bad_files)} of {len(self.samples)} images under {self.root} are unreadable "
                        f"(e.g. {shown}); fix or remove them, or raise max_bad_fraction"
                    ) from err
        raise DataError(f"no readable image in {self.root}")

    def scan(self) -> list[str]:
        """Decode every file once; return the unreadable ones and drop them from the dataset."""
        good, bad = [], []
        for _i, (path, label) in enumerate(self.samples):
            try:
                with Image.open(path) as img:
                    img.load()
                good.append((path, label))
            except (OSError, UnidentifiedImageError, ValueError, SyntaxError):
                bad.append(path)
        for path in bad:
            logger.warning("dropping unreadable image %s", path, extra=PER_RANK)
        if not good:
            raise DataError(f"every image under {self.root} is unreadable")
        self.samples = good
        self.bad_files.update(bad)
        return bad
