r"""The embedded default, before and after: each recipe is trained with the same command and budget (about
10 minutes on 2 CPU cores), then sampled and scored side by side in this one script, at the same sample
count and with the same sampler, with KID and FID (90% bootstrap intervals) on the project's Fashion-MNIST
classifier features.

    python -m experiments.default_comparison                        # v1 (moh-dit 0.1), v2 ... v6 and the default
    python -m experiments.default_comparison --recipe cos=experiments/configs/fashion_mnist_moh_v1.yaml:optim.schedule=cosine

Finished runs and sample sets are reused, so an interrupted comparison continues. Writes RESULTS.md,
results.json and each recipe's grid under experiments/results/default/.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

if not __package__:  # run as a file (python experiments/x.py): the repository root holds the experiments package
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from experiments.common import (
    ROOT,
    add_scoring_arguments,
    describe_reference,
    kept_rows,
    real_recognition,
    reference_protocol,
    render_grid,
    sample_and_score,
    start_scoring,
)
from experiments.report import save_results
from moh_dit.data.fashion_mnist import FASHION_MNIST_CLASSES
from moh_dit.sampling.generation import GenerationSettings
from moh_dit.sampling.spec import GRID_GUIDANCE, SamplingSpec
from moh_dit.training.config import load_config
from moh_dit.training.trainer import train

RECIPES = {
    "v1": "experiments/configs/fashion_mnist_moh_v1.yaml",  # the default of moh-dit 0.1
    "v2": "experiments/configs/fashion_mnist_moh_v2.yaml",  # the default of the quality work's first step (b32)
    "v3": "experiments/configs/fashion_mnist_moh_v3.yaml",  # b16: batch 16 x 5400 steps
    "v4": "experiments/configs/fashion_mnist_moh_v4.yaml",  # v3 with Min-SNR-5 loss weighting
    "v5": "experiments/configs/fashion_mnist_moh_v5.yaml",  # v4 at width 128, 8300 steps in the same time
    "v6": "experiments/configs/fashion_mnist_moh_v6.yaml",  # v5 with learning rate 3e-3
    "v7": "configs/fashion_mnist_moh.yaml",  # the default now: v6 without random flips
}


def parse_recipe(text: str) -> tuple[str, str, list[str]]:
    """``NAME=CONFIG[:key=value,key=value]``; a value may be a list, ``key=[2,2,0]``."""
    name, sep, rest = text.partition("=")
    if not (name and sep and rest):
        raise SystemExit(f"--recipe wants NAME=CONFIG[:key=value,...], got {text!r}")
    config, _, overrides = rest.partition(":")
    parts, depth, current = [], 0, ""
    for char in overrides:  # commas split overrides, except inside a list's brackets
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += char
    if depth:
        raise SystemExit(f"--recipe {text!r}: unbalanced brackets")
    return name, config, [o for o in [*parts, current] if o]


def train_recipe(name: str, config: str, overrides: list[str], out: Path) -> dict:
    run = out / "runs" / name
    record = run.with_name(name + ".train.json")
    start = time.time()
    # a finished run goes through train() too: resuming checks that the folder was made by this recipe
    # (architecture, data, seed, batch), so a reused name cannot score another recipe's model
    summary = train(
        load_config(ROOT / config, [*overrides, f"train.output_dir={run}", "train.resume=latest", "log.trackers=[]"])
    )
    if summary["stop_reason"] != "max_steps":  # stopped by a signal: a checkpoint is saved
        raise SystemExit(f"{run} stopped at step {summary['step']}; rerun the same command to continue from there")
    if not record.exists():  # the training time of the call that finished the run
        record.write_text(json.dumps(dict(summary, wall_minutes=(time.time() - start) / 60), default=str))
    trained = json.loads(record.read_text())
    # the training speed from the run's own log: wall minutes also count whatever else the machine ran
    logged = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    speeds = sorted(r["images_per_s"] for r in logged if "images_per_s" in r)
    return dict(trained, median_images_per_s=speeds[len(speeds) // 2] if speeds else None)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipe", action="append", default=[], help="NAME=CONFIG[:overrides], added to v1 ... v7")
    p.add_argument("--only", nargs="+", default=None, help="run only these recipes")
    p.add_argument("--guidance", type=float, default=2.0)
    p.add_argument("--grid-guidance", type=float, default=GRID_GUIDANCE, help="guidance of the grids")
    add_scoring_arguments(p, "experiments/results/default")
    args = p.parse_args(argv)
    out, reference, extractor = start_scoring(args)
    recipes = {name: (config, []) for name, config in RECIPES.items()}
    for text in args.recipe:
        name, config, overrides = parse_recipe(text)
        recipes[name] = (config, overrides)
    names = args.only or list(recipes)
    settings = GenerationSettings(
        num_samples=args.samples,
        seed=1000,
        batch_size=250,
        label_mode="balanced",
        sampling=SamplingSpec.create(scheduler=None, num_inference_steps=args.steps, guidance_scale=args.guidance),
    )
    protocol = {
        k: getattr(args, k) for k in ("samples", "scheduler", "steps", "guidance", "grid_guidance", "bootstrap")
    } | reference_protocol(args)
    real = real_recognition(args.reference_count)
    # recipes scored earlier with the same protocol stay in the table (in RECIPES order, then the others);
    # the ones run now are replaced
    rows = kept_rows(out, protocol)
    for name in names:
        config, overrides = recipes[name]
        trained = train_recipe(name, config, overrides, out)
        tag = f"samples-{args.scheduler}{args.steps}-cfg{args.guidance:g}-n{args.samples}"
        scores = sample_and_score(
            out / "runs" / name / "pipeline",
            out / "runs" / name / tag,
            settings,
            args.scheduler,
            reference,
            extractor,
            args.bootstrap,
        )
        # every grid drawn alike (the runs' own preview grids used each recipe's preview sampler)
        render_grid(
            out / "runs" / name / "pipeline", out / f"grid_{name}.png", args.scheduler, args.steps, args.grid_guidance
        )
        rows[name] = {"config": config, "overrides": overrides, "train": trained, **scores}
        logging.info("%s: KID %.5f FID %.2f", name, scores["kid"], scores["fid"])
        order = [*[n for n in recipes if n in rows], *[n for n in rows if n not in recipes]]
        result = {"protocol": protocol, "rows": {n: rows[n] for n in order}, "real_recognised": real}
        save_results(out, result, report(result))  # after every recipe: an interrupted comparison keeps it
    return result


def report(result: dict) -> str:
    protocol, rows = result["protocol"], result["rows"]
    base = rows.get("v1", next(iter(rows.values())))["kid"]
    lines = [
        "# The embedded default, before and after",
        "",
        f"Each recipe trained by the same command on 2 CPU cores, then {protocol['samples']} class-balanced samples "
        f"({protocol['scheduler']}, {protocol['steps']} steps, guidance {protocol['guidance']:g}) scored against the "
        f"{describe_reference(protocol)} with the project's classifier features; 90% bootstrap intervals over "
        f"{protocol['bootstrap']} resamples. Reproduce: `python -m experiments.default_comparison`.",
        "",
        "| recipe | steps | minutes | images/s | KID | KID / v1 | FID | precision | recall |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in rows.items():
        kid_lo, kid_hi = r["kid_interval"]
        fid_lo, fid_hi = r["fid_interval"]
        lines.append(
            f"| {name} | {r['train']['step']} | {r['train']['wall_minutes']:.1f} | {r['train']['median_images_per_s'] or 0:.0f} | {r['kid']:.4f} [{kid_lo:.4f}, {kid_hi:.4f}] | "
            f"{r['kid'] / base:.2f} | {r['fid']:.1f} [{fid_lo:.1f}, {fid_hi:.1f}] | {r['precision']:.3f} | {r['recall']:.3f} |"
        )
    lines += [
        "",
        "Recipes: "
        + "; ".join(f"`{n}` = `{r['config']}` {' '.join(r['overrides'])}".strip() for n, r in rows.items()),
    ]
    lines += [f"- `{n}`: {r['train']['note']}" for n, r in rows.items() if r["train"].get("note")]
    lines += ["", *class_tables(rows, result.get("real_recognised"))]
    lines += [
        "",
        f"Grids: seed 0, {protocol['scheduler']} {protocol['steps']} steps, guidance {protocol['grid_guidance']:g}.",
        "",
        *[f"![{n}](grid_{n}.png)" for n in rows],
        "",
    ]
    return "\n".join(lines)


RECOGNISED_NOTE = (
    "It saturates on sandals: moh-dit 0.1's broken sandals are recognised about as often as the best recipe's, "
    "so per-class KID is the measure there."
)


def class_tables(
    rows: dict, real_recognised: list | None, what: str = "recipe", note: str = RECOGNISED_NOTE
) -> list[str]:
    """Per class: KID against the test images of that class, and how many samples the classifier recognises
    as the class they were asked for. The hard classes (sandals, sneakers, bags, ankle boots) are where
    recipes differ most; the grid shows eight samples of each, these count all of them."""
    if not all(r.get("class_kid") and r.get("recognised") for r in rows.values()):
        return []  # rows scored before these columns existed: rerun the script to fill them
    header = [
        f"| {what} | " + " | ".join(n.split("/")[0] for n in FASHION_MNIST_CLASSES) + " |",
        "|---|" + "---|" * len(FASHION_MNIST_CLASSES),
    ]

    def line(name: str, values: list, digits: int) -> str:
        return f"| {name} | " + " | ".join("-" if v is None else f"{v:.{digits}f}" for v in values) + " |"

    lines = ["Per-class KID: each class's samples against the 1,000 test images of that class.", "", *header]
    lines += [line(n, r["class_kid"], 1) for n, r in rows.items()]
    lines += [
        "",
        "Recognised: the share of each class's samples that the classifier labels as that class, and the same on "
        f"the real test images (the classifier's own errors). {note}",
        "",
        *header,
    ]
    lines += [line(n, r["recognised"], 2) for n, r in rows.items()]
    if real_recognised:
        lines.append(line("real test images", real_recognised, 2))
    seams = {n: r for n, r in rows.items() if r.get("class_seam_excess")}
    if seams:  # rows scored before the seam measure existed have none; rerunning the script adds them
        lines += [
            "",
            "Patch seams: how much sharper the lines of the model's patch grid are in the samples than in the test "
            "images of the same class (`moh_dit.evaluation.metrics.patch_seam_ratio` of the samples over that of the real "
            "images; 1 = like real images). The faint 4x4 texture of large bright areas shows up here. Any offset: "
            "the largest excess of all samples over every position of the grid (seams moved off the model's own "
            "grid, as grid averaging could, show there).",
            "",
            header[0][:-1] + "| all | any offset |",
            header[1] + "---|---|",
            *[
                line(n, [*r["class_seam_excess"], r["seam_excess"], r.get("seam_excess_any_offset")], 2)
                for n, r in seams.items()
            ],
        ]
    return lines


if __name__ == "__main__":
    main()
