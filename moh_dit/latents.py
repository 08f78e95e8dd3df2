"""Latent space: loading a diffusers ``AutoencoderKL`` and pre-extracting a data set into one packed file.

Pre-extraction stores, for every image and for *both* horizontal flips, the VAE posterior's mean and
standard deviation, so training still draws a fresh flip and a fresh posterior sample every time an
image is seen (fast-DiT freezes one of each). Everything lives in a single ``.npy`` file read through a
memory map, with a small ``.json`` beside it describing how it was made.

    python -m moh_dit.latents --data.name folder --data.path /data/imagenet/train --data.image_size 256 \
        --vae stabilityai/sd-vae-ft-ema --out latents/imagenet256.npy
"""
from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Optional

import numpy as np
import torch
from diffusers import AutoencoderKL
from torch.utils.data import DataLoader, Dataset
from tqdm.auto import tqdm

__all__ = ["load_vae", "encode_posterior", "sample_posterior", "extract_latents", "LatentDataset"]

logger = logging.getLogger(__name__)
FORMAT_VERSION = 1


def load_vae(spec: Optional[str], device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32):
    """``none`` -> None; a local folder (a VAE, or a pipeline with a ``vae/`` sub-folder) or a hub id such
    as ``stabilityai/sd-vae-ft-ema`` -> an ``AutoencoderKL`` in eval mode."""
    if spec is None or str(spec).lower() in ("", "none"):
        return None
    path = Path(spec).expanduser()
    if path.exists():
        if not path.is_dir():
            raise FileNotFoundError(f"VAE path {path} is not a folder (expected a diffusers AutoencoderKL folder)")
        sub = "vae" if not (path / "config.json").exists() and (path / "vae" / "config.json").exists() else None
        vae = AutoencoderKL.from_pretrained(path, subfolder=sub, torch_dtype=dtype)
    else:
        try:
            vae = AutoencoderKL.from_pretrained(spec, torch_dtype=dtype)
        except (OSError, ValueError) as err:
            raise RuntimeError(
                f"could not load VAE {spec!r}: it is not a local folder and could not be fetched from the hub "
                f"({type(err).__name__}). If you are offline, download it elsewhere "
                f"(`huggingface-cli download {spec}`) and pass the local folder."
            ) from err
    return vae.to(device).eval().requires_grad_(False)


@torch.no_grad()
def encode_posterior(vae: AutoencoderKL, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Images in [-1, 1] (N, C, H, W) -> posterior mean and std (N, c, h, w), unscaled."""
    dist = vae.encode(images.to(vae.dtype)).latent_dist
    return dist.mean.float(), dist.std.float()


def sample_posterior(
    mean: torch.Tensor, std: torch.Tensor, scaling_factor: float, generator: Optional[torch.Generator] = None
) -> torch.Tensor:
    """A fresh draw from N(mean, std^2), times the VAE's scaling factor."""
    eps = torch.randn(mean.shape, generator=generator, device=mean.device, dtype=mean.dtype)
    return (mean + std * eps) * scaling_factor


# ----------------------------------------------------------------------------------------------------
# Pre-extraction
# ----------------------------------------------------------------------------------------------------
def _meta_path(path: Path) -> Path:
    return path.with_suffix(".json")


@torch.no_grad()
def extract_latents(
    dataset: Dataset,
    vae: AutoencoderKL,
    out_path: str | os.PathLike,
    batch_size: int = 64,
    num_workers: int = 0,
    dtype: str = "float16",
    vae_name: str = "",
    id2label: Optional[dict[int, str]] = None,
) -> Path:
    """Encode every image of ``dataset`` (unflipped and flipped) into one packed ``.npy`` file.

    Rows are ``(moments, label)`` with ``moments`` of shape (2 flips, 2 [mean, std], c, h, w). The file is
    written under a temporary name and renamed when complete, so an interrupted run leaves no file that
    looks finished.
    """
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    device = next(vae.parameters()).device
    x0, _ = dataset[0]
    mean0, _ = encode_posterior(vae, x0[None].to(device))
    latent_shape = tuple(mean0.shape[1:])
    row = np.dtype([("moments", dtype, (2, 2, *latent_shape)), ("label", "<i8")])
    tmp = out_path.with_name(out_path.name + ".partial.npy")
    table = np.lib.format.open_memmap(tmp, mode="w+", dtype=row, shape=(len(dataset),))
    loader = DataLoader(dataset, batch_size=batch_size, shuffle=False, num_workers=num_workers)
    start = 0
    for images, labels in tqdm(loader, desc="encoding latents", unit="batch"):
        images = images.to(device)
        both = torch.cat([images, images.flip(-1)])  # unflipped then flipped
        mean, std = encode_posterior(vae, both)
        n = images.shape[0]
        moments = torch.stack([torch.stack([mean[:n], std[:n]], 1), torch.stack([mean[n:], std[n:]], 1)], 1)
        table["moments"][start : start + n] = moments.cpu().numpy().astype(dtype)
        table["label"][start : start + n] = labels.numpy()
        start += n
    table.flush()
    del table
    meta = {
        "format_version": FORMAT_VERSION,
        "count": len(dataset),
        "latent_shape": list(latent_shape),
        "dtype": dtype,
        "vae": vae_name,
        "scaling_factor": float(vae.config.scaling_factor),
        "image_size": int(x0.shape[-1]),
        "id2label": {str(k): v for k, v in (id2label or {}).items()},
    }
    _meta_path(out_path).write_text(json.dumps(meta, indent=2))
    os.replace(tmp, out_path)
    return out_path


class LatentDataset(Dataset):
    """Pre-extracted latents: item ``i`` is ``(moments (2, 2, c, h, w) float32, label)``."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            partial = self.path.with_name(self.path.name + ".partial.npy")
            hint = " (an unfinished extraction left a .partial file: run it again)" if partial.exists() else ""
            raise FileNotFoundError(f"latent file {self.path} not found{hint}")
        meta_file = _meta_path(self.path)
        if not meta_file.is_file():
            raise FileNotFoundError(f"{meta_file} (the description of {self.path.name}) is missing")
        self.meta = json.loads(meta_file.read_text())
        if self.meta.get("format_version") != FORMAT_VERSION:
            raise ValueError(f"{self.path}: unsupported latent format {self.meta.get('format_version')}")
        self.table = np.load(self.path, mmap_mode="r")
        if len(self.table) != self.meta["count"]:
            raise ValueError(f"{self.path} holds {len(self.table)} rows but its description says {self.meta['count']}")
        self.scaling_factor = float(self.meta["scaling_factor"])
        self.latent_shape = tuple(self.meta["latent_shape"])

    @property
    def id2label(self) -> dict[int, str]:
        return {int(k): v for k, v in self.meta.get("id2label", {}).items()}

    @property
    def targets(self) -> list[int]:
        return self.table["label"].tolist()

    def __len__(self) -> int:
        return len(self.table)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        row = self.table[index]
        return torch.from_numpy(np.array(row["moments"], dtype=np.float32)), int(row["label"])


def main(argv: Optional[list[str]] = None) -> None:
    """Command line: encode a data set once into a packed latent file for ``data.name=latents``."""
    import argparse

    from .data import FashionMNIST, ImageFolderDataset

    parser = argparse.ArgumentParser(prog="python -m moh_dit.latents", description=main.__doc__)
    parser.add_argument("--data-name", choices=["folder", "fashion-mnist"], default="folder")
    parser.add_argument("--data-path", help="image folder (one sub-folder per class) or IDX folder")
    parser.add_argument("--image-size", type=int, default=256)
    parser.add_argument("--channels", type=int, default=3)
    parser.add_argument("--vae", default="stabilityai/sd-vae-ft-ema", help="hub id or local AutoencoderKL folder")
    parser.add_argument("--out", required=True, help="output .npy file")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--num-workers", type=int, default=4)
    parser.add_argument("--dtype", choices=["float16", "float32"], default="float16")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    if args.data_name == "folder":
        if not args.data_path:
            parser.error("--data-path is required for --data-name folder")
        dataset = ImageFolderDataset(args.data_path, args.image_size, channels=args.channels)
        bad = dataset.scan()
        if bad:
            logger.warning("dropped %d unreadable images", len(bad))
    else:
        dataset = FashionMNIST(args.data_path, image_size=args.image_size, channels=args.channels)
    vae = load_vae(args.vae, device=args.device)
    if vae is None:
        parser.error("--vae none makes no sense for latent extraction")
    out = extract_latents(dataset, vae, args.out, batch_size=args.batch_size, num_workers=args.num_workers,
                          dtype=args.dtype, vae_name=args.vae, id2label=dataset.id2label)  # fmt: skip
    print(f"wrote {len(dataset)} latents to {out}")


if __name__ == "__main__":
    from moh_dit.cli import run_cli

    run_cli(main)
