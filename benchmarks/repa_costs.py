"""What REPA's encoder costs, and what the two ways to feed it latent training cost on disk.

REPA's encoder sees the clean images of every batch. With pre-extracted latents they must come from somewhere:
kept beside the latents (``moh-dit latents --keep-images``, REPA's way; the encoder then runs every step) or the
encoder's features pre-extracted for both flips (no encoder at training time, but every feature on disk). This
benchmark measures, in one run:

- the FLOPs of one image through DINOv2 (random weights of the real architecture, at REPA's 224 px for 256 px
  images) and through a training step of the network (forward and backward), counted by torch's FlopCounterMode;
- their times on this device (median of interleaved rounds) and the ratio;
- the bytes per image of the latents (both flips, posterior mean and std), the kept image, and the features of
  both flips, and what each comes to for ImageNet-1k's 1,281,167 images.

    python benchmarks/repa_costs.py                                      # DINOv2-B at 224 px, MoH-DiT-XL/2-90
    python benchmarks/repa_costs.py --encoder dinov2-vit-s --model MoH-DiT-S/2-90 --rounds 3   # a CPU-sized run

Writes ``runs/benchmarks/repa_costs_<cpu|cuda>.{json,md}`` (``--out benchmarks/results`` publishes).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

if not __package__:  # run as a file (python benchmarks/x.py): the repository root holds the benchmarks package
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from torch.utils.flop_counter import FlopCounterMode

from benchmarks.timing import DEFAULT_OUT, OUT_HELP, interleaved_rounds, write_report

IMAGENET = 1_281_167


def count_flops(fn) -> int:
    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--encoder", default="dinov2-vit-b")
    p.add_argument("--model", default="MoH-DiT-XL/2-90")
    p.add_argument("--image-size", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", type=Path, default=Path(DEFAULT_OUT), help=OUT_HELP)
    args = p.parse_args(argv)
    import timm

    from moh_dit import create_model
    from moh_dit.training.encoders import DINOV2, repa_input

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    resolution = 224 * (args.image_size // 256)
    torch.manual_seed(0)
    encoder = timm.create_model(DINOV2[args.encoder], pretrained=False, num_classes=0, img_size=resolution)
    encoder = encoder.to(device).eval().requires_grad_(False)
    latent = args.image_size // 8
    model = create_model(args.model, sample_size=latent, in_channels=4, num_classes=1000).to(device).train()
    b = args.batch_size
    images = torch.randint(0, 256, (b, 3, args.image_size, args.image_size), dtype=torch.uint8, device=device)
    x, t, y = (
        torch.randn(b, 4, latent, latent, device=device),
        torch.randint(0, 1000, (b,), device=device),
        torch.zeros(b, dtype=torch.long, device=device),
    )

    def encode():
        with torch.no_grad():
            encoder.forward_features(repa_input(images, resolution))

    def step():
        out = model(x, t, y)
        (out.sample.square().mean() + out.aux_loss).backward()
        model.zero_grad(set_to_none=True)

    flops = {"encoder": count_flops(encode) / b, "training_step": count_flops(step) / b}
    seconds = interleaved_rounds(
        {"encoder": encode, "training_step": step}, device, warmup=1, rounds=args.rounds, per_round=1
    )
    per_image = {k: statistics.median(v) / b for k, v in seconds.items()}
    tokens = (resolution // 14) ** 2
    dim = encoder.num_features
    storage = {
        "latents (both flips, mean and std, float16)": 2 * 2 * 4 * latent * latent * 2,
        "image kept (uint8)": 3 * args.image_size * args.image_size,
        f"{args.encoder} features of both flips (float16)": 2 * tokens * dim * 2,
    }
    result = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "encoder": args.encoder,
        "model": args.model,
        "image_size": args.image_size,
        "encoder_resolution": resolution,
        "flops_per_image": flops,
        "flops_ratio": flops["encoder"] / flops["training_step"],
        "seconds_per_image": per_image,
        "time_ratio": per_image["encoder"] / per_image["training_step"],
        "bytes_per_image": storage,
        "imagenet_gb": {k: v * IMAGENET / 1e9 for k, v in storage.items()},
    }
    lines = [
        f"# REPA's encoder: compute and storage ({result['device']})",
        "",
        f"{args.encoder} (random weights, real architecture) at {resolution} px on {args.image_size} px images, against "
        f"a training step (forward and backward) of {args.model} on the SD-VAE's {latent} x {latent} latents; batch "
        f"{b}, median of {args.rounds} interleaved rounds (`python benchmarks/repa_costs.py`).",
        "",
        "| per image | encoder | training step | encoder / step |",
        "|---|---|---|---|",
        f"| GFLOPs (FlopCounterMode) | {flops['encoder'] / 1e9:.1f} | {flops['training_step'] / 1e9:.1f} | "
        f"{result['flops_ratio']:.3f} |",
        f"| seconds on this device | {per_image['encoder']:.3f} | {per_image['training_step']:.3f} | "
        f"{result['time_ratio']:.3f} |",
        "",
        "| stored per image | bytes | ImageNet-1k |",
        "|---|---|---|",
        *[f"| {k} | {v:,} | {result['imagenet_gb'][k]:.0f} GB |" for k, v in storage.items()],
    ]
    kind = "cuda" if device.type == "cuda" else "cpu"
    write_report(args.out, f"repa_costs_{kind}", result, lines)
    return result


if __name__ == "__main__":
    from moh_dit.cli.common import run_cli

    run_cli(main)  # bad input: one line, as the commands say it
