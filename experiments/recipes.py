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

import logging
from pathlib import Path

import torch

from experiments.arms import pipeline_of, run_name, score, scores_row, train_arm
from experiments.common import (
    ROOT,
    render_grid,
    smoke_run,
    start_scoring,
)
from experiments.recipes_report import COMPARISONS, NFE_BUDGETS, plot, report
from experiments.report import open_study, save_results, study_arguments
from moh_dit.sampling.generation import GenerationSettings
from moh_dit.sampling.loading import recorded_sampling

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
        overrides=[*smoke_run(), "ema.posthoc_every=32"],
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
# ----------------------------------------------------------------------------------------------------
# The parts
# ----------------------------------------------------------------------------------------------------
def part_train(sc, out, reference, seeds, arms, result) -> None:
    for seed in seeds:  # seed by seed, so that a part stopped early has every arm at the first seeds
        for arm in arms:
            result["training"][run_name(arm, seed)] = train_arm(arm, seed, sc, out, reference, ARMS)
            save(out, result)


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


def save(out: Path, result: dict) -> None:
    """results.json and RESULTS.md as they stand (after every finished run or score: an interrupted part loses none)."""
    save_results(out, result, report(result))


# ----------------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> dict:
    parts = ["train", "samplers", "objective", "repa", "posthoc"]
    p = study_arguments(__doc__, parts, SCALES, "default", "experiments/results/recipes")
    p.add_argument("--arms", nargs="+", choices=list(ARMS), default=list(ARMS))
    p.add_argument(
        "--sigma-rels",
        type=float,
        nargs="+",
        default=None,
        help="the post-hoc EMA widths to sweep (the scale's if unset)",
    )
    args = p.parse_args(argv)
    sc = SCALES[args.scale] | ({"sigma_rels": tuple(args.sigma_rels)} if args.sigma_rels else {})
    out = Path(args.out)
    sections = {"training": {}, "samplers": {}, "choice": {}, "objective": [], "repa": [], "posthoc": {}}
    result, seeds, lock = open_study(args, sc, "recipes", sections)  # lock: held to the end
    if not args.report_only:
        out, reference, extractor = start_scoring(args)
        torch.manual_seed(0)
        parts = parts if args.part == "all" else [args.part]
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
                    guidance_interval=recorded.guidance.interval,
                    grid_averaging=recorded.sampler.grid_averaging,
                )
    out.mkdir(parents=True, exist_ok=True)
    save(out, result)
    plot(result, out)
    return result


if __name__ == "__main__":
    from moh_dit.cli.common import run_cli

    run_cli(main)  # bad input: one line, as the commands say it
