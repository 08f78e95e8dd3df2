r"""The embedded default's quality curve: the default config trained with evaluations during training on
(``log.eval_every``), KID and FID of class-balanced samples on the project's Fashion-MNIST classifier features
against the test set, and what the evaluations cost in wall-clock time.

    python -m experiments.training_curve                      # eval every 1000 steps, 1000 samples per point

A finished run is reused (rerunning replots); an interrupted one continues (train.resume=latest). Writes
RESULTS.md, results.json and kid_curve.png under experiments/results/training_curve/.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from pathlib import Path

from experiments.common import REFERENCE_DIR, ROOT, fashion_reference
from experiments.fmnist_classifier import EXTRACTOR_NAME
from experiments.report import save_results
from moh_dit.images import plot_curves
from moh_dit.run_folder import RunLayout
from moh_dit.sampling.card import QUALITY_KEYS
from moh_dit.training.config import load_config
from moh_dit.training.quality import EVALUATION, read_records
from moh_dit.training.trainer import train

CONFIG = "configs/fashion_mnist_moh.yaml"


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--every", type=int, default=1000, help="log.eval_every")
    p.add_argument("--samples", type=int, default=1000, help="log.eval_samples")
    p.add_argument("--run", default="runs/fashion_mnist_moh_eval")
    p.add_argument("--out", default="experiments/results/training_curve")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    out, run = ROOT / args.out, Path(args.run)
    out.mkdir(parents=True, exist_ok=True)
    reference = Path(
        os.path.relpath(fashion_reference(REFERENCE_DIR))
    )  # the 10,000 test images; records stay portable
    overrides = [
        f"train.output_dir={run}",
        f"log.eval_every={args.every}",
        f"log.eval_samples={args.samples}",
        f"log.eval_reference={reference}",
        f"log.eval_extractor={EXTRACTOR_NAME}",
        "log.eval_extractor_module=experiments.fmnist_classifier",
    ]
    previous = json.loads((out / "results.json").read_text()) if (out / "results.json").is_file() else {}
    resume = ["train.resume=latest"] if RunLayout(run).latest_checkpoint() is not None else []
    start = time.time()
    summary = train(load_config(ROOT / CONFIG, overrides + resume))
    wall = (time.time() - start) / 60
    if summary["stop_reason"] != "max_steps":
        raise SystemExit(f"{run} stopped at step {summary['step']}; rerun the same command to continue")
    points = read_records(RunLayout(run).metrics, EVALUATION)
    eval_minutes = sum(p["seconds"] for p in points) / 60
    result = {
        "config": CONFIG,
        "overrides": overrides,
        "points": points,
        # a resumed or reused run does not time the whole run: the time of the call that trained it stays
        "wall_minutes": wall if not resume else previous.get("wall_minutes"),
        "evaluation_minutes": eval_minutes,
    }
    plot_curves(
        points,
        QUALITY_KEYS,
        out / "kid_curve.png",
        f"embedded default, {args.samples} samples per point, classifier features",
    )
    save_results(out, result, render(result, args))
    return result


def render(result: dict, args) -> str:
    rows = [
        f"| {p['step']:,} | {p['kid']:.3g} | {p['fid']:.1f} | {p['precision']:.3f} | {p['recall']:.3f} | "
        f"{p['seconds']:.0f} |"
        for p in result["points"]
    ]
    wall = result["wall_minutes"]
    timing = (
        f"The whole run took {wall:.1f} minutes on this machine, of which the {len(result['points'])} evaluations "
        f"took {result['evaluation_minutes']:.1f}."
        if wall is not None
        else f"The {len(result['points'])} evaluations took {result['evaluation_minutes']:.1f} minutes."
    )
    return "\n".join(
        [
            "# The embedded default's quality curve",
            "",
            f"`python -m experiments.training_curve`: `{CONFIG}` trained with `log.eval_every={args.every}` and "
            f"`log.eval_samples={args.samples}` (class-balanced samples of the EMA weights, unguided DPM-Solver++ "
            "25 steps: the default `log.eval_sampling`), scored on the project's Fashion-MNIST classifier features "
            "against the 10,000 test images. Unguided samples score worse than the guided ones of the default's "
            "published KID; the curve shows the trend.",
            "",
            "![KID, FID, precision and recall during training](kid_curve.png)",
            "",
            "| step | KID | FID | precision | recall | seconds |",
            "|---|---|---|---|---|---|",
            *rows,
            "",
            timing,
            "",
        ]
    )


if __name__ == "__main__":
    from moh_dit.cli.common import run_cli

    run_cli(main)  # bad input: one line, as the commands say it
