r"""Fewer network evaluations per image, two ways, on the embedded default's data and budget (batch 16 x 8300 steps):

    meanflow     configs/fashion_mnist_moh_meanflow.yaml: the flow twin trained on MeanFlow's average velocity
                 (guidance folded into training: omega 1, kappa 0.5), sampled in 1, 2 and 4 steps
    flow         the flow twin (configs/fashion_mnist_moh_flow.yaml): the backbone study's flow arm, the same seeds
                 (--flow-runs), sampled in 25 and 50 Euler steps at its best guidance scale
    caches       diffusers' FirstBlockCache, MagCache (calibrated on the model) and TaylorSeer on the embedded default
                 (the guidance study's DDPM runs, --ddpm-runs) and on the flow twin, at 25 and 50 steps

MeanFlow runs evaluate themselves during training (500 unguided one-step samples, the backbone study's protocol and
points). At the end every model is scored with 1000 class-balanced samples: KID, FID, precision and recall on the
project's classifier features against the 10,000 Fashion-MNIST test images, the network evaluations per image
counted and the sampling time per image measured; MeanFlow and flow paired by seed. The caches part samples seed 0
of each model with and without each cache in the same process, one after the other: its speed-up is the ratio of
the two times, its cost the KID difference.

    python -m experiments.fewstep --part train   --flow-runs DIR   # MeanFlow, 3 seeds (resumable)
    python -m experiments.fewstep --part score   --flow-runs DIR   # 1/2/4 steps against flow at 25/50
    python -m experiments.fewstep --part caches  --flow-runs DIR --ddpm-runs DIR
    python -m experiments.fewstep --report-only

Writes experiments/results/fewstep/{RESULTS.md, results.json, *.png}.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

if not __package__:  # run as a file (python experiments/x.py): the repository root holds the experiments package
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from experiments.common import add_reference_argument, reference_protocol, start_scoring
from experiments.recipes import run_name, train_arm
from experiments.report import hold_lock, save_results

MEANFLOW = "configs/fashion_mnist_moh_meanflow.yaml"
ARMS = {"meanflow": (MEANFLOW, [])}
SCALES = {
    "cpu": dict(
        overrides=[],
        eval=["log.eval_every=1660", "log.eval_samples=500"],  # the backbone study's points: 1660, 3320, ... 8300
        samples=1000,
        seeds=(0, 1, 2),
        bootstrap=20,
    ),
    "tiny": dict(  # a smoke run (tests/test_experiments.py)
        overrides=[
            "model.overrides.hidden_size=32",
            "model.overrides.head_dim=8",
            "train.max_steps=4",
            "train.checkpoint_every=2",
            "data.subset_per_class=4",
            "log.log_every=1",
            "optim.warmup_steps=1",
            "preview.per_class=1",
        ],
        eval=["log.eval_every=2", "log.eval_samples=20"],
        samples=20,
        seeds=(0, 1),
        bootstrap=3,
    ),
}


def part_train(sc: dict, out: Path, reference: Path, seeds, result: dict) -> None:
    for seed in seeds:
        for arm in ARMS:
            result["training"][run_name(arm, seed)] = train_arm(arm, seed, sc, out, reference, ARMS)
            save(out, result)


def report(result: dict) -> str:
    return "# Few-step sampling\n\nIn progress.\n"


def save(out: Path, result: dict) -> None:
    save_results(out, result, report(result))


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", choices=["train", "score", "caches", "all"], default="all")
    p.add_argument("--scale", choices=list(SCALES), default="cpu")
    p.add_argument("--seeds", type=int, nargs="+", default=None)
    p.add_argument("--report-only", action="store_true")
    p.add_argument("--out", default="experiments/results/fewstep")
    add_reference_argument(p)
    args = p.parse_args(argv)
    sc = SCALES[args.scale]
    seeds = tuple(args.seeds) if args.seeds is not None else sc["seeds"]
    out = Path(args.out)
    path = out / "results.json"
    protocol = {"scale": args.scale, "samples": sc["samples"]} | reference_protocol(args)
    result = json.loads(path.read_text()) if path.exists() else {"protocol": protocol, "training": {}, "scores": []}
    if not args.report_only:
        out.mkdir(parents=True, exist_ok=True)
        lock = hold_lock(out, "fewstep")  # noqa: F841 (held until the process ends)
        out, reference, extractor = start_scoring(args)
        torch.manual_seed(0)
        if args.part in ("train", "all"):
            part_train(sc, out, reference, seeds, result)
    save(out, result)
    return result


if __name__ == "__main__":
    main()
