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
    python -m experiments.fewstep --part caches  --flow-runs DIR --ddpm-runs DIR   # either alone: that model only
    python -m experiments.fewstep --report-only

Points already in the records are kept, not redone (--rescore redoes them), so a later run with --seeds 1 2 needs
only those seeds' runs; the flow curves of seeds it does not read are kept.

Writes experiments/results/fewstep/{RESULTS.md, results.json, *.png}.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

if not __package__:  # run as a file (python experiments/x.py): the repository root holds the experiments package
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from experiments.backbone import SCALES as BACKBONE_SCALES
from experiments.common import (
    describe_reference,
    sample_and_score,
    start_scoring,
)
from experiments.recipes import run_name, train_arm
from experiments.report import (
    by_seed_table,
    curve_points,
    fmt_values,
    is_recorded,
    note_lines,
    open_study,
    paired_reading,
    plot_by_seed,
    plot_curves,
    pyplot,
    save_results,
    study_arguments,
    with_row,
)
from moh_dit.sampling.generation import GenerationSettings
from moh_dit.sampling.grids import sample_grid
from moh_dit.sampling.loading import load_pipeline, recorded_sampling
from moh_dit.training.quality import read_records

MEANFLOW = "configs/fashion_mnist_moh_meanflow.yaml"
ARMS = {"meanflow": (MEANFLOW, [])}
MEANFLOW_STEPS = (1, 2, 4)
FLOW_SAMPLER, FLOW_STEPS = "euler", (25, 50)  # the recipes study's flow sampler
FLOW_SCALES = (1.0, 2.0, 3.0, 4.0, 6.0)  # swept on seed 0 at 25 steps, in the model's recorded interval
MEANFLOW_SCALES = (1.0, 1.5, 2.0)  # CFG on top of the guidance folded into training (seed 0, one step)
CACHE_MODELS = {"ddpm": ("dpm-solver", (25, 50)), "flow": (FLOW_SAMPLER, (25, 50))}  # seed 0, recorded guidance
CACHES = ("none", "first-block", "magcache", "taylorseer")
# the backbone study's scales: the same evaluation points and sample counts, so its flow arm pairs with MeanFlow
SCALES = BACKBONE_SCALES


# ----------------------------------------------------------------------------------------------------
# Models and scores
# ----------------------------------------------------------------------------------------------------
def model_of(kind: str, seed: int, ctx: dict) -> Path:
    """The pipeline of ``kind`` at ``seed``: this study's MeanFlow runs, the backbone study's flow arm (--flow-runs),
    the guidance study's DDPM runs (--ddpm-runs)."""
    folder = {"meanflow": ctx["out"] / "runs", "flow": ctx["flow_runs"], "ddpm": ctx["ddpm_runs"]}[kind]
    if folder is None:
        raise SystemExit(f"the {kind} models: pass --{kind}-runs (the folder of their runs)")
    return Path(folder) / run_name(kind, seed) / "pipeline"


def score(kind: str, seed: int, scheduler: str, steps: int, scale: float, ctx: dict, cache: str = "none") -> dict:
    """One sample set of ``kind``'s model (its recorded guidance interval and grid averaging, this sampler, steps and
    scale, the cache), scored (reused when it exists), with the network evaluations per image counted."""
    model = model_of(kind, seed, ctx)
    spec = recorded_sampling(model).replace(
        scheduler=None, num_inference_steps=steps, guidance_scale=scale, cache=None if cache == "none" else cache,
        cache_options=None,
    )  # fmt: skip
    samples = ctx["samples"]
    settings = GenerationSettings(
        samples, seed=1000, batch_size=min(250, samples), label_mode="balanced", sampling=spec
    )
    name = f"{run_name(kind, seed)}-{scheduler}{steps}-cfg{scale:g}" + ("" if cache == "none" else f"-{cache}")
    scores = sample_and_score(
        model, ctx["out"] / "samples" / f"{name}-n{samples}", settings, scheduler, ctx["reference"], ctx["extractor"],
        ctx["bootstrap"],
    )  # fmt: skip
    keep = ("kid", "kid_interval", "fid", "precision", "recall", "seconds_per_image")
    row = {"kind": kind, "seed": seed, "scheduler": scheduler, "steps": steps, "scale": scale, "cache": cache}
    return row | {k: scores[k] for k in keep if k in scores} | {"nfe": evaluations_per_image(model, spec, scheduler)}


def evaluations_per_image(model: Path, spec, scheduler: str) -> int:
    """Network evaluations of one image under ``spec``, counted: the rows of every forward (CFG's two halves and grid
    averaging's copies each count; a cache's skips do not lower it: the setting's uncached count)."""
    pipe = load_pipeline(model, device="cpu", scheduler=scheduler)
    rows: list[int] = []
    handle = pipe.transformer.register_forward_hook(lambda module, args, output: rows.append(args[0].shape[0]))
    try:
        sample_grid(pipe, [0], 1, 0, spec.replace(scheduler=scheduler, cache=None))
    finally:
        handle.remove()
    return sum(rows)


MATCH = ("kind", "seed", "scheduler", "steps", "scale", "cache")  # a row's identity


def _record(result: dict, key: str, row: dict, out: Path) -> None:
    result[key] = with_row(result[key], MATCH, row)
    save(out, result)


def _score_once(result: dict, key: str, ctx: dict, kind: str, seed: int, scheduler: str, steps: int, scale: float,
                cache: str = "none") -> None:  # fmt: skip
    """Score and record one point, unless the records hold it already (then kept; ``--rescore`` redoes it): a later
    session may lack the runs of the points recorded before, seed 0's sweeps among them."""
    identity = dict(kind=kind, seed=seed, scheduler=scheduler, steps=steps, scale=scale, cache=cache)
    if ctx.get("rescore") or not is_recorded(result.get(key, []), MATCH, identity):
        _record(result, key, score(kind, seed, scheduler, steps, scale, ctx, cache), ctx["out"])


def _shown(scale: float | None) -> str:
    return "not swept yet" if scale is None else f"{scale:g}"


def best(result: dict, kind: str) -> float | None:
    rows = [r for r in result["sweep"] if r["kind"] == kind]
    return min(rows, key=lambda r: r["kid"])["scale"] if rows else None


# ----------------------------------------------------------------------------------------------------
# The parts
# ----------------------------------------------------------------------------------------------------
def part_train(sc: dict, out: Path, reference: Path, seeds, result: dict) -> None:
    for seed in seeds:
        for arm in ARMS:
            result["training"][run_name(arm, seed)] = train_arm(arm, seed, sc, out, reference, ARMS)
            save(out, result)


def part_score(ctx: dict, seeds, result: dict) -> None:
    """MeanFlow first (its few-step sets cost minutes): CFG on top of its folded guidance swept at one step on seed
    0, then 1, 2 and 4 steps at its best scale at every seed; then the flow twin (its sets cost an hour):
    its CFG scale swept at 25 steps on seed 0, then 25 and 50 steps at its best scale at every seed. A part stopped
    early keeps what it scored."""
    for scale in MEANFLOW_SCALES:
        _score_once(result, "sweep", ctx, "meanflow", 0, "meanflow", 1, scale)
    meanflow_scale = best(result, "meanflow")
    for seed in seeds:
        for steps in MEANFLOW_STEPS:
            _score_once(result, "scores", ctx, "meanflow", seed, "meanflow", steps, meanflow_scale)
    for scale in FLOW_SCALES:
        _score_once(result, "sweep", ctx, "flow", 0, FLOW_SAMPLER, FLOW_STEPS[0], scale)
    flow_scale = best(result, "flow")
    for seed in seeds:
        for steps in FLOW_STEPS:
            _score_once(result, "scores", ctx, "flow", seed, FLOW_SAMPLER, steps, flow_scale)


def part_caches(ctx: dict, result: dict) -> None:
    """Seed 0 of the embedded default (DDPM) and of the flow twin, sampled as each records (its guidance and
    interval), at 25 and 50 steps, without and with each cache, one after the other in this process. A model whose
    runs folder is not given is left out (and said so); with neither, there is nothing to time."""
    if not any(ctx[f"{kind}_runs"] for kind in CACHE_MODELS):
        raise SystemExit("the caches part: pass --flow-runs, --ddpm-runs or both (the folders of the models' runs)")
    for kind, (scheduler, budgets) in CACHE_MODELS.items():
        if not ctx[f"{kind}_runs"]:
            print(f"caches: no --{kind}-runs, so no {kind} rows this time", flush=True)
            continue
        scale = recorded_sampling(model_of(kind, 0, ctx)).guidance.scale
        for steps in budgets:
            for cache in CACHES:
                _score_once(result, "caches", ctx, kind, 0, scheduler, steps, scale, cache)


# ----------------------------------------------------------------------------------------------------
# Report
# ----------------------------------------------------------------------------------------------------
def by_seed(result: dict, kind: str, steps: int, key: str = "kid") -> dict[int, float]:
    return {r["seed"]: r[key] for r in result["scores"] if (r["kind"], r["steps"]) == (kind, steps)}


def time_ratios(times: dict[int, float], base: dict[int, float]) -> list[float]:
    """Each seed's sampling time over the baseline's at the same seed (both timed on one machine), in seed order."""
    return [times[s] / base[s] for s in sorted(times) if base.get(s)]


def flow_curves(ctx_flow_runs: str | None, seeds) -> list[dict]:
    """The flow twin's evaluations during training (the backbone study's flow arm), as this study's records."""
    if not ctx_flow_runs:
        return []
    runs = []
    for seed in seeds:
        metrics = Path(ctx_flow_runs) / run_name("flow", seed) / "metrics.jsonl"
        if metrics.is_file():
            curve = [{k: r.get(k) for k in ("step", "kid", "fid")} for r in read_records(metrics, "evaluation")]
            runs.append({"arm": "flow", "seed": seed, "curve": curve})
    return runs


def report(result: dict) -> str:
    protocol = result["protocol"]
    lines = [
        "# Few-step sampling: MeanFlow against flow matching, and sampling caches",
        "",
        f"Written by `python -m experiments.fewstep` (scale {protocol['scale']}). The embedded default's data and "
        "budget (MoH-DiT-Ti/4-75 at width 128, batch 16 x 8300 steps, its optimizer and EMA). KID x 1000 on the "
        f"project's classifier features against the {describe_reference(protocol)}; {protocol['samples']} "
        "class-balanced samples per setting; across seeds, means with 95% t-intervals and differences paired by seed. "
        "NFE: network evaluations per image (a CFG step evaluates two predictions, batched in one forward).",
    ]
    curves = [*result["training"].values(), *result.get("flow_curves", [])]
    if curves:
        lines += [
            "",
            "## During training",
            "",
            "500 unguided samples of the EMA weights at each evaluation: MeanFlow in one step, the flow twin with "
            "DPM-Solver++ 25 steps (the backbone study's flow arm); mean over seeds [95% t] (n):",
            "",
            "| step | meanflow, 1 step | flow, 25 steps |",
            "|---|---|---|",
        ]
        points = curve_points(curves)
        for step in sorted({s for arm in points.values() for s in arm}):
            cells = [points.get(a, {}).get(step, {}) for a in ("meanflow", "flow")]
            lines.append(f"| {step} | " + " | ".join(f"{fmt_values(c.values())} (n={len(c)})" for c in cells) + " |")
    if result["sweep"]:
        lines += [
            "",
            "## Guidance (seed 0)",
            "",
            "| model | steps | scale | KID [90%] | FID |",
            "|---|---|---|---|---|",
        ]
        for r in sorted(result["sweep"], key=lambda r: (r["kind"], r["scale"])):
            lo, hi = r["kid_interval"]
            lines.append(
                f"| {r['kind']} | {r['steps']} | {r['scale']:g} | {r['kid']:.2f} [{lo:.2f}, {hi:.2f}] | {r['fid']:.1f} |"
            )
        lines += [
            "",
            "MeanFlow's scale is CFG on top of the guidance folded into its training (omega 1, kappa 0.5; at scale 1 "
            "a step is one evaluation, above it two); each model's rows below take its best scale here (MeanFlow "
            f"{_shown(best(result, 'meanflow'))}, the flow twin {_shown(best(result, 'flow'))} in its recorded "
            "interval).",
        ]
    if result["scores"]:
        lines += ["", "## MeanFlow at 1, 2 and 4 steps against flow at 25 and 50", ""]
        base = by_seed(result, "flow", FLOW_STEPS[0])
        rows = [(("meanflow", str(s)), by_seed(result, "meanflow", s), base) for s in MEANFLOW_STEPS]
        rows += [
            (("flow", str(s)), by_seed(result, "flow", s), base if s != FLOW_STEPS[0] else None) for s in FLOW_STEPS
        ]
        lines += by_seed_table(("model", "steps"), [r for r in rows if r[1]], f"flow at {FLOW_STEPS[0]} steps")
        lines += [
            "",
            f"| model | steps | NFE | FID | precision | recall | s / image | time / flow's at {FLOW_STEPS[0]} steps |",
            "|---|---|---|---|---|---|---|---|",
        ]
        base_time = by_seed(result, "flow", FLOW_STEPS[0], "seconds_per_image")
        for kind, steps in [*(("meanflow", s) for s in MEANFLOW_STEPS), *(("flow", s) for s in FLOW_STEPS)]:
            if by_seed(result, kind, steps):
                nfe = by_seed(result, kind, steps, "nfe")
                cells = [f"{max(nfe.values()):g}"]
                cells += [
                    fmt_values(by_seed(result, kind, steps, k).values(), d)
                    for k, d in (("fid", 1), ("precision", 3), ("recall", 3), ("seconds_per_image", 4))
                ]
                cells.append(fmt_values(time_ratios(by_seed(result, kind, steps, "seconds_per_image"), base_time), 3))
                lines.append(f"| {kind} | {steps} | " + " | ".join(cells) + " |")
        lines += [
            "",
            "The time ratio is taken within each seed (its two models sampled on one machine) and then averaged: the "
            "seconds themselves mix machines when seeds ran on different ones.",
        ]
    if result["caches"]:
        lines += [
            "",
            "## Sampling caches (seed 0, sampled as each model records)",
            "",
            "Seconds per image as the sample sets were generated, one after the other in one process (the speed-up "
            "measured in interleaved rounds is benchmarks/results/caches_cpu_*.md); the KID difference from the "
            "uncached sampler on the same noise and labels, with the cached set's 90% interval.",
            "",
            "| model | steps | cache | KID [90%] | KID - uncached | FID | s / image | speed-up |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in sorted(result["caches"], key=lambda r: (r["kind"], r["steps"], CACHES.index(r["cache"]))):
            plain = next(
                (
                    p
                    for p in result["caches"]
                    if (p["kind"], p["steps"], p["cache"]) == (r["kind"], r["steps"], "none")
                ),
                None,
            )
            lo, hi = r["kid_interval"]
            diff = f"{r['kid'] - plain['kid']:+.2f}" if plain else "-"
            speed = (
                f"{plain['seconds_per_image'] / r['seconds_per_image']:.2f}x"
                if plain and r["seconds_per_image"]
                else "-"
            )
            lines.append(
                f"| {r['kind']} | {r['steps']} | {r['cache']} | {r['kid']:.2f} [{lo:.2f}, {hi:.2f}] | {diff} | "
                f"{r['fid']:.1f} | {r['seconds_per_image']:.4f} | {speed} |"
            )
    lines += note_lines(result)
    lines += ["", "## Reading", "", *reading(result), ""]
    return "\n".join(lines)


def reading(result: dict) -> list[str]:
    out = []
    base = by_seed(result, "flow", FLOW_STEPS[0])
    for kind, steps in [*(("meanflow", s) for s in MEANFLOW_STEPS), ("flow", FLOW_STEPS[1])]:
        line = paired_reading(
            f"{kind} at {steps} step{'s' if steps > 1 else ''} against flow at {FLOW_STEPS[0]}, KID",
            by_seed(result, kind, steps),
            base,
        )
        if line:
            out.append(line)
    return out or ["No paired results yet."]


def plot(result: dict, out: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    curves = [*result["training"].values(), *result.get("flow_curves", [])]
    if curves:
        fig, ax = plt.subplots(figsize=(6.5, 4))
        plot_curves(ax, curve_points(curves), "unguided KID x 1000 (500 samples)")
        ax.set(yscale="log", title="meanflow: 1 step; flow: DPM-Solver++ 25 steps")
        fig.tight_layout()
        fig.savefig(out / "kid_during_training.png", dpi=110)
        plt.close(fig)
    if result["scores"]:
        groups = [f"meanflow {s}" for s in MEANFLOW_STEPS] + [f"flow {s}" for s in FLOW_STEPS]
        values = [by_seed(result, "meanflow", s) for s in MEANFLOW_STEPS] + [
            by_seed(result, "flow", s) for s in FLOW_STEPS
        ]
        fig, ax = plt.subplots(figsize=(7.5, 3.8))
        plot_by_seed(ax, groups, {"KID": values}, "KID x 1000")
        ax.set_title("Each setting at every seed (steps = network evaluations, MeanFlow unguided)")
        fig.tight_layout()
        fig.savefig(out / "kid_by_steps.png", dpi=110)
        plt.close(fig)


def save(out: Path, result: dict) -> None:
    save_results(out, result, report(result))


# ----------------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> dict:
    p = study_arguments(__doc__, ["train", "score", "caches"], SCALES, "cpu", "experiments/results/fewstep")
    p.add_argument("--flow-runs", default=None, help="the backbone study's runs folder (its flow arm)")
    p.add_argument("--ddpm-runs", default=None, help="the guidance study's runs folder (its DDPM mains)")
    p.add_argument("--rescore", action="store_true", help="redo points already in the records (default: kept)")
    args = p.parse_args(argv)
    sc = SCALES[args.scale]
    out = Path(args.out)
    sections = {"training": {}, "sweep": [], "scores": [], "caches": []}
    result, seeds, lock = open_study(args, sc, "fewstep", sections)  # lock: held to the end
    if args.flow_runs:  # this run's seeds read again; the curves of other seeds (other runs folders) kept
        read = flow_curves(args.flow_runs, seeds)
        seeds_read = {c["seed"] for c in read}
        kept = [c for c in result.get("flow_curves", []) if c["seed"] not in seeds_read]
        result["flow_curves"] = sorted(kept + read, key=lambda c: c["seed"])
    if not args.report_only:
        out, reference, extractor = start_scoring(args)
        torch.manual_seed(0)
        ctx = dict(
            out=out, reference=reference, extractor=extractor, samples=sc["samples"], bootstrap=sc["bootstrap"],
            flow_runs=args.flow_runs, ddpm_runs=args.ddpm_runs, rescore=args.rescore,
        )  # fmt: skip
        if args.part in ("train", "all"):
            part_train(sc, out, reference, seeds, result)
        if args.part in ("score", "all"):
            part_score(ctx, seeds, result)
        if args.part in ("caches", "all"):
            part_caches(ctx, result)
    out.mkdir(parents=True, exist_ok=True)
    save(out, result)
    plot(result, out)
    return result


if __name__ == "__main__":
    main()
