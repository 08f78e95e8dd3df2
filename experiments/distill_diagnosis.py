r"""Why the distilled students of moh-dit 0.5 collapse at one step and get worse with longer training: five
measurements on the distillation's own code (docs/objective.md#the-diagnosis).

    times       the drawn (t, r) of each recipe: a histogram, and the share near the intervals the few-step sampler
                evaluates (1 -> 0; 1 -> 0.5 and 0.5 -> 0): t and r each within 0.1 of the interval's ends; with the
                closed form of two logit-normal draws (2 P(a > 0.9) P(b < 0.1))
    collapse    one-step samples of a student: the spread of each class's pixels (std over its samples, mean over
                pixels) against the teacher's 25-step samples and the data, and their distance to the teacher's single
                guided Euler step and to its 25-step sample, from the same noise
    derivative  at the student's checkpoints: its finite-difference du/dt against the exact JVP (relative error), and
                the size of the derivative's term (t - r) du/dt against the teacher's velocity
    updates     at the same checkpoints: the gradient of the loss from the r = t samples against that of the intervals
                (norms, cosine, each one's share of the update's projection)
    fit         a trajectory student's samples against the teacher's trajectory ends, on trajectories it trained on and
                on new noise, with its EMA and raw weights (too few trajectories, or too little training?)
    ema         the share of the start's weights (the teacher's, or the student it started from) the EMA still holds at
                the end, over the EMA's own updates (a DMD2 generator's: one per generator update; its decay rule, exactly)
    weights     the run's EMA (its exported pipeline) and its raw weights at the same step (its last checkpoint's),
                each scored as the distillation study scores a student (class-balanced samples at 1 and 2 steps,
                KID on the project's classifier features of the test split, recall): is the EMA a lag or an anchor?
    consistency where ECT's target for the one-step jump points, at the start and the end of a flow-map run: the direct
                jump's and each fixed step's target image's distance to the teacher's 25-step end
                (experiments/distill_diagnosis_ect.py)
    discriminator  a DMD2 run's discriminator head at its last checkpoint: how well it tells the training split's
                images from one-step samples at fixed noise times (ROC area), and how fast it learns that alone
    variety     where a two-step DMD2 or SiD student loses the teacher's recall: each of its two jumps swapped alone
                for the teacher's guided ODE over that half and for the jump of the student it started from, scored
                as the study scores a student (KID, precision, recall, each class's recall; --samples each;
                --generators-only: the student's and its start's compositions alone, a minute instead of half an
                hour); runs of one arm at several seeds (ARM-seedN) are read side by side, each composition paired
                with the student alone (experiments/distill_diagnosis_variety.py)

    python -m experiments.distill_diagnosis --part times
    python -m experiments.distill_diagnosis --part collapse derivative updates ema --run RUN   # a distillation run

Writes {RESULTS.md, results.json, times.png} into --out: by default experiments/results/distill_diagnosis (the
committed study's, which `--part times` and the study's own runs wrote) without --run, and runs/distill_diagnosis/RUN
with one (a diagnosis of another run never writes over the study's). A part that does not apply to the run's method
(derivative and updates read MeanFlow's interval loss: meanflow and trajectory students; fit a trajectory student's
set) is refused in one line before anything is computed.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import statistics
from pathlib import Path
from typing import Any

import torch

from experiments.arms import run_config
from experiments.common import ROOT
from experiments.distill_diagnosis_ect import part_consistency
from experiments.distill_diagnosis_ema import part_ema, part_weights
from experiments.distill_diagnosis_gan import part_discriminator
from experiments.distill_diagnosis_report import INTERVALS, feature_spread, report, rms, roughness, spread
from experiments.distill_diagnosis_runs import run_parts, student_at, teacher_euler_end, the_objective
from experiments.distill_diagnosis_variety import part_variety
from experiments.report import pyplot
from moh_dit.files import atomic_write_text, json_text
from moh_dit.training.config import load_config

OUT = ROOT / "experiments" / "results" / "distill_diagnosis"
# the methods each part reads (None: every distillation)
APPLIES = {"collapse": None, "derivative": ("meanflow", "trajectory"), "updates": ("meanflow", "trajectory"),
           "fit": ("trajectory",), "ema": None, "weights": None, "discriminator": ("dmd2",),
           "consistency": ("meanflow", "trajectory", "ect"), "variety": ("dmd2", "sid")}  # fmt: skip
WINDOW = 0.1  # "near" an interval: t and r each within this of its ends
# the recipes whose draws are measured: (config, overrides)
RECIPES = {
    "flow twin's student (0.5)": ("experiments/configs/distill_v05.yaml", []),
    "default's student (0.5)": ("experiments/configs/distill_ddpm_v05.yaml", []),
    "MeanFlow distillation (0.6)": ("configs/fashion_mnist_moh_distill.yaml", []),
    "trajectory distillation (0.6)": ("configs/fashion_mnist_moh_distill_trajectory.yaml", []),
}
DRAWS = 1_000_000


# ----------------------------------------------------------------------------------------------------
# times
# ----------------------------------------------------------------------------------------------------
def objective_of_config(config_path: str, overrides: list[str]):
    """The distill objective a config trains (its method, coverage and loss), without a teacher."""
    from moh_dit.training.objective import run_objective

    config = load_config(ROOT / config_path, ["distill.teacher=unused", *overrides])
    record = {"name": "distill", "method": config.distill.method, "time": "moh-dit"}
    return run_objective(config, record, learn_sigma=False)


def near(t: torch.Tensor, r: torch.Tensor, interval: tuple[float, float]) -> torch.Tensor:
    return ((t - interval[0]).abs() <= WINDOW) & ((r - interval[1]).abs() <= WINDOW) & (t > r)


def logit_normal_closed_form(mean: float, std: float) -> float:
    """P(max > 0.9 and min < 0.1) of two independent logit-normal draws: 2 P(a > 0.9) P(b < 0.1)."""
    z = math.log(0.9 / 0.1)
    phi = statistics.NormalDist(mean, std).cdf
    return 2 * (1 - phi(z)) * phi(-z)


def part_times(result: dict, out: Path = OUT) -> None:
    rows, plotted = {}, {}
    for name, (path, overrides) in RECIPES.items():
        objective = objective_of_config(path, overrides)
        g = torch.Generator().manual_seed(0)
        t, r = objective.draw_times(DRAWS, g)
        intervals = t > r
        row = {
            "recipe": objective.coverage.describe(),
            "interval_share": float(intervals.float().mean()),
            **{k: float(near(t, r, v).float().mean()) for k, v in INTERVALS.items()},
            **{
                f"{k} of intervals": float(near(t, r, v).float().sum() / intervals.sum()) for k, v in INTERVALS.items()
            },
        }
        cov = objective.coverage
        if cov.t.sampling == "logit-normal" and cov.r is None and not cov.grid_share:
            row["closed form 1 -> 0 of intervals"] = logit_normal_closed_form(cov.t.mean, cov.t.std)
        rows[name] = row
        plotted[name] = (t[intervals][:200_000], r[intervals][:200_000])
    result["times"] = rows
    plt = pyplot()
    if plt is not None:
        fig, axes = plt.subplots(1, len(plotted), figsize=(3.2 * len(plotted), 3.2), squeeze=False)
        for ax, (name, (t, r)) in zip(axes[0], plotted.items()):
            ax.hist2d(t.numpy(), r.numpy(), bins=40, range=[[0, 1], [0, 1]], cmap="magma", norm="log")
            for a, b in INTERVALS.values():
                ax.plot([a], [b], "c+", markersize=12)
            ax.set(title=name, xlabel="t (start)", ylabel="r (end)")
            ax.title.set_fontsize(8)
        fig.tight_layout()
        fig.savefig(out / "times.png", dpi=110)


# ----------------------------------------------------------------------------------------------------
# A run: its config, teacher, student checkpoints
# ----------------------------------------------------------------------------------------------------
def checkpoint_steps(run: Path) -> list[int]:
    from moh_dit.run_folder import checkpoint_step

    return sorted(checkpoint_step(p) for p in (run / "checkpoints").glob("step-*"))


def a_batch(config, data, objective, n: int, seed: int = 0):
    """``n`` training images with the objective's draws of noise and times, from a fixed generator."""
    g = torch.Generator().manual_seed(seed)
    n = min(n, len(data.dataset))  # a run on a subset of the data (data.subset_per_class) may hold fewer
    index = torch.randperm(len(data.dataset), generator=g)[:n]
    x, y = zip(*(data.dataset[int(i)] for i in index))
    x, y = torch.stack([torch.as_tensor(v) for v in x]), torch.as_tensor(y)
    x0 = data.clean_latents(x, torch.zeros(n, dtype=torch.bool), g, torch.device("cpu"))
    return objective.noised(x0, g, torch.device("cpu")), y


# ----------------------------------------------------------------------------------------------------
# collapse
# ----------------------------------------------------------------------------------------------------
@torch.no_grad()
def part_collapse(result: dict, run: Path, step: int | None = None, per_class: int = 50) -> None:
    from moh_dit.training.distill import teacher_velocity

    config, data, teacher = run_parts(run)
    student = student_at(run, step, ema=True)
    objective = the_objective(config, student)
    classes = data.num_classes
    y = torch.arange(classes).repeat_interleave(per_class)
    z = torch.randn(len(y), *data.dataset[0][0].shape, generator=torch.Generator().manual_seed(1))
    one = torch.ones(len(y))
    velocity = teacher_velocity(teacher, "no", torch.device("cpu"))
    student_1 = z - objective.average_velocity(student, z, one, 0 * one, y).sample
    half = z - 0.5 * objective.average_velocity(student, z, one, 0.5 * one, y).sample
    student_2 = half - 0.5 * objective.average_velocity(student, half, 0.5 * one, 0 * one, y).sample
    euler_1 = z - velocity(z, one, y)
    teacher_25 = teacher_euler_end(velocity, z, y)
    count = min(2000, len(data.dataset))  # a run on a subset of the data (data.subset_per_class) has fewer
    real_x, real_y = zip(*(data.dataset[i] for i in range(count)))
    real = data.clean_latents(torch.stack([torch.as_tensor(v) for v in real_x]), torch.zeros(count, dtype=torch.bool),
                              torch.Generator(), torch.device("cpu"))  # fmt: skip
    from experiments.common import classifier_features

    extractor = classifier_features()
    sets = {
        "student, 1 step": (student_1, y),
        "student, 2 steps": (student_2, y),
        "teacher, one guided Euler step": (euler_1, y),
        "teacher, 25 Euler steps": (teacher_25, y),
        "data": (real, torch.as_tensor(real_y)),
    }
    result.setdefault("collapse", {})[str(step or "last")] = {
        "run": str(run),
        "spread": {name: spread(images, labels) for name, (images, labels) in sets.items()},
        "feature spread": {name: feature_spread(images, labels, extractor) for name, (images, labels) in sets.items()},
        "roughness": {name: roughness(images) for name, (images, _) in sets.items()},
        "distance": {
            "student 1 step to the teacher's one Euler step": rms(student_1, euler_1),
            "student 1 step to the teacher's 25 steps": rms(student_1, teacher_25),
            "teacher's one Euler step to its 25 steps": rms(euler_1, teacher_25),
            "student 2 steps to the teacher's 25 steps": rms(student_2, teacher_25),
        },
    }


# ----------------------------------------------------------------------------------------------------
# derivative and updates, along the run's checkpoints
# ----------------------------------------------------------------------------------------------------
def part_derivative(result: dict, run: Path, n: int = 64) -> None:
    from moh_dit.objectives.meanflow import MeanFlow

    config, data, teacher = run_parts(run)
    rows = []
    for step in checkpoint_steps(run):
        student = student_at(run, step, ema=False)
        objective = the_objective(config, student)
        noised, y = a_batch(config, data, objective, n)
        t, r = noised.terms["t"], noised.terms["r"]
        moving = t > r
        v = teacher.velocity(noised.x_t, t, y, None, contextlib.nullcontext)
        _, fd = objective.finite_difference(student, noised, v, y, None, contextlib.nullcontext)
        _, exact = MeanFlow.velocity_and_derivative(objective, student, noised, v, y, None, contextlib.nullcontext)
        error = (fd - exact).flatten(1).norm(dim=1) / exact.flatten(1).norm(dim=1).clamp(min=1e-12)
        span = (t - r).reshape(-1, 1, 1, 1)
        term = (span * exact).flatten(1).pow(2).mean(dim=1).sqrt()
        fd_term = (span * fd).flatten(1).pow(2).mean(dim=1).sqrt()
        rows.append(
            {
                "step": step,
                "fd_vs_jvp_relative_error_median": float(error[moving].median()),
                "fd_vs_jvp_relative_error_max": float(error[moving].max()),
                "jvp_term_rms": float(term[moving].mean()),
                "fd_term_rms": float(fd_term[moving].mean()),
                "teacher_velocity_rms": float(v.flatten(1).pow(2).mean(dim=1).sqrt().mean()),
            }
        )
    result["derivative"] = {"run": str(run), "fd_eps": objective.fd_eps, "rows": rows}


def part_updates(result: dict, run: Path, n: int = 64) -> None:
    config, data, teacher = run_parts(run)
    rows = []
    for step in checkpoint_steps(run):
        student = student_at(run, step, ema=False).train()
        objective = the_objective(config, student)
        noised, y = a_batch(config, data, objective, n, seed=1)
        equal = noised.terms["t"] == noised.terms["r"]
        losses, _ = objective.forward_losses(
            student, noised, y, torch.zeros_like(y), False, contextlib.nullcontext, {"teacher": teacher}, step
        )
        grads = []
        for part in (equal, ~equal):
            student.zero_grad()
            (losses.loss * part).sum().div(len(y)).backward(retain_graph=True)
            grads.append(torch.cat([p.grad.flatten() for p in student.parameters() if p.grad is not None]).clone())
        g_eq, g_int = grads
        total = g_eq + g_int
        rows.append(
            {
                "step": step,
                "norm_r_eq_t": float(g_eq.norm()),
                "norm_intervals": float(g_int.norm()),
                "cosine": float(torch.nn.functional.cosine_similarity(g_eq, g_int, dim=0)),
                "share_r_eq_t": float(g_eq @ total / total.dot(total)),
                "share_intervals": float(g_int @ total / total.dot(total)),
            }
        )
    result["updates"] = {"run": str(run), "rows": rows}


@torch.no_grad()
def part_fit(result: dict, run: Path, n: int = 256) -> None:
    """A trajectory student against its targets: its 1- and 2-step samples' distance (RMS per pixel) to the teacher's
    trajectory end, on trajectories it trained on and on new noise (the teacher's sampler run now), with its EMA and
    its raw weights: a gap between the two sets is too few trajectories; none, too little training."""
    from moh_dit.training.distill import StoredTrajectories, run_teacher_sampler, teacher_velocity

    config, data, teacher = run_parts(run)
    given = config.distill.trajectories
    stored = StoredTrajectories(Path(given) if given else run / "trajectories", teacher.computes())
    pick = torch.arange(n) / stored.count
    last = torch.full((n,), len(stored.plan.grid) - 1)
    seen_noise, seen_end, seen_y = stored.pairs({"pick": pick.double()}, torch.zeros(n, dtype=torch.long), last, "cpu")
    g = torch.Generator().manual_seed(12345)
    new_y = torch.randint(data.num_classes, (n,), generator=g)
    new_noise = torch.randn(seen_noise.shape, generator=g)
    velocity = teacher_velocity(teacher, "no", torch.device("cpu"))
    new_end = run_teacher_sampler(velocity, new_noise, new_y, stored.plan.grid, stored.plan.sampler)[:, -1]
    rows = {}
    for weights in ("ema", "raw"):
        student = student_at(run, None, ema=weights == "ema")
        objective = the_objective(config, student)
        one = torch.ones(n)
        for name, (z, end, y) in {
            "trained on": (seen_noise, seen_end, seen_y),
            "new": (new_noise, new_end, new_y),
        }.items():
            x1 = z - objective.average_velocity(student, z, one, 0 * one, y).sample
            half = z - 0.5 * objective.average_velocity(student, z, one, 0.5 * one, y).sample
            x2 = half - 0.5 * objective.average_velocity(student, half, 0.5 * one, 0 * one, y).sample
            rows[f"{weights}, {name}"] = {"1 step": rms(x1, end), "2 steps": rms(x2, end)}
    result["fit"] = {"run": str(run), "trajectories": stored.count, "rows": rows}


def check_parts(parts: list[str], run: Path | None) -> None:
    """Refuse, in one line, a part that needs a run without one, and a part the run's method does not have."""
    if not set(parts) - {"times"}:
        return
    if run is None or not (run / "config.yaml").is_file():
        raise SystemExit(f"--part {' '.join(parts)} needs --run: a distillation run folder (got {run})")
    config = run_config(run)
    if config.objective.name != "distill":
        raise SystemExit(f"{run} is not a distillation (objective {config.objective.name}): nothing to diagnose")
    method = config.distill.method
    wrong = [p for p in parts if APPLIES.get(p) is not None and method not in APPLIES[p]]
    if wrong:
        fits = [p for p, methods in APPLIES.items() if methods is None or method in methods]
        raise SystemExit(
            f"--part {' '.join(wrong)} does not apply to {run}, a {method} student (for it: {', '.join(fits)})"
        )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    import json

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--part",
        nargs="+",
        choices=[
            "times",
            "collapse",
            "derivative",
            "updates",
            "fit",
            "ema",
            "weights",
            "discriminator",
            "consistency",
            "variety",
        ],
        default=["times"],
    )
    p.add_argument("--run", type=Path, default=None, help="a distillation run folder (every part but times)")
    p.add_argument("--step", type=int, default=None, help="collapse: the checkpoint at this step (default: the last)")
    p.add_argument("--samples", type=int, default=5000, help="weights, variety: samples per score (the study's 5000)")
    p.add_argument("--generators-only", action="store_true",
                   help="variety: only the student's and its start's compositions (no teacher ODE: about a minute)")  # fmt: skip
    p.add_argument("--out", type=Path, default=None,
                   help=f"where to write (default: {OUT.relative_to(ROOT)} without --run, runs/distill_diagnosis/RUN with it)")  # fmt: skip
    args = p.parse_args(argv)
    check_parts(args.part, args.run)
    out = args.out or (OUT if args.run is None else Path("runs") / "distill_diagnosis" / args.run.resolve().name)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "results.json"
    result = json.loads(path.read_text()) if path.is_file() else {}
    parts = {"times": lambda: part_times(result, out), "collapse": lambda: part_collapse(result, args.run, args.step),
             "derivative": lambda: part_derivative(result, args.run), "updates": lambda: part_updates(result, args.run),
             "fit": lambda: part_fit(result, args.run), "ema": lambda: part_ema(result, args.run),
             "weights": lambda: part_weights(result, args.run, out, args.samples),
             "discriminator": lambda: part_discriminator(result, args.run),
             "consistency": lambda: part_consistency(result, args.run),
             "variety": lambda: part_variety(result, args.run, args.samples, args.generators_only)}  # fmt: skip
    for part in args.part:
        parts[part]()
        atomic_write_text(path, json_text(result))
        atomic_write_text(out / "RESULTS.md", report(result))
    print(f"wrote {out / 'RESULTS.md'}")
    return result


if __name__ == "__main__":
    from moh_dit.cli.common import run_cli

    run_cli(main)
