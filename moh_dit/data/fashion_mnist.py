"""Fashion-MNIST from its IDX files (Debian's ``dataset-fashion-mnist``, a local copy, or a download),
the embedded default's data set.
"""

from __future__ import annotations

import gzip
import math
import os
import struct
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset

from moh_dit.errors import DataError
from moh_dit.files import atomic_path
from moh_dit.images import to_model_range
from moh_dit.manifests import fingerprint_files

if TYPE_CHECKING:
    pass
FASHION_MNIST_CLASSES = (
    "T-shirt/top",
    "Trouser",
    "Pullover",
    "Dress",
    "Coat",
    "Sandal",
    "Shirt",
    "Sneaker",
    "Bag",
    "Ankle boot",
)
FASHION_MNIST_FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}
FASHION_MNIST_URL = "http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/"
FASHION_MNIST_SEARCH_PATHS = ("/usr/share/datasets/fashion-mnist", "~/.cache/moh-dit/fashion-mnist")


# ----------------------------------------------------------------------------------------------------
# Fashion-MNIST (IDX files)
# ----------------------------------------------------------------------------------------------------
def read_idx(path: str | os.PathLike) -> np.ndarray:
    """Read an IDX file (optionally gzipped) into a numpy array (MNIST's format: magic, dims, data)."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        data = f.read()
    if len(data) < 4 or data[0] != 0 or data[1] != 0:
        raise DataError(f"{path} is not an IDX file (bad magic number)")
    dtypes = {0x08: np.uint8, 0x09: np.int8, 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}
    if data[2] not in dtypes:
        raise DataError(f"{path}: unknown IDX data type 0x{data[2]:02x}")
    ndim = data[3]
    shape = struct.unpack(f">{ndim}I", data[4 : 4 + 4 * ndim])
    arr = np.frombuffer(data, dtype=dtypes[data[2]], offset=4 + 4 * ndim)
    if arr.size != math.prod(shape):
        raise DataError(f"{path} is truncated: header says {shape}, found {arr.size} values")
    return arr.reshape(shape)


def _find_idx(folder: Path, stem: str) -> Path | None:
    for name in (stem, stem + ".gz"):
        if (folder / name).is_file():
            return folder / name
    return None


def find_fashion_mnist(root: str | None = None) -> Path | None:
    """The first folder holding the four Fashion-MNIST IDX files: ``root``, $MOH_DIT_FASHION_MNIST,
    Debian's ``dataset-fashion-mnist`` location, then the user cache."""
    candidates = [root, os.environ.get("MOH_DIT_FASHION_MNIST"), *FASHION_MNIST_SEARCH_PATHS]
    for cand in candidates:
        if not cand:
            continue
        folder = Path(cand).expanduser()
        if all(_find_idx(folder, s) for files in FASHION_MNIST_FILES.values() for s in files):
            return folder
    return None


def download_fashion_mnist(dest: str | os.PathLike = "~/.cache/moh-dit/fashion-mnist") -> Path:
    """Fetch the four gzipped IDX files; a clear error when offline."""
    folder = Path(dest).expanduser()
    folder.mkdir(parents=True, exist_ok=True)
    for files in FASHION_MNIST_FILES.values():
        for stem in files:
            target = folder / (stem + ".gz")
            if target.exists():
                continue
            try:
                with atomic_path(target) as tmp:
                    urllib.request.urlretrieve(FASHION_MNIST_URL + stem + ".gz", tmp)
            except OSError as err:
                raise DataError(
                    f"could not download Fashion-MNIST ({err}). Offline? Install Debian's `dataset-fashion-mnist` "
                    f"package (files in /usr/share/datasets/fashion-mnist) or put the four IDX files in a folder "
                    f"and pass it as data.path"
                ) from err
    return folder


class FashionMNIST(Dataset):
    """Fashion-MNIST (60k train / 10k test, 28 x 28 grayscale, 10 classes) from the standard IDX files.

    Args:
        root: folder with the IDX files (``.gz`` or not); searched as in :func:`find_fashion_mnist`.
        split: ``"train"`` or ``"test"``.
        image_size: output size; 28 keeps the originals, other sizes resize bicubically.
        channels: 1 (native) or 3 (gray repeated).
        download: fetch the files into the user cache when they are not found.
    """

    def __init__(
        self,
        root: str | None = None,
        split: str = "train",
        image_size: int = 28,
        channels: int = 1,
        download: bool = False,
    ) -> None:
        if split not in FASHION_MNIST_FILES:
            raise ValueError(f"split must be 'train' or 'test', got {split!r}")
        folder = find_fashion_mnist(root)
        if folder is None:
            if not download:
                where = f"{root}, " if root else ""
                raise DataError(
                    f"Fashion-MNIST IDX files not found (looked in {where}$MOH_DIT_FASHION_MNIST, "
                    f"{', '.join(FASHION_MNIST_SEARCH_PATHS)}). Install Debian's `dataset-fashion-mnist` package, "
                    f"point data.path at a folder holding {FASHION_MNIST_FILES['train'][0]}[.gz] and the other "
                    f"three files, or set data.download=true"
                )
            folder = download_fashion_mnist()
        image_stem, label_stem = FASHION_MNIST_FILES[split]
        self.images = read_idx(_find_idx(folder, image_stem))  # (N, 28, 28) uint8
        self.labels = read_idx(_find_idx(folder, label_stem)).astype(np.int64)
        if self.images.ndim != 3 or len(self.images) != len(self.labels):
            raise DataError(
                f"Fashion-MNIST files in {folder} are inconsistent: {self.images.shape}, {self.labels.shape}"
            )
        if channels not in (1, 3):
            raise ValueError(f"channels must be 1 or 3, got {channels}")
        self.root = folder
        self.split = split
        self.image_size = image_size
        self.channels = channels
        self.classes = list(FASHION_MNIST_CLASSES)

    @property
    def id2label(self) -> dict[int, str]:
        return dict(enumerate(self.classes))

    @property
    def targets(self) -> list[int]:
        return self.labels.tolist()

    def __len__(self) -> int:
        return len(self.labels)

    def describe(self) -> dict:
        """What identifies this data set: the SHA-256 of the split's two IDX files and the preprocessing."""
        files = [_find_idx(self.root, stem) for stem in FASHION_MNIST_FILES[self.split]]
        return {
            "name": "fashion-mnist",
            "split": self.split,
            "source": str(self.root.resolve()),
            "count": len(self),
            "fingerprint": fingerprint_files(self.root, files),
            "image_size": self.image_size,
            "channels": self.channels,
        }

    def load(self, index: int) -> np.ndarray:
        arr = self.images[index]
        if arr.shape[0] != self.image_size:
            arr = np.asarray(Image.fromarray(arr).resize((self.image_size,) * 2, resample=Image.BICUBIC))
        if self.channels == 3:
            arr = np.repeat(arr[:, :, None], 3, axis=2)
        return arr

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return to_model_range(self.load(index)), int(self.labels[index])
