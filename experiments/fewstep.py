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
    python -m experiments.fewstep --scale tiny --out /tmp/fewstep   # the smoke run: trains its own flow twin (about 2 minutes on 2 cores: 114 s measured)

Points already in the records are kept, not redone (--rescore redoes them), so a later run with --seeds 1 2 needs
only those seeds' runs; the flow curves of seeds it does not read are kept.

Writes experiments/results/fewstep/{RESULTS.md, results.json, *.png}.
"""

from __future__ import annotations

from pathlib import Path

from experiments.arms import STUDY_SCALES, run_name, score_model, train_arm
from experiments.common import (
    scoring_context,
)
from experiments.fewstep_report import CACHES, FLOW_SAMPLER, FLOW_STEPS, MEANFLOW_STEPS, best, plot, report
from experiments.report import (
    is_recorded,
    open_study,
    save_results,
    study_arguments,
    with_row,
)
from moh_dit.sampling.loading import recorded_sampling
from moh_dit.training.quality import read_records

MEANFLOW = "configs/fashion_mnist_moh_meanflow.yaml"
ARMS = {"meanflow": (MEANFLOW, [])}
# the flow twin, trained by this study only at a scale whose runs are its own (the smoke run: there is no backbone
# study's folder to pass); at the real scales it is the backbone study's flow arm (--flow-runs)
OWN_FLOW = {"flow": ("configs/fashion_mnist_moh_flow.yaml", [])}
FLOW_SCALES = (1.0, 2.0, 3.0, 4.0, 6.0)  # swept on seed 0 at 25 steps, in the model's recorded interval
MEANFLOW_SCALES = (1.0, 1.5, 2.0)  # CFG on top of the guidance folded into training (seed 0, one step)
CACHE_MODELS = {"ddpm": ("dpm-solver", (25, 50)), "flow": (FLOW_SAMPLER, (25, 50))}  # seed 0, recorded guidance
# the backbone study's scales: the same evaluation points and sample counts, so its flow arm pairs with MeanFlow;
# the smoke run trains its own flow twin, so that it runs as written
SCALES = {name: scale | {"own_flow": name == "tiny"} for name, scale in STUDY_SCALES.items()}


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
    """One sample set of ``kind``'s model at ``seed`` (:func:`experiments.arms.score_model`), as a row."""
    row = {"kind": kind, "seed": seed, "scheduler": scheduler, "steps": steps, "scale": scale, "cache": cache}
    return row | score_model(model_of(kind, seed, ctx), run_name(kind, seed), scheduler, steps, scale, ctx, cache)


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


# ----------------------------------------------------------------------------------------------------
# The parts
# ----------------------------------------------------------------------------------------------------
def part_train(sc: dict, out: Path, reference: Path, seeds, result: dict) -> None:
    arms = ARMS | (OWN_FLOW if sc["own_flow"] else {})
    for seed in seeds:
        for arm in arms:
            result["training"][run_name(arm, seed)] = train_arm(arm, seed, sc, out, reference, arms)
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
    sc = sc | {"own_flow": sc["own_flow"] and not args.flow_runs}
    if sc["own_flow"]:
        args.flow_runs = str(out / "runs")  # the smoke run's own flow twin
    if args.part in ("score", "all") and not args.report_only and not args.flow_runs:
        # said before any training: the score part compares MeanFlow with the flow twin of the backbone study
        p.error("--part score (and all) needs the flow twin's runs: pass --flow-runs DIR (the backbone study's runs)")
    result, seeds, lock = open_study(args, sc, "fewstep", sections)  # lock: held to the end
    if not args.report_only and args.part != "train" and not sc["own_flow"]:
        # checked before any sampling: a missing or wrong runs folder is said at once, not after the first sample sets
        given = {"flow": args.flow_runs, "ddpm": args.ddpm_runs if args.part in ("caches", "all") else None}
        missing = [str(Path(folder) / run_name(kind, seed) / "pipeline") for kind, folder in given.items() if folder
                   for seed in (seeds if kind == "flow" and args.part in ("score", "all") else (0,))
                   if not (Path(folder) / run_name(kind, seed) / "pipeline").is_dir()]  # fmt: skip
        if missing:
            p.error(f"no trained model at {', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}: pass the "
                    f"runs folder of the study that trained them (--flow-runs: the backbone study's, --ddpm-runs: the "
                    f"guidance study's)")  # fmt: skip
    if args.flow_runs:  # this run's seeds read again; the curves of other seeds (other runs folders) kept
        read = flow_curves(args.flow_runs, seeds)
        seeds_read = {c["seed"] for c in read}
        kept = [c for c in result.get("flow_curves", []) if c["seed"] not in seeds_read]
        result["flow_curves"] = sorted(kept + read, key=lambda c: c["seed"])
    if not args.report_only:
        ctx = scoring_context(args, sc, flow_runs=args.flow_runs, ddpm_runs=args.ddpm_runs)
        out = ctx["out"]
        if args.part in ("train", "all"):
            part_train(sc, out, ctx["reference"], seeds, result)
        if args.part in ("score", "all"):
            part_score(ctx, seeds, result)
        if args.part in ("caches", "all"):
            part_caches(ctx, result)
    out.mkdir(parents=True, exist_ok=True)
    save(out, result)
    plot(result, out)
    return result


if __name__ == "__main__":
    from moh_dit.cli.common import run_cli

    run_cli(main)  # bad input: one line, as the commands say it
