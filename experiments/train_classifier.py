"""Train the Fashion-MNIST classifier used as the offline feature extractor (12.7 minutes measured on 2 CPU cores:
weights/fmnist_classifier.json).

python -m experiments.train_classifier                      # writes runs/classifier/fmnist_classifier.*
python -m experiments.train_classifier --out experiments/weights/fmnist_classifier.safetensors   # replaces the shipped one
python -m experiments.train_classifier --seed 1 --out /tmp/clf.safetensors
"""

import argparse
import json
import logging

from experiments.common import ROOT
from experiments.fmnist_classifier import DEFAULT_WEIGHTS, train_classifier


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # by default beside the shipped weights' folder, not over them: a user's run leaves the checkout clean
    p.add_argument(
        "--out",
        default="runs/classifier/fmnist_classifier.safetensors",
        help=f"where the weights go (the shipped ones: {DEFAULT_WEIGHTS.relative_to(ROOT)})",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--data-root", default=None, help="folder with the Fashion-MNIST IDX files")
    p.add_argument("--limit", type=int, default=0, help="train on the first N images only (a smoke run; 0: all)")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO)
    info = train_classifier(args.out, seed=args.seed, epochs=args.epochs, data_root=args.data_root, limit=args.limit)
    print(json.dumps(info, indent=2))


if __name__ == "__main__":
    from moh_dit.cli.common import run_cli

    run_cli(main)  # bad input: one line, as the commands say it
