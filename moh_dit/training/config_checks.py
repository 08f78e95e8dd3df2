"""Checking a training config: every value once, when the config is read, so that a typo fails before any data,
VAE or model is loaded. Whether files, encoders and references exist is checked when a run starts, so that a config
can be printed on any machine.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from moh_dit.argtypes import is_number, is_whole
from moh_dit.errors import ConfigError
from moh_dit.model.block import BlockOptions
from moh_dit.model.presets import CUSTOM, PRESETS, check_config_keys, preset_config
from moh_dit.training.config_sections import Config, EMASection, LogSection, ModelSection, RepaSection
from moh_dit.training.config_values import at_least, one_of
from moh_dit.training.distill import OtherMethodKeys, check_distill

__all__ = [
    "validate",
    "check_repa",
    "check_distill",
    "OtherMethodKeys",
    "check_posthoc",
    "check_evaluation",
    "check_class_weights",
    "architecture_from_weights",
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
    check_model_overrides(model, architecture_from_weights(config))
    one_of("data.name", data.name, ("fashion-mnist", "folder", "latents"))
    one_of("data.split", data.split, ("train", "test"))
    if data.name != "fashion-mnist" and (data.split != "train" or data.download):
        # they would be ignored, and data.split recorded in the run's identity as if it had been used
        raise ConfigError(
            f"data.split and data.download apply to data.name=fashion-mnist, not {data.name}: point data.path "
            f"at the data you want"
        )
    one_of("model.init_classes", model.init_classes, ("strict", "resize", "reinit"))
    one_of("optim.schedule", optim.schedule, ("constant", "cosine"))
    config.preview.sampling()  # the preview spec checks its own keys
    from moh_dit.training.objective import check_objective

    check_objective(config, Config())
    if not 0 <= optim.min_lr <= optim.lr:
        raise ConfigError(f"optim.min_lr must be between 0 and optim.lr, got {optim.min_lr}")
    one_of("train.mixed_precision", train.mixed_precision, ("no", "fp16", "bf16"))
    for name in (
        "global_batch_size",
        "grad_accum_steps",
        "max_steps",
        "checkpoint_every",
        "keep_last",
        "spike_window",
    ):
        at_least(f"train.{name}", getattr(train, name), 1)
    at_least("train.spike_patience", train.spike_patience, 1)
    at_least("train.max_rollbacks", train.max_rollbacks, 0)
    if 0 < train.spike_guard <= 1:
        raise ConfigError(
            f"train.spike_guard must be 0 (off) or a multiple of the median loss > 1, got {train.spike_guard}"
        )
    at_least("log.log_every", log.log_every, 1)
    check_evaluation(log)
    at_least("ema.update_every", ema.update_every, 1)
    for name in ("every", "per_class", "max_classes"):
        at_least(f"preview.{name}", getattr(config.preview, name), 0)
    at_least("data.num_workers", data.num_workers, 0)
    at_least("data.subset_per_class", data.subset_per_class, 0)
    check_class_weights(data.class_weights)
    at_least("data.image_size", data.image_size, 1)
    one_of("data.channels", data.channels, (1, 3))
    at_least("optim.warmup_steps", optim.warmup_steps, 0)
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


def architecture_from_weights(config: Config) -> bool:
    """Whether weights name the model's architecture rather than ``model.preset``: ``model.init_from``, or a
    distillation's student built from its teacher (``distill.student: teacher``) or from another student
    (``distill.student_from``)."""
    if config.model.init_from:
        return True
    from moh_dit.training.objective import run_objective_class

    distill = config.distill
    if "teacher" not in run_objective_class(config).frozen_models:  # the objective learns from no teacher
        return False
    return (distill.teacher is not None and distill.student == "teacher") or distill.student_from is not None


def check_model_overrides(model: ModelSection, from_weights: bool = False) -> None:
    """The ``model.overrides``: known keys (where weights carry the architecture, ``from_weights``: the trainer checks
    the overrides against them), and otherwise the preset's name and per-layer lengths; the block's options and their
    values (a typo such as ``mlp: swigl``) either way. ``model.preset: custom`` (a saved config whose weights matched no
    preset) needs the weights that name its architecture."""
    if model.preset == CUSTOM and not from_weights:
        raise ConfigError(
            f"model.preset {CUSTOM} says the architecture came from weights that match no preset (a run's saved "
            f"config): name them (model.init_from, or distill.teacher with distill.student teacher, or "
            f"distill.student_from), or choose a preset: {', '.join(PRESETS)}"
        )
    if from_weights:
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
    and overrides; where weights name the architecture the trainer checks it against them)."""
    routing = config.token_routing
    share = routing.share
    if not is_number(share) or not 0 <= share < 1:
        raise ConfigError(f"token_routing.share must be a share of the tokens in [0, 1) (TREAD's 0.5), got {share!r}")
    for key in ("first_block", "last_block"):
        value = getattr(routing, key)
        if not is_whole(value):
            raise ConfigError(f"token_routing.{key} must be a block index (negative: from the end), got {value!r}")
    if share and not architecture_from_weights(config):
        from moh_dit.model.token_routing import resolve_span

        depth = preset_config(config.model.preset, **config.model.overrides)["depth"]
        try:
            resolve_span(routing.first_block, routing.last_block, depth)
        except ValueError as err:
            raise ConfigError(f"token_routing: {err}") from None


def check_repa(repa: RepaSection) -> None:
    """The ``repa`` keys (whether the encoders load, with their weights, is checked when a run starts)."""
    at_least("repa.depth", repa.depth, 1)
    at_least("repa.projector_dim", repa.projector_dim, 1)
    at_least("repa.encoder_resolution", repa.encoder_resolution, 0)
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

    at_least("ema.posthoc_every", ema.posthoc_every, 0)
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
    one_of("ema.posthoc_dtype", ema.posthoc_dtype, ("float32", "float16", "bfloat16"))


def check_evaluation(log: LogSection) -> None:
    """The ``log.eval_*`` keys: counts, names and the sampling spec (whether the reference and the extractor
    exist is checked when a run starts, so that a config can be printed on any machine)."""
    at_least("log.eval_every", log.eval_every, 0)
    at_least("log.eval_samples", log.eval_samples, 1)
    at_least("log.eval_batch_size", log.eval_batch_size, 1)
    also = log.eval_also_steps
    if not all(is_whole(n) and 1 <= n <= 1000 for n in also) or len(set(also)) < len(also):
        raise ConfigError(f"log.eval_also_steps must be distinct step counts between 1 and 1000, got {list(also)}")
    for key in ("eval_reference", "eval_extractor_weights", "eval_extractor_module"):
        value = getattr(log, key)
        if value is not None and not (isinstance(value, str) and value):
            raise ConfigError(f"log.{key} must be a path or a name, got {value!r}")
    log.eval_sampling.sampling()
    if log.eval_keep_best is not None:
        from moh_dit.training.quality import check_keep_best

        check_keep_best(log)
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
        number = is_number(weight)
        if not (number and math.isfinite(weight) and weight > 0):
            hint = " (YAML needs a space after the colon: {Sandal: 2})" if weight is None and ":" in str(name) else ""
            raise ConfigError(f"data.class_weights[{name!r}] must be a finite number > 0, got {weight!r}{hint}")
