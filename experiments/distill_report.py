"""The distillation study's settings (``experiments/distill.py`` trains and scores them), the cost of each
distillation, and its report: RESULTS.md and its plots.

What a distillation costs is counted from its run folder against what its teacher's training cost. In network
evaluations at the model's size (a training step's forward and backward count as three forwards): the teacher's
evaluations while the student trains (its guided targets; the run's log counts them exactly), the teacher's
evaluations that recorded the trajectories (the set's manifest), and the student's own passes (its objective's count
per image times the images it saw). In images: the student's training images and the trajectories. In wall-clock: the
student's training steps over its median speed, and the trajectories' process-seconds. The teacher's training: its
images times three, and its steps over its median speed.
"""

from __future__ import annotations

import json
from pathlib import Path

from experiments.arms import run_config
from experiments.common import describe_reference
from experiments.report import (
    by_seed_table,
    curve_points,
    fmt_values,
    note_lines,
    paired,
    paired_readings,
    plot_by_seed,
    plot_curves,
    pyplot,
)

__all__ = [
    "KINDS",
    "METHODS",
    "STUDENT_STEPS",
    "TEACHER_STEPS",
    "GAN",
    "GOAL",
    "GOALS",
    "by_seed",
    "costs",
    "run_cost",
    "report",
    "plot",
]

KINDS = ("flow", "ddpm")  # the teachers: the flow twin, the embedded default
METHODS = ("meanflow", "trajectory", "cmt", "dmd2", "dmd2t", "v05")  # the students' arms, {method}-{kind}
STUDENT_STEPS, TEACHER_STEPS = (1, 2, 4), 25
# the few-step goal: 2 steps within 1.25x the teacher's 25-step KID with recall within 0.05, 1 step within 2x, the
# whole distillation within the teacher's own training cost
GOAL = {"name": "few steps", "kid_ratio": {2: 1.25, 1: 2.0}, "recall_steps": 2, "recall_gap": 0.05, "cost_ratio": 1.0}
# DMD2's: 1 step within 1.5x the teacher's 25-step KID with recall within 0.1 (no cost goal: the cost is reported)
ONE_STEP_GOAL = {"name": "one step", "kid_ratio": {1: 1.5}, "recall_steps": 1, "recall_gap": 0.1, "cost_ratio": None}
GOALS = {"dmd2": ONE_STEP_GOAL, "dmd2t": ONE_STEP_GOAL}  # a method's goal; GOAL otherwise
# seed 0 of the flow twin's DMD2 students with DMD2's GAN term (FastGen's weight), against the same without
GAN = {"dmd2-flow-gan": "dmd2-flow", "dmd2t-flow-gan": "dmd2t-flow"}
NAMES = {"flow": "the flow twin", "ddpm": "the embedded default (DDPM)"}
STARTS_FROM = {"cmt": "trajectory", "dmd2t": "trajectory"}  # students started from another method's: costs add up


# ----------------------------------------------------------------------------------------------------
# Costs
# ----------------------------------------------------------------------------------------------------
FORWARDS_PER_TRAINING_IMAGE = 3.0  # a forward and its backward


def _last_values(run: Path, *keys: str) -> dict:
    """Each of ``keys`` as the last record of the run's log that has it (one read of the log; absent keys left out)."""
    path = run / "metrics.jsonl"
    found = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            record = json.loads(line) if line.strip() else {}
            found |= {key: record[key] for key in keys if key in record}
    return found


def _trajectory_manifest(run: Path) -> dict | None:
    from moh_dit.training.objective import run_objective_class

    config = run_config(run) if (run / "config.yaml").is_file() else None
    # any method that learns from a set of trajectories (trajectory, rcm, dmd2's regression): its table says so
    if config is None or "trajectories" not in run_objective_class(config).frozen_models_for(vars(config.distill)):
        return None
    folder = (
        Path(config.distill.trajectories)
        if config.distill.trajectories not in (None, "online")
        else run / "trajectories"
    )
    start = config.distill.student_from
    if start is not None and (Path(start) / "trajectories").resolve() == folder.resolve():
        return None  # the set of the student this stage starts from: that student's cost counts it
    path = folder / "trajectories.json"
    return json.loads(path.read_text()) if path.is_file() else None


def _student_forwards(run: Path) -> float | None:
    """The student's passes per training image, from its objective as the run trained it."""
    from moh_dit.training.objective import run_objective

    pipeline = run / "pipeline" / "transformer" / "config.json"
    if not (run / "config.yaml").is_file() or not pipeline.is_file():
        return None
    record = json.loads(pipeline.read_text()).get("objective")
    objective = run_objective(run_config(run), record, learn_sigma=False)
    return getattr(objective, "student_forwards", objective.training_forwards)()


def run_cost(run: Path) -> dict:
    """A student's cost from its run folder (``{}`` when it has none yet)."""
    # the training records count the teacher's evaluations; the final evaluation record has samples_seen but not them
    spent = ("teacher_evaluations", "network_evaluations", "generator_updates", "fake_score_updates")
    last = _last_values(run, "samples_seen", *spent)
    if "samples_seen" not in last:
        return {}
    images = last["samples_seen"]
    # the networks' passes as the run counted them (moh-dit 0.7); a run before counts its objective's per image
    per_image = _student_forwards(run) if "network_evaluations" not in last else None
    counted = last.get("network_evaluations", images * per_image if per_image is not None else None)
    cost = {
        "student_images": images,
        "student_forwards": counted,
        "teacher_evaluations": last.get("teacher_evaluations", 0),
    } | {key: last[key] for key in ("generator_updates", "fake_score_updates") if key in last}
    manifest = _trajectory_manifest(run)
    if manifest is not None:
        cost |= {
            "trajectories": manifest["cost"]["images"],
            "trajectory_evaluations": manifest["cost"]["evaluations"],
            "trajectory_seconds": manifest["cost"]["seconds"],
        }
    return cost


def teacher_cost(training: dict) -> dict:
    """The teacher's training cost from its study record (steps, median images/s) at batch 16."""
    images = training["steps"] * 16
    return {"images": images, "forwards": images * FORWARDS_PER_TRAINING_IMAGE,
            "seconds": images / training["median_images_per_s"]}  # fmt: skip


def total_cost(record: dict, chain: list[dict] = ()) -> dict | None:
    """A student's whole distillation (with the students it started from, ``chain``: a cmt student's trajectory
    student): network evaluations, images and seconds."""
    parts = [*chain, record]
    if any("student_images" not in p or p.get("student_forwards") is None for p in parts):
        return None
    forwards = sum(
        p["student_forwards"] + p["teacher_evaluations"] + p.get("trajectory_evaluations", 0) for p in parts
    )
    images = sum(p["student_images"] + p.get("trajectories", 0) for p in parts)
    seconds = sum(
        p["steps"] * 16 / p["median_images_per_s"] + p.get("trajectory_seconds", 0.0)
        for p in parts
        if p.get("median_images_per_s")
    )
    return {"forwards": forwards, "images": images, "seconds": seconds}


# ----------------------------------------------------------------------------------------------------
# The report
# ----------------------------------------------------------------------------------------------------
def _steps(count: int) -> str:
    return f"{count} step" + ("s" if count != 1 else "")


def by_seed(rows: list[dict], arm: str, steps: int, key: str = "kid") -> dict[int, float]:
    return {r["seed"]: r[key] for r in rows if (r["arm"], r["steps"]) == (arm, steps) and key in r}


def _meanflow_by_seed(result: dict, steps: int, key: str = "kid") -> dict[int, float]:
    return {r["seed"]: r[key] for r in result.get("meanflow", []) if r["steps"] == steps and key in r}


def costs(result: dict, method: str, kind: str) -> dict[int, dict[str, float]]:
    """Each seed's whole distillation by ``method`` from the teacher ``kind``, as ratios to the teacher's training:
    network evaluations, images and seconds."""
    training, found = result["training"], {}
    for run in training.values():
        if run.get("arm") != f"{method}-{kind}":
            continue
        seed = run["seed"]
        start = STARTS_FROM.get(method)
        chain = [training.get(f"{start}-{kind}-seed{seed}", {})] if start else []
        whole, teacher = total_cost(run, chain), training.get(f"{kind}-seed{seed}")
        if whole is None or not teacher or not teacher.get("median_images_per_s"):
            continue
        base = teacher_cost(teacher)
        found[seed] = {"forwards": whole["forwards"] / base["forwards"], "images": whole["images"] / base["images"],
                       "seconds": whole["seconds"] / base["seconds"]}  # fmt: skip
    return found


def _goal_lines(result: dict, method: str, kind: str) -> list[str]:
    """Whether ``method``'s students of ``kind`` meet their goal (:data:`GOALS`), seed by seed."""
    rows, student, lines = result["scores"], f"{method}-{kind}", []
    goal = GOALS.get(method, GOAL)
    teacher_kid = by_seed(rows, kind, TEACHER_STEPS)
    for steps, limit in sorted(goal["kid_ratio"].items(), reverse=True):
        mine = by_seed(rows, student, steps)
        ratios = [mine[s] / teacher_kid[s] for s in sorted(teacher_kid) if s in mine]
        if ratios:
            met = sum(r <= limit for r in ratios)
            lines.append(f"- {_steps(steps)}: KID {fmt_values(ratios)} x the teacher's (goal <= {limit:g}x; met at "
                         f"{met} of {len(ratios)} seeds).")  # fmt: skip
    steps = goal["recall_steps"]
    gaps = paired(by_seed(rows, student, steps, "recall"), by_seed(rows, kind, TEACHER_STEPS, "recall"))
    if gaps:
        met = sum(g >= -goal["recall_gap"] for g in gaps)
        lines.append(f"- {_steps(steps)}: recall {fmt_values(gaps, 3)} from the teacher's (goal: within "
                     f"{goal['recall_gap']:g}; met at {met} of {len(gaps)} seeds).")  # fmt: skip
    spent = costs(result, method, kind)
    if spent:
        ratios = [c["forwards"] for c in spent.values()]
        limit = goal["cost_ratio"]
        judged = (
            f"goal <= {limit:g}; met at {sum(r <= limit for r in ratios)} of {len(ratios)} seeds"
            if limit
            else "no goal"
        )
        lines.append(f"- cost: {fmt_values(ratios)} x the teacher's training in network evaluations, "
                     f"{fmt_values([c['seconds'] for c in spent.values()])} x in wall-clock ({judged}).")  # fmt: skip
    return [f"**{method}** (the {goal['name']} goal):", *lines] if lines else []


def _curve_lines(result: dict) -> list[str]:
    curves = [r for r in result["training"].values() if r.get("curve") and r["arm"].split("-")[0] in METHODS]
    if not curves:
        return []
    lines = ["", "## During training", "", "500 samples of the students' EMA weights at each evaluation, unguided (the "
             "teacher's guidance is folded in), in one step and in two: KID x 1000, mean over seeds [95% t] (n):", "",
             "| student | step | 1 step | 2 steps |", "|---|---|---|---|"]  # fmt: skip
    one, two = curve_points(curves), curve_points(curves, "kid@2")
    for arm in sorted(one):
        for step in sorted(one[arm]):
            cells = [one[arm][step], two.get(arm, {}).get(step, {})]
            lines.append(
                f"| {arm} | {step} | " + " | ".join(f"{fmt_values(c.values())} (n={len(c)})" for c in cells) + " |"
            )
    return lines


def _kind_lines(result: dict, kind: str) -> list[str]:
    rows = result["scores"]
    teacher = by_seed(rows, kind, TEACHER_STEPS)
    students = [m for m in METHODS if by_seed(rows, f"{m}-{kind}", 1)]
    if not teacher and not students:
        return []
    lines = ["", f"## {NAMES[kind]}: students at 1, 2 and 4 steps against the teacher at {TEACHER_STEPS}", ""]
    table = [
        ((f"{m}-{kind}", str(s)), by_seed(rows, f"{m}-{kind}", s), teacher) for m in students for s in STUDENT_STEPS
    ]
    table.append(((f"teacher ({kind})", str(TEACHER_STEPS)), teacher, None))
    table += [(("MeanFlow from scratch", str(s)), _meanflow_by_seed(result, s), teacher) for s in STUDENT_STEPS]
    lines += by_seed_table(("model", "steps"), [r for r in table if r[1]], f"the teacher at {TEACHER_STEPS}")
    lines += ["", "| model | steps | NFE | FID | precision | recall | cost / teacher's (evaluations, images, time) |",
              "|---|---|---|---|---|---|---|"]  # fmt: skip
    shown = [(f"{m}-{kind}", s, m) for m in students for s in STUDENT_STEPS] + [(kind, TEACHER_STEPS, None)]
    for arm, steps, method in shown:
        if by_seed(rows, arm, steps):
            cells = [f"{max(by_seed(rows, arm, steps, 'nfe').values()):g}"]
            cells += [fmt_values(by_seed(rows, arm, steps, k).values(), d)
                      for k, d in (("fid", 1), ("precision", 3), ("recall", 3))]  # fmt: skip
            spent = costs(result, method, kind) if method else {}
            cells.append(", ".join(fmt_values([c[k] for c in spent.values()]) for k in ("forwards", "images", "seconds"))
                         if spent else "")  # fmt: skip
            lines.append(f"| {arm} | {steps} | " + " | ".join(cells) + " |")
    lines += ["", "Against the goal (the issue's):", ""]
    for method in students:
        lines += _goal_lines(result, method, kind)
    comparisons = [(f"{m}-{kind}, {_steps(s)} - MeanFlow from scratch, KID", by_seed(rows, f"{m}-{kind}", s),
                    _meanflow_by_seed(result, s)) for m in students for s in STUDENT_STEPS]  # fmt: skip
    return [*lines, "", *paired_readings(comparisons)]


def _per_seed(values: dict[int, float], seeds: list[int], spec: str) -> str:
    """``values`` seed by seed in the order of ``seeds`` ("a / b"; "-" for a seed without one)."""
    return " / ".join("-" if values.get(s) is None else format(values[s], spec) for s in seeds) or "-"


def _ablation_lines(result: dict) -> list[str]:
    return [line for kind in KINDS for line in _teacher_ablation_lines(result, kind)]


def _teacher_ablation_lines(result: dict, kind: str) -> list[str]:
    """The meanflow student of the ``kind`` teacher beside each of its ablations, seed by seed."""
    rows, training, student = result["scores"], result["training"], f"meanflow-{kind}"
    ablations = sorted({r["arm"] for r in training.values() if r.get("arm", "").startswith(student + "-")})
    if not ablations:
        return []
    seeds = sorted({r["seed"] for r in [*rows, *training.values()] if r.get("arm") in ablations})  # diverged too
    lines = ["", f"## Ablations: the meanflow student of {NAMES[kind]} with one stabiliser changed, seed by "
             f"seed ({', '.join(map(str, seeds))})", "",
             "| student | 1 step KID | 2 steps KID | 4 steps KID | 2 steps recall | KID at 1 step during training, "
             f"seed {seeds[0]} |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for arm in [student, *ablations]:
        diverged = [f"seed {s}: {training[f'{arm}-seed{s}']['diverged']}" for s in seeds
                    if "diverged" in training.get(f"{arm}-seed{s}", {})]  # fmt: skip
        if diverged:
            lines.append(f"| {arm} | diverged ({'; '.join(diverged)}) |||||")
            continue
        cells = [_per_seed(by_seed(rows, arm, s), seeds, ".2f") for s in STUDENT_STEPS]
        cells.append(_per_seed(by_seed(rows, arm, 2, "recall"), seeds, ".3f"))
        curve = training.get(f"{arm}-seed{seeds[0]}", {}).get("curve", [])
        lines.append(
            f"| {arm} | "
            + " | ".join(cells)
            + " | "
            + " / ".join(f"{p['kid']:.1f}" for p in curve if "kid" in p)
            + " |"
        )
    return lines


def _gan_lines(result: dict) -> list[str]:
    rows = result["scores"]
    pairs = [(arm, base) for arm, base in GAN.items() if by_seed(rows, arm, 1)]
    if not pairs:
        return []
    seeds = sorted({r["seed"] for r in rows if r["arm"] in GAN})
    lines = ["", f"## DMD2 with and without its GAN term, the flow twin, seed by seed ({', '.join(map(str, seeds))})",
             "", "| student | GAN term | 1 step KID | 2 steps KID | 1 step recall | 2 steps recall |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for arm, base in pairs:
        for name, gan in ((base, "without"), (arm, "with")):
            cells = [_per_seed(by_seed(rows, name, s, k), seeds, ".3g") for k in ("kid", "recall") for s in (1, 2)]
            lines.append(f"| {base} | {gan} | " + " | ".join(cells) + " |")
    return lines


def report(result: dict) -> str:
    from experiments.distill_dmd2_report import dmd2_lines, earlier_rows

    whole, result = result, result | {"scores": earlier_rows(result)}  # the earlier arms' tables
    protocol = result["protocol"]
    lines = [
        "# Distillation: 1, 2 and 4 steps from a trained model",
        "",
        f"Written by `python -m experiments.distill` (scale {protocol['scale']}). Teachers: the embedded default "
        "(DDPM) and its flow twin (MoH-DiT-Ti/4-75 at width 128, batch 16 x 8300 steps); students by each method "
        "(meanflow; trajectory; cmt: the trajectory student post-trained by MeanFlow; dmd2: DMD2 from the teacher; "
        "dmd2t: DMD2 from the trajectory student; v05: moh-dit 0.5's recipe) from each teacher at the same seed, "
        "3320 steps each (cmt and dmd2t: their configs' 415 and 830 on top of their trajectory student's). "
        f"KID x 1000 on the project's classifier features against the {describe_reference(protocol)}; "
        f"{result['scores'][0].get('samples', 1000) if result['scores'] else protocol['samples']} class-balanced samples "
        f"per setting (the DMD2 study below: {protocol['samples']}); across seeds, means with 95% t-intervals and "
        "differences paired by seed. NFE: network evaluations per image (a CFG step counts its two halves). Cost: "
        "the whole distillation (the teacher's evaluations for targets and trajectories, the student's passes, "
        "images, wall-clock) over the teacher's training (experiments/distill_report.py).",
    ]
    lines += _curve_lines(result)
    for kind in KINDS:
        lines += _kind_lines(result, kind)
    lines += _gan_lines(result)
    lines += _ablation_lines(result)
    lines += dmd2_lines(whole)
    lines += note_lines(result)
    return "\n".join(lines) + "\n"


def plot(result: dict, out: Path) -> None:
    """distill_kid.png: KID by steps for each teacher's students, the teacher and MeanFlow from scratch; and the
    students' one-step curves during training."""
    from experiments.distill_dmd2_report import earlier_rows

    plt = pyplot()
    rows = earlier_rows(result)  # the earlier arms' scores (the DMD2 study's: distill_cost.png)
    if plt is None or not rows:
        return
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    for ax, kind in zip(axes[:2], KINDS):
        groups = [_steps(s) for s in STUDENT_STEPS] + [f"{TEACHER_STEPS} (teacher)"]
        arms = {f"{m}-{kind}": [by_seed(rows, f"{m}-{kind}", s) for s in STUDENT_STEPS] + [{}] for m in METHODS
                if by_seed(rows, f"{m}-{kind}", 1)}  # fmt: skip
        arms["teacher"] = [{}] * len(STUDENT_STEPS) + [by_seed(rows, kind, TEACHER_STEPS)]
        arms["MeanFlow from scratch"] = [_meanflow_by_seed(result, s) for s in STUDENT_STEPS] + [{}]
        plot_by_seed(ax, groups, arms, "KID x 1000 (1000 samples)")
        ax.set_title(NAMES[kind])
        ax.set_yscale("log")
    curves = [r for r in result["training"].values() if r.get("curve") and r["arm"] in
              {f"{m}-{k}" for m in METHODS for k in KINDS}]  # fmt: skip
    if curves:
        plot_curves(axes[2], curve_points(curves), "KID x 1000, 1 step (500 samples)")
        axes[2].set_title("students during training")
        axes[2].set_yscale("log")
        axes[2].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "distill_kid.png", dpi=120)
    plt.close(fig)
