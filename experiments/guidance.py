r"""Guidance beyond classifier-free on the embedded default and its flow twin, 3 seeds each: CFG, autoguidance by the
same run's checkpoint at a quarter of training (step 2000 of 8300), autoguidance by a smaller model (width 64
instead of 128) trained an eighth as long (1037 steps), APG and CFG-Zero*, each swept over its scale at NFE 25.

    main models   ddpm: configs/fashion_mnist_moh.yaml, trained here with post-hoc EMA snapshots and every checkpoint
                  flow: the flow arm of the backbone study (experiments/backbone.py, the same config and seeds), its
                        step-2000 checkpoints kept aside (--flow-guides)
    small guides  the same config at width 64, 1037 steps (its cosine schedule ends there)

Every method samples with its objective's sampler at NFE 25 (DDPM: DPM-Solver++ 25 steps; flow: Euler 25 steps, the
recipes study's choice) and the model's recorded grid averaging; CFG, APG and CFG-Zero* guide in the recorded
interval (timesteps 100-500), autoguidance at every step (EDM2's choice: its interval did not help it). The scales
are swept on seed 0 with 500 class-balanced samples; each method's best scale by KID is then scored at every seed with
1000 samples: KID, FID, precision, recall (the project's classifier features against the 10,000 Fashion-MNIST test
images), paired by seed against CFG. The EMA part rebuilds the DDPM main model and its step-2000 guide at several
post-hoc widths (EDM2: the guide wants a longer EMA than the main model) and scores each pair. The sampling time per
image of each method is measured apart (benchmarks/guidance.py), on a quiet machine. The method ag-quarter-ema (DDPM
only: its runs keep post-hoc snapshots) guides by the quarter checkpoint rebuilt at the EMA part's best guide width.
Points already in the records are kept, not redone (--rescore redoes them).

    python -m experiments.guidance --part train     # the DDPM mains and the small guides (resumable)
    python -m experiments.guidance --part sweep     # seed 0: every method and scale
    python -m experiments.guidance --part seeds     # each method's best scale at every seed
    python -m experiments.guidance --part ema       # post-hoc widths of the main model and of its guide (DDPM)
    python -m experiments.guidance --report-only

Writes experiments/results/guidance/{RESULTS.md, results.json, *.png}.
"""

from __future__ import annotations

from pathlib import Path

import torch

from experiments.arms import run_name, train_arm
from experiments.common import (
    describe_reference,
    sample_and_score,
    smoke_run,
    start_scoring,
)
from experiments.report import (
    by_seed_table,
    fmt_values,
    is_recorded,
    note_lines,
    open_study,
    plot_by_seed,
    pyplot,
    save_results,
    study_arguments,
    with_row,
)
from moh_dit.sampling.generation import GenerationSettings
from moh_dit.sampling.loading import recorded_sampling
from moh_dit.training.posthoc_export import rebuild_pipeline

DDPM, FLOW = "configs/fashion_mnist_moh.yaml", "configs/fashion_mnist_moh_flow.yaml"
SMALL = ["model.overrides.hidden_size=64", "train.max_steps=1037"]  # an eighth of 8300 steps, half the width
ARMS = {
    # every checkpoint kept (the guide of a quarter of training is step 2000) and post-hoc snapshots every 500 steps
    "ddpm": (DDPM, ["train.keep_last=20", "ema.posthoc_every=8000"]),
    "flow": (FLOW, ["train.keep_last=20"]),  # trained here only without --flow-runs
    "ddpm-small": (DDPM, SMALL),
    "flow-small": (FLOW, SMALL),
}
OBJECTIVE_OF_CONFIG = {DDPM: "ddpm", FLOW: "flow"}  # which objective each arm trains: its config's
QUARTER = 2000  # the checkpoint of a quarter of training (500-step checkpoints; 2075 is a quarter of 8300)
SAMPLER = {"ddpm": ("dpm-solver", 25), "flow": ("euler", 25)}  # NFE 25 (the recipes study's choices)
METHODS = {  # method -> (rule, guide, scales swept)
    "cfg": ("cfg", None, (2.0, 3.0, 4.0, 6.0)),
    "ag-quarter": ("cfg", "quarter", (1.5, 2.0, 3.0)),
    "ag-small": ("cfg", "small", (1.5, 2.0, 3.0)),
    "apg": ("apg", None, (2.0, 3.0, 4.0, 6.0, 8.0)),  # 2 and 3 added after 4 came out best at seed 0
    "cfg-zero-star": ("cfg-zero-star", None, (2.0, 3.0, 4.0, 6.0)),
    # the quarter checkpoint rebuilt from the run's post-hoc snapshots at GUIDE_SIGMA_REL (the main model keeps its
    # fixed EMA): added after the EMA part found the guide's EMA, not the main model's, decides autoguidance on DDPM
    "ag-quarter-ema": ("cfg", "quarter-ema", (2.0, 3.0, 4.0)),
}
GUIDE_SIGMA_REL = 0.05  # the EMA part's best guide width (seed 0, 500 samples; 0.10 within noise of it)
# methods that need what only some objectives' mains keep: the flow twin's runs (the backbone study's) keep no
# post-hoc snapshots
ONLY_FOR = {"ag-quarter-ema": ("ddpm",)}
# scales swept on one objective only, added after the largest tried came out best there (the flow twin's
# autoguidance peaked inside its range, at 2)
EXTRA_SCALES = {("ddpm", "ag-quarter"): (4.0, 6.0)}
EMA_MAIN, EMA_GUIDE = (0.05, 0.10), (0.05, 0.10, 0.15)
SCALES = {
    "cpu": dict(
        overrides=[],
        eval=["log.eval_every=0"],
        sweep_samples=500,
        samples=1000,
        seeds=(0, 1, 2),
        bootstrap=20,
        quarter=QUARTER,
    ),
    "tiny": dict(  # a smoke run (tests/test_experiments.py)
        overrides=[*smoke_run(8), "ema.posthoc_every=32"],
        eval=["log.eval_every=0"],
        sweep_samples=10,
        samples=12,
        seeds=(0, 1),
        bootstrap=3,
        quarter=2,  # a quarter of its 8 steps (a checkpoint every 2)
    ),  # fmt: skip
}


# ----------------------------------------------------------------------------------------------------
# Models
# ----------------------------------------------------------------------------------------------------
def main_run(objective: str, seed: int, out: Path, flow_runs: Path | None) -> Path:
    """The main model's run: this study's, or the backbone study's flow arm (``--flow-runs``)."""
    return (
        flow_runs / run_name(objective, seed)
        if objective == "flow" and flow_runs
        else out / "runs" / run_name(objective, seed)
    )


def main_model(objective: str, seed: int, out: Path, flow_runs: Path | None) -> Path:
    return main_run(objective, seed, out, flow_runs) / "pipeline"


def guide_of(objective: str, which: str | None, seed: int, ctx: dict) -> str | None:
    """The guide's folder: the main run's checkpoint at a quarter of training (kept aside in ``--flow-guides`` for the
    backbone study's runs, which keep their last three), or the small model's run."""
    if which is None:
        return None
    if which == "quarter-ema":  # the run itself: its snapshots rebuild the guide (guide_options name step and width)
        return str(main_run(objective, seed, ctx["out"], ctx["flow_runs"]))
    if which == "small":
        return str(ctx["out"] / "runs" / run_name(f"{objective}-small", seed) / "pipeline")
    step = f"step-{ctx['quarter']:08d}"
    if objective == "flow" and ctx["flow_guides"] is not None:
        return str(ctx["flow_guides"] / f"{run_name(objective, seed)}-{step}")
    return str(main_run(objective, seed, ctx["out"], ctx["flow_runs"]) / "checkpoints" / step)


def spec_for(objective: str, method: str, scale: float, model: Path, guide: str | None, **guide_options):
    """The method's spec: the model's recorded grid averaging; CFG-like rules in its recorded interval, autoguidance
    at every step; the objective's NFE-25 sampler."""
    rule, which, _ = METHODS[method]
    scheduler, steps = SAMPLER[objective]
    recorded = recorded_sampling(model)
    spec = recorded.replace(scheduler=None, num_inference_steps=steps, guidance_scale=scale, guidance_rule=rule)
    if which is not None:
        spec = spec.replace(guidance_interval=None, guidance_noise=None, guide=guide, **guide_options)
    return spec, scheduler


def score(name: str, objective: str, method: str, scale: float, seed: int, samples: int, ctx: dict, **extra) -> dict:
    """One sample set, scored (reused when it exists), with what made it."""
    model = extra.pop("model", None) or main_model(objective, seed, ctx["out"], ctx["flow_runs"])
    which = METHODS[method][1]
    guide = extra.pop("guide", None) or guide_of(objective, which, seed, ctx)
    rebuilt = {"guide_step": ctx["quarter"], "guide_sigma_rel": GUIDE_SIGMA_REL} if which == "quarter-ema" else {}
    spec, scheduler = spec_for(objective, method, scale, model, guide, **extra.pop("guide_options", rebuilt))
    settings = GenerationSettings(
        samples, seed=1000, batch_size=min(250, samples), label_mode="balanced", sampling=spec
    )
    folder = ctx["out"] / "samples" / f"{name}-n{samples}"
    scores = sample_and_score(
        model, folder, settings, scheduler, ctx["reference"], ctx["extractor"], ctx["bootstrap"], **extra
    )
    keep = ("kid", "kid_interval", "fid", "precision", "recall", "seconds_per_image")
    return {"objective": objective, "method": method, "scale": scale, "seed": seed, "samples": samples} | {
        k: scores[k] for k in keep if k in scores
    }


# ----------------------------------------------------------------------------------------------------
# The parts
# ----------------------------------------------------------------------------------------------------
def part_train(sc, out, reference, seeds, objectives, result, flow_runs: Path | None) -> None:
    """The mains and small guides of the chosen objectives (the flow main only without ``--flow-runs``)."""
    arms = [a for a, (config, _) in ARMS.items() if OBJECTIVE_OF_CONFIG[config] in objectives]
    arms = [a for a in arms if not (a == "flow" and flow_runs)]
    for seed in seeds:
        for arm in arms:
            result["training"][run_name(arm, seed)] = train_arm(arm, seed, sc, out, reference, ARMS)
            save(out, result)


MATCH = ("objective", "method", "scale", "seed", "samples", "main_sigma_rel", "guide_sigma_rel")  # a row's identity


def _record(result: dict, key: str, row: dict, out: Path) -> None:
    result[key] = with_row(result[key], MATCH, row)
    save(out, result)


def recorded(result: dict, key: str, ctx: dict, **identity) -> bool:
    """Whether a row of this identity is in the records already (then kept, not redone, unless ``--rescore``):
    the records outlive the sample sets, which may have been deleted to save space."""
    return not ctx["rescore"] and is_recorded(result[key], MATCH, identity)


def applicable(methods: list[str], objective: str) -> list[str]:
    """The methods that apply to ``objective``; each one left out is said (a chosen method never vanishes unsaid)."""
    kept = [m for m in methods if objective in ONLY_FOR.get(m, (objective,))]
    for method in sorted(set(methods) - set(kept)):
        print(f"{method}: only for {', '.join(ONLY_FOR[method])}, so not run on {objective}", flush=True)
    return kept


def part_sweep(sc, ctx, objectives, result, methods: list[str]) -> None:
    for objective in objectives:
        for method in applicable(methods, objective):
            for scale in METHODS[method][2] + EXTRA_SCALES.get((objective, method), ()):
                identity = dict(objective=objective, method=method, scale=scale, seed=0, samples=sc["sweep_samples"])
                if not recorded(result, "sweep", ctx, **identity):
                    name = f"{objective}-{method}-s{scale:g}-seed0"
                    row = score(name, objective, method, scale, 0, sc["sweep_samples"], ctx)
                    _record(result, "sweep", row, ctx["out"])


def best_scale(result: dict, objective: str, method: str) -> float | None:
    rows = [r for r in result["sweep"] if (r["objective"], r["method"]) == (objective, method)]
    return min(rows, key=lambda r: r["kid"])["scale"] if rows else None


def part_seeds(sc, ctx, seeds, objectives, result, methods: list[str]) -> None:
    for objective in objectives:
        chosen = applicable(methods, objective)  # said once per objective, not once per seed
        for seed in seeds:
            for method in chosen:
                scale = best_scale(result, objective, method)
                identity = dict(objective=objective, method=method, scale=scale, seed=seed, samples=sc["samples"])
                if scale is not None and not recorded(result, "seeds", ctx, **identity):
                    name = f"{objective}-{method}-s{scale:g}-seed{seed}"
                    row = score(name, objective, method, scale, seed, sc["samples"], ctx)
                    _record(result, "seeds", row, ctx["out"])


def part_ema(sc, ctx, result) -> None:
    """The DDPM main model rebuilt at each width of EMA_MAIN (its newest snapshot) guided by its step-2000 guide
    rebuilt at each of EMA_GUIDE, at autoguidance's best scale; and CFG at each main width."""
    run = main_run("ddpm", 0, ctx["out"], None)
    ag, cfg = best_scale(result, "ddpm", "ag-quarter"), best_scale(result, "ddpm", "cfg")
    n = sc["sweep_samples"]
    for main in EMA_MAIN:
        pipe = rebuild_pipeline(run, main)
        options = {"model": run / "pipeline", "pipe": pipe}  # the recorded sampling of the run; the rebuilt weights
        identity = dict(objective="ddpm", seed=0, samples=n, main_sigma_rel=main)
        if not recorded(result, "ema", ctx, method="cfg", scale=cfg, guide_sigma_rel=None, **identity):
            row = score(f"ema-main{main:g}-cfg", "ddpm", "cfg", cfg, 0, n, ctx, **options)
            _record(result, "ema", row | {"main_sigma_rel": main, "guide_sigma_rel": None}, ctx["out"])
        for width in EMA_GUIDE:
            if recorded(result, "ema", ctx, method="ag-quarter", scale=ag, guide_sigma_rel=width, **identity):
                continue
            guide = {"guide": str(run), "guide_options": {"guide_step": ctx["quarter"], "guide_sigma_rel": width}}
            row = score(
                f"ema-main{main:g}-guide{width:g}",
                "ddpm",
                "ag-quarter",
                ag,
                0,
                n,
                ctx,
                **options,
                **guide,
            )
            _record(result, "ema", row | {"main_sigma_rel": main, "guide_sigma_rel": width}, ctx["out"])


# ----------------------------------------------------------------------------------------------------
# Report
# ----------------------------------------------------------------------------------------------------
def by_seed(result: dict, objective: str, method: str, key: str = "kid") -> dict[int, float]:
    return {r["seed"]: r[key] for r in result["seeds"] if (r["objective"], r["method"]) == (objective, method)}


def report(result: dict) -> str:
    protocol = result["protocol"]
    lines = [
        "# Guidance beyond classifier-free: autoguidance, APG and CFG-Zero*",
        "",
        f"Written by `python -m experiments.guidance` (scale {protocol['scale']}). KID x 1000 on the project's "
        f"classifier features against the {describe_reference(protocol)}; NFE 25 (DDPM: DPM-Solver++ 25 steps, flow: "
        "Euler 25 steps; a guided step evaluates two predictions: CFG's halves in one batched forward, autoguidance's "
        "main and guide models one forward each). Across seeds, means with 95% t-intervals, differences paired by seed.",
    ]
    lines += note_lines(result)
    for objective in ("ddpm", "flow"):
        rows = [r for r in result["sweep"] if r["objective"] == objective]
        if rows:
            lines += ["", f"## {objective}: the scale sweep (seed 0, {rows[0]['samples']} samples)", ""]
            lines += ["| method | scale | KID [90%] | FID | precision | recall |", "|---|---|---|---|---|---|"]
            for r in sorted(rows, key=lambda r: (list(METHODS).index(r["method"]), r["scale"])):
                lo, hi = r["kid_interval"]
                lines.append(
                    f"| {r['method']} | {r['scale']:g} | {r['kid']:.2f} [{lo:.2f}, {hi:.2f}] | {r['fid']:.1f} | "
                    f"{r['precision']:.3f} | {r['recall']:.3f} |"
                )
        seeded = [r for r in result["seeds"] if r["objective"] == objective]
        if seeded:
            lines += [
                "",
                f"## {objective}: each method at its best scale, every seed ({seeded[0]['samples']} samples)",
                "",
            ]
            table = []
            for method in METHODS:
                kid = by_seed(result, objective, method)
                if kid:
                    scale = best_scale(result, objective, method)
                    table.append(
                        ((method, f"{scale:g}"), kid, by_seed(result, objective, "cfg") if method != "cfg" else None)
                    )
            lines += by_seed_table(("method", "scale"), table, "cfg")
            lines += ["", "| method | FID | precision | recall |", "|---|---|---|---|"]
            for method in METHODS:
                if by_seed(result, objective, method):
                    cells = [
                        fmt_values(by_seed(result, objective, method, k).values(), d)
                        for k, d in (("fid", 1), ("precision", 3), ("recall", 3))
                    ]
                    lines.append(f"| {method} | " + " | ".join(cells) + " |")
    if result["ema"]:
        lines += ["", "## Post-hoc EMA widths of the main model and its guide (ddpm, seed 0)", ""]
        lines += ["| main sigma_rel | guidance | guide sigma_rel | KID [90%] |", "|---|---|---|---|"]
        for r in sorted(result["ema"], key=lambda r: (r["main_sigma_rel"], r["guide_sigma_rel"] or 0)):
            lo, hi = r["kid_interval"]
            guide = f"{r['guide_sigma_rel']:g}" if r["guide_sigma_rel"] else "-"
            lines.append(
                f"| {r['main_sigma_rel']:g} | {r['method']} {r['scale']:g} | {guide} | {r['kid']:.2f} [{lo:.2f}, {hi:.2f}] |"
            )
    return "\n".join(lines) + "\n"


def plot(result: dict, out: Path) -> None:
    plt = pyplot()
    if plt is None or not result["seeds"]:
        return
    panels = {  # one panel per objective with scored seeds
        objective: {m: [by_seed(result, objective, m)] for m in METHODS if by_seed(result, objective, m)}
        for objective in ("ddpm", "flow")
    }
    panels = {objective: methods for objective, methods in panels.items() if methods}
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.8), squeeze=False)
    for ax, (objective, methods) in zip(axes[0], panels.items()):
        plot_by_seed(ax, ["best scale, NFE 25"], methods, "KID x 1000")
        ax.set_title(objective)
    fig.tight_layout()
    fig.savefig(out / "kid_by_seed.png", dpi=110)
    plt.close(fig)


def save(out: Path, result: dict) -> None:
    save_results(out, result, report(result))


def main(argv: list[str] | None = None) -> dict:
    p = study_arguments(__doc__, ["train", "sweep", "seeds", "ema"], SCALES, "cpu", "experiments/results/guidance")
    p.add_argument("--objectives", nargs="+", choices=["ddpm", "flow"], default=["ddpm", "flow"])
    p.add_argument("--flow-runs", default=None, help="the backbone study's runs (its flow arm); default: trained here")
    p.add_argument("--flow-guides", default=None, help="the flow runs' step-2000 checkpoints (default: in their runs)")
    p.add_argument("--methods", nargs="+", choices=list(METHODS), default=list(METHODS), help="for --part sweep/seeds")
    p.add_argument("--rescore", action="store_true", help="redo points already in the records (default: kept)")
    p.add_argument(
        "--quarter", type=int, default=None, help="the step of the quarter-training guide (default: the scale's)"
    )
    args = p.parse_args(argv)
    sc = SCALES[args.scale]
    args.quarter = sc["quarter"] if args.quarter is None else args.quarter
    out = Path(args.out)
    sections = {"training": {}, "sweep": [], "seeds": [], "ema": []}
    result, seeds, lock = open_study(args, sc, "guidance", sections)  # lock: held to the end
    if not args.report_only:
        out, reference, extractor = start_scoring(args)
        torch.manual_seed(0)
        flow_runs = Path(args.flow_runs) if args.flow_runs else None
        ctx = dict(out=out, reference=reference, extractor=extractor, bootstrap=sc["bootstrap"], flow_runs=flow_runs,
                   flow_guides=Path(args.flow_guides) if args.flow_guides else None, quarter=args.quarter,
                   rescore=args.rescore)  # fmt: skip
        parts = ["train", "sweep", "seeds", "ema"] if args.part == "all" else [args.part]
        if "train" in parts:
            part_train(sc, out, reference, seeds, args.objectives, result, ctx["flow_runs"])
        if "sweep" in parts:
            part_sweep(sc, ctx, args.objectives, result, args.methods)
        if "seeds" in parts:
            part_seeds(sc, ctx, seeds, args.objectives, result, args.methods)
        if "ema" in parts and "ddpm" in args.objectives:
            part_ema(sc, ctx, result)
    out.mkdir(parents=True, exist_ok=True)
    save(out, result)
    plot(result, out)
    return result


if __name__ == "__main__":
    from moh_dit.cli.common import run_cli

    run_cli(main)  # bad input: one line, as the commands say it
