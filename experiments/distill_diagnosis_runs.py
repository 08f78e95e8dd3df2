"""A distillation run's pieces as the diagnosis parts read them (experiments/distill_diagnosis.py and its part
modules): its config, data and frozen teacher, a checkpoint's student, and the student's objective."""

from __future__ import annotations

from pathlib import Path

import torch

from experiments.arms import run_config

__all__ = ["run_parts", "student_at", "the_objective", "teacher_euler_end"]


def run_parts(run: Path):
    """The run's config, its data and its frozen teacher (on the CPU)."""
    from moh_dit.data.training_data import load_training_data
    from moh_dit.training.distill import Teacher

    config = run_config(run)
    data = load_training_data(config.data, torch.device("cpu"))
    teacher = Teacher.load(config.distill, data, torch.device("cpu"))
    teacher.freeze("cpu")
    return config, data, teacher


def student_at(run: Path, step: int | None, ema: bool) -> torch.nn.Module:
    """The student of ``run``'s checkpoint at ``step`` (``None``: its latest), its EMA weights or its raw ones."""
    from moh_dit.run_folder import RunLayout
    from moh_dit.sampling.sources import checkpoint_model

    layout = RunLayout(run)
    folder = layout.checkpoint(step) if step is not None else layout.latest_checkpoint()
    model, _ = checkpoint_model(Path(folder), prefer_ema=ema)
    return model.eval()


def the_objective(config, model):
    """The objective ``model`` was trained with, as ``config`` builds it."""
    from moh_dit.training.objective import run_objective

    return run_objective(config, model.config.objective, learn_sigma=False)


@torch.no_grad()
def teacher_euler_end(velocity, z: torch.Tensor, y: torch.Tensor, steps: int = 25) -> torch.Tensor:
    """The end of the teacher's ODE from noise ``z`` with labels ``y`` by ``steps`` Euler steps of its (guided)
    ``velocity``: the reference the parts measure a student's samples against."""
    from moh_dit.training.distill import run_teacher_sampler

    return run_teacher_sampler(velocity, z, y, torch.linspace(1, 0, steps + 1).tolist(), "euler")[:, -1]
