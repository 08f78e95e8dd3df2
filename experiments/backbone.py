r"""LightningDiT's ablation at this project's scale: the flow-matching twin of the embedded default, then cumulatively
its training changes and its block, each arm from scratch on the default's data and budget (batch 16 x 8300 steps):

    flow         configs/fashion_mnist_moh_flow.yaml (SiT's linear path, uniform times, DiT's block)
    +lognorm     logit-normal times
    +cosine      + the velocity-direction (cosine) loss, weight 1
    +swiglu      + SwiGLU
    +rmsnorm     + RMSNorm
    +rope        + 2-D RoPE: LightningDiT's released block, on MoH-DiT-Ti/4-75
    +qknorm      + QK-norm (RMSNorm): every option (configs/fashion_mnist_moh_modern.yaml); a separate row
    dit-modern   +rope on DiT-Ti/4 (configs/fashion_mnist_dit_flow.yaml): MoH-DiT against DiT inside the new block

Each run evaluates itself during training (``log.eval_every``: KID and FID of 500 unguided DPM-Solver++ samples of
the EMA weights against the 10,000 Fashion-MNIST test images on the project's classifier features: the protocol of
the recipes study, so its DDPM curve is the target). Then each run is scored guided at NFE 25 with the flow twin's
sampler (Euler 25 steps, guidance 4 in the default's interval, grids averaged at low noise: the recipes study's
choice), 1000 class-balanced samples: KID, FID, precision and recall. The report gives, per arm, the mean over seeds,
each difference paired by seed against the row above, and how many steps each arm needs to reach the embedded
default's final unguided KID (the recipes study's DDPM arm, 3 seeds), interpolated in log KID between evaluations.

    python -m experiments.backbone --part train                  # every arm, seed by seed (resumable)
    python -m experiments.backbone --part score                  # guided at NFE 25, 3 seeds
    python -m experiments.backbone --report-only                 # RESULTS.md and the plots from results.json

Two processes can train at once into separate --out folders whose ``runs`` link to one folder (finished runs are
reused); a last ``--part train`` in the main folder collects them. The time per step of each arm is measured apart, on
a quiet machine, by ``benchmarks/config_throughput.py`` (RESULTS.md names the file). Writes
experiments/results/backbone/{RESULTS.md, results.json, *.png}.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import torch

from experiments.arms import STUDY_SCALES as SCALES
from experiments.arms import pipeline_of, run_name, score, scores_row, train_arm
from experiments.common import describe_reference, start_scoring
from experiments.report import (
    by_seed_table,
    curve_points,
    curve_table,
    fmt_values,
    open_study,
    paired_readings,
    plot_by_seed,
    plot_curves,
    pyplot,
    save_results,
    study_arguments,
)

FLOW, DIT_FLOW = "configs/fashion_mnist_moh_flow.yaml", "configs/fashion_mnist_dit_flow.yaml"
LOGNORM = ["objective.time_sampling=logit-normal"]
COSINE = [*LOGNORM, "objective.cosine_loss=1.0"]


def _block(**options) -> list[str]:
    shown = ", ".join(f"{k}: {str(v).lower()}" for k, v in options.items())
    return [*COSINE, f"model.overrides.block={{{shown}}}"]


LIGHTNINGDIT = dict(mlp="swiglu", norm="rmsnorm", rope=True)
ARMS = {  # each adds one change to the row before (dit-modern: +rope's recipe on DiT-Ti/4)
    "flow": (FLOW, []),
    "+lognorm": (FLOW, LOGNORM),
    "+cosine": (FLOW, COSINE),
    "+swiglu": (FLOW, _block(mlp="swiglu")),
    "+rmsnorm": (FLOW, _block(mlp="swiglu", norm="rmsnorm")),
    "+rope": (FLOW, _block(**LIGHTNINGDIT)),
    "+qknorm": (FLOW, _block(**LIGHTNINGDIT, qk_norm="rmsnorm")),
    "dit-modern": (DIT_FLOW, _block(**LIGHTNINGDIT)),
}
ABLATION = ["flow", "+lognorm", "+cosine", "+swiglu", "+rmsnorm", "+rope"]
# the rows that are not the next step of the ablation, and what each is compared with
SIDE_ROWS = {"+qknorm": "+rope", "dit-modern": "+rope"}
GUIDED = dict(scheduler="euler", steps=25, guidance=4.0)  # the recipes study's flow choice at NFE 25
# the embedded default's final unguided KID in the recipes study (moh-ddpm, step 8300, seeds 0-2; the same 500-sample
# evaluation): experiments/results/recipes/results.json
RECIPES = Path(__file__).resolve().parent / "results" / "recipes" / "results.json"


# ----------------------------------------------------------------------------------------------------
# The parts
# ----------------------------------------------------------------------------------------------------
def part_train(sc: dict, out: Path, reference: Path, seeds, arms: list[str], result: dict) -> None:
    for seed in seeds:  # seed by seed, so that a part stopped early has every arm at the first seeds
        for arm in arms:
            result["training"][run_name(arm, seed)] = train_arm(arm, seed, sc, out, reference, ARMS)
            save(out, result)


def part_score(sc: dict, out: Path, reference: Path, extractor, seeds, arms: list[str], result: dict) -> None:
    for seed in seeds:
        for arm in arms:
            model = pipeline_of(out, arm, seed)
            if not model.is_dir():
                continue  # not trained yet
            row = scores_row(
                score(model, GUIDED["scheduler"], GUIDED["steps"], GUIDED["guidance"], sc, reference, extractor)
            )
            result["scores"] = [r for r in result["scores"] if (r["arm"], r["seed"]) != (arm, seed)]
            result["scores"].append({"arm": arm, "seed": seed, **row})
            save(out, result)


# ----------------------------------------------------------------------------------------------------
# Report
# ----------------------------------------------------------------------------------------------------
def target_kid(path: Path = RECIPES) -> dict[int, float]:
    """The embedded default's final unguided KID by seed (the recipes study's DDPM arm)."""
    if not path.is_file():
        return {}
    training = json.loads(path.read_text())["training"]
    return {t["seed"]: t["curve"][-1]["kid"] for t in training.values() if t["arm"] == "moh-ddpm" and t["curve"]}


def steps_to_reach(curve: dict[int, float], target: float) -> float | None:
    """The first training step at which a KID curve (step -> KID) reaches ``target``, interpolated linearly in log
    KID between the two evaluations around it; ``None`` if it never does."""
    points = sorted(curve.items())
    for (s0, k0), (s1, k1) in zip(points, points[1:]):
        if k1 <= target < k0:
            return s0 + (s1 - s0) * (math.log(k0) - math.log(target)) / (math.log(k0) - math.log(k1))
    return float(points[0][0]) if points and points[0][1] <= target else None


def reach_rows(result: dict, target: float) -> list[dict]:
    """Per arm and seed, the steps to the target and the wall-clock minutes at the run's measured speed."""
    points, rows = curve_points(result["training"].values()), []
    for arm, by_step in points.items():
        for seed in sorted({s for at in by_step.values() for s in at}):
            curve = {step: at[seed] for step, at in by_step.items() if seed in at}
            steps = steps_to_reach(curve, target)
            run = result["training"].get(run_name(arm, seed), {})
            speed = run.get("median_images_per_s")
            minutes = steps * 16 / speed / 60 if steps is not None and speed else None  # batch 16
            rows.append({"arm": arm, "seed": seed, "steps": steps, "minutes": minutes})
    return rows


def final_kid(result: dict, arm: str) -> dict[int, float]:
    return {t["seed"]: t["curve"][-1]["kid"] for t in result["training"].values() if t["arm"] == arm and t["curve"]}


def guided(result: dict, arm: str, key: str = "kid") -> dict[int, float]:
    return {r["seed"]: r[key] for r in result["scores"] if r["arm"] == arm}


def comparisons() -> list[tuple[str, str]]:
    """(arm, the row it is paired with): each ablation row against the one before, the side rows against theirs."""
    return [*zip(ABLATION[1:], ABLATION), *SIDE_ROWS.items()]


def report(result: dict) -> str:
    protocol = result["protocol"]
    targets = target_kid()
    target = statistics.mean(targets.values()) if targets else None
    lines = [
        "# LightningDiT's block and recipe on the embedded default",
        "",
        f"Written by `python -m experiments.backbone` (scale {protocol['scale']}). Every arm is the flow twin of the "
        "embedded default (MoH-DiT-Ti/4-75 at width 128, batch 16 x 8300 steps, its optimizer and EMA) with the changes "
        "of its row added to those above it. KID x 1000 on the project's classifier features against the "
        f"{describe_reference(protocol)}; across seeds, means with 95% t-intervals and differences paired by seed.",
        "",
        "## Unguided KID during training",
        "",
        "500 unguided DPM-Solver++ 25-step samples of the EMA weights at each evaluation; mean over seeds [95% t] (n), "
        "and each row's difference from the row above, paired by seed:",
        "",
    ]
    lines += curve_table(result["training"].values(), list(ARMS), comparisons())
    rows = [((arm, "final, unguided"), final_kid(result, arm), final_kid(result, base)) for arm, base in comparisons()]
    rows.insert(0, (("flow", "final, unguided"), final_kid(result, "flow"), None))
    lines += ["", "At the end of training (step 8300), against the row above:", ""]
    lines += by_seed_table(("arm", "KID"), [r for r in rows if r[1]], "the row above")
    if result["scores"]:
        lines += [
            "",
            f"## Guided at NFE 25 ({GUIDED['scheduler']} {GUIDED['steps']} steps, guidance {GUIDED['guidance']:g} in the "
            f"default's interval, {protocol['samples']} samples)",
            "",
        ]
        rows = [((arm, "KID"), guided(result, arm), guided(result, base)) for arm, base in comparisons()]
        rows.insert(0, (("flow", "KID"), guided(result, "flow"), None))
        lines += by_seed_table(("arm", "score"), [r for r in rows if r[1]], "the row above")
        lines += ["", "| arm | FID | precision | recall | s / image |", "|---|---|---|---|---|"]
        for arm in ARMS:
            if guided(result, arm):
                cells = [fmt_values(guided(result, arm, k).values(), d) for k, d in (("fid", 1), ("precision", 3))]
                cells += [fmt_values(guided(result, arm, "recall").values(), 3)]
                cells += [fmt_values(guided(result, arm, "seconds_per_image").values(), 3)]
                lines.append(f"| {arm} | " + " | ".join(cells) + " |")
    if target is not None and result["training"]:
        lines += [
            "",
            f"## Steps to the embedded default's final unguided KID ({target:.2f}, the DDPM arm of the recipes study)",
            "",
            "Interpolated in log KID between evaluations; minutes at each run's own median training speed (the runs "
            "shared the machine two at a time, so compare the steps; benchmarks/results/config_throughput_cpu_backbone.md "
            "has the time per step of each arm measured alone):",
            "",
            "| arm | steps, per seed | mean steps [95% t] | share of the default's 8300 | minutes, mean |",
            "|---|---|---|---|---|",
        ]
        reach = reach_rows(result, target)
        for arm in ARMS:
            mine = [r for r in reach if r["arm"] == arm]
            if not mine:
                continue
            steps = [r["steps"] for r in mine if r["steps"] is not None]
            shown = ", ".join("never" if r["steps"] is None else f"{r['steps']:.0f}" for r in mine)
            share = fmt_values([s / 8300 for s in steps]) if len(steps) == len(mine) else "-"
            minutes = [r["minutes"] for r in mine if r["minutes"] is not None]
            lines.append(
                f"| {arm} | {shown} | {fmt_values(steps, 0) if len(steps) == len(mine) else '-'} | {share} | "
                f"{statistics.mean(minutes):.1f} |"
                if minutes
                else f"| {arm} | {shown} | - | - | - |"
            )
    lines += ["", "## Reading", "", *reading(result), ""]
    return "\n".join(lines)


def reading(result: dict) -> list[str]:
    """One line per comparison: the paired difference of the guided KID (else the final unguided one) and its
    verdict."""
    return paired_readings(
        (f"{arm} against {base}, {label}", mine, theirs)
        for arm, base in comparisons()
        for label, mine, theirs in (
            ("guided KID at NFE 25", guided(result, arm), guided(result, base)),
            ("final unguided KID", final_kid(result, arm), final_kid(result, base)),
        )
    )


def plot(result: dict, out: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    points = curve_points(result["training"].values())
    if points:
        fig, ax = plt.subplots(figsize=(7, 4.2))
        plot_curves(ax, {a: points[a] for a in ARMS if a in points}, "unguided KID x 1000 (500 samples)")
        targets = target_kid()
        if targets:
            ax.axhline(statistics.mean(targets.values()), color="k", ls="--", lw=1, label="embedded default, final")
            ax.legend(fontsize=7)
        ax.set(yscale="log", title="During training (band: lowest to highest seed)")
        fig.tight_layout()
        fig.savefig(out / "kid_during_training.png", dpi=110)
        plt.close(fig)
    if result["scores"]:
        fig, ax = plt.subplots(figsize=(8, 3.8))
        arms = [a for a in ARMS if guided(result, a)]
        plot_by_seed(ax, ["guided, NFE 25"], {a: [guided(result, a)] for a in arms}, "KID x 1000")
        ax.set_title("Each arm at the end, guided")
        fig.tight_layout()
        fig.savefig(out / "kid_by_seed.png", dpi=110)
        plt.close(fig)


def save(out: Path, result: dict) -> None:
    save_results(out, result, report(result))


# ----------------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> dict:
    p = study_arguments(__doc__, ["train", "score"], SCALES, "cpu", "experiments/results/backbone")
    p.add_argument("--arms", nargs="+", choices=list(ARMS), default=list(ARMS))
    args = p.parse_args(argv)
    sc = SCALES[args.scale]
    out = Path(args.out)
    result, seeds, lock = open_study(args, sc, "backbone", {"training": {}, "scores": []})  # lock: held to the end
    if not args.report_only:
        out, reference, extractor = start_scoring(args)
        torch.manual_seed(0)
        if args.part in ("train", "all"):
            part_train(sc, out, reference, seeds, args.arms, result)
        if args.part in ("score", "all"):
            part_score(sc, out, reference, extractor, seeds, args.arms, result)
    out.mkdir(parents=True, exist_ok=True)
    save(out, result)
    plot(result, out)
    return result


if __name__ == "__main__":
    from moh_dit.cli.common import run_cli

    run_cli(main)  # bad input: one line, as the commands say it
