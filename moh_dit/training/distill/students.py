"""The student a distillation starts from: its teacher's weights where the layouts allow, or every weight of another
student of the same teacher (``distill.student_from``; CMT's second stage, DMD2 from a trajectory student).

A flow teacher's student is all of its weights, with MeanFlow's second time embedding added at zero, so that the
untrained student is the teacher (Decoupled MeanFlow's split adds nothing); a DDPM teacher's student keeps its backbone
and learns a new output layer (a velocity where the teacher predicted noise and variance), or keeps the teacher's own
parameterization (``distill.head: noise``).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from moh_dit.errors import ConfigError
from moh_dit.model.network import MoHDiT
from moh_dit.model.surgery import first_output_channels

if TYPE_CHECKING:
    from moh_dit.data.training_data import TrainingData
    from moh_dit.training.config_sections import Config, DistillSection

__all__ = [
    "student_from_teacher"
]  # ``teacher``: a moh_dit.training.distill.teacher.Teacher (not imported: it imports this)

logger = logging.getLogger("moh_dit.train")


def student_from_teacher(teacher: Any, config: Config, data: TrainingData) -> tuple[MoHDiT, dict]:
    """The student: the teacher's architecture (``distill.student: teacher``) or the config's preset, with the distill
    objective (the teacher's time convention, recorded teacher and guidance) and every tensor of the teacher with its
    name and shape; MeanFlow's second time embedding starts at zero, so that it adds nothing yet. Returns the model and
    a report of what was copied."""
    from moh_dit.model.presets import preset_config
    from moh_dit.objectives.distill import HEADS, native_head
    from moh_dit.training.objective import objective_record, run_objective
    from moh_dit.training.setup import HOW_TO_DROP_OVERRIDES

    time = teacher.objective.time_convention
    section = config.distill
    head = native_head(time) if section.head == "teacher" else section.head
    defaults = type(section)()
    others = {key for kind in HEADS.values() for key in kind.options} - set(HEADS[head].options)
    unread = sorted(f"distill.{key}" for key in others if getattr(section, key) != getattr(defaults, key))
    if unread:
        raise ConfigError(f"{', '.join(unread)}: not an option of this student's head ({head}; distill.head)")
    record = dict(
        objective_record(config), time=time, teacher=teacher.record(), guidance=teacher.guidance.record(), head=head
    ) | {key: getattr(section, key) for key in HEADS[head].options}
    objective = run_objective(config, record, learn_sigma=False)
    if config.distill.student == "teacher":
        base = {k: v for k, v in teacher.model.config.items() if not k.startswith("_")}
        base.update(repa_depth=None, repa_dims=None, repa_projector_dim=2048)
        from moh_dit.model.presets import architecture

        claimed = architecture(dict(base) | dict(config.model.overrides))
        wrong = [k for k in config.model.overrides if k in claimed and claimed[k] != architecture(base)[k]]
        if wrong:
            raise ConfigError(
                f"model.overrides {', '.join(f'{k}={config.model.overrides[k]!r}' for k in wrong)} contradict the "
                f"teacher's architecture, which the student takes (distill.student=teacher): drop them "
                f"({HOW_TO_DROP_OVERRIDES}), or choose distill.student=preset for model.preset with overrides"
            )
    elif section.student_from is None:  # (a student of another student has that student's architecture)
        derived = dict(in_channels=data.in_channels, sample_size=data.sample_size, num_classes=data.num_classes)
        base = preset_config(config.model.preset, **(derived | dict(config.model.overrides)))
    if section.student_from is not None:
        return _student_from_student(teacher, section, objective)
    student = MoHDiT(**(base | objective.model_config()))
    theirs, mine = teacher.model.state_dict(), student.state_dict()
    if HEADS[head].noise_channels:  # a learned-sigma teacher's output layer without its variance channels
        theirs = theirs | first_output_channels(theirs, student.final_layer.linear, teacher.model.out_channels)
    copied = {k: v for k, v in theirs.items() if k in mine and mine[k].shape == v.shape}
    student.load_state_dict(copied, strict=False)
    if student.h_embedder is not None:  # the interval's embedding starts at nothing: the student is its teacher
        torch.nn.init.zeros_(student.h_embedder.mlp[2].weight)
        torch.nn.init.zeros_(student.h_embedder.mlp[2].bias)
    if not config.distill.train_time_embedding:  # the teacher's embedding of t, kept as it is
        student.t_embedder.requires_grad_(False)
    new = sorted(set(mine) - set(copied))
    draws = getattr(objective, "draws_config_times", True)  # DMD2 draws its times from its grids, not objective.*
    if any(name.startswith("final_layer.") for name in new) and draws and config.objective.time_sampling != "uniform":
        logger.warning(
            "the student's output layer is new (the teacher predicts %s): MeanFlow's %s times rarely reach pure noise, "
            "where one step starts; objective.time_sampling=uniform and optim.lr=1e-3 made such a student converge "
            "(configs/fashion_mnist_moh_distill_ddpm.yaml, docs/results.md#distillation)",
            teacher.objective.describe(),
            config.objective.time_sampling,
        )
    report = {"distilled_from": teacher.source, "copied": len(copied), "of": len(mine), "new": new}
    if len(copied) < len(mine) / 2:  # another width or depth (distill.student=preset): almost nothing fits
        logger.warning(
            "the student (%s) takes only %d of its %d tensors from the teacher (the others differ in shape): it starts "
            "nearly from scratch; distill.student=teacher takes the teacher's architecture and all its weights",
            config.model.preset, len(copied), len(mine),
        )  # fmt: skip
    logger.info(
        "the student: %d of %d tensors from the teacher%s",
        len(copied),
        len(mine),
        f"; new: {', '.join(new[:6])}{' ...' if len(new) > 6 else ''}" if new else "",
    )
    return student, report


def _student_from_student(teacher: Any, section: DistillSection, objective) -> tuple[MoHDiT, dict]:
    """The student of ``distill.student_from``: every weight of another student of the same teacher (a trajectory
    student post-trained by MeanFlow, CMT's second stage), with this run's objective record."""
    from moh_dit.sampling.sources import load_transformer

    model, source = load_transformer(Path(section.student_from))
    record = model.config.get("objective") or {}
    theirs = (record.get("teacher") or {}).get("sha256")  # a distilled student records its teacher
    if theirs != teacher.fingerprint:
        what = f"a student of another teacher ({theirs[:12]})" if theirs else "not a distilled student"
        raise ConfigError(
            f"distill.student_from={section.student_from} is {what}: a student starts from a student of its own "
            f"teacher ({teacher.fingerprint[:12]}), or from the teacher (distill.student_from unset)"
        )
    base = {k: v for k, v in model.config.items() if not k.startswith("_")}
    student = MoHDiT(**(base | objective.model_config()))
    student.load_state_dict(model.state_dict())
    if not section.train_time_embedding:
        student.t_embedder.requires_grad_(False)
    logger.info("the student: every tensor of %s (%s)", source.path, record.get("method", "meanflow"))
    return student, {
        "distilled_from": teacher.source,
        "started_from": str(source.path),
        "copied": len(student.state_dict()),
        "of": len(student.state_dict()),
        "new": [],
    }
