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
import logging

from experiments.arms import train_recipe
from experiments.common import (
    add_scoring_arguments,
    describe_reference,
    kept_rows,
    real_recognition,
    reference_protocol,
    render_grid,
    sample_and_score,
    start_scoring,
)
from experiments.report import class_tables, save_results
from moh_dit.sampling.generation import GenerationSettings
from moh_dit.sampling.spec import GRID_GUIDANCE, SamplingSpec

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


if __name__ == "__main__":
    from moh_dit.cli.common import run_cli

    run_cli(main)  # bad input: one line, as the commands say it
