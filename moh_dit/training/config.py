"""Training configuration: a YAML file plus ``section.key=value`` command-line overrides.

Architecture (``model``) is kept apart from training flags (``data``, ``optim``, ``train``, ``ema``,
``log``), as in k-diffusion: the model section names a preset and may override any architecture field;
the rest never reaches the model config. Unknown keys are errors, never silently ignored.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from moh_dit.errors import ConfigError
from moh_dit.model.presets import check_config_keys, preset_config
from moh_dit.sampling.spec import FAST_SCHEDULER, FAST_STEPS, LEGACY_CONFIG_KEYS, SamplingSpec

__all__ = [
    "Config",
    "ModelSection",
    "ObjectiveSection",
    "DataSection",
    "OptimSection",
    "TrainSection",
    "EMASection",
    "LogSection",
    "EvalSamplingSection",
    "PreviewSection",
    "RepaSection",
    "load_config",
    "apply_overrides",
    "config_to_dict",
]


@dataclass
class ModelSection:
    preset: str = "MoH-DiT-Ti/4-75"
    overrides: dict[str, Any] = field(default_factory=dict)  # any MoHDiT config key, e.g. num_classes
    init_from: str | None = None  # a run, checkpoint, pipeline or transformer folder to start from
    # with init_from and data of another class count: strict (an error), resize (keep the shared label rows
    # and the null row) or reinit (a new label table); every other weight is kept
    init_classes: str = "strict"


@dataclass
class ObjectiveSection:
    """What the network learns (moh_dit.objectives, docs/objective.md): DiT's DDPM or flow matching (SiT). ``null``
    means the default (ddpm, linear, moh-dit) for a new model, and what the weights were trained with for
    ``model.init_from``, whose objective a run keeps."""

    name: str | None = None  # ddpm | flow
    path: str | None = None  # flow: linear (SiT's Linear) | gvp (SiT's GVP, the cosine path)
    # flow: the network's time input and output: moh-dit (1000 s, v), repa (s, v) or sit (1 - s, -v); sit and repa
    # models export to those projects' code (moh-dit convert --to sit | repa)
    convention: str | None = None
    time_sampling: str = "uniform"  # flow: uniform (SiT, REPA) | logit-normal (SD3) | lognormal (REPA's option)
    time_mean: float = 0.0  # flow: the normal of logit-normal and lognormal time sampling
    time_std: float = 1.0


@dataclass
class DataSection:
    name: str = "fashion-mnist"  # fashion-mnist | folder | latents
    path: str | None = None  # folder of class folders, IDX folder, or pre-extracted latents (.npy)
    image_size: int = 28
    channels: int = 1
    split: str = "train"
    download: bool = False
    num_workers: int = 0
    random_flip: bool = True
    max_bad_fraction: float = 0.01
    subset_per_class: int = 0  # > 0: use only the first N images of every class (smoke runs, tests)
    # how often each class is drawn per epoch, relative to its share of the data: {Sandal: 2, Bag: 2} (names
    # or ids), or "balanced" (every class equally often); {} draws every image once per epoch
    class_weights: Any = field(default_factory=dict)
    vae: str = "none"  # none | hub id (stabilityai/sd-vae-ft-ema) | local folder


@dataclass
class OptimSection:
    lr: float = 1e-4
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    grad_clip: float = 0.0  # max global grad norm; 0 disables
    warmup_steps: int = 0  # linear LR warm-up
    schedule: str = "constant"  # after warm-up: constant (DiT) or cosine (decays to min_lr at train.max_steps)
    min_lr: float = 0.0  # the end of the cosine schedule


@dataclass
class TrainSection:
    output_dir: str = "runs/default"
    global_batch_size: int = 256
    grad_accum_steps: int = 1
    max_steps: int = 400_000
    time_limit_minutes: float = 0.0  # > 0: stop (and checkpoint) after this long
    seed: int = 0
    mixed_precision: str = "no"  # no | fp16 | bf16
    allow_tf32: bool = True
    gradient_checkpointing: bool = False
    compile: bool = False
    moh_loss_coeff: float = 0.01
    snr_gamma: float | None = None  # Min-SNR-gamma weighting of the noise MSE (e.g. 5); None: DiT's loss
    checkpoint_every: int = 50_000
    keep_last: int = 3
    resume: str | None = None  # latest | PATH
    # resume on another number of processes or accumulation steps (same global batch): the data of every step is
    # kept, the per-process random draws are not, so the run does not continue exactly as it would have
    elastic_resume: bool = False
    # the spike guard (moh_dit/training/spike_guard.py): > 0 skips an update whose loss exceeds this multiple of
    # the median loss of the last spike_window steps; spike_patience spikes in a row, or a non-finite loss, roll
    # back to the newest checkpoint, at most max_rollbacks times. 0: off (a non-finite loss stops the run)
    spike_guard: float = 0.0
    spike_window: int = 50
    spike_patience: int = 3
    max_rollbacks: int = 3
    overwrite: bool = False  # clear an earlier run in output_dir (what moh-dit wrote there) before starting
    push_to_hub: str | None = None  # a Hub repo id: upload the exported pipeline (with its card) at the end


@dataclass
class EMASection:
    decay: float = 0.9999
    warmup: bool = False  # diffusers' EMA warm-up (decay ramps up from 0); DiT uses a constant decay
    inv_gamma: float = 1.0
    power: float = 2.0 / 3.0
    update_every: int = 1
    # post-hoc EMA (EDM2; docs/training.md#post-hoc-ema): power-function EMAs of these relative widths, tracked in
    # training images, with a snapshot of each every posthoc_every images (a multiple of train.global_batch_size;
    # 0: off); `moh-dit ema RUN --sigma-rel S` rebuilds an EMA of any width afterwards
    posthoc_every: int = 0
    posthoc_sigma_rels: tuple[float, ...] = (0.05, 0.10)
    posthoc_dtype: str = "float32"  # of the snapshots: float16 halves their size and adds ~5e-4 relative error


@dataclass
class EvalSamplingSection:
    """How the evaluations during training sample. By default the fast protocol without guidance: DiT's curves of
    FID against training steps are unguided, and 25 solver steps cost a tenth of DiT's 250."""

    scheduler: str = FAST_SCHEDULER
    num_steps: int = FAST_STEPS
    guidance_scale: float = 1.0
    guidance_interval: list[int] | None = None
    guidance_channels: int | None = None
    grid_averaging: int | None = None
    guidance_noise: list[float] | None = None  # [low, high] noise levels guided instead of guidance_interval
    time_shift: float = 1.0  # flow samplers' grid shift (1: none)

    def sampling(self) -> SamplingSpec:
        """The spec, checked; the error of a bad value names its key."""
        return SamplingSpec.from_config(dataclasses.asdict(self), prefix="log.eval_sampling.")


@dataclass
class RepaSection:
    """REPA's representation alignment (moh_dit/training/repa.py, docs/training.md#repa); off without an encoder."""

    encoder: list[str] = field(default_factory=list)  # dinov2-vit-b (REPA's), ...; several: one projector each
    encoder_weights: list[str] = field(default_factory=list)  # one file per encoder: nothing is downloaded here
    encoder_module: str | None = None  # a module that registers encoders (torch-fidelity extractors, patch_tokens)
    encoder_resolution: int = 0  # the encoders' input size; 0: REPA's 224 * (data.image_size // 256)
    depth: int = 8  # the block, from 1, whose tokens are aligned: REPA's 8 for L/XL, 4 for B (a third of the depth)
    coeff: float = 0.5  # REPA's lambda
    projector_dim: int = 2048


@dataclass
class LogSection:
    log_every: int = 100
    trackers: list[str] = field(default_factory=lambda: ["tensorboard"])  # accelerate trackers; [] for none
    project: str = "moh-dit"  # the trackers' project name (a wandb project, a TensorBoard sub-folder)
    head_usage: bool = True
    # peak TFLOP/s of one device for MFU; 0: known GPUs by name, a matmul measured at the start on a CPU
    peak_tflops: float = 0.0
    # evaluation during training (moh_dit/training/quality.py): every eval_every steps and at the end (0: off),
    # eval_samples class-balanced images of the EMA weights, sampled on every process as `moh-dit evaluate
    # --model` samples, scored (KID, FID, precision, recall, ...) against eval_reference with eval_extractor
    eval_every: int = 0
    eval_samples: int = 10_000
    eval_reference: str | None = None  # ADM reference .npz, or an .npz / folder of real images
    eval_extractor: str = "inception"  # or a torch-fidelity extractor (registered by eval_extractor_module)
    eval_extractor_weights: str | None = None  # default: $MOH_DIT_INCEPTION_WEIGHTS, then the torch hub cache
    eval_extractor_module: str | None = None
    eval_batch_size: int = 64  # images per sampling block (as evaluate's --sample-batch-size)
    eval_keep_samples: bool = False  # keep the images (PNGs and .npz) after scoring; the scores are always kept
    eval_sampling: EvalSamplingSection = field(default_factory=EvalSamplingSection)


@dataclass
class PreviewSection:
    """The trainer's grids of EMA samples: when, how many, and how they are sampled (a ``SamplingSpec``, which
    the exported pipeline records for ``sample.py`` and the demo)."""

    every: int = 0  # > 0: save a grid every N steps (and at the end)
    per_class: int = 4  # images per class row; 0: no grids, not even at the end
    max_classes: int = 10
    guidance_scale: float = 4.0
    guidance_interval: list[int] | None = None  # [first, last] guided DDPM timesteps (flow: their noise levels)
    guidance_noise: list[float] | None = None  # or [low, high] guided noise levels; null (both): every step
    grid_averaging: int | None = None  # average over shifted patch grids at timesteps <= this; null: none
    time_shift: float = 1.0  # flow samplers: shift the grid toward high noise (SD3's 3); 1: none
    num_steps: int = FAST_STEPS  # the fast protocol (moh_dit.sampling.spec.PROTOCOLS)
    scheduler: str = FAST_SCHEDULER  # ddpm | ddim | dpm-solver | ... (moh_dit.sampling.spec.SCHEDULERS)

    def sampling(self) -> SamplingSpec:
        """How the grids are drawn, checked; the error of a bad value names its key."""
        return SamplingSpec.from_config(dataclasses.asdict(self))


@dataclass
class Config:
    model: ModelSection = field(default_factory=ModelSection)
    objective: ObjectiveSection = field(default_factory=ObjectiveSection)
    data: DataSection = field(default_factory=DataSection)
    optim: OptimSection = field(default_factory=OptimSection)
    train: TrainSection = field(default_factory=TrainSection)
    ema: EMASection = field(default_factory=EMASection)
    log: LogSection = field(default_factory=LogSection)
    preview: PreviewSection = field(default_factory=PreviewSection)
    repa: RepaSection = field(default_factory=RepaSection)

    def validate(self) -> None:
        """Every value checked once, when the config is read, so that a typo fails before any data, VAE or
        model is loaded."""
        model, data, optim, train, ema, log = self.model, self.data, self.optim, self.train, self.ema, self.log
        if not isinstance(model.overrides, dict):
            raise ConfigError(
                f"model.overrides must be a mapping such as {{hidden_size: 256}}, got {model.overrides!r}"
            )
        if model.init_from:  # the weights carry their architecture; the trainer checks the overrides against it
            # and records the preset the weights match
            check_config_keys(model.overrides)
        else:  # the preset name, the override keys and per-layer lengths, once
            preset_config(model.preset, **model.overrides)
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
        self.preview.sampling()  # the preview spec checks its own keys
        from moh_dit.training.objective import check_objective

        check_objective(self, Config())
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
            _at_least(f"preview.{name}", getattr(self.preview, name), 0)
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
        if not 0.0 <= ema.decay <= 1.0:
            raise ConfigError(f"ema.decay must be in [0, 1], got {ema.decay}")
        check_posthoc(ema, train.global_batch_size)
        check_repa(self.repa)
        if not 0.0 <= data.max_bad_fraction <= 1.0:
            raise ConfigError(f"data.max_bad_fraction must be in [0, 1], got {data.max_bad_fraction}")
        if train.resume is not None and not isinstance(train.resume, str):
            raise ConfigError(
                f"train.resume must be 'latest' or the path of a checkpoint folder, got {train.resume!r}"
            )
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


# Trackers accelerate can log to (accelerate.tracking.LOGGER_TYPE_TO_CLASS); checked without importing it.
TRACKERS = ("tensorboard", "wandb", "comet_ml", "aim", "mlflow", "clearml", "dvclive", "swanlab", "trackio")
# keys of earlier versions, and what replaces them
RENAMED = {
    "log.tensorboard": "log.tensorboard was replaced by log.trackers (e.g. log.trackers=[tensorboard], or [] for none)"
}


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
    from moh_dit.training.posthoc_ema import MAX_SIGMA_REL

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


# keys of moh-dit 0.2 that moved to another section: configs and run folders that use them still load
MOVED = {
    "log.sample_every": "preview.every",
    "log.sample_per_class": "preview.per_class",
    "log.sample_max_classes": "preview.max_classes",
    **{f"log.{old}": f"preview.{new}" for old, new in LEGACY_CONFIG_KEYS.items()},
}


def _move_old_keys(raw: dict[str, Any]) -> dict[str, Any]:
    """Keys of :data:`MOVED` to where they live now (a warning names them); an old and a new key for the same
    value are an error."""
    moved = []
    for old, new in MOVED.items():
        (old_section, old_key), (new_section, new_key) = old.split("."), new.split(".")
        section = raw.get(old_section)
        if not isinstance(section, dict) or old_key not in section:
            continue
        target = raw.setdefault(new_section, {}) or {}
        raw[new_section] = target
        if not isinstance(target, dict):
            raise ConfigError(f"{new_section} must be a mapping, got {target!r}")
        if new_key in target:
            raise ConfigError(f"{old} and {new} are the same setting: give {new} only")
        target[new_key] = section.pop(old_key)
        moved.append(f"{old} -> {new}")
    if moved:
        logging.getLogger("moh_dit").warning("config keys of moh-dit 0.2 read as: %s", ", ".join(moved))
    return raw


def _from_dict(cls, data: dict[str, Any], where: str):
    if not isinstance(data, dict):
        raise ConfigError(f"{(where or 'config').rstrip('.')} must be a mapping, got {data!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    renamed = [RENAMED[f"{where}{k}"] for k in unknown if f"{where}{k}" in RENAMED]
    if renamed:
        raise ConfigError("; ".join(renamed))
    if unknown:
        raise ConfigError(
            f"unknown config keys {[f'{where}{k}' for k in unknown]}; valid: {[f'{where}{k}' for k in fields]}"
        )
    kwargs = {}
    for name, value in data.items():
        default = getattr(cls(), name)
        if dataclasses.is_dataclass(default):
            kwargs[name] = _from_dict(type(default), {} if value is None else value, f"{where}{name}.")
        elif isinstance(default, tuple) and isinstance(value, list):
            kwargs[name] = tuple(value)
        else:
            kwargs[name] = _coerce(value, default, f"{where}{name}")
    return cls(**kwargs)


def _coerce(value: Any, default: Any, key: str) -> Any:
    """Match the type of the field's default (YAML reads ``3e-4`` as a string, ``1`` as an int)."""
    if value is None or default is None:
        return value
    try:
        if isinstance(default, bool):
            if isinstance(value, bool):
                return value
            raise TypeError
        if isinstance(default, int):
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise TypeError
            return int(value)
        if isinstance(default, float):
            if isinstance(value, bool):
                raise TypeError
            return float(value)
        if isinstance(default, str) and not isinstance(value, str):
            raise TypeError
        if isinstance(default, list):
            value = [value] if isinstance(value, str) else value  # one tracker may be given without brackets
            if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                raise TypeError
    except (TypeError, ValueError):
        raise ConfigError(f"{key} must be a {type(default).__name__}, got {value!r}") from None
    return value


def config_to_dict(config: Config) -> dict[str, Any]:
    def convert(v):
        if isinstance(v, tuple):
            return list(v)
        if isinstance(v, dict):
            return {k: convert(x) for k, x in v.items()}
        return v

    return {k: convert(v) for k, v in dataclasses.asdict(config).items()}


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``section.key=value`` strings (values parsed as YAML) to a nested dict."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like section.key=value")
        key, value = item.split("=", 1)
        parts = key.strip().lstrip("-").split(".")
        node = raw
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"cannot set {key}: {part} is not a section")
        try:
            node[parts[-1]] = yaml.safe_load(value)
        except yaml.YAMLError as err:
            raise ConfigError(f"override {item!r}: the value is not valid YAML ({_yaml_problem(err)})") from None
    return raw


def _merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in update.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def _read_yaml(path: Path, seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    """Read a YAML config; a top-level ``base: other.yaml`` (relative to this file) is read first."""
    if not path.is_file():
        raise ConfigError(f"config file {path} not found")
    if path.resolve() in seen:
        raise ConfigError(f"config files include each other in a loop: {path}")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"{path} is not valid YAML: {_yaml_problem(err)}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path} must hold a mapping of sections")
    base = raw.pop("base", None)
    if base is None:
        return raw
    return _merge(_read_yaml(path.parent / base, (*seen, path.resolve())), raw)


def _yaml_problem(err: yaml.YAMLError) -> str:
    mark = getattr(err, "problem_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    return f"{getattr(err, 'problem', None) or err}{where}"


def load_config(source: str | Path | dict | None = None, overrides: list[str] | None = None) -> Config:
    """Defaults, updated by ``source`` (a YAML file, or a dict of sections as the file would hold, which may
    name a ``base`` file) and then by ``section.key=value`` ``overrides``; validated once."""
    if isinstance(source, dict):
        raw = copy.deepcopy(source)
        base = raw.pop("base", None)
        raw = _merge(_read_yaml(Path(base)), raw) if base is not None else raw
    else:
        raw = _read_yaml(Path(source)) if source is not None else {}
    raw = _move_old_keys(apply_overrides(raw, overrides or []))
    config = _from_dict(Config, raw, "")
    config.validate()
    return config
