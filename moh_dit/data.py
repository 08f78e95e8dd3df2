"""Datasets: class-per-folder images with DiT's ADM preprocessing, Fashion-MNIST from IDX files, and a
resumable, rank-sharded batch sampler.

Every dataset returns ``(image, label)`` with the image a float32 tensor (C, H, W) in [-1, 1], un-flipped:
random horizontal flips are drawn by the training loop from its per-step generator, so augmentation is
reproducible after a resume and identical whether images come from disk or from pre-extracted latents.
"""

from __future__ import annotations

import dataclasses
import functools
import gzip
import logging
import math
import os
import struct
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Optional, Sequence

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError
from torch.utils.data import Dataset, Subset

from .artifacts import fingerprint_files
from .errors import DataError
from .images import to_model_range
from .seeding import epoch_seed

if TYPE_CHECKING:
    from .config import DataSection

__all__ = [
    "DataError",
    "IMAGE_EXTENSIONS",
    "FASHION_MNIST_CLASSES",
    "ImageFolderDataset",
    "FashionMNIST",
    "ShardedEpochBatchSampler",
    "center_crop_arr",
    "read_idx",
    "to_model_range",
    "list_images",
    "load_image",
    "TrainingData",
    "build_dataset",
    "load_training_data",
    "load_data_space",
    "ClassDraws",
    "class_draws",
    "dataset_labels",
]

logger = logging.getLogger(__name__)

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".webp", ".tif", ".tiff", ".gif", ".jpe", ".ppm")
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


def load_image(path: str | os.PathLike, image_size: Optional[int] = None, channels: int = 3) -> np.ndarray:
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
                    logger.warning("skipping unreadable image %s (%s); %d bad so far", path, err, len(self.bad_files))
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
        for i, (path, label) in enumerate(self.samples):
            try:
                with Image.open(path) as img:
                    img.load()
                good.append((path, label))
            except (OSError, UnidentifiedImageError, ValueError, SyntaxError):
                bad.append(path)
        for path in bad:
            logger.warning("dropping unreadable image %s", path)
        if not good:
            raise DataError(f"every image under {self.root} is unreadable")
        self.samples = good
        self.bad_files.update(bad)
        return bad


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


def _find_idx(folder: Path, stem: str) -> Optional[Path]:
    for name in (stem, stem + ".gz"):
        if (folder / name).is_file():
            return folder / name
    return None


def find_fashion_mnist(root: Optional[str] = None) -> Optional[Path]:
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
            tmp = target.with_suffix(".gz.part")
            try:
                urllib.request.urlretrieve(FASHION_MNIST_URL + stem + ".gz", tmp)
            except OSError as err:
                raise DataError(
                    f"could not download Fashion-MNIST ({err}). Offline? Install Debian's `dataset-fashion-mnist` "
                    f"package (files in /usr/share/datasets/fashion-mnist) or put the four IDX files in a folder "
                    f"and pass it as data.path"
                ) from err
            os.replace(tmp, target)
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
        root: Optional[str] = None,
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


# ----------------------------------------------------------------------------------------------------
# Sampling order
# ----------------------------------------------------------------------------------------------------
class ShardedEpochBatchSampler:
    """Batches of indices for one rank: a fresh permutation per epoch from ``(seed, epoch)``, split over
    ranks, with an optional start offset so a resumed run continues mid-epoch on exactly the batches an
    uninterrupted run would have seen.

    We write this instead of using accelerate's prepared data loader and ``skip_first_batches`` because
    the order must be a pure function of (seed, epoch, rank, position) for bit-exact resume, independent
    of any RNG state the loader consumed before the interruption.

    With ``draws`` (see :func:`class_draws`) an epoch holds each item as often as its class's weight says
    instead of once; the items of a fractional weight's extra share are drawn afresh every epoch.
    """

    def __init__(
        self,
        dataset_size: int,
        batch_size: int,
        num_replicas: int = 1,
        rank: int = 0,
        seed: int = 0,
        epoch: int = 0,
        start_batch: int = 0,
        draws: Optional["ClassDraws"] = None,
    ) -> None:
        epoch_size = dataset_size if draws is None else draws.epoch_size
        self.batches_per_epoch = epoch_size // (num_replicas * batch_size)
        if self.batches_per_epoch == 0:
            raise DataError(
                f"dataset of {epoch_size} items per epoch is smaller than one global micro-batch "
                f"({num_replicas} processes x {batch_size}); lower the batch size"
            )
        self.dataset_size, self.batch_size, self.draws = dataset_size, batch_size, draws
        self.num_replicas, self.rank = num_replicas, rank
        self.seed, self.epoch, self.start_batch = seed, epoch, start_batch

    def __len__(self) -> int:
        return self.batches_per_epoch - self.start_batch

    def __iter__(self) -> Iterator[list[int]]:
        g = torch.Generator().manual_seed(epoch_seed(self.seed, self.epoch))
        if self.draws is None:
            order = torch.randperm(self.dataset_size, generator=g)
        else:
            items = self.draws.epoch_items(g)
            order = items[torch.randperm(len(items), generator=g)]
        per_rank = self.batches_per_epoch * self.batch_size
        # interleave ranks batch by batch so that every global step sees a fresh, disjoint set of items
        mine = order[: per_rank * self.num_replicas].view(self.batches_per_epoch, self.num_replicas, self.batch_size)
        for b in range(self.start_batch, self.batches_per_epoch):
            yield mine[b, self.rank].tolist()


@dataclass(frozen=True)
class ClassDraws:
    """How often an epoch draws each class: item ``i`` of class ``c`` is drawn ``floor(w_c)`` times, and a
    fresh ``w_c - floor(w_c)`` share of the class's items once more, so every epoch has the same size and
    every item the same expected count.

    torch's ``WeightedRandomSampler`` draws with replacement, which repeats some images and skips others
    within an epoch and makes the epoch's length a separate choice; this keeps DiT's "every image once per
    epoch" for a weight of 1 and stays a pure function of (seed, epoch) for exact resume.

    Attributes:
        labels: the class of every item, ``(N,)``.
        weights: the weight of every class id that has items.
    """

    labels: torch.Tensor
    weights: dict[int, float]

    @functools.cached_property
    def _members(self) -> list[tuple[torch.Tensor, int, int]]:
        """``(items of the class, whole repeats, extra items)`` per class, found once (the sampler of every
        epoch asks for them)."""
        out = []
        for c, w in sorted(self.weights.items()):
            members = torch.nonzero(self.labels == c).flatten()
            whole = int(math.floor(w))
            out.append((members, whole, round((w - whole) * len(members))))
        return out

    @property
    def epoch_size(self) -> int:
        return sum(len(m) * whole + extra for m, whole, extra in self._members)

    def epoch_items(self, generator: torch.Generator) -> torch.Tensor:
        """The item indices of one epoch (a multiset, in class order; the caller shuffles it)."""
        parts = []
        for members, whole, extra in self._members:
            parts += [members] * whole
            if extra:
                parts.append(members[torch.randperm(len(members), generator=generator)[:extra]])
        return torch.cat(parts)

    def shares(self) -> dict[int, float]:
        """Each class's share of an epoch's draws."""
        size = self.epoch_size
        return {
            c: (len(m) * whole + extra) / size for c, (m, whole, extra) in zip(sorted(self.weights), self._members)
        }


def class_draws(spec: Any, labels: Sequence[int], id2label: dict[int, str]) -> Optional[ClassDraws]:
    """The draws ``data.class_weights`` asks for, checked against the data's classes; ``None`` for ``{}``.

    ``spec`` maps class names (as the data names them, any case) or ids to weights; classes it does not
    name keep weight 1. ``"balanced"`` weighs every class by the inverse of its size, so each is drawn
    equally often and an epoch keeps the data's size.
    """
    if not spec:
        return None
    labels_t = torch.as_tensor(list(labels), dtype=torch.long)
    ids, counts = torch.unique(labels_t, return_counts=True)
    present = dict(zip(ids.tolist(), counts.tolist()))
    if spec == "balanced":
        weights = {c: len(labels_t) / (len(present) * n) for c, n in present.items()}
    else:
        by_name = {name.lower(): c for c, name in id2label.items()}
        weights = {c: 1.0 for c in present}
        for key, weight in spec.items():
            c = by_name.get(str(key).lower())
            if c is None and (isinstance(key, int) or str(key).isdigit()):
                c = int(key)
            if c not in present:
                known = ", ".join(f"{i} ({id2label[i]})" if i in id2label else str(i) for i in sorted(present))
                raise DataError(
                    f"data.class_weights names {key!r}, which is not a class of this data; its classes: {known}"
                )
            weights[c] = float(weight)
    # all 1 (named so, or "balanced" on balanced data): the plain epoch, the same run as without weights
    return None if all(w == 1 for w in weights.values()) else ClassDraws(labels_t, weights)


def dataset_labels(dataset: Dataset) -> list[int]:
    """The class of every item of a data set or of a ``Subset`` of one."""
    if isinstance(dataset, Subset):
        parent = dataset_labels(dataset.dataset)
        return [parent[i] for i in dataset.indices]
    return list(dataset.targets)


def subset_indices(labels: Sequence[int], per_class: int) -> list[int]:
    """The first ``per_class`` indices of every class (tiny, balanced subsets for tests and smoke runs)."""
    seen: dict[int, int] = {}
    out = []
    for i, label in enumerate(labels):
        if seen.get(label, 0) < per_class:
            seen[label] = seen.get(label, 0) + 1
            out.append(i)
    return out


# ----------------------------------------------------------------------------------------------------
# What training reads: the data set, its classes, and the space the model works in
# ----------------------------------------------------------------------------------------------------
@dataclass
class TrainingData:
    """A training data set and what the model must know about it.

    Attributes:
        dataset: items ``(x, label)``: images in [-1, 1], or posterior moments for ``latent_input``.
        id2label: class names (empty when the data has none).
        num_classes: distinct classes of the data.
        in_channels, sample_size: the model's input (latent channels and size with a VAE).
        latent_input: items are pre-extracted posterior moments (2 flips, mean/std, c, h, w).
        vae: the ``AutoencoderKL`` (to encode images on the fly, and to decode previews and exported
            pipelines), or ``None`` in pixel space.
        vae_record: what identifies the VAE (see :func:`moh_dit.latents.vae_record`).
        scaling_factor: latent scaling of the VAE (1 in pixel space).
        description: what identifies the data (name, fingerprint, count, preprocessing).
        draws: how often an epoch draws each class (``data.class_weights``); ``None``: every item once.
    """

    dataset: Dataset
    id2label: dict[int, str]
    num_classes: int
    in_channels: int
    sample_size: int
    latent_input: bool = False
    vae: Optional[torch.nn.Module] = None
    vae_record: Optional[dict] = None
    scaling_factor: float = 1.0
    description: dict = field(default_factory=dict)
    draws: Optional[ClassDraws] = None

    def record(self) -> dict:
        """What a checkpoint keeps of the data: the VAE record and the class names."""
        return {"vae": self.vae_record, "id2label": {str(k): v for k, v in self.id2label.items()}}

    def loader(self, batch_sampler, num_workers: int):
        """A DataLoader over the data set in the batches of ``batch_sampler``."""
        from torch.utils.data import DataLoader

        pin = torch.cuda.is_available()
        return DataLoader(self.dataset, batch_sampler=batch_sampler, num_workers=num_workers, pin_memory=pin)

    def clean_latents(
        self, x: torch.Tensor, flip: torch.Tensor, generator: torch.Generator, device: torch.device
    ) -> torch.Tensor:
        """A micro-batch as the model's clean input x0: flipped where ``flip``, and in latent space either
        drawn from the pre-extracted posterior of that flip or encoded by the VAE and drawn from its
        posterior (the draws come from ``generator``)."""
        from .latents import encode_posterior, sample_posterior

        n = x.shape[0]
        if self.latent_input:  # x: (N, 2 flips, 2 [mean, std], c, h, w)
            moments = x[torch.arange(n), flip.long()]
            return sample_posterior(moments[:, 0], moments[:, 1], self.scaling_factor, generator).to(device)
        x = torch.where(flip[:, None, None, None], x.flip(-1), x).to(device)
        if self.vae is None:
            return x
        mean, std = encode_posterior(self.vae, x)
        eps = torch.randn(mean.shape, generator=generator).to(device)
        return (mean + std * eps) * self.scaling_factor


def build_dataset(section: "DataSection") -> Dataset:
    """The data set named by a config's ``data`` section (without subsetting)."""
    from .latents import LatentDataset

    if section.name == "fashion-mnist":
        return FashionMNIST(
            section.path,
            split=section.split,
            image_size=section.image_size,
            channels=section.channels,
            download=section.download,
        )
    if not section.path:
        what = (
            "a folder with one sub-folder per class"
            if section.name == "folder"
            else "a file written by `moh-dit latents`"
        )
        raise DataError(f"data.name={section.name} needs data.path ({what})")
    if section.name == "folder":
        return ImageFolderDataset(
            section.path, section.image_size, channels=section.channels, max_bad_fraction=section.max_bad_fraction
        )
    return LatentDataset(section.path)


def load_training_data(section: "DataSection", device: str | torch.device = "cpu") -> TrainingData:
    """Read the data set, resolve the space the model works in (:func:`load_data_space`) and how often
    each class is drawn (``data.class_weights``, :func:`class_draws`)."""
    data = load_data_space(section, device)
    draws = class_draws(section.class_weights, dataset_labels(data.dataset), data.id2label)
    if draws is None:
        return data
    shares = ", ".join(
        f"{data.id2label.get(c, c)} {share:.1%}" for c, share in draws.shares().items() if draws.weights[c] != 1
    )
    logger.info("class weights: %d draws per epoch from %d items; %s", draws.epoch_size, len(data.dataset), shares)
    # the weights by class id, so that a name and its id (or "balanced" and its numbers) record alike
    described = dict(data.description, class_weights={str(c): w for c, w in sorted(draws.weights.items())})
    return dataclasses.replace(data, draws=draws, description=described)


def load_data_space(section: "DataSection", device: str | torch.device = "cpu") -> TrainingData:
    """Read the data set and resolve the space the model works in.

    Pixel space (``data.vae=none``): the images themselves. With a VAE: images are encoded on the fly,
    and the VAE must load now (it is needed for previews and the exported pipeline; finding out after days
    of training would be too late). Pre-extracted latents: the VAE recorded in the latent file's manifest
    is authoritative; ``data.vae`` may only name the same VAE (the same path or hub id, or a copy with the
    same weights), anything else is an error.
    """
    from .latents import LatentDataset, check_vae, load_vae, resolve_vae_spec, vae_record

    base = build_dataset(section)
    if section.name == "fashion-mnist" and section.random_flip:
        # DiT's flips suit photos; in this catalogue every shoe points the same way, and a model trained
        # with flips draws half of them mirrored (experiments/results/default/flip_floor.md)
        logger.warning(
            "data.random_flip=true on Fashion-MNIST: its shoes all point one way, so the model will draw "
            "half of them mirrored; set data.random_flip=false unless that is what you want"
        )
    described = base.describe()
    dataset: Dataset = base
    if section.subset_per_class > 0:
        dataset = Subset(base, subset_indices(base.targets, section.subset_per_class))
        described = dict(described, subset_per_class=section.subset_per_class, count=len(dataset))
    id2label = dict(base.id2label)
    num_classes = len(id2label) if id2label else len(set(base.targets))
    if isinstance(base, LatentDataset):
        # the run records data.image_size and data.channels; they must say what the latents were made from
        made = {"image_size": base.meta.get("image_size"), "channels": base.meta.get("image_channels")}
        wrong = [f"data.{k}={v}" for k, v in made.items() if v is not None and getattr(section, k) != v]
        if wrong:
            asked = ", ".join(f"data.{k}={getattr(section, k)}" for k in made)
            raise DataError(
                f"the latents in {base.path} were extracted from {made['image_size']} px images with "
                f"{made['channels']} channels, not {asked}: set {' '.join(wrong)}, or extract latents to match"
            )
        record = base.vae
        wanted = resolve_vae_spec(section.vae)
        if wanted is not None and wanted != record.get("spec"):
            # another name for the recorded VAE is fine (a copy in another folder, a cached hub id), as long
            # as it is the same VAE; never fetched from the network just to find out it is not
            try:
                vae = load_vae(wanted, device=device, local_only=True)
            except DataError:
                raise DataError(
                    f"data.vae={section.vae} differs from the VAE recorded with the latents "
                    f"({record.get('spec')}) and is not available locally to compare: set data.vae=none "
                    f"to use the recorded one"
                ) from None
            check_vae(vae, wanted, record, f"the latents {base.path}")
            spec = wanted
        else:
            spec = record.get("spec")
            if spec is None:
                raise DataError(f"the latents in {base.path} record no VAE; extract them again")
            try:
                vae = load_vae(spec, device=device)
            except DataError as err:
                raise DataError(
                    f"{err} (the VAE the latents {base.path} were made with): pass it, or a copy, as data.vae"
                ) from None
            check_vae(vae, spec, record, f"the latents {base.path}")
        c, size = base.latent_shape[0], base.latent_shape[-1]
        return TrainingData(
            dataset,
            id2label,
            num_classes,
            c,
            size,
            True,
            vae,
            dict(record, spec=spec),
            float(record["scaling_factor"]),
            described,
        )
    vae = load_vae(section.vae, device=device)
    if vae is None:
        return TrainingData(
            dataset, id2label, num_classes, section.channels, section.image_size, description=described
        )
    record = vae_record(vae, section.vae)
    factor = record["downsample_factor"]
    if vae.config.in_channels != section.channels:
        raise DataError(
            f"data.vae takes {vae.config.in_channels}-channel images but data.channels={section.channels}: set "
            f"data.channels={vae.config.in_channels} (grayscale is repeated)"
        )
    if section.image_size % factor:
        raise DataError(
            f"data.image_size={section.image_size} is not divisible by the VAE's downsampling factor {factor}"
        )
    return TrainingData(
        dataset,
        id2label,
        num_classes,
        record["latent_channels"],
        section.image_size // factor,
        False,
        vae,
        record,
        record["scaling_factor"],
        described,
    )
