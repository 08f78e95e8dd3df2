"""The ``moh-dit`` command: one entry point, one module per subcommand.

    moh-dit train --config configs/fashion_mnist_moh.yaml
    moh-dit sample runs/fashion_mnist_moh --class-labels Sneaker Bag
    moh-dit evaluate --samples s.npz --reference ref.npz
    moh-dit convert DiT-XL-2-256x256.pt pipelines/dit-xl-2 --vae stabilityai/sd-vae-ft-ema
    moh-dit latents --data-path /data/imagenet/train --image-size 256 --out latents/in256.npy
    moh-dit reference /data/imagenet/train --image-size 256 --out refs/in256.npz
    moh-dit demo runs/fashion_mnist_moh
    moh-dit ema runs/fashion_mnist_moh --sigma-rel 0.07 --out pipelines/ema-0.07
    moh-dit trajectories --teacher runs/fashion_mnist_moh_flow --out trajectories/flow --count 2048

Each subcommand module has ``build_parser(prog)`` and ``main(argv, prog)`` and imports torch only after its
arguments are parsed, so ``--help`` answers at once. ``train.py``, ``sample.py`` and ``evaluate_fid.py`` at
the repository root are the same commands under the names the reference code uses.
"""

from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS = {
    "train": "train MoH-DiT or DiT (from a config, resumable, any number of processes)",
    "sample": "sample a labelled grid, or N images for evaluation (PNGs + ADM .npz)",
    "evaluate": "FID, sFID, IS, precision and recall with ADM's semantics",
    "convert": "convert DiT / MoH-DiT / diffusers checkpoints, or turn a DiT into MoH-DiT",
    "latents": "encode a data set once into a packed latent file",
    "reference": "build an ADM-style reference batch from an image tree",
    "demo": "open a local web page to try a model (needs the demo extra)",
    "ema": "rebuild an EMA of any width from a run's post-hoc EMA snapshots, or sweep widths and score them",
    "trajectories": "record a teacher's sampling trajectories for trajectory distillation (resumable, sharded)",
}


def main(argv: list[str] | None = None) -> None:
    from moh_dit import __version__
    from moh_dit.cli.common import run_cli

    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
        prog="moh-dit", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--version", action="version", version=f"moh-dit {__version__}")
    parser.add_argument("command", choices=list(COMMANDS), metavar="command", help=_listing())
    parser.add_argument("args", nargs=argparse.REMAINDER, help="the command's arguments (see moh-dit COMMAND --help)")
    if not argv or argv[0] in ("-h", "--help", "--version"):
        parser.parse_args(argv or ["--help"])
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        parser.parse_args(argv)  # the usage error names the choices
    module = importlib.import_module(f"moh_dit.cli.{name}")
    run_cli(lambda: module.main(rest, prog=f"moh-dit {name}"))


def _listing() -> str:
    return "; ".join(f"{name}: {what}" for name, what in COMMANDS.items())
