"""A small convolutional autoencoder of Fashion-MNIST, trained without labels: the frozen encoder the REPA study aligns
to (docs/results.md#repa). It must not be the evaluation's feature extractor (the project's classifier, trained with
labels), or aligning to it would game the score; an autoencoder learns what it can rebuild the images from, nothing
about their classes.

Its encoder maps a 28 x 28 image to a 7 x 7 grid of 64-d tokens: the token grid of the /4 presets at 28 px, so REPA
aligns token to token. :func:`register` registers it with torch-fidelity as ``fmnist-ae-tokens`` (feature
``patch_tokens``), what ``repa.encoder`` names:

    python -m experiments.fmnist_encoder                     # trains it (7 minutes measured on 2 CPU cores), from its seed,
                                                             # into runs/encoder/ (--out the shipped file replaces it)
    train.py ... repa.encoder=fmnist-ae-tokens repa.encoder_module=experiments.fmnist_encoder \
        repa.encoder_weights=experiments/weights/fmnist_ae.safetensors
"""

from __future__ import annotations

import argparse
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

from moh_dit.manifests import fingerprint_file
from moh_dit.training.encoders import PatchTokenEncoder, register_encoder

__all__ = ["FashionAutoencoder", "train_autoencoder", "register", "ENCODER_NAME", "DEFAULT_WEIGHTS"]

logger = logging.getLogger(__name__)
ENCODER_NAME = "fmnist-ae-tokens"
DEFAULT_WEIGHTS = Path(__file__).with_name("weights") / "fmnist_ae.safetensors"


class FashionAutoencoder(nn.Module):
    """Encoder: conv(32) 28x28 -> conv(64, stride 2) 14x14 -> conv(64, stride 2) 7x7 = 49 tokens of 64; decoder:
    the mirror image with transposed convolutions. Input and output grayscale in [-1, 1]."""

    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.encoder = nn.Sequential(
            nn.Conv2d(1, 32, 3, padding=1),
            nn.GELU(),
            nn.Conv2d(32, width, 4, stride=2, padding=1),
            nn.GELU(),
            nn.Conv2d(width, width, 4, stride=2, padding=1),
        )
        self.decoder = nn.Sequential(
            nn.GELU(),
            nn.ConvTranspose2d(width, width, 4, stride=2, padding=1),
            nn.GELU(),
            nn.ConvTranspose2d(width, 32, 4, stride=2, padding=1),
            nn.GELU(),
            nn.Conv2d(32, 1, 3, padding=1),
        )

    def tokens(self, x: torch.Tensor) -> torch.Tensor:
        """(N, 1, 28, 28) in [-1, 1] -> (N, 49, 64), row by row as the transformer's patches."""
        return self.encoder(x).flatten(2).transpose(1, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.encoder(x))


def to_input(images: torch.Tensor) -> torch.Tensor:
    """uint8 (N, C, 28, 28), C = 1 or 3 (repeated gray) -> float (N, 1, 28, 28) in [-1, 1]."""
    x = images.float()
    return (x.mean(dim=1, keepdim=True) if x.shape[1] == 3 else x) / 127.5 - 1.0


def train_autoencoder(
    out: str | os.PathLike = DEFAULT_WEIGHTS, seed: int = 0, epochs: int = 3, batch_size: int = 128, lr: float = 2e-3
) -> dict:
    """Train on the Fashion-MNIST training images (no labels) to rebuild them; save ``out`` and ``out.json``
    (settings, the test images' reconstruction error)."""
    from moh_dit.data.fashion_mnist import FashionMNIST

    torch.manual_seed(seed)
    train, test = FashionMNIST(split="train"), FashionMNIST(split="test")
    model, g = FashionAutoencoder(), torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    steps = epochs * (len(train.images) // batch_size)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps)
    start = time.time()
    for epoch in range(epochs):
        order = torch.randperm(len(train.images), generator=g)
        for b in range(len(train.images) // batch_size):
            idx = order[b * batch_size : (b + 1) * batch_size].numpy()
            x = to_input(torch.from_numpy(np.array(train.images[idx])).unsqueeze(1))
            loss = F.mse_loss(model(x), x)
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
        logger.info("epoch %d: reconstruction MSE %.4f", epoch + 1, loss.item())
    model.eval()
    with torch.no_grad():
        x = to_input(torch.from_numpy(np.array(test.images[:2000])).unsqueeze(1))
        test_mse = F.mse_loss(model(x), x).item()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, out)
    info = {
        "what": "convolutional autoencoder of the Fashion-MNIST training images, trained without labels",
        "test_reconstruction_mse": test_mse,
        "seed": seed,
        "epochs": epochs,
        "batch_size": batch_size,
        "lr": lr,
        "minutes": (time.time() - start) / 60,
    }
    out.with_suffix(".json").write_text(json.dumps(info, indent=2))
    return info


class AutoencoderTokens(PatchTokenEncoder):
    """torch-fidelity wrapper: uint8 (N, C, 28, 28) -> ``patch_tokens`` (N, 49, 64) of the frozen encoder."""

    dummy_input = (1, 28, 28)

    def __init__(self, name, features_list, feature_extractor_weights_path=None, **kwargs):
        super().__init__(name, features_list)
        path = Path(feature_extractor_weights_path or DEFAULT_WEIGHTS)
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found: train it with `python -m experiments.fmnist_encoder`")
        self.net = FashionAutoencoder()
        self.net.load_state_dict(load_file(path))
        self.net.eval().requires_grad_(False)
        self.weights_sha256 = fingerprint_file(path)

    def forward(self, x):
        return (self.net.tokens(to_input(x)),)


def register() -> str:
    """Register the encoder with torch-fidelity (once); returns its name."""
    return register_encoder(ENCODER_NAME, AutoencoderTokens)


register()  # `repa.encoder_module=experiments.fmnist_encoder` makes the name known by importing this module


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # by default beside the shipped weights' folder, not over them: a user's run leaves the checkout clean
    p.add_argument("--out", type=Path, default=Path("runs/encoder/fmnist_ae.safetensors"),
                   help="where the weights go (the shipped ones: experiments/weights/fmnist_ae.safetensors)")  # fmt: skip
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--epochs", type=int, default=3)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    info = train_autoencoder(args.out, args.seed, args.epochs)
    print(json.dumps(info, indent=2))
    return info


if __name__ == "__main__":
    from moh_dit.cli.common import run_cli

    run_cli(main)  # bad input: one line, as the commands say it
