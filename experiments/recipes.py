r"""The field's newer recipes on the embedded default: DDPM against flow matching, REPA, post-hoc EMA.

Every arm is the embedded default's model (MoH-DiT-Ti/4-75, width 128), data and budget (batch 16 x 8300 steps,
the same learning rate, schedule, clipping and EMA), trained from scratch with one change:

    moh-ddpm        configs/fashion_mnist_moh.yaml (the embedded default, DiT's DDPM), post-hoc EMA snapshots on
    moh-flow        configs/fashion_mnist_moh_flow.yaml (flow matching: SiT's linear path, velocity, uniform times)
    dit-flow        configs/fashion_mnist_dit_flow.yaml (its DiT-Ti/4 twin: plain multi-head attention)
    moh-flow-repa   moh-flow aligned (REPA) to a Fashion-MNIST autoencoder trained without labels
                    (experiments/fmnist_encoder.py), never to the evaluation's classifier

Each run evaluates itself during training (``log.eval_every``: KID and FID of 500 unguided DPM-Solver++ samples
against the test set, the curve). Scores: 2000 class-balanced samples (1000 with ``--scale cpu``) scored against the
10,000 Fashion-MNIST test images with the project's classifier features: KID and FID with 90% bootstrap intervals;
across seeds, means with 95% t-intervals and differences paired by seed.

    python -m experiments.recipes --part train       # every arm, seed by seed (resumable; 22 min a run measured on one
                                                     # thread of a 2-core machine)
    python -m experiments.recipes --part samplers    # each objective's samplers at NFE 25 and 50, guidance (seed 0)
    python -m experiments.recipes --part objective   # DDPM against flow (and the DiT twin) at NFE 25 and 50, 3 seeds
    python -m experiments.recipes --part repa        # flow with and without REPA, 3 seeds
    python -m experiments.recipes --part posthoc     # KID against the post-hoc EMA's sigma_rel beside the fixed EMA, each seed
    python -m experiments.recipes --report-only      # rewrite RESULTS.md and the plots from results.json
    python -m experiments.recipes --scale cpu ...    # the same training, scored on 1000 samples and fewer samplers

NFE counts the network's evaluations per image (a guided step evaluates both halves in one batched call, as
the papers count it; Heun's steps cost two). ``objective`` and ``repa`` sample each objective with the sampler and
guidance ``samplers`` found best for it at that NFE, so run ``samplers`` first. Finished runs and sample sets are
reused, so an interrupted part continues; writes experiments/results/recipes/{RESULTS.md, results.json, *.png}.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
from pathlib import Path

import torch

from experiments.common import (
    ROOT,
    add_reference_argument,
    describe_reference,
    reference_protocol,
    render_grid,
    sample_and_score,
    start_scoring,
    t_interval,
)
from experiments.default_comparison import train_recipe
from moh_dit.files import atomic_write_json, atomic_write_text
from moh_dit.sampling.generation import GenerationSettings
from moh_dit.sampling.loading import load_pipeline, recorded_sampling
from moh_dit.sampling.spec import SamplingSpec
from moh_dit.training.quality import read_records

logger = logging.getLogger("experiments.recipes")

ENCODER_WEIGHTS = ROOT / "experiments" / "weights" / "fmnist_ae.safetensors"
REPA = [
    "repa.encoder=[fmnist-ae-tokens]",
    "repa.encoder_module=experiments.fmnist_encoder",
    f"repa.encoder_weights=[{ENCODER_WEIGHTS}]",
    "repa.depth=2",  # block 2 of 6: REPA's 8 of 28 (XL) and 4 of 12 (B) are a third of the depth or less
]
ARMS = {
    # a snapshot every 8000 images (500 steps of 16); the snapshots do not change the training
    "moh-ddpm": ("configs/fashion_mnist_moh.yaml", ["ema.posthoc_every=8000"]),
    "moh-flow": ("configs/fashion_mnist_moh_flow.yaml", []),
    "dit-flow": ("configs/fashion_mnist_dit_flow.yaml", []),
    "moh-flow-repa": ("configs/fashion_mnist_moh_flow.yaml", REPA),
}
OBJECTIVE_OF = {"moh-ddpm": "ddpm", "moh-flow": "flow", "dit-flow": "flow", "moh-flow-repa": "flow"}
# candidate samplers per objective as (scheduler, steps), each at about 25 and 50 network evaluations
CANDIDATES = {  # DDIM and UniPC left out of the flow list: DDIM trailed and UniPC tied DPM-Solver++ in the DDPM study
    "ddpm": [("dpm-solver", 25), ("unipc", 25), ("dpm-solver", 50), ("unipc", 50)],  # (benchmarks/results/v7)
    "flow": [("dpm-solver", 25), ("euler", 25), ("heun", 13), ("sde", 25)]
    + [("dpm-solver", 50), ("euler", 50), ("heun", 25), ("sde", 50)],
}
NFE_BUDGETS = (25, 50)
# each comparison: its arms, the first the baseline the others are paired against
COMPARISONS = {"objective": ("moh-ddpm", "moh-flow", "dit-flow"), "repa": ("moh-flow", "moh-flow-repa")}
TITLES = {"objective": "DDPM against flow matching", "repa": "REPA"}
# swept with the best sampler at NFE 25 around the embedded default's 4 (guided in the interval of timesteps 100-500),
# and kept at NFE 50
GUIDANCE_SWEEP = (3.0, 4.0, 6.0)
SIGMA_RELS = (0.03, 0.05, 0.08, 0.12, 0.16)
DEFAULT_SCALE = dict(
    overrides=[],
    eval=["log.eval_every=2075", "log.eval_samples=500"],
    samples=2000,
    seeds=(0, 1, 2),
    bootstrap=20,
    candidates=CANDIDATES,
    guidance_sweep=GUIDANCE_SWEEP,
    sigma_rels=SIGMA_RELS,
)
SCALES = {
    "default": DEFAULT_SCALE,
    # the default's training, scored on 1000 samples with fewer candidates (DDPM: DPM-Solver++, the sampler study's
    # choice; flow: every sampler at NFE 25, two at 50), guidance 4 (the default's) and three post-hoc widths: what
    # an evening of 2 CPU cores affords (each 2000-sample set at NFE 50 takes about 13 minutes there)
    "cpu": DEFAULT_SCALE
    | dict(
        samples=1000,
        candidates={
            "ddpm": [("dpm-solver", 25), ("dpm-solver", 50)],
            "flow": [("dpm-solver", 25), ("euler", 25), ("heun", 13), ("sde", 25), ("dpm-solver", 50), ("sde", 50)],
        },
        guidance_sweep=(4.0,),
        sigma_rels=(0.05, 0.10, 0.16),
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
            "ema.posthoc_every=32",
        ],
        eval=["log.eval_every=2", "log.eval_samples=20"],
        samples=20,
        seeds=(0, 1),
        bootstrap=3,
        candidates={"ddpm": [("dpm-solver", 25), ("ddim", 50)], "flow": [("heun", 13), ("sde", 25), ("euler", 50)]},
        guidance_sweep=(2.0,),
        sigma_rels=(0.05, 0.1),
    ),
}


# ----------------------------------------------------------------------------------------------------
# Training, sampling, scoring
# ----------------------------------------------------------------------------------------------------
def eval_overrides(sc: dict, reference: Path) -> list[str]:
    """The evaluations during training: the study's reference and the project's classifier features."""
    return [
        *sc["eval"],
        f"log.eval_reference={reference}",
        "log.eval_extractor=fmnist-classifier",
        "log.eval_extractor_module=experiments.fmnist_classifier",
    ]


def run_name(arm: str, seed: int) -> str:
    return f"{arm}-seed{seed}"


def train_arm(arm: str, seed: int, sc: dict, out: Path, reference: Path) -> dict:
    """Train (or reuse) one arm at one seed; its training record, speed and evaluation curve."""
    config, extra = ARMS[arm]
    overrides = [*extra, *sc["overrides"], *eval_overrides(sc, reference), f"train.seed={seed}"]
    trained = train_recipe(run_name(arm, seed), config, overrides, out)
    run = out / "runs" / run_name(arm, seed)
    records = read_records(run / "metrics.jsonl")
    last = records[-1] if records else {}
    return {
        "arm": arm,
        "seed": seed,
        "median_images_per_s": trained["median_images_per_s"],
        "final_loss": last.get("diffusion_loss"),
        "final_repa_loss": last.get("repa_loss"),
        "curve": [
            {k: r.get(k) for k in ("step", "kid", "fid")} for r in read_records(run / "metrics.jsonl", "evaluation")
        ],
    }


def evaluations_per_image(model: Path, scheduler: str, steps: int) -> int:
    """How many times the sampler calls the network for one image (counted, not assumed)."""
    pipe = load_pipeline(model, device="cpu", scheduler=scheduler)
    calls = []
    handle = pipe.transformer.register_forward_hook(lambda *_: calls.append(1))
    try:
        pipe.sample_grid([0], 1, 0, SamplingSpec(scheduler, steps, 1.0))
    finally:
        handle.remove()
    return len(calls)


def score(model: Path, scheduler: str, steps: int, guidance: float, sc: dict, reference: Path, extractor) -> dict:
    """2000 (the scale's count) class-balanced samples with the model's own guidance interval and grid averaging
    and this sampler, steps and guidance scale; scored, with the sampler's NFE."""
    recorded = recorded_sampling(model)  # the interval and averaging the run recorded
    spec = recorded.replace(scheduler=None, num_inference_steps=steps, guidance_scale=guidance)
    settings = GenerationSettings(
        num_samples=sc["samples"], seed=1000, batch_size=min(250, sc["samples"]), label_mode="balanced", sampling=spec
    )
    folder = model.parent / f"samples-{scheduler}{steps}-cfg{guidance:g}-n{sc['samples']}"
    scores = sample_and_score(model, folder, settings, scheduler, reference, extractor, sc["bootstrap"])
    return dict(
        scores, scheduler=scheduler, steps=steps, guidance=guidance, nfe=evaluations_per_image(model, scheduler, steps)
    )


def scores_row(scores: dict) -> dict:
    keep = ("kid", "kid_interval", "fid", "fid_interval", "precision", "recall", "seconds_per_image", "nfe")
    return {k: scores[k] for k in keep if k in scores} | {k: scores[k] for k in ("scheduler", "steps", "guidance")}


# ----------------------------------------------------------------------------------------------------
# The parts
# ----------------------------------------------------------------------------------------------------
def part_train(sc, out, reference, seeds, arms, result) -> None:
    for seed in seeds:  # seed by seed, so that a part stopped early has every arm at the first seeds
        for arm in arms:
            result["training"][run_name(arm, seed)] = train_arm(arm, seed, sc, out, reference)
            save(out, result)


def pipeline_of(out: Path, arm: str, seed: int) -> Path:
    return out / "runs" / run_name(arm, seed) / "pipeline"


def at_budget(row: dict, budget: int) -> bool:
    """Whether a setting spends the budget's NFE: at most ``budget``, and more than 90% of it (Heun's 2n - 1)."""
    return 0.9 * budget <= row["nfe"] <= budget


def part_samplers(sc, out, reference, extractor, result) -> None:
    """Seed 0 of each objective's MoH arm: every candidate sampler at the default's guidance 4, then the guidance
    sweep with the best sampler at NFE 25. The choice per objective: the guidance of the lowest KID at NFE 25, and
    at each budget the sampler of the lowest KID at guidance 4 (at NFE 25 the swept sampler with that guidance)."""
    for objective, arm in (("ddpm", "moh-ddpm"), ("flow", "moh-flow")):
        model, rows = pipeline_of(out, arm, 0), result["samplers"].setdefault(objective, [])
        done = {(r["scheduler"], r["steps"], r["guidance"]) for r in rows}
        for scheduler, steps in sc["candidates"][objective]:
            if (scheduler, steps, 4.0) not in done:
                rows.append(scores_row(score(model, scheduler, steps, 4.0, sc, reference, extractor)))
                save(out, result)
        first = NFE_BUDGETS[0]
        best = min((r for r in rows if at_budget(r, first) and r["guidance"] == 4.0), key=lambda r: r["kid"])
        for guidance in sc["guidance_sweep"]:
            if (best["scheduler"], best["steps"], guidance) not in {
                (r["scheduler"], r["steps"], r["guidance"]) for r in rows
            }:
                rows.append(
                    scores_row(score(model, best["scheduler"], best["steps"], guidance, sc, reference, extractor))
                )
                save(out, result)
        guidance = min((r for r in rows if at_budget(r, first)), key=lambda r: r["kid"])["guidance"]
        for budget in NFE_BUDGETS:
            at = [r for r in rows if at_budget(r, budget) and r["guidance"] in (4.0, guidance)]
            chosen = min(at, key=lambda r: (r["guidance"] != guidance, r["kid"]))  # the chosen guidance's best sampler
            result["choice"].setdefault(objective, {})[str(budget)] = {
                k: chosen[k] for k in ("scheduler", "steps", "nfe")
            } | {"guidance": guidance}
            save(out, result)


def choice(result: dict, objective: str, budget: int) -> dict:
    try:
        return result["choice"][objective][str(budget)]
    except KeyError:
        raise SystemExit(f"no sampler chosen for {objective} at NFE {budget}: run --part samplers first") from None


def part_scores(name, arms, budgets, sc, out, reference, extractor, seeds, result) -> None:
    """Every (seed, arm, budget) with its objective's chosen sampler and guidance."""
    records = result.setdefault(name, [])
    for seed in seeds:
        for arm in arms:
            for budget in budgets:
                pick = choice(result, OBJECTIVE_OF[arm], budget)
                if not pipeline_of(out, arm, seed).is_dir():
                    raise SystemExit(f"{arm} is not trained at seed {seed}: --part train --arms {arm} --seeds {seed}")
                scores = score(
                    pipeline_of(out, arm, seed),
                    pick["scheduler"],
                    pick["steps"],
                    pick["guidance"],
                    sc,
                    reference,
                    extractor,
                )
                records[:] = [r for r in records if (r["arm"], r["seed"], r["budget"]) != (arm, seed, budget)]
                records.append({"arm": arm, "seed": seed, "budget": budget, **scores_row(scores)})
                save(out, result)


def part_posthoc(sc, out, reference, extractor, seeds, result) -> None:
    """KID against sigma_rel, unguided and at the DDPM's chosen guidance, beside the fixed EMA, with the DDPM's
    chosen NFE-25 sampler (``moh_dit.training.posthoc_export.sweep``, what ``moh-dit ema --sweep`` runs)."""
    from moh_dit.training.posthoc_export import sweep

    pick = choice(result, "ddpm", 25)
    for seed in seeds:
        run = out / "runs" / run_name("moh-ddpm", seed)
        recorded = recorded_sampling(run / "pipeline")
        spec = recorded.replace(scheduler=pick["scheduler"], num_inference_steps=pick["steps"])
        settings = GenerationSettings(sc["samples"], 1000, min(250, sc["samples"]), "balanced", spec)
        swept = sweep(
            run,
            list(sc["sigma_rels"]),
            sorted({1.0, pick["guidance"]}),
            settings,
            reference,
            extractor,
            out / f"posthoc-seed{seed}",
        )
        result["posthoc"][str(seed)] = swept
        save(out, result)


# ----------------------------------------------------------------------------------------------------
# Report
# ----------------------------------------------------------------------------------------------------
def save(out: Path, result: dict) -> None:
    atomic_write_json(out / "results.json", result)
    atomic_write_text(out / "RESULTS.md", report(result))


def summary(values: list[float]) -> str:
    if not values:
        return "-"
    interval = t_interval(values)
    mean = statistics.mean(values)
    return f"{mean:.2f}" + (f" [{interval[0]:.2f}, {interval[1]:.2f}]" if interval else "")


def by_seed(records: list[dict], arm: str, budget: int) -> dict[int, float]:
    return {r["seed"]: r["kid"] for r in records if r["arm"] == arm and r["budget"] == budget}


def compare_table(records: list[dict], arms: list[str], budgets, base: str) -> list[str]:
    seeds = sorted({r["seed"] for r in records})
    lines = [
        "| arm | NFE | sampler | " + " | ".join(f"seed {s}" for s in seeds) + f" | mean [95% t] | vs {base}, paired |",
        "|---|---|---|" + "---|" * len(seeds) + "---|---|",
    ]
    for budget in budgets:
        for arm in arms:
            kid = by_seed(records, arm, budget)
            if not kid:
                continue
            row = next(r for r in records if r["arm"] == arm and r["budget"] == budget)
            ref = by_seed(records, base, budget)
            paired = [kid[s] - ref[s] for s in kid if s in ref]
            cells = " | ".join(f"{kid[s]:.2f}" if s in kid else "-" for s in seeds)
            diff = summary(paired) if arm != base and paired else ""
            lines.append(
                f"| {arm} | {row['nfe']} | {row['scheduler']} {row['steps']}, guidance {row['guidance']:g} | {cells} | "
                f"{summary(list(kid.values()))} | {diff} |"
            )
    return lines


def curve_points(training: dict) -> dict[str, dict[int, dict[int, float]]]:
    """Unguided KID during training (the runs' own evaluations) by arm, then step, then seed."""
    kid: dict[str, dict[int, dict[int, float]]] = {}
    for t in training.values():
        for point in t["curve"]:
            if point.get("kid") is not None:
                kid.setdefault(t["arm"], {}).setdefault(point["step"], {})[t["seed"]] = point["kid"]
    return kid


def curve_table(training: dict, arms: list[str], pairs: list[tuple[str, str]]) -> list[str]:
    """Per step and arm, the mean over seeds [95% t] of the unguided KID during training, and each (arm, baseline)
    pair's difference paired by seed."""
    kid = curve_points(training)
    arms = [a for a in arms if a in kid]
    pairs = [(a, b) for a, b in pairs if a in kid and b in kid]
    steps = sorted({step for a in arms for step in kid[a]})
    header = arms + [f"{a} - {b}, paired" for a, b in pairs]
    lines = ["| step | " + " | ".join(header) + " |", "|---|" + "---|" * len(header)]
    for step in steps:
        at = {a: kid[a].get(step, {}) for a in arms}
        cells = [f"{summary(list(at[a].values()))} (n={len(at[a])})" for a in arms]
        cells += [summary([at[a][s] - at[b][s] for s in at[a] if s in at[b]]) for a, b in pairs]
        lines.append(f"| {step} | " + " | ".join(cells) + " |")
    return lines


def posthoc_by_seed(posthoc: dict) -> dict[tuple[str, float], dict[int, dict]]:
    """The sweeps' rows keyed by (weights, guidance), then seed."""
    rows: dict[tuple[str, float], dict[int, dict]] = {}
    for seed, swept in posthoc.items():
        for r in swept["rows"]:
            rows.setdefault((r["weights"], r["guidance"]), {})[int(seed)] = r
    return rows


def posthoc_table(posthoc: dict, baseline: str = "fixed-ema") -> list[str]:
    """KID per seed, mean [95% t] and the difference from the fixed EMA paired by seed, per weights and guidance."""
    rows = posthoc_by_seed(posthoc)
    seeds = sorted({int(s) for s in posthoc})
    lines = [
        "| weights | guidance | "
        + " | ".join(f"seed {s}" for s in seeds)
        + f" | mean [95% t] | vs {baseline}, paired |",
        "|---|---|" + "---|" * len(seeds) + "---|---|",
    ]
    for (weights, guidance), by in sorted(rows.items(), key=lambda kv: (kv[0][1], kv[0][0] == baseline, kv[0][0])):
        base = rows.get((baseline, guidance), {})
        kid = {s: r["kid"] for s, r in by.items()}
        paired = [kid[s] - base[s]["kid"] for s in kid if s in base]
        cells = " | ".join(f"{kid[s]:.2f}" if s in kid else "-" for s in seeds)
        diff = summary(paired) if weights != baseline and paired else ""
        lines.append(f"| {weights} | {guidance:g} | {cells} | {summary(list(kid.values()))} | {diff} |")
    return lines


def report(result: dict) -> str:
    protocol = result["protocol"]
    lines = [
        "# Newer recipes on the embedded default: flow matching, REPA, post-hoc EMA",
        "",
        f"Written by `python -m experiments.recipes` (scale {protocol['scale']}). {protocol['samples']} class-balanced "
        f"samples per score against the {describe_reference(protocol)} with the project's classifier features; "
        "KID x 1000 (lower is better) with each run's 90% bootstrap interval in results.json; across seeds, means "
        "with 95% t-intervals and differences paired by seed. NFE: network evaluations per image, counted.",
        "",
        "## Training",
        "",
        "| run | images/s (median) | final loss | final REPA loss | KID during training (step: KID) |",
        "|---|---|---|---|---|",
    ]
    for name, t in result["training"].items():
        curve = ", ".join(f"{p['step']}: {p['kid']:.1f}" for p in t["curve"] if p.get("kid") is not None)
        repa = f"{t['final_repa_loss']:.3f}" if t.get("final_repa_loss") is not None else "-"
        loss = f"{t['final_loss']:.4f}" if t.get("final_loss") is not None else "-"
        lines.append(f"| {name} | {t['median_images_per_s']:.0f} | {loss} | {repa} | {curve} |")
    if result["training"]:
        lines += ["", "Unguided KID x 1000 during training, mean over seeds [95% t] (n seeds):", ""]
        pairs = [(arm, arms[0]) for arms in COMPARISONS.values() for arm in arms[1:]]
        lines += curve_table(result["training"], list(ARMS), pairs)
    for objective, rows in result["samplers"].items():
        lines += [
            "",
            f"## Samplers of {objective} (seed 0)",
            "",
            "| sampler | steps | NFE | guidance | KID [90%] | FID | precision | recall | s / image |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for r in sorted(rows, key=lambda r: (r["guidance"] != 4.0, r["nfe"], r["scheduler"], r["guidance"])):
            lo, hi = r["kid_interval"]
            lines.append(
                f"| {r['scheduler']} | {r['steps']} | {r['nfe']} | {r['guidance']:g} | {r['kid']:.2f} [{lo:.2f}, {hi:.2f}] | "
                f"{r['fid']:.1f} | {r['precision']:.3f} | {r['recall']:.3f} | {r['seconds_per_image']:.3f} |"
            )
        picks = result["choice"].get(objective, {})
        lines += [
            "",
            "Chosen: "
            + "; ".join(
                f"NFE {b}: {p['scheduler']} {p['steps']} steps, guidance {p['guidance']:g}" for b, p in picks.items()
            ),
        ]
    for name, arms in COMPARISONS.items():
        if result[name]:
            lines += ["", f"## {TITLES[name]}", ""]
            lines += compare_table(result[name], arms, NFE_BUDGETS, arms[0])
    if result["posthoc"]:
        lines += ["", "## Post-hoc EMA across seeds (moh-ddpm)", ""]
        lines += posthoc_table(result["posthoc"])
    for seed, swept in result["posthoc"].items():
        lines += ["", f"## Post-hoc EMA (moh-ddpm, seed {seed}, step {swept['step']})", ""]
        lines += ["| weights | guidance | KID | FID |", "|---|---|---|---|"]
        for r in swept["rows"]:
            lines.append(f"| {r['weights']} | {r['guidance']:g} | {r['kid']:.2f} | {r['fid']:.1f} |")
    return "\n".join(lines) + "\n"


def plot(result: dict, out: Path) -> None:
    """KID against NFE per sampler (seed 0), and KID during training per arm (mean over seeds, min-max band)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if result["samplers"]:
        fig, axes = plt.subplots(1, len(result["samplers"]), figsize=(5 * len(result["samplers"]), 3.6), squeeze=False)
        for ax, (objective, rows) in zip(axes[0], result["samplers"].items()):
            for scheduler in dict.fromkeys(r["scheduler"] for r in rows):
                points = sorted(
                    (r["nfe"], r["kid"]) for r in rows if r["scheduler"] == scheduler and r["guidance"] == 4.0
                )
                ax.plot(*zip(*points), marker="o", label=scheduler)
            ax.set(title=f"{objective} (seed 0, guidance 4)", xlabel="NFE", ylabel="KID x 1000")
            ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / "kid_vs_nfe.png", dpi=110)
        plt.close(fig)
    comparisons = [(name, arms) for name, arms in COMPARISONS.items() if result[name]]
    if comparisons:
        fig, axes = plt.subplots(1, len(comparisons), figsize=(5 * len(comparisons), 3.6), squeeze=False)
        for ax, (name, arms) in zip(axes[0], comparisons):
            for offset, arm in enumerate(arms):
                for i, budget in enumerate(NFE_BUDGETS):
                    kid = list(by_seed(result[name], arm, budget).values())
                    if not kid:
                        continue
                    x = i + 0.25 * (offset - (len(arms) - 1) / 2)
                    ax.plot([x] * len(kid), kid, "o", color=f"C{offset}", alpha=0.5)
                    interval = t_interval(kid)
                    mean = statistics.mean(kid)
                    err = [[mean - interval[0]], [interval[1] - mean]] if interval else None
                    ax.errorbar(
                        [x],
                        [mean],
                        yerr=err,
                        fmt="_",
                        markersize=14,
                        capsize=4,
                        color=f"C{offset}",
                        label=arm if i == 0 else None,
                    )
            ax.set_xticks(range(len(NFE_BUDGETS)), [f"NFE {b}" for b in NFE_BUDGETS])
            ax.set(
                title=TITLES[name],
                xlabel="each seed a dot; the mean with its 95% t-interval",
                ylabel="KID x 1000 (each arm's best sampler)",
            )
            ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / "kid_by_seed.png", dpi=110)
        plt.close(fig)
    curves = curve_points(result["training"])
    if curves:
        fig, ax = plt.subplots(figsize=(6, 4))
        for arm, points in curves.items():
            steps = sorted(points)
            kid = [list(points[s].values()) for s in steps]
            ax.plot(steps, [statistics.mean(k) for k in kid], marker="o", label=arm)
            ax.fill_between(steps, [min(k) for k in kid], [max(k) for k in kid], alpha=0.2)
        ax.set(
            xlabel="training step", ylabel="KID x 1000 (500 unguided samples)", yscale="log", title="During training"
        )
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / "kid_during_training.png", dpi=110)
        plt.close(fig)
    if result["posthoc"]:
        plot_posthoc(posthoc_by_seed(result["posthoc"]), out / "posthoc_by_seed.png", plt)


def plot_posthoc(rows: dict[tuple[str, float], dict[int, dict]], path: Path, plt) -> None:
    """KID against sigma_rel per guidance: each seed a dot, the mean a line; the fixed EMA's mean a dashed line."""
    guidances = sorted({g for _, g in rows})
    fig, axes = plt.subplots(1, len(guidances), figsize=(5 * len(guidances), 3.6), squeeze=False)
    for ax, guidance in zip(axes[0], guidances):
        swept = sorted(
            (next(iter(by.values()))["sigma_rel"], by)
            for (weights, g), by in rows.items()
            if g == guidance and weights != "fixed-ema"
        )
        for sigma_rel, by in swept:
            ax.plot([sigma_rel] * len(by), [r["kid"] for r in by.values()], "o", color="C0", alpha=0.4)
        ax.plot(
            [x for x, _ in swept],
            [statistics.mean(r["kid"] for r in by.values()) for _, by in swept],
            "-",
            color="C0",
            label="post-hoc EMA (mean over seeds)",
        )
        fixed = rows.get(("fixed-ema", guidance))
        if fixed:
            ax.axhline(
                statistics.mean(r["kid"] for r in fixed.values()), color="C1", ls="--", label="fixed EMA (mean)"
            )
        ax.set(title=f"guidance {guidance:g}", xlabel="sigma_rel", ylabel="KID x 1000")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ----------------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------------
def hold_lock(out: Path):
    """One writer per ``--out``: each part keeps results.json in memory and rewrites it, so a second process on the
    same folder would lose the first one's records. Runs in parallel take separate folders (whose ``runs`` may be
    links to one folder of runs: finished runs are reused)."""
    try:
        import fcntl
    except ImportError:  # not on Windows: one process per folder is then up to the user
        return None
    handle = open(out / ".recipes.lock", "w")  # noqa: SIM115 (open for the process's life)
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise SystemExit(
            f"another experiments.recipes process is writing {out}: wait for it, or use another --out"
        ) from None
    return handle


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", choices=["train", "samplers", "objective", "repa", "posthoc", "all"], default="all")
    p.add_argument("--scale", choices=list(SCALES), default="default")
    p.add_argument("--seeds", type=int, nargs="+", default=None)
    p.add_argument("--arms", nargs="+", choices=list(ARMS), default=list(ARMS))
    p.add_argument(
        "--sigma-rels",
        type=float,
        nargs="+",
        default=None,
        help="the post-hoc EMA widths to sweep (the scale's if unset)",
    )
    p.add_argument("--report-only", action="store_true")
    p.add_argument("--out", default="experiments/results/recipes")
    add_reference_argument(p)
    args = p.parse_args(argv)
    sc = SCALES[args.scale] | ({"sigma_rels": tuple(args.sigma_rels)} if args.sigma_rels else {})
    seeds = tuple(args.seeds) if args.seeds is not None else sc["seeds"]
    out = Path(args.out)
    path = out / "results.json"
    protocol = {"scale": args.scale, "samples": sc["samples"]} | reference_protocol(args)
    empty = {
        "protocol": protocol,
        "training": {},
        "samplers": {},
        "choice": {},
        "objective": [],
        "repa": [],
        "posthoc": {},
    }
    if not args.report_only:
        out.mkdir(parents=True, exist_ok=True)
        lock = hold_lock(out)  # noqa: F841 (held until the process ends)
    result = json.loads(path.read_text()) if path.exists() else empty
    if result.get("protocol") != protocol:
        raise SystemExit(f"{path} was written with {result.get('protocol')}, not {protocol}: use another --out")
    if not args.report_only:
        out, reference, extractor = start_scoring(args)
        torch.manual_seed(0)
        parts = ["train", "samplers", "objective", "repa", "posthoc"] if args.part == "all" else [args.part]
        if "train" in parts:
            part_train(sc, out, reference, seeds, args.arms, result)
        if "samplers" in parts:
            part_samplers(sc, out, reference, extractor, result)
        for name, arms in COMPARISONS.items():
            if name in parts:
                part_scores(name, arms, NFE_BUDGETS, sc, out, reference, extractor, seeds, result)
        if "posthoc" in parts:
            part_posthoc(sc, out, reference, extractor, seeds, result)
        for arm in ("moh-ddpm", "moh-flow"):
            model = pipeline_of(out, arm, 0)
            if model.is_dir() and OBJECTIVE_OF[arm] in result["choice"]:
                pick = choice(result, OBJECTIVE_OF[arm], 25)
                recorded = recorded_sampling(model)
                render_grid(
                    model,
                    out / f"grid_{arm}.png",
                    pick["scheduler"],
                    pick["steps"],
                    pick["guidance"],
                    guidance_interval=recorded.guidance_interval,
                    grid_averaging=recorded.grid_averaging,
                )
    out.mkdir(parents=True, exist_ok=True)
    save(out, result)
    plot(result, out)
    return result


if __name__ == "__main__":
    main()
