"""The distillation study's settings (``experiments/distill.py`` trains and scores them) and its report: RESULTS.md
and its plots."""

from __future__ import annotations

from pathlib import Path

from experiments.common import describe_reference
from experiments.report import (
    by_seed_table,
    curve_points,
    fmt_values,
    mean_ci,
    note_lines,
    paired,
    paired_readings,
    plot_by_seed,
    plot_curves,
    pyplot,
)
from moh_dit.logs import plural

__all__ = ["KINDS", "STUDENT_STEPS", "TEACHER_STEPS", "GOAL", "by_seed", "time_fractions", "report", "plot"]

KINDS = ("flow", "ddpm")  # the teachers: the flow twin, the embedded default
STUDENT_STEPS, TEACHER_STEPS = (1, 2, 4), 25
# the goal: 2 steps within 1.25x the teacher's 25-step KID with recall within 0.05, 1 step within 2x, for at
# most half the teacher's training time
GOAL = {"kid_ratio": {2: 1.25, 1: 2.0}, "recall_gap": 0.05, "time_fraction": 0.5}
NAMES = {"flow": "the flow twin", "ddpm": "the embedded default (DDPM)"}


def _steps(count: int) -> str:
    return f"{count} step" + ("s" if count != 1 else "")


def by_seed(rows: list[dict], arm: str, steps: int, key: str = "kid") -> dict[int, float]:
    return {r["seed"]: r[key] for r in rows if (r["arm"], r["steps"]) == (arm, steps) and key in r}


def time_fractions(result: dict, arm: str, kind: str) -> dict[int, float]:
    """Each seed's training time of ``arm`` over its teacher's: each run's steps over the median images/s its own log
    measured (the same batch of 16 images a step)."""
    training, fractions = result["training"], {}
    for run in training.values():
        if run["arm"] != arm or not run.get("median_images_per_s"):
            continue
        teacher = training.get(f"{kind}-seed{run['seed']}")
        if teacher and teacher.get("median_images_per_s"):
            student_time = run["steps"] / run["median_images_per_s"]
            fractions[run["seed"]] = student_time / (teacher["steps"] / teacher["median_images_per_s"])
    return fractions


def _meanflow_by_seed(result: dict, steps: int, key: str = "kid") -> dict[int, float]:
    return {r["seed"]: r[key] for r in result.get("meanflow", []) if r["steps"] == steps}


def _goal_lines(result: dict, kind: str) -> list[str]:
    """Whether the students of ``kind`` meet the issue's goal, seed by seed and on the mean."""
    rows, student, lines = result["scores"], f"distill-{kind}", []
    teacher_kid = by_seed(rows, kind, TEACHER_STEPS)
    for steps, limit in sorted(GOAL["kid_ratio"].items(), reverse=True):
        ratios = [by_seed(rows, student, steps)[s] / teacher_kid[s] for s in sorted(teacher_kid)
                  if s in by_seed(rows, student, steps)]  # fmt: skip
        if ratios:
            met = sum(r <= limit for r in ratios)
            lines.append(
                f"- {_steps(steps)}: KID {fmt_values(ratios)} x the teacher's (goal <= {limit:g}x; "
                f"met at {met} of {len(ratios)} seeds)."
            )
    gaps = paired(by_seed(rows, student, 2, "recall"), by_seed(rows, kind, TEACHER_STEPS, "recall"))
    if gaps:
        met = sum(abs(g) <= GOAL["recall_gap"] or g > 0 for g in gaps)
        lines.append(
            f"- 2 steps: recall {fmt_values(gaps, 3)} from the teacher's (goal: within {GOAL['recall_gap']:g}; met at "
            f"{met} of {len(gaps)} seeds)."
        )
    fractions = list(time_fractions(result, student, kind).values())
    if fractions:
        met = sum(f <= GOAL["time_fraction"] for f in fractions)
        lines.append(
            f"- training time {fmt_values(fractions, 2)} of the teacher's (goal <= {GOAL['time_fraction']:g}; met at "
            f"{met} of {len(fractions)} seeds)."
        )
    return lines


def _ablation_lines(result: dict, kind: str) -> list[str]:
    """The table of ``kind``'s student against its ablations at seed 0 (arms ``distill-{kind}-*``)."""
    rows, training, student = result["scores"], result["training"], f"distill-{kind}"
    ablations = sorted(
        {r["arm"] for r in rows if r["arm"].startswith(student + "-")}
        | {r["arm"] for r in training.values() if r["arm"].startswith(student + "-") and "diverged" in r}
    )
    if not ablations:
        return []
    lines = [
        "",
        f"## Ablations: the student of {NAMES[kind]}, seed 0",
        "",
        "| student | 1 step KID | 2 steps KID | 4 steps KID | 2 steps recall | training images/s | time / teacher's |",
        "|---|---|---|---|---|---|---|",
    ]
    for arm in [student, *ablations]:
        run = training.get(f"{arm}-seed0", {})
        if "diverged" in run:
            lines.append(f"| {arm} | diverged: {run['diverged']} |||||")
            continue
        kids = [by_seed(rows, arm, s).get(0) for s in STUDENT_STEPS]
        recall = by_seed(rows, arm, 2, "recall").get(0)
        fraction = time_fractions(result, arm, kind).get(0)
        cells = [*(f"{k:.2f}" if k is not None else "-" for k in kids)]
        cells += [f"{recall:.3f}" if recall is not None else "-", f"{run.get('median_images_per_s') or 0:.1f}"]
        cells.append(f"{fraction:.2f}" if fraction is not None else "-")
        lines.append(f"| {arm} | " + " | ".join(cells) + " |")
    return lines


def report(result: dict) -> str:
    protocol, rows = result["protocol"], result["scores"]
    lines = [
        "# Distillation: 1, 2 and 4 steps from a trained model",
        "",
        f"Written by `python -m experiments.distill` (scale {protocol['scale']}). Teachers: the embedded default "
        "(DDPM) and its flow twin (MoH-DiT-Ti/4-75 at width 128, batch 16 x 8300 steps); students: "
        "configs/fashion_mnist_moh_distill.yaml (the flow twin) and fashion_mnist_moh_distill_ddpm.yaml (the default: "
        "uniform times, lr 1e-3) from each teacher at the same seed (830 steps, finite differences, the teacher's time "
        "embedding kept). "
        f"KID x 1000 on the project's classifier features against the {describe_reference(protocol)}; "
        f"{protocol['samples']} class-balanced samples per setting; across seeds, means with 95% t-intervals and "
        "differences paired by seed. NFE: network evaluations per image (a CFG step counts its two halves).",
    ]
    curves = [r for r in result["training"].values() if r["arm"].startswith("distill-") and r.get("curve")]
    if curves:
        lines += [
            "",
            "## During training",
            "",
            "500 samples of the students' EMA weights at each evaluation, unguided (the teacher's guidance is folded "
            "in), in one step and in two: KID x 1000, mean over seeds [95% t] (n):",
            "",
            "| student | step | 1 step | 2 steps |",
            "|---|---|---|---|",
        ]
        one, two = curve_points(curves), curve_points(curves, "kid@2")
        for arm in sorted(one):
            for step in sorted(one[arm]):
                cells = [one[arm][step], two.get(arm, {}).get(step, {})]
                lines.append(
                    f"| {arm} | {step} | " + " | ".join(f"{fmt_values(c.values())} (n={len(c)})" for c in cells) + " |"
                )
    for kind in KINDS:
        teacher = by_seed(rows, kind, TEACHER_STEPS)
        student = f"distill-{kind}"
        if not teacher and not by_seed(rows, student, 1):
            continue
        lines += ["", f"## {NAMES[kind]}: students at 1, 2 and 4 steps against the teacher at {TEACHER_STEPS}", ""]
        table = [((student, str(s)), by_seed(rows, student, s), teacher) for s in STUDENT_STEPS]
        table.append(((f"teacher ({kind})", str(TEACHER_STEPS)), teacher, None))
        if kind == "flow":
            table += [(("MeanFlow from scratch", str(s)), _meanflow_by_seed(result, s), teacher) for s in (1, 2, 4)]
        lines += by_seed_table(("model", "steps"), [r for r in table if r[1]], f"the teacher at {TEACHER_STEPS}")
        lines += [
            "",
            "| model | steps | NFE | FID | precision | recall | s / image |",
            "|---|---|---|---|---|---|---|",
        ]
        shown = [(student, s, rows) for s in STUDENT_STEPS] + [(kind, TEACHER_STEPS, rows)]
        for arm, steps, source in shown:
            if by_seed(source, arm, steps):
                cells = [f"{max(by_seed(source, arm, steps, 'nfe').values()):g}"]
                cells += [
                    fmt_values(by_seed(source, arm, steps, k).values(), d)
                    for k, d in (("fid", 1), ("precision", 3), ("recall", 3), ("seconds_per_image", 4))
                ]
                lines.append(f"| {arm} | {steps} | " + " | ".join(cells) + " |")
        lines += ["", "Against the goal (the issue's):", "", *_goal_lines(result, kind)]
        lines += [
            "",
            *paired_readings(
                [(f"{student}, {_steps(s)} - teacher, KID", by_seed(rows, student, s), teacher) for s in STUDENT_STEPS]
                + [
                    (
                        f"{student}, {_steps(s)} - MeanFlow from scratch, KID",
                        by_seed(rows, student, s),
                        _meanflow_by_seed(result, s),
                    )
                    for s in STUDENT_STEPS
                    if kind == "flow"
                ]  # fmt: skip
            ),
        ]
    for kind in KINDS:
        lines += _ablation_lines(result, kind)
    teachers = [r for r in result["training"].values() if r["arm"] in KINDS]
    if teachers:
        speeds = {arm: mean_ci([r["median_images_per_s"] for r in result["training"].values() if r["arm"] == arm])
                  for arm in sorted({r["arm"] for r in result["training"].values()})}  # fmt: skip
        lines += ["", "## Training speed (images/s, median of each run's log; mean over runs)", ""]
        lines += [
            f"- {arm}: {stat['mean']:.1f} ({plural(len(stat['values']), 'run')})" for arm, stat in speeds.items()
        ]
    lines += note_lines(result)
    return "\n".join(lines) + "\n"


def plot(result: dict, out: Path) -> None:
    """distill_kid.png: KID by steps for each teacher's students, the teacher and MeanFlow from scratch; and the
    students' curves during training."""
    plt = pyplot()
    if plt is None or not result["scores"]:
        return
    rows = result["scores"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for ax, kind in zip(axes[:2], KINDS):
        groups = [_steps(s) for s in STUDENT_STEPS] + [f"{TEACHER_STEPS} (teacher)"]
        arms = {
            f"distill-{kind}": [by_seed(rows, f"distill-{kind}", s) for s in STUDENT_STEPS] + [{}],
            "teacher": [{}] * len(STUDENT_STEPS) + [by_seed(rows, kind, TEACHER_STEPS)],
        }
        if kind == "flow":
            arms["MeanFlow from scratch"] = [_meanflow_by_seed(result, s) for s in STUDENT_STEPS] + [{}]
        plot_by_seed(ax, groups, arms, "KID x 1000 (1000 samples)")
        ax.set_title(NAMES[kind])
    curves = [r for r in result["training"].values() if r["arm"].startswith("distill-") and r.get("curve")]
    if curves:
        plot_curves(axes[2], curve_points(curves), "KID x 1000, 1 step (500 samples)")
        axes[2].set_title("students during training")
    fig.tight_layout()
    fig.savefig(out / "distill_kid.png", dpi=120)
    plt.close(fig)
