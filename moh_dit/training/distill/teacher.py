"""A distillation's teacher: a trained model beside the student (a :class:`~moh_dit.training.frozen.FrozenModel`,
role ``teacher``) whose guided velocity the student learns (``moh_dit.objectives.distill``), and the student it
starts.

The teacher is any model moh-dit loads: a run, checkpoint, pipeline or transformer folder, or a checkpoint file that
``moh-dit convert`` reads (DiT, SiT, REPA, LightningDiT), of any objective that has a velocity of the linear path
(DDPM, flow matching, MeanFlow, a distilled student). It must fit the run's data: its image size, channels, classes and
latent space are checked before training (another data set with the same class names is said, not refused: a subset or
another version of the same data teaches as well). Its guidance (CFG at a scale over an interval of flow times, or
autoguidance by a guide of its own) is folded into the target.

The student starts from the teacher's weights where the layouts allow (:func:`student_from_teacher`): every tensor of
the same name and shape. A flow teacher's student is all of its weights, with MeanFlow's second time embedding added
at zero, so that the untrained student is the teacher (Decoupled MeanFlow's split adds nothing); a DDPM teacher's
student keeps its backbone and learns a new output layer (a velocity where the teacher predicted noise and variance).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from moh_dit.errors import ConfigError
from moh_dit.manifests import fingerprint_module, read_manifest
from moh_dit.model.network import MoHDiT
from moh_dit.objectives import objective_of
from moh_dit.objectives.noise import flow_time
from moh_dit.training.frozen import FrozenModel
from moh_dit.vae import latent_space_differences, space_of

if TYPE_CHECKING:
    from moh_dit.data.training_data import TrainingData
    from moh_dit.sampling.guides import Guide
    from moh_dit.training.config_sections import Config, DistillSection

__all__ = ["Teacher", "TeacherGuidance", "guided_velocity"]

logger = logging.getLogger("moh_dit.train")


@dataclass(frozen=True)
class TeacherGuidance:
    """The teacher's guidance folded into the target: the scale, the flow times it applies at, and the guide of
    autoguidance (``None``: classifier-free guidance)."""

    scale: float = 1.0
    times: tuple[float, float] = (0.0, 1.0)
    guide: Guide | None = None

    def record(self) -> dict[str, Any]:
        """The guidance by what it computes: the scale, the flow times, and the guide's weights (not its path)."""
        guide = None
        if self.guide is not None:
            spec = self.guide.spec.record()
            guide = {"sha256": self.guide.fingerprint} | {k: spec[k] for k in ("step", "sigma_rel")}
        return {"scale": self.scale, "times": list(self.times), "guide": guide}


@dataclass
class _Loaded:
    model: MoHDiT
    source: str  # the model's folder as it resolved (a run's pipeline or checkpoint), or the file
    id2label: dict[int, str] | None
    vae: dict | None  # the latent space it was trained in (None: pixels), or "unknown"
    data: dict | None  # its training data's record, where it has one


class Teacher(FrozenModel):
    """A frozen teacher and its guidance; :meth:`velocity` is what the student learns."""

    role = "teacher"

    def __init__(
        self, model: MoHDiT, source: str, guidance: TeacherGuidance, sampling: tuple[str, int] | None = None
    ) -> None:
        self.model, self.source, self.guidance = model.eval(), source, guidance
        self.sampling = sampling  # the (scheduler, steps) it records, where it records them
        self.evaluations = 0  # rows of the teacher's (and its guide's) forwards so far, in this process
        self.objective = objective_of(model)
        if self.objective.time_convention is None:
            raise ConfigError(f"{source} cannot teach: {self.objective.describe()} has no velocity to learn from")
        if guidance.scale != 1.0 and guidance.guide is None and model.null_class_id is None:
            raise ConfigError(
                f"{source} was trained without label dropout: it has no unconditional prediction to guide with; "
                f"distill.guidance_scale=1, or a guide (distill.guide)"
            )
        self.fingerprint = fingerprint_module(model)

    # ------------------------------------------------------------------------------------------------
    # Loading, checked against the run's data
    # ------------------------------------------------------------------------------------------------
    @classmethod
    def load(
        cls,
        section: DistillSection,
        data: TrainingData | None,
        device: torch.device,
        recorded: dict[str, Any] | None = None,
    ) -> Teacher:
        """The teacher ``section`` names, checked against ``data`` (one :class:`ConfigError` naming every difference;
        ``None``: no data to check against, as for ``moh-dit trajectories``), with its guide. ``recorded``: the
        teacher a resumed run was trained beside (its identity and provenance): a run folder that has trained on since
        gives the checkpoint of those weights, or the error says which weights are needed."""
        loaded = _load(section)
        if recorded is not None:
            loaded = _the_recorded_weights(section, loaded, recorded)
        if data is not None:
            check_fits(loaded, data)
        guide = None
        if section.guide is not None:
            from moh_dit.sampling.guides import load_guide
            from moh_dit.sampling.spec_parts import GuideSpec

            space = None if loaded.vae == "unknown" else loaded.vae
            guide = load_guide(
                GuideSpec(section.guide, section.guide_step, section.guide_sigma_rel), loaded.model, space
            )
        scale, times, sampling = _guidance_of(section)
        _warn_if_guided_twice(loaded, scale)
        teacher = cls(loaded.model.to(device), loaded.source, TeacherGuidance(scale, times, guide), sampling)
        logger.info("the teacher: %s", teacher.describe())
        return teacher

    def modules(self) -> list[torch.nn.Module]:
        return [self.model] + ([self.guidance.guide.model] if self.guidance.guide is not None else [])

    def record(self) -> dict[str, Any]:
        """What the student's config keeps of its teacher: its weights and objective (what it computes; not the path it
        was given by, which may change while the weights do not)."""
        return {"sha256": self.fingerprint, "objective": self.objective.record()}

    def identity(self) -> dict[str, Any]:
        return dict(self.record(), guidance=self.guidance.record())

    def provenance(self) -> dict[str, Any]:
        """Where the weights came from: the folder they resolved to (a run's pipeline or checkpoint) or the file."""
        return {"weights": self.source}

    def computes(self) -> dict[str, Any]:
        """What the teacher computes, wherever it was loaded from: its weights' fingerprint, objective and guidance
        (a set of its trajectories records this)."""
        return {"sha256": self.fingerprint, "objective": self.objective.record(), "guidance": self.guidance.record()}

    def describe(self) -> str:
        how = ""
        if self.guidance.scale != 1.0:
            kind = f"autoguidance by {self.guidance.guide.source}" if self.guidance.guide else "CFG"
            how = (
                f", {kind} {self.guidance.scale:g} at flow times {self.guidance.times[0]:g}-{self.guidance.times[1]:g}"
            )
        return f"{self.source} ({self.objective.describe()}; weights {self.fingerprint[:12]}){how}"

    def initial_student(self, config: Config, data: TrainingData) -> tuple[MoHDiT, dict]:
        """The student this teacher starts (:func:`moh_dit.training.distill.students.student_from_teacher`)."""
        from moh_dit.training.distill.students import student_from_teacher

        return student_from_teacher(self, config, data)

    # ------------------------------------------------------------------------------------------------
    # What the student learns
    # ------------------------------------------------------------------------------------------------
    def velocity(
        self,
        z: torch.Tensor,
        t: torch.Tensor,
        labels: torch.Tensor | None,
        drop: torch.Tensor | None,
        autocast,
        scale: float | None = None,
        grad: bool = False,
    ) -> torch.Tensor:
        """The velocity of the linear path at ``(z, t)`` the student learns (:func:`guided_velocity` of this teacher's
        predictions, in the run's precision); float32. ``scale``: another guidance scale than the teacher's (DMD2's real
        score), over the same flow times and with the same guide. ``grad``: differentiable in ``z`` (SiD's real score;
        the weights stay frozen), each evaluation counted three times (a backward costs two forwards)."""
        with torch.set_grad_enabled(grad):
            return self._velocity(z, t, labels, drop, autocast, scale, 3 if grad else 1)

    def _velocity(self, z, t, labels, drop, autocast, scale, passes: int) -> torch.Tensor:
        guidance = self.guidance if scale is None else dataclasses.replace(self.guidance, scale=float(scale))
        if guidance.scale != 1.0 and guidance.guide is None and self.model.null_class_id is None:
            raise ConfigError(
                f"{self.source} was trained without label dropout: it has no unconditional prediction to guide with at "
                f"scale {guidance.scale:g}"
            )
        guide = guidance.guide

        def teacher(z, t, y):
            self.evaluations += passes * z.shape[0]
            return self.objective.linear_velocity(self.model, z, t, y)

        def weaker(z, t, y):
            self.evaluations += passes * z.shape[0]
            return self.objective.linear_velocity(guide.model, z, t, y)

        with autocast():
            return guided_velocity(
                teacher, z, t, labels, drop, self.model.null_class_id, guidance, weaker if guide else None
            )


def guided_velocity(
    teacher,
    z: torch.Tensor,
    t: torch.Tensor,
    labels: torch.Tensor | None,
    drop: torch.Tensor | None,
    null: int | None,
    guidance: TeacherGuidance,
    guide=None,
) -> torch.Tensor:
    """The teacher's velocity ``teacher(z, t, y)`` guided as FastGen's distillation guides it: ``v_u + w (v_c - v_u)``
    inside the guided flow times (``v_u``: the unconditional velocity, in the conditional batch's forward; with a
    ``guide``, the guide's conditional velocity), the conditional one outside; where ``drop`` replaced a label (or the
    model is unconditional) the unconditional one, unguided."""
    if labels is None:
        return teacher(z, t, None)
    given = labels if drop is None or null is None else torch.where(drop.bool(), torch.full_like(labels, null), labels)
    rows = (t >= guidance.times[0]) & (t <= guidance.times[1])
    rows = rows & (given != null) if null is not None else rows
    guided = rows.nonzero().flatten() if guidance.scale != 1.0 else rows.new_zeros(0, dtype=torch.long)
    if guide is not None or guided.numel() == 0:
        v = teacher(z, t, given)
        if guided.numel() == 0:
            return v
        weak = guide(z[guided], t[guided], given[guided])
    else:  # the conditional batch and the guided rows' unconditional halves in one forward
        both = teacher(
            torch.cat([z, z[guided]]),
            torch.cat([t, t[guided]]),
            torch.cat([given, torch.full_like(given[guided], null)]),
        )
        v, weak = both[: len(z)], both[len(z) :]
    v = v.float().clone()
    v[guided] = weak.float() + guidance.scale * (v[guided] - weak.float())
    return v


# ----------------------------------------------------------------------------------------------------
# Loading and checking
# ----------------------------------------------------------------------------------------------------
def _load(section: DistillSection) -> _Loaded:
    """The teacher's weights and what they were trained on, as far as their files say."""
    path = Path(section.teacher)
    if path.is_file():  # a checkpoint of another codebase, read as moh-dit convert reads it
        from moh_dit.errors import ConversionError
        from moh_dit.interop.load import load_any

        heads = {} if section.teacher_num_heads is None else {"num_heads": section.teacher_num_heads}
        try:
            model, _, id2label, report = load_any(path, section.teacher_format, section.teacher_path, **heads)
        except ConversionError as err:
            if "number of heads" not in str(err):
                raise
            raise ConfigError(
                f"distill.teacher={path}: {str(err).split('; pass')[0]}: give distill.teacher_num_heads=N, or the run, "
                f"checkpoint or pipeline folder of a moh-dit model (it says its heads itself)"
            ) from None
        return _Loaded(model.eval(), str(path), id2label or None, "unknown", None)
    return load_folder(path)


def load_folder(path: str | Path) -> _Loaded:
    """A moh-dit model of a run, checkpoint, pipeline or transformer folder, with its class names, latent space and
    training data as far as its files say (a teacher's, or a lead model's: moh_dit/training/distill/lead.py)."""
    from moh_dit.sampling.sources import load_transformer, source_vae_record

    model, source = load_transformer(path)
    id2label, data = None, None
    if source.kind == "pipeline":
        index = json.loads((source.path / "model_index.json").read_text())
        id2label = {int(k): v for k, v in (index.get("id2label") or {}).items()} or None
        data = (((read_manifest(source.path, "pipeline") or {}).get("source") or {}).get("training") or {}).get("data")
    elif source.kind == "checkpoint":
        state = json.loads((source.path / "trainer_state.json").read_text())
        id2label = {int(k): v for k, v in (state.get("id2label") or {}).items()} or None
    if source.run is not None and data is None:
        data = ((read_manifest(source.run, "run") or {}).get("identity") or {}).get("data")
    vae = source_vae_record(source) if source.kind != "transformer" else "unknown"
    return _Loaded(model, str(source.path), id2label, vae, data)


def _guidance_of(section: DistillSection) -> tuple[float, tuple[float, float], tuple[str, int] | None]:
    """The scale and flow times the config gives, or where it gives none the teacher's recorded guidance (its
    previews': the scale, and its interval as noise levels, read as the linear path's times); a checkpoint file records
    none: no guidance. And the sampler and steps it records (``None`` for a checkpoint file)."""
    scale, times = section.guidance_scale, section.guidance_times
    from moh_dit.sampling.loading import recorded_sampling

    recorded = recorded_sampling(section.teacher) if not Path(section.teacher).is_file() else None
    if scale is None:
        scale = recorded.guidance.scale if recorded is not None else 1.0
    if times is None:
        levels = recorded.guidance.noise_range() if recorded is not None else None
        times = (0.0, 1.0) if levels is None else tuple(flow_time(level) for level in levels)
    if recorded is not None and (section.guidance_scale is None or section.guidance_times is None):
        # say which part the record gives: a config's own scale with the recorded interval is not the record's scale
        taken = [part for part, given in (("scale", section.guidance_scale), ("interval", section.guidance_times)) if given is None]  # fmt: skip
        logger.info(
            "the teacher's guidance %s from its record (%s)", " and ".join(taken), recorded.describe_guidance()
        )
    sampling = None
    if recorded is not None and recorded.sampler.scheduler is not None:
        sampling = (recorded.sampler.scheduler, recorded.sampler.num_steps)
    return float(scale), (float(times[0]), float(times[1])), sampling


def _warn_if_guided_twice(teacher: _Loaded, scale: float) -> None:
    """A teacher that has guidance folded into its own training (a distilled student, MeanFlow) samples at scale 1;
    guiding its target again stacks CFG on top, as sampling it with --cfg-scale would: said once, here."""
    from moh_dit.objectives.registry import objective_name, sampling_guidance

    record = teacher.model.config.get("objective")
    if scale != 1.0 and sampling_guidance(objective_name(record), record) == 1.0:
        logger.warning(
            "the teacher %s has guidance folded into its training already (it samples at scale 1): guidance %g in the "
            "target guides it again on top (distill.guidance_scale=1 takes it as it samples)", teacher.source, scale,
        )  # fmt: skip


def check_fits(teacher: _Loaded, data: TrainingData, what: str = "the teacher") -> None:
    """The teacher (or another model beside the student, ``what``) must see what the student sees: one
    :class:`ConfigError` naming every difference."""
    config, wrong = teacher.model.config, []
    for key, mine in (("sample_size", data.sample_size), ("in_channels", data.in_channels)):
        if config[key] != mine:
            wrong.append(f"{key} {config[key]} (this run's data: {mine})")
    if config.num_classes not in (0, data.num_classes):
        wrong.append(f"{config.num_classes} classes (this run's data: {data.num_classes})")
    names = {int(k): v for k, v in data.id2label.items()}
    if teacher.id2label and names and teacher.id2label != names:
        wrong.append(
            f"other class names ({list(teacher.id2label.values())[:3]}... against {list(names.values())[:3]}...)"
        )
    if teacher.vae == "unknown":
        if data.vae_record is not None:
            spec = data.vae_record.get("spec")
            logger.warning(
                "%s does not say which autoencoder it was trained with: check it is %s", teacher.source, spec
            )
    elif (teacher.vae is None) != (data.vae_record is None) or (
        teacher.vae is not None and latent_space_differences(teacher.vae, data.vae_record)
    ):
        shown = [None if v is None else space_of(v) for v in (teacher.vae, data.vae_record)]
        wrong.append(f"latent space {shown[0]} (this run's data: {shown[1]})")
    if wrong:
        raise ConfigError(f"{what} {teacher.source} does not fit this run's data: {'; '.join(wrong)}")
    theirs, mine = (teacher.data or {}).get("fingerprint"), data.description.get("fingerprint")
    if theirs and mine and theirs != mine:
        logger.warning(
            "%s %s was trained on other images (data fingerprint %s) than this run's (%s): the same classes, "
            "so it serves, but check it is the data you mean",
            what,
            teacher.source,
            theirs[:12],
            mine[:12],
        )


def _the_recorded_weights(section: DistillSection, loaded: _Loaded, recorded: dict[str, Any]) -> _Loaded:
    """The teacher's weights a resumed run was trained beside: those loaded when they are; else, for a run folder that
    trained on since, its checkpoint (or pipeline) that holds them; else one :class:`ConfigError` saying which."""
    wanted = (recorded.get("identity") or {}).get("sha256")
    if not wanted or fingerprint_module(loaded.model) == wanted:
        return loaded
    from moh_dit.run_folder import RunLayout
    from moh_dit.sampling.sources import load_transformer, resolve_model_source

    source = resolve_model_source(section.teacher)
    if source.run is not None:
        layout = RunLayout(source.run)
        for candidate in [layout.pipeline, *(path for _, path in reversed(layout.list_checkpoints()))]:
            if candidate.is_dir():
                model, found = load_transformer(candidate)
                if fingerprint_module(model) == wanted:
                    logger.warning(
                        "the teacher %s has trained on since this run started: using %s, the weights it was trained "
                        "beside (%s)", section.teacher, found.path, wanted[:12],
                    )  # fmt: skip
                    return _Loaded(model.eval(), str(found.path), loaded.id2label, loaded.vae, loaded.data)
    was = (recorded.get("provenance") or {}).get("weights")
    searched = " (nor does any checkpoint of its run)" if source.run is not None else ""
    raise ConfigError(
        f"the teacher {section.teacher} does not hold the weights this run was trained beside{searched}: its weights "
        f"are {fingerprint_module(loaded.model)[:12]}, the run's were {wanted[:12]}"
        + (f", loaded from {was}" if was else "")
        + ": give distill.teacher= a run, checkpoint or pipeline that holds those weights, or start a new run"
    )
