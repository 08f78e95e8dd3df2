"""Latent space: loading a diffusers ``AutoencoderKL`` and pre-extracting a data set into one packed file.

Pre-extraction stores, for every image and for *both* horizontal flips, the VAE posterior's mean and
standard deviation, so training still draws a fresh flip and a fresh posterior sample every time an
image is seen (fast-DiT freezes one of each). Everything lives in a single ``.npy`` file read through a
memory map, with a manifest (``<file>.json``) beside it that records how it was made.

    moh-dit latents --data-path /data/imagenet/train --image-size 256 \\
        --vae stabilityai/sd-vae-ft-ema --out latents/imagenet256.npy
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Optional

import numpy as np
import torch
from diffusers import AutoencoderKL
from torch.utils.data import DataLoader, Dataset
from tqdm.auto import tqdm

from .artifacts import (
    ensure_writable_dir,
    fingerprint_file,
    fingerprint_module,
    format_differences,
    read_manifest,
    sibling,
    write_manifest,
)
from .errors import ArtifactError, DataError

__all__ = [
    "load_vae",
    "resolve_vae_spec",
    "vae_record",
    "check_vae",
    "encode_posterior",
    "sample_posterior",
    "extract_latents",
    "LatentDataset",
]

logger = logging.getLogger(__name__)
FORMAT_VERSION = 2


# ----------------------------------------------------------------------------------------------------
# The VAE
# ----------------------------------------------------------------------------------------------------
def _looks_like_path(spec: str) -> bool:
    """A hub id is ``name`` or ``namespace/name``; anything absolute, relative (``./``, ``../``, ``~``) or
    deeper is a path on disk."""
    return spec.startswith(("/", ".", "~")) or spec.count("/") > 1 or (os.sep != "/" and os.sep in spec)


def resolve_vae_spec(spec: Optional[str]) -> Optional[str]:
    """``none`` -> ``None``; an existing local folder -> its absolute path (so a record stays valid from any
    working directory); a hub id -> as given. A path that does not exist is an error, not a hub lookup."""
    if spec is None or str(spec).strip().lower() in ("", "none"):
        return None
    path = Path(str(spec)).expanduser()
    if path.exists():
        if not path.is_dir():
            raise DataError(f"VAE path {path} is not a folder (expected a diffusers AutoencoderKL folder)")
        return str(path.resolve())
    if _looks_like_path(str(spec)):
        raise DataError(f"VAE folder {spec} does not exist")
    return str(spec)


def load_vae(
    spec: Optional[str],
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    local_only: bool = False,
):
    """``none`` -> None; a local folder (a VAE, or a pipeline with a ``vae/`` sub-folder) or a hub id such
    as ``stabilityai/sd-vae-ft-ema`` -> an ``AutoencoderKL`` in eval mode. Hub ids are looked up in the local
    cache first, so an offline machine that has the VAE cached does not wait on the network;
    ``local_only`` never goes to the network."""
    resolved = resolve_vae_spec(spec)
    if resolved is None:
        return None
    path = Path(resolved)
    try:
        if path.is_dir():
            sub = "vae" if not (path / "config.json").exists() and (path / "vae" / "config.json").exists() else None
            vae = AutoencoderKL.from_pretrained(path, subfolder=sub, torch_dtype=dtype, use_safetensors=True)
        else:
            try:
                vae = AutoencoderKL.from_pretrained(resolved, torch_dtype=dtype, local_files_only=True)
            except (OSError, ValueError):
                if local_only:
                    raise
                vae = AutoencoderKL.from_pretrained(resolved, torch_dtype=dtype)
    except (OSError, ValueError) as err:
        where = (
            "the folder is not a readable AutoencoderKL"
            if path.is_dir()
            else (
                f"it is not cached locally and could not be fetched from the hub; if you are offline, download it "
                f"elsewhere (`hf download {resolved}`) and pass the local folder"
            )
        )
        raise DataError(f"could not load VAE {resolved}: {where} ({str(err).splitlines()[0]})") from None
    return vae.to(device).eval().requires_grad_(False)


def vae_record(vae: AutoencoderKL, spec: Optional[str]) -> dict:
    """What identifies a VAE for latents and pipelines: where it came from, its weights fingerprint, and
    the numbers that change the latent space (scaling factor, downsampling, channels)."""
    return {
        "spec": resolve_vae_spec(spec) if spec else None,
        "sha256": fingerprint_module(vae),
        "scaling_factor": float(vae.config.scaling_factor),
        "downsample_factor": 2 ** (len(vae.config.block_out_channels) - 1),
        "latent_channels": int(vae.config.latent_channels),
    }


def check_vae(vae: AutoencoderKL, spec: Optional[str], record: dict, what: str) -> None:
    """Stop when ``vae`` is not the VAE described by ``record`` (weights, scaling factor, downsampling)."""
    mine = vae_record(vae, spec)
    diffs = [
        (k, record.get(k), mine[k])
        for k in ("sha256", "scaling_factor", "downsample_factor", "latent_channels")
        if record.get(k) is not None and record.get(k) != mine[k]
    ]
    if diffs:
        raise ArtifactError(
            f"VAE {mine['spec']} is not the VAE {what} was made with ({format_differences(diffs)}); "
            f"use the recorded VAE {record.get('spec')}"
        )


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
def partial_path(path: Path) -> Path:
    return sibling(path, ".partial.npy")


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
    looks finished. Its manifest (``<file>.json``) records the data, the VAE (resolved path or hub id,
    fingerprint, scaling factor, downsampling) and the shapes; training trusts that record over its config.
    """
    out_path = Path(out_path)
    ensure_writable_dir(out_path.parent, "latent output folder")
    device = next(vae.parameters()).device
    x0, _ = dataset[0]
    mean0, _ = encode_posterior(vae, x0[None].to(device))
    latent_shape = tuple(mean0.shape[1:])
    row = np.dtype([("moments", dtype, (2, 2, *latent_shape)), ("label", "<i8")])
    tmp = partial_path(out_path)
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
    data_record = {"count": len(dataset), "id2label": {str(k): v for k, v in (id2label or {}).items()}}
    describe = getattr(dataset, "describe", None)
    if describe is not None:
        data_record.update(describe())
    os.replace(tmp, out_path)
    write_manifest(
        out_path,
        "latents",
        format_version=FORMAT_VERSION,
        count=len(dataset),
        latent_shape=list(latent_shape),
        dtype=dtype,
        image_size=int(x0.shape[-1]),
        image_channels=int(x0.shape[0]),
        vae=vae_record(vae, vae_name or None),
        data=data_record,
        file_sha256=fingerprint_file(out_path),
        file_size=out_path.stat().st_size,
    )
    return out_path


class LatentDataset(Dataset):
    """Pre-extracted latents: item ``i`` is ``(moments (2, 2, c, h, w) float32, label)``. The manifest
    beside the file is checked against the file (row count, size, shapes) when it is opened."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            hint = (
                " (an unfinished extraction left a .partial file: run it again)"
                if partial_path(self.path).exists()
                else ""
            )
            raise DataError(f"latent file {self.path} not found{hint}")
        meta = read_manifest(self.path, "latents")
        if meta is None:
            old = self.path.with_suffix(".json")
            hint = f" ({old.name} is from an older moh-dit: extract the latents again)" if old.is_file() else ""
            raise ArtifactError(f"{sibling(self.path, '.json')} (the manifest of {self.path.name}) is missing{hint}")
        if meta.get("format_version") != FORMAT_VERSION:
            raise ArtifactError(f"{self.path}: unsupported latent format {meta.get('format_version')}; extract again")
        self.meta = meta
        if self.path.stat().st_size != meta["file_size"]:
            raise ArtifactError(
                f"{self.path} has {self.path.stat().st_size} bytes but its manifest says "
                f"{meta['file_size']}: the file was changed or truncated; extract again"
            )
        try:
            self.table = np.load(self.path, mmap_mode="r")
        except (OSError, ValueError) as err:
            raise ArtifactError(f"{self.path} is not a readable latent file ({err}); extract again") from None
        expected = (2, 2, *meta["latent_shape"])
        if len(self.table) != meta["count"] or tuple(self.table.dtype["moments"].shape) != expected:
            raise ArtifactError(
                f"{self.path} does not match its manifest ({len(self.table)} rows of "
                f"{self.table.dtype['moments'].shape}, manifest: {meta['count']} of {expected})"
            )
        self.vae = meta["vae"]
        self.scaling_factor = float(self.vae["scaling_factor"])
        self.latent_shape = tuple(meta["latent_shape"])

    @property
    def id2label(self) -> dict[int, str]:
        return {int(k): v for k, v in self.meta["data"].get("id2label", {}).items()}

    @property
    def targets(self) -> list[int]:
        return self.table["label"].tolist()

    def describe(self) -> dict:
        """What identifies this data set: the latent file's fingerprint (recorded at extraction)."""
        return {
            "name": "latents",
            "fingerprint": self.meta["file_sha256"],
            "count": len(self),
            "source": self.meta["data"],
        }

    def __len__(self) -> int:
        return len(self.table)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        row = self.table[index]
        return torch.from_numpy(np.array(row["moments"], dtype=np.float32)), int(row["label"])


if __name__ == "__main__":  # python -m moh_dit.latents: the same as `moh-dit latents`
    from moh_dit.cli import run_cli
    from moh_dit.commands.latents import main

    run_cli(main)
