"""Checking a training config: every value once, when the config is read, so that a typo fails before any data,
VAE or model is loaded. Whether files, encoders and references exist is checked when a run starts, so that a config
can be printed on any machine.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

from moh_dit.errors import ConfigError
from moh_dit.model.block import BlockOptions
from moh_dit.model.presets import check_config_keys, preset_config
from moh_dit.training.config_sections import (
    Config,
    DistillSection,
    EMASection,
    LogSection,
    ModelSection,
    RepaSection,
)

__all__ = [
    "validate",
    "check_repa",
    "check_distill",
    "check_posthoc",
    "check_evaluation",
    "check_class_weights",
    "TRACKERS",
]

# Trackers accelerate can log to (accelerate.tracking.LOGGER_TYPE_TO_CLASS); checked without importing it.
TRACKERS = ("tensorboard", "wandb", "comet_ml", "aim", "mlflow", "clearml", "dvclive", "swanlab", "trackio")


def validate(config: Config) -> None:
    """Every value checked once, when the config is read, so that a typo fails before any data, VAE or
    model is loaded."""
    model, data, optim, train, ema, log = config.model, config.data, config.optim, config.train, config.ema, config.log
    if not isinstance(model.overrides, dict):
        raise ConfigError(f"model.overrides must be a mapping such as {{hidden_size: 256}}, got {model.overrides!r}")
    check_model_overrides(model)
    _one_of("data.name", data.name, ("fashion-mnist", "folder", "latents"))
    _one_of("data.split", data.split, ("train", "test"))
    if data.name != "fashion-mnist" and (data.split != "train" or data.download):
        # they would be ignored, and data.split recorded in the run's identity as if it had been used
        raise ConfigError(
            f"data.split and data.download apply to data.name=fashion-mnist, not {data.name}: point data.path "
            f"at the data you want"
        )
    _one_of("model.init_classes", model.init_classes, ("strict", "resize", "reinit"))
    _one_of("optim.schedule", optim.schedule, ("constant", "cosine"))
    config.preview.sampling()  # the preview spec checks its own keys
    from moh_dit.training.objective import check_objective

    check_objective(config, Config())
    if not 0 <= optim.min_lr <= optim.lr:
        raise ConfigError(f"optim.min_lr must be between 0 and optim.lr, got {optim.min_lr}")
    _one_of("train.mixed_precision", train.mixed_precision, ("no", "fp16", "bf16"))
    for name in (
        "global_batch_size",
        "grad_accum_steps",
        "max_steps",
        "checkpoint_every",
        "keep_last",
        "spike_window",
    ):
        _at_least(f"train.{name}", getattr(train, name), 1)
    _at_least("train.spike_patience", train.spike_patience, 1)
    _at_least("train.max_rollbacks", train.max_rollbacks, 0)
    if 0 < train.spike_guard <= 1:
        raise ConfigError(
            f"train.spike_guard must be 0 (off) or a multiple of the median loss > 1, got {train.spike_guard}"
        )
    _at_least("log.log_every", log.log_every, 1)
    check_evaluation(log)
    _at_least("ema.update_every", ema.update_every, 1)
    for name in ("every", "per_class", "max_classes"):
        _at_least(f"preview.{name}", getattr(config.preview, name), 0)
    _at_least("data.num_workers", data.num_workers, 0)
    _at_least("data.subset_per_class", data.subset_per_class, 0)
    check_class_weights(data.class_weights)
    _at_least("data.image_size", data.image_size, 1)
    _one_of("data.channels", data.channels, (1, 3))
    _at_least("optim.warmup_steps", optim.warmup_steps, 0)
    for key, value in (
        ("optim.lr", optim.lr),
        ("optim.eps", optim.eps),
        ("optim.weight_decay", optim.weight_decay),
        ("optim.grad_clip", optim.grad_clip),
        ("train.time_limit_minutes", train.time_limit_minutes),
        ("train.moh_loss_coeff", train.moh_loss_coeff),
        ("log.peak_tflops", log.peak_tflops),
        ("train.spike_guard", train.spike_guard),
    ):
        if not math.isfinite(value) or value < 0:
            raise ConfigError(f"{key} must be a finite number >= 0, got {value}")
    if optim.lr <= 0:
        raise ConfigError(f"optim.lr must be > 0, got {optim.lr}")
    if not (math.isfinite(optim.new_lr_scale) and optim.new_lr_scale > 0):
        raise ConfigError(
            f"optim.new_lr_scale must be a finite number > 0 (a multiple of optim.lr), got {optim.new_lr_scale}"
        )
    if not 0.0 <= ema.decay <= 1.0:
        raise ConfigError(f"ema.decay must be in [0, 1], got {ema.decay}")
    check_posthoc(ema, train.global_batch_size)
    check_repa(config.repa)
    check_distill(config)
    check_token_routing(config)
    if not 0.0 <= data.max_bad_fraction <= 1.0:
        raise ConfigError(f"data.max_bad_fraction must be in [0, 1], got {data.max_bad_fraction}")
    if train.resume is not None and not isinstance(train.resume, str):
        raise ConfigError(f"train.resume must be 'latest' or the path of a checkpoint folder, got {train.resume!r}")
    if (
        train.resume is not None
        and train.resume != "latest"
        and not (Path(train.resume) / "trainer_state.json").is_file()
    ):
        raise ConfigError(
            f"train.resume={train.resume}: not a complete checkpoint folder (use 'latest' or a "
            f"path such as runs/x/checkpoints/step-00001000)"
        )
    unknown = sorted(set(log.trackers) - set(TRACKERS))
    if unknown:
        raise ConfigError(f"log.trackers: unknown tracker(s) {unknown}; accelerate knows {', '.join(TRACKERS)}")
    if train.resume is not None and train.overwrite:
        raise ConfigError(
            "train.resume and train.overwrite contradict each other: resume keeps the run, overwrite clears it"
        )


def check_model_overrides(model: ModelSection) -> None:
    """The ``model.overrides``: known keys (with ``init_from`` the weights carry their architecture; the trainer checks
    the overrides against it), and without it the preset's name and per-layer lengths; the block's options and their
    values (a typo such as ``mlp: swigl``) either way."""
    if model.init_from:
        check_config_keys(model.overrides)
    else:
        preset_config(model.preset, **model.overrides)
    if "block" in model.overrides:
        try:
            BlockOptions.from_config(model.overrides["block"])
        except ValueError as err:
            said = str(err)
            where = f"model.overrides.{said}" if said.startswith("block ") else f"model.overrides.block: {said}"
            raise ConfigError(where) from None


def check_token_routing(config: Config) -> None:
    """TREAD's settings: a share in [0, 1) and, when on, a span of blocks inside the model (its depth from the preset
    and overrides; with ``model.init_from`` the trainer checks it against the weights)."""
    routing = config.token_routing
    share = routing.share
    if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 <= share < 1:
        raise ConfigError(f"token_routing.share must be a share of the tokens in [0, 1) (TREAD's 0.5), got {share!r}")
    for key in ("first_block", "last_block"):
        value = getattr(routing, key)
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"token_routing.{key} must be a block index (negative: from the end), got {value!r}")
    if share and not config.model.init_from:
        from moh_dit.model.token_routing import resolve_span

        depth = preset_config(config.model.preset, **config.model.overrides)["depth"]
        try:
            resolve_span(routing.first_block, routing.last_block, depth)
        except ValueError as err:
            raise ConfigError(f"token_routing: {err}") from None


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
    _one_of("distill.teacher_format", section.teacher_format, TEACHER_FORMATS)
    _one_of("distill.teacher_path", section.teacher_path, ("linear", "gvp"))
    _one_of("distill.student", section.student, ("teacher", "preset"))
    from moh_dit.objectives.distill_heads import HEADS

    _one_of("distill.head", section.head, ("teacher", *HEADS))
    scale = section.guidance_scale
    if scale is not None and (
        isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale < 0
    ):
        raise ConfigError(
            f"distill.guidance_scale must be a finite number >= 0 (1: no guidance; below 1 towards the unconditional "
            f"velocity, 0 that velocity alone; a negative scale would push each class away from itself) or null (the "
            f"teacher's), got {scale!r}"
        )
    times = section.guidance_times
    if times is not None and (
        not (isinstance(times, list) and len(times) == 2 and all(isinstance(v, (int, float)) for v in times))
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
    from moh_dit.objectives.distill_methods import method_entry
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
        from moh_dit.objectives.distill_methods import DEFAULT_METHOD

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

    folder = Path(__file__).resolve().parents[2] / "configs"
    found = []
    for path in sorted(folder.glob("*.yaml")) if folder.is_dir() else []:
        raw = yaml.safe_load(path.read_text()) or {}
        if (raw.get("distill") or {}).get("method") == method:
            found.append(f"configs/{path.name}")
    return found[:2]


def check_distill_method(section: DistillSection, defaults: DistillSection) -> None:
    """The method is known and no key of another method is set (it would be ignored); the trajectory keys hold."""
    from moh_dit.objectives.distill_methods import keys_of_other_methods, method_entry

    method_entry(section.method)
    ignored = sorted(k for k in keys_of_other_methods(section.method) if getattr(section, k) != getattr(defaults, k))
    if ignored:
        raise OtherMethodKeys(ignored, section.method)
    for key in ("trajectory_count", "trajectory_shard_size"):
        _at_least(f"distill.{key}", getattr(section, key), 1)
    if section.trajectory_steps is not None:
        _at_least("distill.trajectory_steps", section.trajectory_steps, 1)
    if section.trajectory_sampler is not None:
        from moh_dit.training.trajectories import TRAJECTORY_SAMPLERS

        _one_of("distill.trajectory_sampler", section.trajectory_sampler, TRAJECTORY_SAMPLERS)
    from moh_dit.objectives.dmd2 import DMD_INPUTS

    _one_of("distill.dmd_input", section.dmd_input, DMD_INPUTS)
    if len(section.dmd_time) != 2:
        raise ConfigError(f"distill.dmd_time must be [first, last] flow times, got {list(section.dmd_time)!r}")
    if section.gan_block is not None:
        _at_least("distill.gan_block", section.gan_block, 1)
    if section.student_from is not None and not isinstance(section.student_from, str):
        raise ConfigError(
            f"distill.student_from must be a run, checkpoint or pipeline folder, got {section.student_from!r}"
        )


def check_repa(repa: RepaSection) -> None:
    """The ``repa`` keys (whether the encoders load, with their weights, is checked when a run starts)."""
    _at_least("repa.depth", repa.depth, 1)
    _at_least("repa.projector_dim", repa.projector_dim, 1)
    _at_least("repa.encoder_resolution", repa.encoder_resolution, 0)
    if not (math.isfinite(repa.coeff) and repa.coeff >= 0):
        raise ConfigError(f"repa.coeff must be a finite number >= 0 (REPA's 0.5), got {repa.coeff}")
    if repa.encoder_weights and len(repa.encoder_weights) != len(repa.encoder):
        raise ConfigError(
            f"repa.encoder_weights gives {len(repa.encoder_weights)} files for {len(repa.encoder)} encoders: one each"
        )
    if not repa.encoder and (repa.encoder_weights or repa.encoder_module):
        raise ConfigError("repa.encoder_weights / encoder_module without repa.encoder: name the encoder to align to")


def check_posthoc(ema: EMASection, global_batch: int) -> None:
    """The post-hoc EMA keys: an interval in whole steps of images, widths a power function has, a snapshot dtype."""
    from moh_dit.posthoc_ema import MAX_SIGMA_REL

    _at_least("ema.posthoc_every", ema.posthoc_every, 0)
    if ema.posthoc_every % global_batch:
        raise ConfigError(
            f"ema.posthoc_every={ema.posthoc_every} images must be a multiple of train.global_batch_size={global_batch} "
            f"(snapshots are taken after whole steps)"
        )
    rels = ema.posthoc_sigma_rels
    if (
        not rels
        or not all(isinstance(r, (int, float)) and 0 < r < MAX_SIGMA_REL for r in rels)
        or len(set(rels)) < len(rels)
    ):
        raise ConfigError(
            f"ema.posthoc_sigma_rels must be distinct relative widths between 0 and {MAX_SIGMA_REL:.4f} (EDM2 tracks "
            f"[0.05, 0.10]), got {list(rels)}"
        )
    _one_of("ema.posthoc_dtype", ema.posthoc_dtype, ("float32", "float16", "bfloat16"))


def check_evaluation(log: LogSection) -> None:
    """The ``log.eval_*`` keys: counts, names and the sampling spec (whether the reference and the extractor
    exist is checked when a run starts, so that a config can be printed on any machine)."""
    _at_least("log.eval_every", log.eval_every, 0)
    _at_least("log.eval_samples", log.eval_samples, 1)
    _at_least("log.eval_batch_size", log.eval_batch_size, 1)
    also = log.eval_also_steps
    if not all(isinstance(n, int) and not isinstance(n, bool) and 1 <= n <= 1000 for n in also) or len(
        set(also)
    ) < len(also):
        raise ConfigError(f"log.eval_also_steps must be distinct step counts between 1 and 1000, got {list(also)}")
    for key in ("eval_reference", "eval_extractor_weights", "eval_extractor_module"):
        value = getattr(log, key)
        if value is not None and not (isinstance(value, str) and value):
            raise ConfigError(f"log.{key} must be a path or a name, got {value!r}")
    log.eval_sampling.sampling()
    if log.eval_every and not log.eval_reference:
        raise ConfigError(
            f"log.eval_every={log.eval_every} evaluates against log.eval_reference, which is not set: give a reference "
            f"(an ADM reference batch such as VIRTUAL_imagenet256_labeled.npz, or an .npz / folder of real images), "
            f"or log.eval_every=0"
        )


def check_class_weights(weights: Any) -> None:
    """``data.class_weights`` is ``balanced`` or a mapping of class names or ids to finite weights > 0
    (which classes exist is checked against the data when it is read)."""
    if weights == "balanced":
        return
    if not isinstance(weights, dict):
        raise ConfigError(
            f"data.class_weights must be a mapping such as {{Sandal: 2, Bag: 2}} or 'balanced', got {weights!r}"
        )
    for name, weight in weights.items():
        number = isinstance(weight, (int, float)) and not isinstance(weight, bool)
        if not (number and math.isfinite(weight) and weight > 0):
            hint = " (YAML needs a space after the colon: {Sandal: 2})" if weight is None and ":" in str(name) else ""
            raise ConfigError(f"data.class_weights[{name!r}] must be a finite number > 0, got {weight!r}{hint}")


def _at_least(key: str, value: Any, low: int) -> None:
    if value < low:
        raise ConfigError(f"{key} must be >= {low}, got {value}")


def _one_of(key: str, value: Any, choices: tuple) -> None:
    if value not in choices:
        raise ConfigError(f"{key} must be one of {', '.join(map(str, choices))}; got {value!r}")
