"""The ``distill`` section's checks, made when a config is read (moh_dit/training/config_checks.py calls
:func:`check_distill`): a teacher exactly when the objective learns from one, values in range, no key of another
method, a one-line message that says where a key came from."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from moh_dit.argtypes import is_number
from moh_dit.errors import ConfigError
from moh_dit.training.config_sections import DistillSection
from moh_dit.training.config_values import at_least, one_of

if TYPE_CHECKING:
    from moh_dit.training.config_sections import Config

__all__ = ["TEACHER_FORMATS", "check_distill", "OtherMethodKeys", "configs_of_method"]


TEACHER_FORMATS = ("dit", "sit", "repa", "lightningdit")  # checkpoint files moh-dit convert reads as a model


def check_distill(config: Config) -> None:
    """The ``distill`` section: a teacher exactly when the objective is ``distill``, a format ``moh-dit convert``
    reads, guidance a finite scale over ordered flow times, a guide spec that holds, a student ``teacher`` or
    ``preset`` (whether the teacher loads and fits the data is checked when a run starts)."""
    from moh_dit.training.objective import run_objective_class

    # the section is the teacher's: it applies where the objective learns from one
    section, distilling = config.distill, "teacher" in run_objective_class(config).frozen_models
    defaults = DistillSection()
    if not distilling:
        changed = [
            f"distill.{f.name}"
            for f in dataclasses.fields(section)
            if getattr(section, f.name) != getattr(defaults, f.name)
        ]
        if changed:
            said = "applies" if len(changed) == 1 else "apply"
            raise ConfigError(f"{', '.join(changed)} {said} to a distillation (objective.name=distill)")
        return
    if not section.teacher or not isinstance(section.teacher, str):
        raise ConfigError("a distillation learns from a trained model: name it with distill.teacher=RUN")
    if config.model.init_from:
        raise ConfigError(
            "a distillation starts its student from the teacher (distill.teacher); model.init_from is not used: to go "
            "on with a distillation, resume its run (train.resume=latest)"
        )
    own, teacher = Path(config.train.output_dir).resolve(), Path(section.teacher).resolve()
    if teacher == own or own in teacher.parents:
        raise ConfigError(
            f"a run cannot teach itself: distill.teacher={section.teacher} is this run's own folder "
            f"(train.output_dir={config.train.output_dir}); name the trained teacher's run, or another train.output_dir"
        )
    one_of("distill.teacher_format", section.teacher_format, TEACHER_FORMATS)
    one_of("distill.teacher_path", section.teacher_path, ("linear", "gvp"))
    one_of("distill.student", section.student, ("teacher", "preset"))
    from moh_dit.objectives.distill import HEADS

    one_of("distill.head", section.head, ("teacher", *HEADS))
    scale = section.guidance_scale
    if scale is not None and (not is_number(scale) or not math.isfinite(scale) or scale < 0):
        raise ConfigError(
            f"distill.guidance_scale must be a finite number >= 0 (1: no guidance; below 1 towards the unconditional "
            f"velocity, 0 that velocity alone; a negative scale would push each class away from itself) or null (the "
            f"teacher's), got {scale!r}"
        )
    times = section.guidance_times
    if times is not None and (
        not (isinstance(times, list) and len(times) == 2 and all(is_number(v) for v in times))
        or not 0 <= times[0] <= times[1] <= 1
    ):
        raise ConfigError(
            f"distill.guidance_times must be [first, last] flow times with 0 <= first <= last <= 1, or null, got "
            f"{times!r}"
        )
    if section.guide is None and (section.guide_step is not None or section.guide_sigma_rel is not None):
        raise ConfigError(
            "distill.guide_step and distill.guide_sigma_rel choose the guide's weights: give distill.guide too"
        )
    if section.guide is not None:
        from moh_dit.sampling.spec_parts import GuideSpec

        try:
            GuideSpec(section.guide, section.guide_step, section.guide_sigma_rel)
        except ConfigError as err:
            raise ConfigError(f"distill.{err}") from None
    check_distill_method(section, defaults)
    from moh_dit.objectives.distill import method_entry
    from moh_dit.training.objective import run_objective_class

    if config.repa.encoder and run_objective_class(config).trained_models:
        raise ConfigError(
            f"repa.encoder aligns the student's tokens; distill.method={section.method} trains another network on "
            f"alternate steps: drop repa.encoder"
        )
    if config.train.mixed_precision == "fp16" and not method_entry(section.method).fp16:
        raise ConfigError(
            f"distill.method={section.method} diverges in float16 (its authors' and FastGen's finding): "
            f"train.mixed_precision=bf16 or no"
        )


class OtherMethodKeys(ConfigError):
    """``distill`` keys of another method than the one chosen: :meth:`explained` says where they came from."""

    def __init__(self, keys: list[str], method: str) -> None:
        self.keys, self.method = keys, method
        super().__init__(f"{', '.join(f'distill.{k}' for k in keys)}: not an option of distill.method={method}")

    def explained(self, source: Any, overrides: list[str], file_method: str | None) -> str:
        """The message, with the keys the config file set named as its, those the overrides gave as theirs, and a
        config of the chosen method to start from instead (one line)."""
        from moh_dit.objectives.distill import DEFAULT_METHOD

        given = {o.split("=", 1)[0].strip() for o in overrides}
        from_file = [f"distill.{k}" for k in self.keys if f"distill.{k}" not in given]
        if not from_file or not isinstance(source, (str, Path)):
            return str(self)
        written_for = file_method or DEFAULT_METHOD
        theirs = f" (written for distill.method={written_for})" if written_for != self.method else ""
        overridden = [f"distill.{k}" for k in self.keys if f"distill.{k}" in given]
        also = f"; the overrides give {', '.join(overridden)}" if overridden else ""
        own = configs_of_method(self.method)
        instead = f"; start from a config of {self.method} instead ({', '.join(own)})" if own else ""
        return (
            f"{', '.join(f'distill.{k}' for k in self.keys)}: not an option of distill.method={self.method}: "
            f"{Path(source).name} sets {', '.join(from_file)}{theirs}{also}{instead}, or set them back to their "
            f"defaults"
        )


def configs_of_method(method: str) -> list[str]:
    """The shipped configs (``configs/*.yaml`` of a checkout) that train distillation ``method``."""
    import yaml

    folder = Path(__file__).resolve().parents[3] / "configs"
    found = []
    for path in sorted(folder.glob("*.yaml")) if folder.is_dir() else []:
        raw = yaml.safe_load(path.read_text()) or {}
        if (raw.get("distill") or {}).get("method") == method:
            found.append(f"configs/{path.name}")
    return found[:2]


def check_distill_method(section: DistillSection, defaults: DistillSection) -> None:
    """The method is known and no key of another method is set (it would be ignored); the trajectory keys hold."""
    from moh_dit.objectives.distill import keys_of_other_methods, method_entry

    method_entry(section.method)
    ignored = sorted(k for k in keys_of_other_methods(section.method) if getattr(section, k) != getattr(defaults, k))
    if ignored:
        raise OtherMethodKeys(ignored, section.method)
    for key in ("trajectory_count", "trajectory_shard_size"):
        at_least(f"distill.{key}", getattr(section, key), 1)
    if section.trajectory_steps is not None:
        at_least("distill.trajectory_steps", section.trajectory_steps, 1)
    if section.trajectory_sampler is not None:
        from moh_dit.training.distill.trajectories import TRAJECTORY_SAMPLERS

        one_of("distill.trajectory_sampler", section.trajectory_sampler, TRAJECTORY_SAMPLERS)
    from moh_dit.objectives.distill import DMD_INPUTS

    one_of("distill.dmd_input", section.dmd_input, DMD_INPUTS)
    if len(section.dmd_time) != 2:
        raise ConfigError(f"distill.dmd_time must be [first, last] flow times, got {list(section.dmd_time)!r}")
    if section.gan_block is not None:
        at_least("distill.gan_block", section.gan_block, 1)
    if section.student_from is not None and not isinstance(section.student_from, str):
        raise ConfigError(
            f"distill.student_from must be a run, checkpoint or pipeline folder, got {section.student_from!r}"
        )
