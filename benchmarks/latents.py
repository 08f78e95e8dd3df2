r"""Latent extraction speed: one process against two, the VAE in fp32 against bf16, in one run.

The VAE has the architecture of Stable Diffusion's (``stabilityai/sd-vae-ft-ema``: 4 down blocks of 128-512
channels, 2 layers each) with random weights, so no download is needed and the compute is the real one.
Every configuration runs the real command (``moh-dit latents``) on the same images; images/s is read from
the encoding time the latent file's manifest records (start-up and model loading excluded). The bf16 row
also reports the deviation of the posterior means from fp32 that the manifest records.

    python benchmarks/latents.py                                  # CPU: 64 px, 48 images
    python benchmarks/latents.py --image-size 256 --images 2048 --batch-size 64 --processes 1,8   # 8 GPUs

Writes runs/benchmarks/latents_<device>.{json,md} (--out benchmarks/results publishes).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
from diffusers import AutoencoderKL
from PIL import Image

if not __package__:  # run as a file (python benchmarks/x.py): the repository root holds the benchmarks package
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.timing import DEFAULT_OUT, OUT_HELP

SD_VAE = dict(
    in_channels=3,
    out_channels=3,
    latent_channels=4,
    down_block_types=("DownEncoderBlock2D",) * 4,
    up_block_types=("UpDecoderBlock2D",) * 4,
    block_out_channels=(128, 256, 512, 512),
    layers_per_block=2,
    norm_num_groups=32,
    scaling_factor=0.18215,
)


def make_images(root: Path, count: int, size: int) -> None:
    rng = np.random.default_rng(0)
    for i in range(count):
        folder = root / f"class{i % 4}"
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)).save(folder / f"{i}.png")


def run(args, work: Path, processes: int, vae_dtype: str) -> dict:
    out = work / f"lat-{processes}-{vae_dtype}.npy"
    launcher = (
        [sys.executable]
        if processes == 1
        else [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(processes)]
    )
    cmd = [
        *launcher,
        "-m",
        "moh_dit",
        "latents",
        "--data-path",
        str(work / "images"),
        "--image-size",
        str(args.image_size),
        "--vae",
        str(work / "vae"),
        "--out",
        str(out),
        "--batch-size",
        str(args.batch_size),
        "--num-workers",
        "0",
        "--vae-dtype",
        vae_dtype,
        "--device",
        args.device,
    ]
    subprocess.run(cmd, check=True, capture_output=True, env=dict(os.environ, PYTHONPATH=str(Path.cwd())))
    manifest = json.loads(Path(f"{out}.json").read_text())
    row = {
        "processes": processes,
        "vae_dtype": vae_dtype,
        "seconds": manifest["encode_seconds"],
        "images_per_s": args.images / manifest["encode_seconds"],
    }
    if "deviation_from_fp32" in manifest["vae"]:
        row["deviation_from_fp32"] = manifest["vae"]["deviation_from_fp32"]
    return row


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--image-size", type=int, default=64)
    p.add_argument("--images", type=int, default=48)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--processes", default="1,2")
    p.add_argument("--dtypes", default="fp32,bf16")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", default=DEFAULT_OUT, help=OUT_HELP)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        make_images(work / "images", args.images, args.image_size)
        torch.manual_seed(0)
        AutoencoderKL(**SD_VAE).save_pretrained(work / "vae")
        rows = []
        for processes in map(int, args.processes.split(",")):
            for dtype in args.dtypes.split(","):
                rows.append(run(args, work, processes, dtype))
                print(f"{processes} process(es), VAE {dtype}: {rows[-1]['images_per_s']:.2f} images/s", flush=True)
    base = rows[0]["images_per_s"]
    for row in rows:
        row["ratio_to_first"] = row["images_per_s"] / base
    device = torch.cuda.get_device_name() if args.device == "cuda" else (platform.processor() or "cpu")
    result = {"device": device, "torch": torch.__version__, "args": vars(args), "rows": rows}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    kind = "cuda" if args.device == "cuda" else "cpu"
    (out / f"latents_{kind}.json").write_text(json.dumps(result, indent=2))
    lines = [
        f"# Latent extraction ({device}, torch {torch.__version__})",
        "",
        f"SD-VAE architecture (random weights), {args.images} images of {args.image_size} px, both flips encoded, "
        f"batch {args.batch_size}; encoding time from the latent manifest (start-up excluded). Ratios are to the "
        "first row, measured in the same run.",
        "",
        "| processes | VAE dtype | images/s | ratio | posterior-mean deviation from fp32 (max, rms / std) |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        dev = r.get("deviation_from_fp32")
        note = f"{dev['max_abs']:.3g}, {100 * dev['rms_over_std']:.2f}%" if dev else "-"
        lines.append(
            f"| {r['processes']} | {r['vae_dtype']} | {r['images_per_s']:.2f} | {r['ratio_to_first']:.2f} | {note} |"
        )
    (out / f"latents_{kind}.md").write_text("\n".join(lines) + "\n")
    return result


if __name__ == "__main__":
    from moh_dit.cli.common import run_cli

    run_cli(main)  # bad input: one line, as the commands say it
