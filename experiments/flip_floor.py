"""What random horizontal flips cost on Fashion-MNIST, measured without training anything.

DiT flips every training image with probability 1/2, which suits ImageNet photos. Fashion-MNIST is a
catalogue: every shoe points the same way. A generator trained with flips learns the mirrored shoes too,
so even a perfect one draws half of them facing the wrong way. This script scores real training images,
as they are, half of them mirrored, and all mirrored, with the per-class KID the default comparison uses
(classifier features, each class against the test images of that class). The half-mirrored row is the
floor a perfectly trained model with flips could reach.

    python -m experiments.flip_floor        # writes experiments/results/default/flip_floor.{json,md}
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from experiments.common import (
    REFERENCE_COUNT,
    ROOT,
    add_reference_argument,
    classifier_features,
    describe_reference,
    fashion_reference,
    per_class_scores,
    reference_protocol,
)
from moh_dit.data.fashion_mnist import FASHION_MNIST_CLASSES, FashionMNIST
from moh_dit.evaluation.features import extract_features
from moh_dit.manifests import code_version

VARIANTS = ("as they are", "half mirrored", "all mirrored")


def mirrored(images: np.ndarray, share: float, seed: int = 0) -> np.ndarray:
    """``images`` (N, H, W) with a random ``share`` of them flipped left to right."""
    flip = np.random.default_rng(seed).random(len(images)) < share  # (N,); random() < 1: share 1 flips all
    return np.where(flip[:, None, None], images[:, :, ::-1], images)


def flip_floor(per_class: int, reference_dir: Path, reference_count: int = REFERENCE_COUNT) -> dict:
    """Per-class KID and recognition of ``per_class`` training images per class in each variant, against
    :func:`fashion_reference` (the first ``reference_count`` test images) in ``reference_dir``."""
    train = FashionMNIST(split="train")
    picked = np.concatenate([np.flatnonzero(train.labels == c)[:per_class] for c in range(len(FASHION_MNIST_CLASSES))])
    images, labels = train.images[picked], train.labels[picked]  # (N, 28, 28) uint8, (N,)
    reference, extractor = fashion_reference(reference_dir, reference_count), classifier_features()
    rows = {}
    for name, share in zip(VARIANTS, (0.0, 0.5, 1.0)):
        rgb = np.repeat(mirrored(images, share)[..., None], 3, axis=3)  # (N, 28, 28, 3)
        rows[name] = per_class_scores(extract_features(extractor, rgb, 500), labels, reference, extractor)
    made_by = {"code": code_version(), "extractor": extractor.name, "weights_sha256": extractor.weights_sha256}
    counted = reference_protocol(argparse.Namespace(reference_count=reference_count))
    return {"per_class": per_class, "classes": list(FASHION_MNIST_CLASSES), "rows": rows, **counted, **made_by}


def report(result: dict) -> str:
    classes = result["classes"]
    lines = [
        "# What random flips cost on Fashion-MNIST",
        "",
        f"Per-class KID of {result['per_class']} real training images per class against those of the "
        f"{describe_reference(result)} in that class (the classifier's features), with none, half or all of them mirrored left to "
        "right. Written by `python -m experiments.flip_floor`.",
        "",
        "| images | " + " | ".join(classes) + " |",
        "|---|" + "---|" * len(classes),
    ]
    for name, row in result["rows"].items():
        lines.append(f"| {name} | " + " | ".join(f"{k:.1f}" for k in row["class_kid"]) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--per-class", type=int, default=200, help="training images per class")
    p.add_argument("--out", type=Path, default=ROOT / "experiments/results/default")
    add_reference_argument(p)
    args = p.parse_args(argv)
    # the reference file the default comparison uses
    result = flip_floor(args.per_class, args.out.parent, args.reference_count)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "flip_floor.json").write_text(json.dumps(result, indent=2))
    (args.out / "flip_floor.md").write_text(report(result))
    print(report(result))
    return result


if __name__ == "__main__":
    from moh_dit.cli.common import run_cli

    run_cli(main)  # bad input: one line, as the commands say it
