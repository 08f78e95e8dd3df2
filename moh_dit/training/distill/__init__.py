r"""Distillation in training: what a run needs beside its student when it learns from a teacher
(``objective.name: distill``; the methods themselves are ``moh_dit.objectives.distill``).

Read it in this order:

    checks.py        the ``distill`` section checked when a config is read (one line per mistake)
    teacher.py       the teacher: loaded from a run, checkpoint, pipeline or file, checked against the data, its
                     guided velocity (what a student learns), its recorded weights on resume
    students.py      the student a run starts from: the teacher's architecture and weights, or another student's
    trajectories.py  sets of the teacher's sampling trajectories: recorded in shards, read back, resumable
    sources.py       where a run's trajectories come from (online, its own set, one recorded before) and their plan
    companions.py    networks trained beside the student (DMD2's fake score and its discriminator)
    lead.py          a frozen lead model whose first steps are a generator's input at its later grid times

Outside this folder import these names from the package (``from moh_dit.training.distill import Teacher``); the
modules load on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

# each public name, by the module that holds it (loaded on first use: a config check does not load the teacher's)
_NAMES = {
    "TEACHER_FORMATS": "checks",
    "check_distill": "checks",
    "OtherMethodKeys": "checks",
    "configs_of_method": "checks",
    "Teacher": "teacher",
    "FrozenLead": "lead",
    "TeacherGuidance": "teacher",
    "guided_velocity": "teacher",
    "student_from_teacher": "students",
    "TRAJECTORY_SAMPLERS": "trajectories",
    "TrajectoryPlan": "trajectories",
    "StoredTrajectories": "trajectories",
    "OnlineTrajectories": "trajectories",
    "record_trajectories": "trajectories",
    "run_teacher_sampler": "trajectories",
    "trajectory_grid": "trajectories",
    "MANIFEST": "trajectories",
    "ONLINE": "sources",
    "RUN_FOLDER": "sources",
    "plan_of": "sources",
    "record_set": "sources",
    "teacher_velocity": "sources",
    "trajectory_source": "sources",
    "Companion": "companions",
    "FakeScore": "companions",
    "COMPANIONS": "companions",
    "build_companions": "companions",
}

__all__ = list(_NAMES)


def __getattr__(name: str) -> Any:
    if name in _NAMES:
        return getattr(importlib.import_module(f"{__name__}.{_NAMES[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
