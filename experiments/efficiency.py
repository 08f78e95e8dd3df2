r"""Training efficiency against the goal of issue #65: the embedded default's final quality in at most 0.3 of its
steps. Each arm trains for 0.3 of the default's budget (2490 of 8300 steps at batch 16, its schedule compressed to
them) and is compared with the full-budget runs of the distillation study (the embedded default and its flow twin,
same seeds, same evaluations):

    flow-short    the flow twin (configs/fashion_mnist_moh_flow.yaml) on the short budget: what the budget alone does
    tread-short   token routing (configs/fashion_mnist_moh_tread.yaml): half of each image's tokens skip blocks 2-3 of 6
    mg-short      guidance folded into the default's DDPM training (configs/fashion_mnist_moh_mg.yaml), its warm-up
                  scaled with the budget (300 steps), sampled at one network evaluation per step
    xpred-short   the flow twin with x-prediction (JiT: the network outputs the clean image, the loss and the sampler
                  stay in velocity); flow-p7-short, xpred-p7-short, flow-p14-short, xpred-p14-short: velocity and
                  x-prediction at patch 7 (16 tokens) and 14 (4 tokens) instead of 4 (49 tokens), in pixels
    second round  modern-short, modern-tread-short, dit-modern-short, dit-modern-tread-short: routing on the modern
                  recipe (configs/fashion_mnist_moh_modern.yaml), MoH-DiT and DiT; tread-s25/s75/wide-short: the
                  share and span swept on the flow twin; mg-flow-short (configs/fashion_mnist_moh_flow_mg.yaml) and
                  ddpm-short, the plain default on the short budget; modern-tread-mg-short: every option on the modern
                  block; mg-full: folded guidance on the default's full 8300 steps; modern-time, dit-modern-time:
                  the plain modern recipe for the wall-clock its routed run took (EQUAL_TIME: 1905 and 1997 steps)

Every run evaluates itself during training (500 unguided samples every 830 steps, a full-budget arm's every 1660;
the project's classifier features against the 10,000 Fashion-MNIST test images); at the end each model is scored with 1000 class-balanced
samples at 25 steps of its fast sampler, without CFG (the folded guidance is in the weights), and each plain arm
that a folded one is held to also with the CFG its model records (FOLDED), against the full-budget runs' final scores
(the distillation study scores the teachers at 25 steps with their CFG). Wall-clock
is each run's steps over its median images per second as its own log measured them, two runs at a time on the
machine's two cores.

    python -m experiments.efficiency                    # seed 0 (resumable); --seeds 0 1 2 for the three
    python -m experiments.efficiency --seeds 1 2 --arms flow-short tread-short mg-short   # some arms only
    python -m experiments.efficiency --report-only

Writes experiments/results/efficiency/{RESULTS.md, results.json}.
"""

from __future__ import annotations

import json
from pathlib import Path

from experiments.arms import STUDY_SCALES, run_name, score_model, train_arm
from experiments.common import ROOT, scoring_context
from experiments.report import is_recorded, open_study, save_results, study_arguments, with_row
from moh_dit.sampling.loading import recorded_sampling

SHORT = 2490  # 0.3 of the default's 8300 steps
ARMS = {
    "flow-short": ("configs/fashion_mnist_moh_flow.yaml", []),
    "tread-short": ("configs/fashion_mnist_moh_tread.yaml", []),
    "mg-short": ("configs/fashion_mnist_moh_mg.yaml", ["objective.guidance_warmup=300"]),
    # x-prediction (JiT) against velocity prediction in pixels at patch 4 (flow-short), 7 and 14
    "xpred-short": ("configs/fashion_mnist_moh_flow.yaml", ["objective.prediction=x"]),
    **{
        f"{kind}-p{patch}-short": (
            "configs/fashion_mnist_moh_flow.yaml",
            [f"model.overrides.patch_size={patch}", *(["objective.prediction=x"] if kind == "xpred" else [])],
        )
        for patch in (7, 14)
        for kind in ("flow", "xpred")
    },
}
MODERN, DIT = "configs/fashion_mnist_moh_modern.yaml", ["model.preset=DiT-Ti/4"]


def _routing(share: float = 0.5, first: int = 2, last: int = -3) -> list[str]:
    return [f"token_routing.share={share}", f"token_routing.first_block={first}", f"token_routing.last_block={last}"]


WARMUP = ["objective.guidance_warmup=300"]  # the folded guidance's warm-up scaled with the budget (1000 of 8300)
ARMS |= {
    # the routed share and span swept on the flow twin at one seed (tread-short: share 0.5, blocks 2-3 of the 6)
    "tread-s25-short": ("configs/fashion_mnist_moh_flow.yaml", _routing(share=0.25)),
    "tread-s75-short": ("configs/fashion_mnist_moh_flow.yaml", _routing(share=0.75)),
    "tread-wide-short": ("configs/fashion_mnist_moh_flow.yaml", _routing(first=1, last=-2)),
    # token routing on the modern recipe, MoH-DiT and DiT
    "modern-short": (MODERN, []),
    "modern-tread-short": (MODERN, _routing()),
    "dit-modern-short": (MODERN, DIT),
    "dit-modern-tread-short": (MODERN, [*DIT, *_routing()]),
    # folded guidance on the flow twin, the DDPM default on the same short budget (its CFG baseline), and every
    # option of the issue on the modern block
    "mg-flow-short": ("configs/fashion_mnist_moh_flow_mg.yaml", WARMUP),
    "ddpm-short": ("configs/fashion_mnist_moh.yaml", []),
    "modern-tread-mg-short": ("configs/fashion_mnist_moh_modern_tread_mg.yaml", WARMUP),
    # folded guidance on the default's full budget (its own 1000-step warm-up), against the default's CFG
    "mg-full": ("configs/fashion_mnist_moh_mg.yaml", []),
}
FULL_BUDGET = {"mg-full"}  # the arms trained on the default's 8300 steps, evaluated as the full-budget runs are
# token routing at equal wall-clock: the plain recipe trained for the time its routed run took, its 2490 steps over
# the routed/plain images-per-second ratio an idle machine measured (benchmarks/results/
# config_throughput_cpu_efficiency_modern_idle.md: MoH 109.4/83.7 = 1.31x, DiT 117.1/93.9 = 1.25x); its schedule
# is compressed to those steps as the short arms' is to 2490. Arm: (its routed arm, steps).
EQUAL_TIME = {"modern-time": ("modern-tread-short", 1905), "dit-modern-time": ("dit-modern-tread-short", 1997)}
ARMS |= {"modern-time": ARMS["modern-short"], "dit-modern-time": ARMS["dit-modern-short"]}
SAMPLERS = {"mg-short": "dpm-solver", "ddpm-short": "dpm-solver", "mg-full": "dpm-solver"}  # the others: euler
# the plain arms also scored with CFG at the scale and interval their models record (two evaluations per step inside
# it), against the arm that folds the same guidance into training and samples at one
FOLDED = {
    "mg-short": "ddpm-short",
    "mg-flow-short": "flow-short",
    "modern-tread-mg-short": "modern-short",
    "mg-full": "ddpm",  # the default's full-budget run, scored with its CFG by the distillation study
}
# the full-budget run each is held to; the others: the flow twin
BASELINES = {"mg-short": "ddpm", "ddpm-short": "ddpm", "mg-full": "ddpm"}
SCALES = {
    "cpu": STUDY_SCALES["cpu"]
    | {
        "overrides": [f"train.max_steps={SHORT}"],
        "eval": ["log.eval_every=830", "log.eval_samples=500"],
        "seeds": (0,),
        # a full-budget arm: the config's own steps, evaluated as the full-budget runs are (every 1660 steps)
        "full_budget": {"overrides": [], "eval": STUDY_SCALES["cpu"]["eval"]},
    },
    "tiny": STUDY_SCALES["tiny"],  # its budget is already the config's tiny one, whatever the arm
}
MATCH = ("arm", "seed", "scale")
FULL = ROOT / "experiments" / "results" / "distill" / "results.json"


def part_train(sc: dict, out: Path, reference: Path, seeds, result: dict, arms=tuple(ARMS)) -> None:
    for seed in seeds:
        for arm in arms:
            result["training"][run_name(arm, seed)] = train_arm(arm, seed, arm_scale(sc, arm), out, reference, ARMS)
            save(out, result)


def arm_scale(sc: dict, arm: str) -> dict:
    """The study's scale for ``arm``: the short budget; for a full-budget arm the scale's ``full_budget`` part (the
    config's own steps and the full-budget runs' evaluations) where the scale has one; for an equal-time arm its own
    steps where the scale sets the short budget."""
    if arm in FULL_BUDGET:
        return sc | sc.get("full_budget", {})
    if arm in EQUAL_TIME and f"train.max_steps={SHORT}" in sc["overrides"]:
        steps = f"train.max_steps={EQUAL_TIME[arm][1]}"
        return sc | {"overrides": [steps if o == f"train.max_steps={SHORT}" else o for o in sc["overrides"]]}
    return sc


def part_score(ctx: dict, seeds, result: dict, arms=tuple(ARMS)) -> None:
    for seed in seeds:
        for arm in arms:
            model = ctx["out"] / "runs" / run_name(arm, seed) / "pipeline"
            cfg = arm in FOLDED.values()  # a plain arm that a folded one is held to
            unguided = [] if cfg and ctx.get("guided_only") else [1.0]
            scales = unguided + ([recorded_sampling(model).guidance.scale] if cfg else [])
            for scale in scales:
                identity = dict(arm=arm, seed=seed, scale=scale)
                if ctx.get("rescore") or not is_recorded(result["scores"], MATCH, identity):
                    scores = score_model(model, run_name(arm, seed), SAMPLERS.get(arm, "euler"), 25, scale, ctx)
                    result["scores"] = with_row(result["scores"], MATCH, identity | scores)
                    save(ctx["out"], result)


def full_budget() -> dict:
    """The distillation study's teachers (the default and its flow twin at 8300 steps): training and final scores."""
    if not FULL.is_file():
        return {}
    full = json.loads(FULL.read_text())
    teachers = {k: v for k, v in full["training"].items() if v.get("arm") in ("ddpm", "flow")}
    scores = [r for r in full["scores"] if r["arm"] in ("ddpm", "flow")]
    return {"training": teachers, "scores": scores}


def _score(rows: list[dict], arm: str, seed: int, guided: bool = False) -> dict:
    """The arm's final score at this seed: unguided, or (``guided``) with its recorded CFG."""
    return next(
        (r for r in rows if (r["arm"], r["seed"]) == (arm, seed) and (r.get("scale", 1.0) != 1.0) == guided), {}
    )


def _fmt(value, digits: int = 2) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def report(result: dict) -> str:
    full = result.get("full_budget") or {}
    lines = [
        "# Training efficiency: 0.3 of the default's steps",
        "",
        "Each arm trains 2490 steps (0.3 of the default's 8300), batch 16, seed as listed; the baselines are the "
        "distillation study's full-budget runs at the same seed. KID x1000 on the project's classifier features.",
        "",
        "| arm | seed | steps | images/s | minutes | KID during training (500 unguided, by step) | final KID "
        "(1000, 25 steps, NFE) | full-budget run: final KID during training, scored KID (NFE) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for _, run in sorted(result["training"].items()):
        arm, seed = run["arm"], run["seed"]
        curve = ", ".join(f"{c['step']}: {c['kid']:.1f}" for c in run.get("curve", []))
        speed = run.get("median_images_per_s")
        minutes = run["steps"] * 16 / speed / 60 if speed else None
        score = _score(result["scores"], arm, seed)
        base = BASELINES.get(arm, "flow")
        base_run = full.get("training", {}).get(run_name(base, seed), {})
        last = (base_run.get("curve") or [{}])[-1]
        base_score = next((r for r in full.get("scores", []) if (r["arm"], r["seed"]) == (base, seed)), {})
        lines.append(
            f"| {arm} | {seed} | {run['steps']} | {_fmt(speed, 1)} | {_fmt(minutes, 1)} | {curve} | "
            f"{_fmt(score.get('kid'))} ({score.get('nfe', 'n/a')}) | {base}: {_fmt(last.get('kid'))} at "
            f"{last.get('step', 'n/a')}, {_fmt(base_score.get('kid'))} ({base_score.get('nfe', 'n/a')}) |"
        )
    return "\n".join(lines + goal_table(result) + equal_time_table(result) + guidance_table(result)) + "\n"


def steps_to(curve: list[dict], target: float) -> int | None:
    """The first evaluated step whose KID is at most ``target`` (``None``: not reached)."""
    return next((c["step"] for c in curve if c["kid"] <= target), None)


def goal_table(result: dict) -> list[str]:
    """Each arm against the goal: the embedded default's final unguided KID during training (its full-budget run at
    the same seed) reached within the short budget, and at which step."""
    default = (result.get("full_budget") or {}).get("training", {})
    finals = {run["seed"]: run["curve"][-1] for run in default.values() if run["arm"] == "ddpm" and run.get("curve")}
    lines = [
        "",
        "Against the goal (the default's final unguided KID during training, its 8300-step run at the same seed: "
        + ", ".join(f"seed {s}: {f['kid']:.1f}" for s, f in sorted(finals.items()))
        + "); KID during training (500 samples; unguided, a folded arm at its recorded guidance), mean over the seeds run:",
        "",
        "| arm | seeds | mean KID by step | reached at step (by seed; -: not within the run) |",
        "|---|---|---|---|",
    ]
    arms: dict[str, list[dict]] = {}
    for run in result["training"].values():
        arms.setdefault(run["arm"], []).append(run)
    for arm in ARMS:
        runs = sorted((r for r in arms.get(arm, []) if r.get("curve")), key=lambda r: r["seed"])
        if not runs or not finals:
            continue
        steps = [c["step"] for c in runs[0]["curve"]]
        means = [sum(r["curve"][i]["kid"] for r in runs) / len(runs) for i in range(len(steps))]
        reached = [steps_to(r["curve"], finals[r["seed"]]["kid"]) if r["seed"] in finals else None for r in runs]
        lines.append(
            f"| {arm} | {', '.join(str(r['seed']) for r in runs)} | "
            + ", ".join(f"{step}: {kid:.1f}" for step, kid in zip(steps, means))
            + f" | {', '.join('-' if x is None else str(x) for x in reached)} |"
        )
    return lines


def equal_time_table(result: dict) -> list[str]:
    """Each routed arm against its plain recipe trained for the same wall-clock (EQUAL_TIME): the last KID during
    training of each, paired by seed."""
    lines = [
        "",
        "Token routing at equal wall-clock (the plain recipe trained for the routed run's time on an idle machine); "
        "the last KID during training (500 unguided samples) by seed, and the mean:",
        "",
        "| routed arm (steps) | plain arm (steps) | seeds | routed KID | plain KID | routed minus plain, mean |",
        "|---|---|---|---|---|---|",
    ]
    runs = {(r["arm"], r["seed"]): r for r in result["training"].values() if r.get("curve")}
    for plain, (routed, steps) in EQUAL_TIME.items():
        seeds = sorted(s for a, s in runs if a == plain and (routed, s) in runs)
        if not seeds:
            continue
        kid = {arm: [runs[arm, s]["curve"][-1]["kid"] for s in seeds] for arm in (routed, plain)}
        diff = sum(r - p for r, p in zip(kid[routed], kid[plain])) / len(seeds)
        lines.append(
            f"| {routed} ({runs[routed, seeds[0]]['steps']}) | {plain} ({steps}) | {', '.join(map(str, seeds))} | "
            + " / ".join(f"{k:.1f}" for k in kid[routed])
            + " | "
            + " / ".join(f"{k:.1f}" for k in kid[plain])
            + f" | {diff:+.1f} |"
        )
    return lines


def guidance_table(result: dict) -> list[str]:
    """Each folded-guidance arm at one evaluation per step against its plain arm with CFG, both at 25 steps."""
    lines = [
        "",
        "Folded guidance (one evaluation per step) against CFG on the same budget (1000 samples, 25 steps; seconds "
        "per image as measured beside the other study jobs):",
        "",
        "| arm | seed | guidance | NFE | KID | FID | precision | recall | s/image |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    rows = result["scores"] + (result.get("full_budget") or {}).get("scores", [])
    for folded, plain in FOLDED.items():
        for seed in sorted({r["seed"] for r in result["scores"] if r["arm"] == folded}):
            for arm, guided, how in ((folded, False, "folded"), (plain, True, "CFG")):
                r = _score(rows, arm, seed, guided)
                if r:
                    how = how if not guided else f"CFG {r['scale']:g}"
                    lines.append(
                        f"| {arm} | {seed} | {how} | {r['nfe']} | {_fmt(r['kid'])} | {_fmt(r.get('fid'), 1)} | "
                        f"{_fmt(r.get('precision'))} | {_fmt(r.get('recall'))} | {_fmt(r.get('seconds_per_image'), 3)} |"
                    )
    return lines


def save(out: Path, result: dict) -> None:
    result["full_budget"] = full_budget()
    save_results(out, result, report(result))


def main(argv: list[str] | None = None) -> dict:
    p = study_arguments(__doc__, ["train", "score"], SCALES, "cpu", "experiments/results/efficiency")
    p.add_argument("--rescore", action="store_true", help="redo points already in the records (default: kept)")
    p.add_argument("--arms", nargs="+", choices=list(ARMS), default=list(ARMS), help="default: every arm")
    p.add_argument(
        "--guided-only",
        action="store_true",
        help="score a plain arm only with its CFG (its unguided KID is in its curve)",
    )
    args = p.parse_args(argv)
    sc = SCALES[args.scale]
    result, seeds, lock = open_study(args, sc, "efficiency", {"training": {}, "scores": []})
    for row in result["scores"]:  # records from before the CFG rows were unguided
        row.setdefault("scale", 1.0)
    if not args.report_only:
        ctx = scoring_context(args, sc, guided_only=args.guided_only)
        if args.part in ("train", "all"):
            part_train(sc, ctx["out"], ctx["reference"], seeds, result, args.arms)
        if args.part in ("score", "all"):
            part_score(ctx, seeds, result, args.arms)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    save(Path(args.out), result)
    return result


if __name__ == "__main__":
    from moh_dit.cli.common import run_cli

    run_cli(main)  # bad input: one line, as the commands say it
