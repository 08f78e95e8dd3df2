"""The distillation diagnosis's ``consistency`` part (experiments/distill_diagnosis.py): where ECT's target for the
one-step jump points. ECT trains a flow map's jump from ``t`` to ``r`` towards one step of the teacher's guided velocity
to ``s = t - dt`` followed by the student's own jump from ``s``. For the one-step sampler's jump (1 -> 0), that target's
image is ``z_s - s u(z_s, s, 0)`` with ``z_s = z - dt v(z, 1)``. If it lies farther from the teacher's own ODE end than
the student's direct jump does, every update drags the one-step jump away from the teacher; the fixed step decides how
much of the target is the teacher's and how much the student's.

For the student a run started from (``distill.student_from``) and the run's last checkpoint, EMA weights each, from the
same noise and balanced labels: the RMS per pixel of the direct jump and of each step's target image to the teacher's
guided 25-step Euler end, and of each target image to the direct jump (how far the target asks the jump to move)."""

from __future__ import annotations

from pathlib import Path

import torch

__all__ = ["STEPS", "part_consistency", "consistency_row"]

STEPS = (0.01, 0.05, 0.1)  # ECT's fixed steps measured: its own 0.01 and the study's longer two


@torch.no_grad()
def consistency_row(objective, student, velocity, z: torch.Tensor, y: torch.Tensor, teacher_end: torch.Tensor) -> dict:
    """One student's distances (see the module docstring) from noise ``z`` with labels ``y``; ``velocity``: the
    teacher's guided velocity ``(z, t, y)``; ``teacher_end``: its 25-step end from ``z``."""
    from experiments.distill_diagnosis_report import rms

    one = torch.ones(len(y))
    direct = z - objective.average_velocity(student, z, one, 0 * one, y).sample.float()
    v = velocity(z, one, y).float()
    row = {"direct to the teacher": rms(direct, teacher_end)}
    for dt in STEPS:
        s = 1.0 - dt
        z_s = z - dt * v
        target = z_s - s * objective.average_velocity(student, z_s, s * one, 0 * one, y).sample.float()
        row[f"target dt={dt:g} to the teacher"] = rms(target, teacher_end)
        row[f"target dt={dt:g} to direct"] = rms(target, direct)
    return row


def part_consistency(result: dict, run: Path, per_class: int = 20) -> None:
    """The start's and the run's last checkpoint's rows (:func:`consistency_row`) on ``per_class`` noises per class."""
    from experiments.distill_diagnosis_runs import run_parts, student_at, teacher_euler_end, the_objective
    from moh_dit.training.distill import teacher_velocity

    config, data, teacher = run_parts(run)
    if config.distill.student_from is None:
        raise SystemExit(
            f"--part consistency compares a run with the student it started from; {run} started from none"
        )
    start = Path(config.distill.student_from)
    end = student_at(run, None, ema=True)
    objective = the_objective(config, end)
    y = torch.arange(data.num_classes).repeat_interleave(per_class)
    z = torch.randn(len(y), *data.dataset[0][0].shape, generator=torch.Generator().manual_seed(2))
    velocity = teacher_velocity(teacher, "no", torch.device("cpu"))
    teacher_end = teacher_euler_end(velocity, z, y).float()
    rows = {
        f"the start ({start.name})": consistency_row(
            objective, student_at(start, None, ema=True), velocity, z, y, teacher_end
        ),
        "the run's end": consistency_row(objective, end, velocity, z, y, teacher_end),
    }
    step = config.distill.ect_dt if config.distill.method == "ect" else None  # the section's default elsewhere
    result.setdefault("consistency", {})[run.name] = {"run": str(run), "samples": len(y), "ect_dt": step, "rows": rows}
