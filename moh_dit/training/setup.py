"""What a training run is built from: the model (preset, init, EMA), the accelerator (processes,
precision, accumulation), the optimizer and learning rate, the run's identity for resume checks, and the
stop signals.
"""

from __future__ import annotations

import contextlib
import logging
import math
import signal
import threading
from collections.abc import Collection, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import ProjectConfiguration
from diffusers.training_utils import EMAModel

from moh_dit.data.training_data import TrainingData
from moh_dit.errors import ConfigError, NonFiniteLossError
from moh_dit.manifests import fingerprint_module, format_differences, short
from moh_dit.model.network import MoHDiT
from moh_dit.model.presets import architecture, preset_config
from moh_dit.model.surgery import with_num_classes
from moh_dit.training.config import Config, EMASection
from moh_dit.training.objective import objective_record, run_objective
from moh_dit.training.tracking import tracker_available
from moh_dit.vae import latent_space_differences, space_of

logger = logging.getLogger("moh_dit.train")


# ----------------------------------------------------------------------------------------------------
# Construction
# ----------------------------------------------------------------------------------------------------
def build_model(
    config: Config, data: TrainingData, frozen: Mapping[str, Any] | None = None
) -> tuple[MoHDiT, dict | None]:
    """The preset with overrides, the data's shape and the objective's head filled in (checked when given
    explicitly), the student a frozen model starts (a teacher's), or the weights of ``init_from`` (which keep the
    objective they were trained with); returns the model and, for a teacher or ``init_from``, a report of what was
    kept.

    ``num_classes=0`` (an override) trains an unconditional model on any data (labels are ignored).
    """
    section = config.model
    report = None
    wanted = section.overrides.get("num_classes", data.num_classes)
    started = [made for model in (frozen or {}).values() if (made := model.initial_student(config, data)) is not None]
    if started:
        model, report = started[0]
    elif section.init_from:
        from moh_dit.sampling.sources import load_transformer, source_vae_record

        model, source = load_transformer(section.init_from)
        logger.info("initialised from %s", source.describe())
        source_vae = source_vae_record(source)
        _check_init_latent_space(section.init_from, source_vae, data.vae_record)
        # what the run started from, so that its record names the weights and not only a path
        report = {
            "init_from": source.describe(),
            "transformer_sha256": fingerprint_module(model),
            "vae_sha256": (source_vae or {}).get("sha256"),
        }
        if model.config.num_classes != wanted:
            if section.init_classes == "strict":
                raise ConfigError(
                    f"{section.init_from} has {model.config.num_classes} classes but this run has {wanted}: pass "
                    f"--init-classes resize (keep the shared label rows) or reinit (a new label table); every other "
                    f"weight is kept"
                )
            model, resized = with_num_classes(model, wanted, section.init_classes)
            report = resized | report
            new = ", ".join(report["new"]) or "none"
            logger.info(
                f"label table {section.init_classes}d from {report['classes'][0]} to {report['classes'][1]} "
                f"classes; kept {len(report['kept'])} tensors; new: {new}"
            )
        # an override is a claim about the architecture: one the weights contradict would be silently ignored
        have = architecture(model.config)
        claimed = architecture(dict(model.config) | dict(section.overrides))
        wrong = [
            f"{k}={section.overrides[k]!r} (the weights have {model.config[k]!r})"
            for k in section.overrides
            if k != "num_classes" and claimed[k] != have[k]
        ]
        if wrong:
            raise ConfigError(
                f"model.overrides contradict {section.init_from}: {', '.join(wrong)}; the architecture comes from "
                f"init_from, so drop these overrides ({HOW_TO_DROP_OVERRIDES})"
            )
        record = objective_record(config, model.config.objective, section.init_from)
        if run_objective(config, record, model.config.learn_sigma).record() != model.config.objective:
            model.register_to_config(objective=record)  # an older moh-dit's flow record, completed
    else:
        derived = dict(in_channels=data.in_channels, sample_size=data.sample_size, num_classes=data.num_classes)
        objective = run_objective(config, objective_record(config), learn_sigma=False)
        derived |= objective.model_config()
        model_config = preset_config(section.preset, **(derived | dict(section.overrides)))
        _check_patch_grid(section.preset, model_config, data)
        model = MoHDiT(**model_config)
    cfg = model.config
    for key, value in dict(in_channels=data.in_channels, sample_size=data.sample_size).items():
        if cfg[key] != value:
            raise ConfigError(f"model {key}={cfg[key]} does not match the data ({key}={value})")
    if cfg.num_classes not in (0, data.num_classes):
        raise ConfigError(
            f"model has num_classes={cfg.num_classes} but the data set has {data.num_classes} classes "
            f"(model.overrides.num_classes=0 trains an unconditional model)"
        )
    return model, report


def _check_patch_grid(preset: str, model_config: dict, data: TrainingData) -> None:
    """The patch size must divide the grid the model sees (the latent grid, image size / the autoencoder's
    downsampling); otherwise the patch embedding would drop the last rows and columns."""
    size, patch = model_config["sample_size"], model_config["patch_size"]
    if size % patch:
        where = (
            f"the {size} x {size} latent grid of the {data.vae_record.get('kind', 'autoencoder')} "
            f"({data.vae_record['downsample_factor']}x downsampling)"
            if data.vae_record
            else f"the {size} x {size} images"
        )
        raise ConfigError(
            f"{preset}'s patch size {patch} does not divide {where}: choose a preset whose patch size divides "
            f"{size} (or model.overrides.patch_size), or another data.image_size"
        )


def describe_tokens(model_config, vae_record: dict | None) -> str:
    """The tokens per image the transformer attends over, and where they come from (printed at the start of a run)."""
    size, patch = model_config["sample_size"], model_config["patch_size"]
    space = f"{space_of(vae_record)['kind']} latents" if vae_record else "pixels"
    return (
        f"{(size // patch) ** 2} tokens per image: {model_config['in_channels']} x {size} x {size} {space} in "
        f"{patch} x {patch} patches ({size // patch} x {size // patch})"
    )


def _check_init_latent_space(init_from: str, source: dict | None, data: dict | None) -> None:
    """Weights trained on the latents of one VAE learn nothing useful from latents of another scale or
    resolution (the channel count is checked with the model's shape); another VAE with the same numbers
    (a re-trained encoder) is allowed and said."""
    if source is None or data is None:
        return
    wrong = latent_space_differences(source, data)
    if wrong:
        raise ConfigError(
            f"{init_from} was trained in another latent space than this data's VAE ({format_differences(wrong)}): "
            f"use the VAE it was trained with (data.vae, or latents extracted with it)"
        )
    if source.get("sha256") and source["sha256"] != data.get("sha256"):
        logger.warning(
            "%s was trained with another VAE (fingerprint %s) than this data's (%s); the latent-space numbers agree",
            init_from,
            short(source["sha256"]),
            short(data.get("sha256")),
        )


# how to drop overrides a base config sets (a `base:` YAML's model.overrides reach every config built on it)
HOW_TO_DROP_OVERRIDES = (
    "those a base config sets: 'model.overrides={}' on the command line, or model.overrides: {} in yours"
)


def make_ema(model: torch.nn.Module, section: EMASection) -> EMAModel:
    """diffusers' EMA configured as DiT: a copy of the model at step 0, then a constant ``decay`` from the
    first update on (``update_after_step=-1``; with 0 diffusers' first update would copy the weights).
    ``section.warmup`` switches to diffusers' warm-up schedule instead."""
    return EMAModel(
        model.parameters(),
        decay=section.decay,
        min_decay=0.0 if section.warmup else section.decay,
        update_after_step=0 if section.warmup else -1,
        use_ema_warmup=section.warmup,
        inv_gamma=section.inv_gamma,
        power=section.power,
        foreach=True,
    )


def token_routing(section, model: torch.nn.Module) -> tuple[tuple[int, int] | None, int]:
    """TREAD's span of blocks ``[start, stop)`` in ``model`` and how many tokens of each image skip it (``(None, 0)``:
    off), logged; a span outside the model (one of ``model.init_from``'s weights) is a ConfigError."""
    if not section.share:
        return None, 0
    from moh_dit.model.token_routing import resolve_span

    try:
        span = resolve_span(section.first_block, section.last_block, len(model.blocks))
    except ValueError as err:
        raise ConfigError(f"token_routing: {err}") from None
    routed = round(section.share * model.num_tokens)
    logger.info(
        "token routing (TREAD): %d of %d tokens per image skip blocks %d-%d in training; sampling uses every token",
        routed, model.num_tokens, span[0], span[1] - 1,
    )  # fmt: skip
    return span, routed


class EMANetwork:
    """The EMA weights as a network of their own, for objectives that predict with them (folded guidance from the
    EMA): a copy of the model, without gradient, refreshed from the EMA whenever the EMA has stepped since (so also
    after a resume loads it)."""

    def __init__(self, model: torch.nn.Module, ema: EMAModel) -> None:
        import copy

        self.ema, self.network, self._step = ema, copy.deepcopy(model).eval().requires_grad_(False), None

    def current(self) -> torch.nn.Module:
        if self._step != self.ema.optimization_step:
            self.ema.copy_to(self.network.parameters())
            self._step = self.ema.optimization_step
        return self.network


@contextlib.contextmanager
def stop_signals() -> Iterator[list[int]]:
    """SIGINT and SIGTERM ask the loop to stop after the current step (it saves a checkpoint and exits
    cleanly); a second signal aborts at once. Yields the list of received signal numbers."""
    received: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield received
        return

    def handler(signum, frame):  # noqa: ARG001
        if received:
            raise KeyboardInterrupt
        received.append(signum)
        name = signal.Signals(signum).name
        logger.warning("received %s: stopping after this step with a checkpoint (send it again to abort now)", name)

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield received
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def make_accelerator(config: Config) -> Accelerator:
    """accelerate for this run; ``Accelerator(cpu=True)`` on machines without CUDA makes CPU processes see
    each other (``torchrun --nproc_per_node N``)."""
    if torch.cuda.is_available():
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = config.train.allow_tf32
    missing = [name for name in config.log.trackers if not tracker_available(name)]
    if missing:
        raise ConfigError(
            f"log.trackers: {', '.join(missing)} not installed; pip install {' '.join(missing)} (or set "
            f"log.trackers to the ones you have; tensorboard comes with moh-dit)"
        )
    run = Path(config.train.output_dir)
    return Accelerator(
        mixed_precision=config.train.mixed_precision,
        gradient_accumulation_steps=config.train.grad_accum_steps,
        cpu=not torch.cuda.is_available(),
        log_with=list(config.log.trackers) or None,
        project_config=ProjectConfiguration(project_dir=str(run), logging_dir=str(run / "tensorboard")),
    )


def micro_batch_size(config: Config, world: int) -> int:
    """Images per process and micro-step: the global batch split over processes and accumulation steps."""
    per_step = world * config.train.grad_accum_steps
    if config.train.global_batch_size % per_step:
        raise ConfigError(
            f"train.global_batch_size={config.train.global_batch_size} is not divisible by {world} processes x "
            f"{config.train.grad_accum_steps} accumulation steps"
        )
    return config.train.global_batch_size // per_step


def make_optimizer(model: torch.nn.Module, config: Config, new: Collection[str] = ()) -> torch.optim.Optimizer:
    """AdamW over the model's parameters; those named in ``new`` (not taken from a teacher or ``init_from``) form a
    second group (``new``) whose learning rate is ``optim.new_lr_scale`` times the schedule's."""
    optim = config.optim
    named = list(model.named_parameters())
    split = bool(new) and optim.new_lr_scale != 1.0  # one group as before otherwise: older checkpoints resume
    groups = [{"params": [p for name, p in named if not (split and name in new)], "new": False}]
    if split:
        groups.append({"params": [p for name, p in named if name in new], "new": True})
    return torch.optim.AdamW(
        groups, lr=optim.lr, betas=tuple(optim.betas), eps=optim.eps, weight_decay=optim.weight_decay
    )


def learning_rate(config: Config, step: int) -> float:
    """The learning rate of optimizer step ``step`` (0-based): linear warm-up, then constant (as DiT) or a
    cosine decay to ``optim.min_lr`` at ``train.max_steps``."""
    optim = config.optim
    warmed = optim.lr * min(1.0, (step + 1) / max(1, optim.warmup_steps))
    if optim.schedule == "constant" or step < optim.warmup_steps:
        return warmed
    progress = min(1.0, (step - optim.warmup_steps) / max(1, config.train.max_steps - optim.warmup_steps))
    return optim.min_lr + (optim.lr - optim.min_lr) * 0.5 * (1 + math.cos(math.pi * progress))


def non_finite_error(
    step: int, saved: Path | None, peak: float, newest: Path | None, losses=None
) -> NonFiniteLossError:
    """The one-line stop for a non-finite loss at ``step + 1`` (``losses``) or exploded weights at ``step``."""
    if losses is not None:
        what = f"non-finite loss at step {step + 1} (diffusion {losses[0].item():.4g}, MoH {losses[1].item():.4g})"
    else:
        what = f"exploded weights at step {step}"
    where = (
        f"the state before this step is saved in {saved}"
        if saved is not None
        else f"the weights had already exploded (max |w| = {peak:.3g}) and were not saved; the newest good "
        f"checkpoint is {newest or 'none'}"
    )
    return NonFiniteLossError(
        f"{what}; {where}. Try a lower optim.lr, optim.grad_clip > 0, or train.mixed_precision=bf16/no"
    )


def warn_if_never_folded(folded, max_steps: int) -> None:
    """Say, before training, that a run ends before its folded guidance's warm-up does (``folded``: the objective's
    :class:`~moh_dit.objectives.folded_guidance.FoldedGuidance`): the model records the guidance without learning it."""
    if folded.active and folded.warmup >= max_steps:
        logger.warning(
            "objective.guidance_warmup=%d is not shorter than train.max_steps=%d: this run will not fold its guidance "
            "in (the model records it, but learns it only once a resume trains past step %d); until then sample it "
            "with CFG (--cfg-scale)",
            folded.warmup,
            max_steps,
            folded.warmup,
        )
