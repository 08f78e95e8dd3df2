"""Training throughput: DiT-S/2 vs MoH-DiT-S/2-75 at the same width, fp32 vs bf16 autocast, with the VAE
encoding images on the fly vs pre-extracted latents (posterior moments in memory).

Every configuration is timed in the same process, in interleaved rounds; we report the median images/s
and the ratio to the baseline (DiT-S/2, fp32, pre-extracted latents) measured in the same run.

    python benchmarks/train_throughput.py                        # GPU: 256 px, SD-VAE-sized encoder
    python benchmarks/train_throughput.py --image-size 64 --batch-size 4 --rounds 3   # a CPU-sized run

The VAE has the SD-VAE architecture with random weights (no download needed; the cost is the same).
Writes ``runs/benchmarks/train_throughput_<device>.{json,md}`` (``--out benchmarks/results`` publishes).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
from pathlib import Path

if not __package__:  # run as a file (python benchmarks/x.py): the repository root holds the benchmarks package
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from diffusers import AutoencoderKL

from benchmarks.timing import DEFAULT_OUT, OUT_HELP, interleaved_rounds, write_report
from moh_dit import create_model
from moh_dit.diffusion import DiffusionObjective
from moh_dit.vae import LatentNormalization, encode_posterior, sample_posterior

MODELS = ("DiT-S/2", "MoH-DiT-S/2-75")


def make_vae(kind: str, device) -> AutoencoderKL:
    if kind == "sd":  # the architecture of stabilityai/sd-vae-ft-ema (diffusers' defaults for 4 blocks)
        vae = AutoencoderKL(
            down_block_types=("DownEncoderBlock2D",) * 4,
            up_block_types=("UpDecoderBlock2D",) * 4,
            block_out_channels=(128, 256, 512, 512),
            layers_per_block=2,
            latent_channels=4,
        )
    else:  # tiny, for smoke tests
        vae = AutoencoderKL(
            down_block_types=("DownEncoderBlock2D",) * 4,
            up_block_types=("UpDecoderBlock2D",) * 4,
            block_out_channels=(8, 8, 8, 8),
            layers_per_block=1,
            latent_channels=4,
            norm_num_groups=4,
        )
    return vae.to(device).eval().requires_grad_(False)


class Setup:
    """One configuration: model + optimizer + a fixed batch of images or latent moments."""

    def __init__(self, name, precision, source, args, vae, device):
        torch.manual_seed(0)
        latent = args.image_size // 8
        overrides = dict(sample_size=latent, num_classes=1000)
        if args.hidden_size:
            overrides.update(hidden_size=args.hidden_size, head_dim=args.hidden_size // 6)
        self.model = create_model(name, **overrides).to(device).train()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4, weight_decay=0)
        self.objective = DiffusionObjective()
        self.precision, self.source, self.vae, self.device = precision, source, vae, device
        b = args.batch_size
        self.labels = torch.randint(0, 1000, (b,), device=device)
        if source == "vae":
            self.images = torch.rand(b, 3, args.image_size, args.image_size, device=device) * 2 - 1
        else:
            with torch.no_grad():
                mean, std = encode_posterior(
                    vae, torch.rand(b, 3, args.image_size, args.image_size, device=device) * 2 - 1
                )
            self.moments = (mean, std)
        self.name = f"{name} | {precision} | {'VAE on the fly' if source == 'vae' else 'pre-extracted latents'}"
        self.key = (name, precision, source)

    def step(self) -> None:
        if self.source == "vae":
            flipped = torch.where(
                torch.rand(len(self.images), device=self.device)[:, None, None, None] < 0.5,
                self.images.flip(-1),
                self.images,
            )
            mean, std = encode_posterior(self.vae, flipped)
        else:
            mean, std = self.moments
        x0 = sample_posterior(mean, std, LatentNormalization(0.18215))
        t = torch.randint(0, 1000, (len(x0),), device=self.device)
        noise = torch.randn_like(x0)
        x_t = self.objective.add_noise(x0, noise, t)
        ctx = (
            torch.autocast(self.device.type, dtype=torch.bfloat16)
            if self.precision == "bf16"
            else torch.autocast(self.device.type, enabled=False)
        )
        with ctx:
            out = self.model(x_t, t, self.labels)
        loss = self.objective.losses(out.sample.float(), x0, x_t, t, noise).loss.mean() + 0.01 * out.aux_loss
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--image-size", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--steps", type=int, default=5, help="timed steps per configuration per round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--hidden-size", type=int, default=0, help="shrink the width (smoke tests); 0 = real S width")
    p.add_argument("--vae", choices=["sd", "tiny"], default="sd")
    p.add_argument("--precisions", default="fp32,bf16")
    p.add_argument("--out", default=DEFAULT_OUT, help=OUT_HELP)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args(argv)
    torch.set_flush_denormal(True)
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    vae = make_vae(args.vae, device)
    setups = [
        Setup(m, prec, src, args, vae, device)
        for m in MODELS
        for prec in args.precisions.split(",")
        for src in ("latents", "vae")
    ]
    times = interleaved_rounds({s.key: s.step for s in setups}, device, args.warmup, args.rounds, args.steps)
    base_key = (MODELS[0], "fp32", "latents")
    base = args.batch_size * args.steps / statistics.median(times[base_key])
    rows = []
    for s in setups:
        ips = args.batch_size * args.steps / statistics.median(times[s.key])
        rows.append(
            {
                "model": s.key[0],
                "precision": s.key[1],
                "input": s.key[2],
                "images_per_s": ips,
                "ratio_to_baseline": ips / base,
                "round_seconds": times[s.key],
            }
        )
    dev_name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    result = {
        "device": dev_name,
        "torch": torch.__version__,
        "args": vars(args),
        "baseline": " | ".join(base_key),
        "rows": rows,
    }
    lines = [
        f"# Training throughput ({dev_name}, torch {torch.__version__})",
        "",
        f"image size {args.image_size}, batch {args.batch_size}, median of {args.rounds} interleaved rounds of "
        f"{args.steps} steps; ratio to {result['baseline']} measured in the same run.",
        "",
        "| model | precision | input | images/s | ratio |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['precision']} | {r['input']} | {r['images_per_s']:.2f} | {r['ratio_to_baseline']:.3f} |"
        )
    write_report(Path(args.out), f"train_throughput_{device.type}", result, lines)
    return result


if __name__ == "__main__":
    from moh_dit.cli.common import run_cli

    run_cli(main)  # bad input: one line, as the commands say it
