"""A small Fashion-MNIST classifier used as the feature extractor for offline FID / precision / recall on that
domain (the ImageNet Inception network is a poor judge of 28 x 28 grayscale clothes, and needs weights we
cannot download here).

The network is trained by :func:`train_classifier` (``python -m experiments.train_classifier``), from a seed,
on the training split; its test-split accuracy is stored next to the weights (``experiments/weights/``). It
serves the experiments and the tests, not the package. :func:`register` registers it with torch-fidelity as
``fmnist-classifier`` with features ``pool`` (the 128-d penultimate layer, for FID, KID and precision/recall)
and ``logits_unbiased`` (10 classes, for the Inception-Score analogue); on the command line:

    python evaluate_fid.py --samples s.npz --reference ref.npz --extractor fmnist-classifier \
        --extractor-module experiments.fmnist_classifier
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn
from torch_fidelity.feature_extractor_base import FeatureExtractorBase
from torch_fidelity.registry import FEATURE_EXTRACTORS_REGISTRY, register_feature_extractor

from moh_dit.manifests import fingerprint_file

__all__ = ["FashionClassifier", "train_classifier", "DEFAULT_WEIGHTS", "EXTRACTOR_NAME", "load_classifier", "register"]

logger = logging.getLogger(__name__)
EXTRACTOR_NAME = "fmnist-classifier"
DEFAULT_WEIGHTS = Path(__file__).with_name("weights") / "fmnist_classifier.safetensors"
WEIGHTS_ENV = "MOH_DIT_FMNIST_CLASSIFIER"


class FashionClassifier(nn.Module):
    """conv(32)-conv(64)-pool-conv(128)-pool -> 3x3 average pool -> 128-d features -> 10 logits, for 28 x 28
    grayscale in [-1, 1]."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, padding=1)
        self.conv2 = nn.Conv2d(32, 64, 3, padding=1)
        self.conv3 = nn.Conv2d(64, 128, 3, padding=1)
        self.norm1, self.norm2, self.norm3 = nn.BatchNorm2d(32), nn.BatchNorm2d(64), nn.BatchNorm2d(128)
        self.embed = nn.Linear(128 * 9, 128)
        self.fc = nn.Linear(128, 10)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.norm1(self.conv1(x)))  # (N, 32, 28, 28)
        x = F.max_pool2d(F.relu(self.norm2(self.conv2(x))), 2)  # (N, 64, 14, 14)
        x = F.max_pool2d(F.relu(self.norm3(self.conv3(x))), 2)  # (N, 128, 7, 7)
        x = F.adaptive_avg_pool2d(x, 3).flatten(1)  # (N, 1152): keeps the coarse layout of the garment
        return F.relu(self.embed(x))  # (N, 128)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.features(x))


def uint8_to_input(images: torch.Tensor) -> torch.Tensor:
    """uint8 (N, C, H, W), C = 1 or 3 -> float grayscale (N, 1, 28, 28) in [-1, 1]."""
    x = images.float()
    if x.shape[1] == 3:
        x = x.mean(dim=1, keepdim=True)  # samples and references are repeated gray: the mean is the gray value
    if x.shape[-1] != 28:
        x = F.interpolate(x, size=(28, 28), mode="bilinear", align_corners=False, antialias=True)
    return x / 127.5 - 1.0


@torch.no_grad()
def predict(model: FashionClassifier, images: np.ndarray, batch: int = 1000) -> np.ndarray:
    """The classifier's label for each uint8 image, (N, H, W) grayscale or (N, H, W, C)."""
    model.eval()
    images = np.asarray(images)
    labels = []
    for i in range(0, len(images), batch):
        x = torch.from_numpy(np.array(images[i : i + batch]))
        x = x.unsqueeze(1) if x.ndim == 3 else x.permute(0, 3, 1, 2)  # (N, C, H, W)
        labels.append(model(uint8_to_input(x)).argmax(1).numpy())
    return np.concatenate(labels) if labels else np.zeros(0, dtype=np.int64)


def accuracy(model: FashionClassifier, images: np.ndarray, labels: np.ndarray, batch: int = 1000) -> float:
    return float((predict(model, images, batch) == np.asarray(labels)).mean())


def recognition_rates(predicted: np.ndarray, labels: np.ndarray, num_classes: int = 10) -> list[float | None]:
    """Per class, the share of the images of that class the classifier calls that class (its recall; None
    for a class with no images). On generated images: how often a requested garment is recognisable."""
    predicted, labels = np.asarray(predicted), np.asarray(labels)
    rates = []
    for c in range(num_classes):
        of_class = labels == c
        rates.append(float((predicted[of_class] == c).mean()) if of_class.any() else None)
    return rates


def train_classifier(
    out: str | os.PathLike = DEFAULT_WEIGHTS,
    seed: int = 0,
    epochs: int = 5,
    batch_size: int = 128,
    lr: float = 2e-3,
    data_root: str | None = None,
    limit: int = 0,
) -> dict:
    """Train on the Fashion-MNIST training split (random flips and 2-pixel shifts), report test accuracy,
    and save ``out`` (safetensors) plus ``out.json`` (accuracy, seed, settings)."""
    from moh_dit.data.fashion_mnist import FashionMNIST

    torch.manual_seed(seed)
    train = FashionMNIST(data_root, split="train")
    test = FashionMNIST(data_root, split="test")
    images, labels = train.images, train.labels
    if limit:
        images, labels = images[:limit], labels[:limit]
    model = FashionClassifier()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=1e-4)
    steps = epochs * (len(images) // batch_size)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps)
    g = torch.Generator().manual_seed(seed)
    start = time.time()
    for epoch in range(epochs):
        model.train()
        order = torch.randperm(len(images), generator=g)
        for b in range(len(images) // batch_size):
            idx = order[b * batch_size : (b + 1) * batch_size]
            x = uint8_to_input(torch.from_numpy(np.array(images[idx.numpy()])).unsqueeze(1))
            flip = torch.rand(len(x), generator=g) < 0.5
            x = torch.where(flip[:, None, None, None], x.flip(-1), x)
            shift = torch.randint(-2, 3, (2,), generator=g)
            x = torch.roll(x, shifts=(int(shift[0]), int(shift[1])), dims=(2, 3))
            loss = F.cross_entropy(model(x), torch.from_numpy(labels[idx.numpy()]))
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
        logger.info("epoch %d: loss %.4f", epoch + 1, loss.item())
    acc = accuracy(model, test.images, test.labels)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, out)
    info = {
        "test_accuracy": acc,
        "seed": seed,
        "epochs": epochs,
        "batch_size": batch_size,
        "lr": lr,
        "train_images": int(len(images)),
        "minutes": (time.time() - start) / 60,
    }
    out.with_suffix(".json").write_text(json.dumps(info, indent=2))
    return info


def load_classifier(path: str | os.PathLike | None = None) -> FashionClassifier:
    path = Path(path or os.environ.get(WEIGHTS_ENV) or DEFAULT_WEIGHTS)
    if not path.is_file():
        raise FileNotFoundError(
            f"Fashion-MNIST classifier weights not found at {path}; train them with "
            f"`python -m experiments.train_classifier` (12.7 minutes measured on 2 CPU cores) or set {WEIGHTS_ENV}"
        )
    model = FashionClassifier()
    model.load_state_dict(load_file(path))
    return model.eval()


class FashionClassifierExtractor(FeatureExtractorBase):
    """torch-fidelity wrapper: uint8 (N, 3, H, W) images -> ``pool`` (128) and ``logits_unbiased`` (10)."""

    def __init__(self, name, features_list, feature_extractor_weights_path=None, **kwargs):
        super().__init__(name, features_list)
        path = Path(feature_extractor_weights_path or os.environ.get(WEIGHTS_ENV) or DEFAULT_WEIGHTS)
        self.net = load_classifier(path)
        self.weights_sha256 = fingerprint_file(path) if path.is_file() else None
        self.requires_grad_(False)

    def forward(self, x):
        inp = uint8_to_input(x)
        pool = self.net.features(inp)
        out = {"pool": pool, "logits_unbiased": self.net.fc(pool)}
        return tuple(out[f] for f in self.features_list)

    @staticmethod
    def get_provided_features_list():
        return "pool", "logits_unbiased"

    @staticmethod
    def get_default_feature_layer_for_metric(metric):
        return {"fid": "pool", "kid": "pool", "prc": "pool", "isc": "logits_unbiased"}[metric]

    @staticmethod
    def can_be_compiled():
        return False

    @staticmethod
    def get_dummy_input_for_compile():
        return torch.zeros(1, 3, 28, 28, dtype=torch.uint8)


def register() -> str:
    """Register the classifier with torch-fidelity (once); returns its extractor name."""
    if EXTRACTOR_NAME not in FEATURE_EXTRACTORS_REGISTRY:
        register_feature_extractor(EXTRACTOR_NAME, FashionClassifierExtractor)
    return EXTRACTOR_NAME
