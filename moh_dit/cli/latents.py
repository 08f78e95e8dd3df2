r"""Encode a data set once into a packed latent file for ``data.name=latents`` (both flips; the posterior's mean
and standard deviation, or the latent of a deterministic encoder such as DC-AE; a manifest records the data, the
autoencoder and every number of its latent space). Runs on any number of processes, each writing its own blocks of
the one file (the result is the same for any count).

    moh-dit latents --data-path /data/imagenet/train --image-size 256 --vae stabilityai/sd-vae-ft-ema \
        --out latents/imagenet256.npy
    moh-dit latents --data-path /data/imagenet/train --image-size 512 \
        --vae mit-han-lab/dc-ae-f32c32-in-1.0-diffusers --out latents/imagenet512-dcae.npy
    moh-dit latents --data-path /data/imagenet/train --image-size 256 \
        --vae stabilityai/stable-diffusion-3.5-medium:vae --out latents/imagenet256-sd3.npy
    accelerate launch --num_processes 8 -m moh_dit latents --data-path /data/imagenet/train \
        --image-size 256 --vae-dtype bf16 --out latents/imagenet256.npy
    torchrun --standalone --nproc_per_node 2 -m moh_dit latents ...      # two CPU processes

--vae takes any diffusers autoencoder (AutoencoderKL, AutoencoderDC, ...): a hub id, ``repo:subfolder`` for the
autoencoder inside a pipeline repository, or a local folder (docs/latent_spaces.md lists them).

--vae-dtype bf16 (or fp16) runs the VAE in half precision: much faster on GPUs; the deviation of the
posterior means from fp32 is measured on the first block and written to the log and the manifest.

An interrupted extraction resumes when run again with the same data, VAE and --batch-size (on any number
of processes); latents already complete at --out are left alone, and latents of other data or another VAE
there are replaced only with --overwrite.
"""

import argparse
import logging
from pathlib import Path

from moh_dit.cli.common import positive_int
from moh_dit.logs import setup_logging

logger = logging.getLogger("moh_dit.vae")


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--data-name", choices=["folder", "fashion-mnist"], default="folder")
    parser.add_argument("--data-path", help="image folder (one sub-folder per class) or IDX folder")
    parser.add_argument("--image-size", type=positive_int, default=256)
    parser.add_argument("--channels", type=int, choices=[1, 3], default=3)
    parser.add_argument(
        "--vae",
        default="stabilityai/sd-vae-ft-ema",
        help="any diffusers autoencoder: hub id, hub id:subfolder, or local folder",
    )
    parser.add_argument("--out", required=True, help="output .npy file")
    parser.add_argument("--batch-size", type=positive_int, default=64)
    parser.add_argument("--num-workers", type=int, default=4)
    parser.add_argument("--dtype", choices=["float16", "float32"], default="float16", help="storage dtype of the file")
    parser.add_argument("--vae-dtype", choices=["fp32", "bf16", "fp16"], default="fp32", help="dtype the VAE runs in")
    parser.add_argument("--max-bad-fraction", type=float, default=0.01, help="share of unreadable images tolerated")
    parser.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    parser.add_argument(
        "--commit-every",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="how often each process records its finished blocks: the most work an interrupted extraction redoes",
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace latents of other data or another VAE at --out (and any unfinished extraction there)",
    )
    parser.add_argument(
        "--keep-images",
        action="store_true",
        help="also store each image (uint8) beside its latents: REPA's encoders need them (as REPA stores them); "
        "docs/training.md#repa weighs this against pre-extracted encoder features",
    )
    return parser


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    if args.commit_every < 0:
        parser.error(f"--commit-every must be >= 0 seconds, got {args.commit_every}")
    setup_logging()
    import copy

    import torch
    from accelerate import Accelerator

    from moh_dit.data.fashion_mnist import FashionMNIST
    from moh_dit.data.image_folder import ImageFolderDataset
    from moh_dit.data.latents import extract_latents
    from moh_dit.devices import resolve_device
    from moh_dit.files import ensure_writable_dir
    from moh_dit.vae import load_vae, resolve_vae_spec

    device = resolve_device(args.device)
    accelerator = Accelerator(cpu=device.type == "cpu")
    logger.info("%d process(es) on %s", accelerator.num_processes, accelerator.device)
    out = Path(args.out)
    ensure_writable_dir(out.parent, "--out folder")
    if args.data_name == "folder":
        if not args.data_path:
            parser.error("--data-path is required for --data-name folder")
        dataset = ImageFolderDataset(args.data_path, args.image_size, channels=args.channels)
    else:
        dataset = FashionMNIST(args.data_path, image_size=args.image_size, channels=args.channels)
    if resolve_vae_spec(args.vae) is None:
        parser.error("--vae none makes no sense for latent extraction")
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.vae_dtype]
    fp32_vae = load_vae(args.vae, device=accelerator.device)
    vae = copy.deepcopy(fp32_vae).to(dtype) if dtype != torch.float32 else fp32_vae
    out = extract_latents(
        dataset,
        vae,
        out,
        batch_size=args.batch_size,
        num_workers=args.num_workers,
        dtype=args.dtype,
        vae_name=args.vae,
        id2label=dataset.id2label,
        accelerator=accelerator,
        max_bad_fraction=args.max_bad_fraction,
        fp32_vae=fp32_vae if vae is not fp32_vae else None,
        overwrite=args.overwrite,
        commit_every_s=args.commit_every,
        keep_images=args.keep_images,
    )
    if out is not None:
        print(f"{len(dataset)} rows of latents in {out}")
