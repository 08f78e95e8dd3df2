r"""The training loop: DiT/MoH-DiT on accelerate, from one CPU to many GPUs and nodes.

    python train.py --config configs/fashion_mnist_moh.yaml
    accelerate launch --multi_gpu --num_processes 8 train.py --config configs/imagenet256/moh-dit-xl-2-90.yaml \
        data.path=/data/imagenet/train

What it adds over the reference scripts: exact resume (model, EMA, optimizer, grad scaler, step, RNG
states, data position and the open loss window; a SIGKILLed run resumes to the same per-step losses),
checkpoints written atomically and only from finite, sane weights, a clean stop with a checkpoint on
SIGINT/SIGTERM (how schedulers preempt), a run folder that is never mixed with another run, mixed
precision, gradient accumulation and checkpointing, the diffusion and MoH losses logged separately and
averaged over processes, and per-layer head usage.

All randomness of a step comes from a generator seeded by (seed, rank, step, micro-batch) and the data
order is a pure function of (seed, epoch, rank) (see ``moh_dit.seeding``); that is what makes a resumed
run bit-identical to an uninterrupted one.
"""
from __future__ import annotations

import contextlib
import logging
import random
import signal
import threading
import time
from pathlib import Path
from typing import Any, Iterator, Optional

import numpy as np
import torch
import yaml
from accelerate import Accelerator
from accelerate.utils import set_seed
from diffusers.training_utils import EMAModel
from torch.utils.data import DataLoader

from .artifacts import (
    RunLayout,
    atomic_write_text,
    begin_checkpoint,
    check_run_manifest,
    checkpoint_step,
    find_checkpoint,
    finish_checkpoint,
    format_differences,
    open_run_folder,
    prune_checkpoints,
    read_checkpoint,
    weight_health,
    write_checkpoint_weights,
    write_rank_state,
    write_run_manifest,
)
from .config import Config, EMASection, ModelSection, config_to_dict
from .data import ShardedEpochBatchSampler, TrainingData, load_training_data
from .diffusion import DiffusionObjective
from .errors import ArtifactError, ConfigError, NonFiniteLossError
from .images import make_grid
from .latents import encode_posterior, sample_posterior
from .model import MoHDiT
from .pipeline import MoHDiTPipeline
from .presets import preset_config
from .seeding import step_generator
from .tracking import LossWindow, MetricsLog, Progress

__all__ = ["train", "Trainer", "NonFiniteLossError", "find_checkpoint", "build_model", "make_ema", "run_identity"]

logger = logging.getLogger("moh_dit.train")


# ----------------------------------------------------------------------------------------------------
# Construction
# ----------------------------------------------------------------------------------------------------
def build_model(section: ModelSection, data: TrainingData) -> MoHDiT:
    """The preset with overrides and the data's shape filled in (checked when given explicitly), or the
    weights of ``init_from``."""
    if section.init_from:
        from .generate import load_transformer

        model, source = load_transformer(section.init_from)
        logger.info("initialised from %s", source.describe())
    else:
        overrides = dict(section.overrides)
        for key, value in dict(in_channels=data.in_channels, sample_size=data.sample_size,
                               num_classes=data.num_classes).items():  # fmt: skip
            overrides.setdefault(key, value)
        model = MoHDiT(**preset_config(section.preset, **overrides))
    cfg = model.config
    for key, value in dict(in_channels=data.in_channels, sample_size=data.sample_size).items():
        if cfg[key] != value:
            raise ConfigError(f"model {key}={cfg[key]} does not match the data ({key}={value})")
    if cfg.num_classes != data.num_classes:
        raise ConfigError(f"model has num_classes={cfg.num_classes} but the data set has {data.num_classes} classes")
    return model


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


def run_identity(config: Config, data: TrainingData, model: MoHDiT) -> tuple[dict, dict]:
    """``(identity, settings)`` of a run. The identity (architecture, data, seed, global batch) makes a run
    this run: a resume with another identity is refused. Settings may change on resume; changes are logged
    and recorded in the run's manifest."""
    full = config_to_dict(config)
    data_keys = ("name", "split", "image_size", "channels", "random_flip", "subset_per_class")
    identity = {
        "model": {k: v for k, v in dict(model.config).items() if not k.startswith("_")},
        "data": {k: full["data"][k] for k in data_keys} | {"fingerprint": data.description.get("fingerprint"),
                                                            "vae_sha256": (data.vae_record or {}).get("sha256")},  # fmt: skip
        "train": {"seed": config.train.seed, "global_batch_size": config.train.global_batch_size},
    }
    volatile = ("resume", "overwrite", "output_dir")
    settings = {name: full[name] for name in ("optim", "ema", "log")}
    settings["train"] = {k: v for k, v in full["train"].items() if k not in volatile and k not in identity["train"]}
    settings["data"] = {k: v for k, v in full["data"].items() if k not in data_keys and k != "vae"}
    return identity, settings


# ----------------------------------------------------------------------------------------------------
# Stopping on a signal
# ----------------------------------------------------------------------------------------------------
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
        logger.warning("received %s: stopping after this step with a checkpoint (send it again to abort now)",
                       signal.Signals(signum).name)  # fmt: skip

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield received
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def _python_rng_state() -> dict[str, Any]:
    py, npy = random.getstate(), np.random.get_state()
    return {"python": [py[0], list(py[1]), py[2]], "numpy": [npy[0], npy[1].tolist(), *npy[2:]]}


def _set_python_rng_state(state: dict[str, Any]) -> None:
    py, npy = state["python"], state["numpy"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    np.random.set_state((npy[0], np.array(npy[1], dtype=np.uint32), *npy[2:]))


# ----------------------------------------------------------------------------------------------------
# The trainer
# ----------------------------------------------------------------------------------------------------
class Trainer:
    """Set-up, one micro-step, and ``run()``: the loop that trains to ``train.max_steps``."""

    def __init__(self, config: Config) -> None:
        self.config = config
        train_cfg = config.train
        self.layout = RunLayout(train_cfg.output_dir)
        self.accelerator = acc = Accelerator(
            mixed_precision=train_cfg.mixed_precision,
            gradient_accumulation_steps=train_cfg.grad_accum_steps,
            cpu=not torch.cuda.is_available(),  # Accelerator(cpu=True) makes CPU processes see each other
            log_with="tensorboard" if config.log.tensorboard else None,
            project_dir=str(self.layout.root),
        )
        self.world, self.rank = acc.num_processes, acc.process_index
        logger.info("%d process(es) on %s", self.world, acc.device)
        per_step = self.world * train_cfg.grad_accum_steps
        if train_cfg.global_batch_size % per_step:
            raise ValueError(f"train.global_batch_size={train_cfg.global_batch_size} is not divisible by "
                             f"{self.world} processes x {train_cfg.grad_accum_steps} accumulation steps")  # fmt: skip
        self.micro_batch = train_cfg.global_batch_size // per_step
        if torch.cuda.is_available():
            torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = train_cfg.allow_tf32

        # the run folder first: an earlier run there is refused before any data or model is loaded
        self.resume_from = open_run_folder(self.layout, train_cfg.resume, train_cfg.overwrite, acc.is_main_process)
        acc.wait_for_everyone()
        self.data = load_training_data(config.data, acc.device)

        set_seed(train_cfg.seed)  # identical initialisation on every rank
        model = build_model(config.model, self.data)
        if train_cfg.gradient_checkpointing:
            model.enable_gradient_checkpointing()
        model.train()
        self.ema = make_ema(model, config.ema)
        self.ema.to(acc.device)
        optim_cfg = config.optim
        optimizer = torch.optim.AdamW(model.parameters(), lr=optim_cfg.lr, betas=tuple(optim_cfg.betas),
                                      eps=optim_cfg.eps, weight_decay=optim_cfg.weight_decay)  # fmt: skip
        self.model, self.optimizer = acc.prepare(model, optimizer)
        if train_cfg.compile:
            self.model = torch.compile(self.model)
        self.objective = DiffusionObjective(learn_sigma=model.config.learn_sigma)
        self.identity, self.settings = run_identity(config, self.data, model)
        self.window = LossWindow(acc.device)
        self.metrics = MetricsLog(self.layout.metrics, acc, config.log.tensorboard)
        self.run_id: Optional[str] = None
        self.step = 0
        self.samples_seen = 0
        self.sampler_args = dict(dataset_size=len(self.data.dataset), batch_size=self.micro_batch,
                                 num_replicas=self.world, rank=self.rank, seed=train_cfg.seed)  # fmt: skip
        self.batches_per_epoch = ShardedEpochBatchSampler(**self.sampler_args).batches_per_epoch

    @property
    def unwrapped(self) -> MoHDiT:
        return self.accelerator.unwrap_model(self.model)

    def _param_names(self) -> list[str]:
        return [n for n, _ in self.unwrapped.named_parameters()]

    # ------------------------------------------------------------------------------------------------
    # One micro-step
    # ------------------------------------------------------------------------------------------------
    def _prepare_batch(self, x: torch.Tensor, y: torch.Tensor, gen: torch.Generator):
        """Flip, encode (or draw from pre-extracted posteriors) and noise a micro-batch."""
        device, data = self.accelerator.device, self.data
        n = x.shape[0]
        flip = torch.rand(n, generator=gen) < 0.5 if self.config.data.random_flip else torch.zeros(n, dtype=torch.bool)
        if data.latent_input:  # x: (N, 2 flips, 2 [mean, std], c, h, w)
            moments = x[torch.arange(n), flip.long()]
            x0 = sample_posterior(moments[:, 0], moments[:, 1], data.scaling_factor, gen).to(device)
        else:
            x = torch.where(flip[:, None, None, None], x.flip(-1), x).to(device)
            if data.vae is not None:
                mean, std = encode_posterior(data.vae, x)
                eps = torch.randn(mean.shape, generator=gen).to(device)
                x0 = (mean + std * eps) * data.scaling_factor
            else:
                x0 = x
        t = torch.randint(0, self.objective.num_timesteps, (n,), generator=gen).to(device)
        noise = torch.randn(x0.shape, generator=gen).to(device)
        drop = (torch.rand(n, generator=gen) < self.unwrapped.config.class_dropout_prob).long().to(device)
        return x0, y.to(device), t, noise, drop

    def _micro_step(self, x, y, micro: int, want_heads: bool):
        gen = step_generator(self.config.train.seed, self.rank, self.step, micro, self.config.train.grad_accum_steps)
        x0, y, t, noise, drop = self._prepare_batch(x, y, gen)
        x_t = self.objective.add_noise(x0, noise, t)
        with self.accelerator.autocast():
            y_in = y if self.unwrapped.config.num_classes > 0 else None
            out = self.model(x_t, t, y_in, force_drop_ids=drop if y_in is not None else None,
                             return_head_masks=want_heads)  # fmt: skip
        terms = self.objective.losses(out.sample.float(), x0, x_t, t, noise)
        diffusion_loss = terms.loss.mean()
        moh_loss = out.aux_loss.float()
        loss = diffusion_loss + self.config.train.moh_loss_coeff * moh_loss
        return loss, diffusion_loss.detach(), moh_loss.detach(), out.head_masks

    # ------------------------------------------------------------------------------------------------
    # Checkpoints
    # ------------------------------------------------------------------------------------------------
    def save_checkpoint(self, prune: bool = True) -> Optional[Path]:
        """Write ``checkpoints/step-N`` atomically. Writes nothing and returns ``None`` when the weights or
        EMA are not finite or have exploded: such a state must never replace a good checkpoint."""
        acc = self.accelerator
        sane, self.weight_peak = weight_health([*self.unwrapped.parameters(), *self.ema.shadow_params])
        if not sane:
            return None
        tmp, final = self.layout.checkpoint_tmp(self.step), self.layout.checkpoint(self.step)
        if acc.is_main_process:
            begin_checkpoint(tmp)
        acc.wait_for_everyone()
        if acc.is_main_process:
            ema_state = {n: p.detach().cpu().contiguous() for n, p in zip(self._param_names(), self.ema.shadow_params)}
            scaler = acc.scaler.state_dict() if acc.scaler is not None else None
            fingerprints = write_checkpoint_weights(tmp, self.unwrapped, ema_state, self.optimizer.state_dict(), scaler)
        rank_tensors = {"torch": torch.get_rng_state(), "window": self.window.state()}
        if torch.cuda.is_available():
            rank_tensors["cuda"] = torch.cuda.get_rng_state()
        write_rank_state(tmp, self.rank, rank_tensors, _python_rng_state())
        acc.wait_for_everyone()
        if acc.is_main_process:
            state = {
                "step": self.step,
                "samples_seen": self.samples_seen,
                "ema_optimization_step": self.ema.optimization_step,
                "micro_batches_per_rank": self.step * self.config.train.grad_accum_steps,
                "batches_per_epoch": self.batches_per_epoch,
                "world_size": self.world,
                "id2label": {str(k): v for k, v in self.data.id2label.items()},
                "vae": self.data.vae_record,
            }
            finish_checkpoint(tmp, final, state, dict(run_id=self.run_id, step=self.step,
                                                      max_abs_weight=self.weight_peak, **fingerprints))  # fmt: skip
            if prune:
                prune_checkpoints(self.layout, self.config.train.keep_last)
            logger.info("saved checkpoint %s", final)
        acc.wait_for_everyone()
        return final

    def load_checkpoint(self, path: Path, run_id: Optional[str] = None) -> None:
        """Restore everything a checkpoint holds; it must be of this architecture and (when both record
        one) of this run."""
        acc = self.accelerator
        contents = read_checkpoint(path, self.rank, acc.device)
        owner = (contents.manifest or {}).get("run_id")
        if run_id and owner and owner != run_id:
            raise ArtifactError(f"{path} belongs to another run ({owner[:12]}) than {self.layout.root} ({run_id[:12]})")
        saved = MoHDiT.load_config(path / "model")
        diffs = [(k, saved.get(k), v) for k, v in self.unwrapped.config.items()
                 if not k.startswith("_") and saved.get(k) != (list(v) if isinstance(v, tuple) else v)]  # fmt: skip
        if diffs:
            raise ArtifactError(f"checkpoint {path} is for another architecture ({format_differences(diffs)})")
        self.unwrapped.load_state_dict(contents.model_state)
        names = self._param_names()
        missing = [n for n in names if n not in contents.ema_state]
        if missing:
            raise ArtifactError(f"{path}/ema.safetensors does not match the model: missing {missing[:5]}")
        for name, shadow in zip(names, self.ema.shadow_params):
            shadow.copy_(contents.ema_state[name])
        state = contents.trainer_state
        self.ema.optimization_step = state["ema_optimization_step"]
        self.optimizer.load_state_dict(contents.optimizer_state)
        if acc.scaler is not None and contents.scaler_state is not None:
            acc.scaler.load_state_dict(contents.scaler_state)
        rng = contents.rank_tensors
        if "torch" in rng:
            torch.set_rng_state(rng["torch"])
            if "cuda" in rng and torch.cuda.is_available():
                torch.cuda.set_rng_state(rng["cuda"])
            _set_python_rng_state(contents.rank_python)
        self.window.load(rng.get("window"))
        if state.get("world_size") != self.world or state.get("batches_per_epoch") != self.batches_per_epoch:
            logger.warning("resuming with a different number of processes or data size: data order will differ")
        self.step, self.samples_seen = state["step"], state["samples_seen"]
        logger.info("resumed from %s at step %d", path, self.step)

    def _open_run(self) -> None:
        """Check the run's manifest, resume from the chosen checkpoint, and record the start."""
        acc = self.accelerator
        recorded, changes = check_run_manifest(self.layout, self.identity, self.settings)
        self.run_id = recorded["run_id"] if recorded else None
        if self.resume_from is not None:
            self.load_checkpoint(self.resume_from, self.run_id)
        if changes:
            logger.warning("resuming with changed settings: %s", format_differences(changes, limit=20))
        self.metrics.truncate_after(self.step)
        if acc.is_main_process:
            atomic_write_text(self.layout.config, yaml.safe_dump(config_to_dict(self.config), sort_keys=False))
            event = {"event": "resume" if self.step else "start", "step": self.step, "world_size": self.world,
                     "changed": {k: [a, b] for k, a, b in changes}}  # fmt: skip
            self.run_id = write_run_manifest(self.layout, recorded, self.identity, self.settings, event)["run_id"]
        acc.wait_for_everyone()

    def _record_event(self, event: str, **fields: Any) -> None:
        if self.accelerator.is_main_process:
            recorded, _ = check_run_manifest(self.layout, self.identity, self.settings)
            write_run_manifest(self.layout, recorded, self.identity, self.settings,
                               {"event": event, "step": self.step, **fields})  # fmt: skip

    def _stop_non_finite(self, diffusion_loss: torch.Tensor, moh_loss: torch.Tensor) -> None:
        """The loss of step N + 1 is not finite: save step N if its weights are sane, and stop."""
        self.optimizer.zero_grad(set_to_none=True)
        path = self.save_checkpoint(prune=False)  # never prune older checkpoints for a rescue save
        if path is not None:
            where = f"the state before this step is saved in {path}"
        else:
            newest = self.layout.latest_checkpoint()
            where = (f"the weights had already exploded (max |w| = {self.weight_peak:.3g}) and were not saved; the "
                     f"newest good checkpoint is {newest or 'none'}")  # fmt: skip
        self._record_event("stopped", reason="non-finite loss")
        raise NonFiniteLossError(
            f"non-finite loss at step {self.step + 1} (diffusion {diffusion_loss.item():.4g}, MoH {moh_loss.item():.4g}); "
            f"{where}. Try a lower optim.lr, optim.grad_clip > 0, or train.mixed_precision=bf16/no"
        )

    def _checkpoint(self, prune: bool = True) -> Path:
        path = self.save_checkpoint(prune)
        if path is None:
            newest = self.layout.latest_checkpoint()
            self._record_event("stopped", reason="exploded weights")
            raise NonFiniteLossError(
                f"the weights exploded by step {self.step} (max |w| = {self.weight_peak:.3g}) and were not saved; "
                f"the newest good checkpoint is {newest or 'none'}. Try a lower optim.lr or optim.grad_clip > 0"
            )
        return path

    # ------------------------------------------------------------------------------------------------
    # Previews and export: the EMA weights in a pipeline
    # ------------------------------------------------------------------------------------------------
    def ema_pipeline(self) -> MoHDiTPipeline:
        """The EMA weights with DiT's sampler, the VAE and the class names."""
        ema_model = MoHDiT.from_config(self.unwrapped.config).to(self.accelerator.device)
        self.ema.copy_to(ema_model.parameters())
        return MoHDiTPipeline.build(ema_model, self.data.vae, self.data.id2label,
                                    latent_space=self.data.vae_record is not None)  # fmt: skip

    @torch.no_grad()
    def save_sample_grid(self, tag: str) -> Optional[Path]:
        """A grid of EMA samples, one row per class (main process)."""
        if not self.accelerator.is_main_process:
            return None
        log_cfg = self.config.log
        pipe = self.ema_pipeline()
        classes = list(range(min(pipe.transformer.config.num_classes, log_cfg.sample_max_classes)))
        images, names = pipe.sample_grid(classes, log_cfg.sample_per_class, self.config.train.seed,
                                         log_cfg.sample_cfg_scale, log_cfg.sample_steps)  # fmt: skip
        out = self.layout.samples / f"{tag}.png"
        out.parent.mkdir(parents=True, exist_ok=True)
        make_grid(images, ncols=log_cfg.sample_per_class, row_labels=names).save(out)
        return out

    def export_pipeline(self) -> Optional[Path]:
        """The EMA model as a self-describing pipeline folder (``<run>/pipeline``) with its manifest."""
        acc = self.accelerator
        acc.wait_for_everyone()
        if not acc.is_main_process:
            return None
        source = {"run": str(self.layout.root.resolve()), "run_id": self.run_id, "step": self.step, "weights": "ema",
                  "vae": self.data.vae_record}  # fmt: skip
        return self.ema_pipeline().save(self.layout.pipeline, source)

    # ------------------------------------------------------------------------------------------------
    # The loop
    # ------------------------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        acc, train_cfg, log_cfg = self.accelerator, self.config.train, self.config.log
        self._open_run()
        if log_cfg.tensorboard:
            acc.init_trackers("tensorboard")
        n_params = sum(p.numel() for p in self.unwrapped.parameters())
        active, total = self.unwrapped.head_counts()
        logger.info("training %s: %s parameters, %d/%d heads active, %d processes x %d images x %d accumulation = %d "
                    "per step", self.config.model.preset, f"{n_params:,}", active, total, self.world, self.micro_batch,
                    train_cfg.grad_accum_steps, train_cfg.global_batch_size)  # fmt: skip
        lr_at = lambda s: self.config.optim.lr * min(1.0, (s + 1) / max(1, self.config.optim.warmup_steps))  # noqa: E731
        start_time = window_start = time.time()
        window_steps, last_heads, stop = 0, None, None
        progress = Progress(train_cfg.max_steps, self.step, "train", "step", acc.is_local_main_process)
        micro_total = self.step * train_cfg.grad_accum_steps
        with stop_signals() as received:
            while self.step < train_cfg.max_steps and stop is None:
                epoch, start_batch = divmod(micro_total, self.batches_per_epoch)
                sampler = ShardedEpochBatchSampler(**self.sampler_args, epoch=epoch, start_batch=start_batch)
                loader = DataLoader(self.data.dataset, batch_sampler=sampler, num_workers=self.config.data.num_workers,
                                    pin_memory=torch.cuda.is_available())  # fmt: skip
                for x, y in loader:
                    micro = micro_total % train_cfg.grad_accum_steps
                    micro_total += 1
                    want_heads = log_cfg.head_usage and (self.step + 1) % log_cfg.log_every == 0 and micro == 0
                    for group in self.optimizer.param_groups:
                        group["lr"] = lr_at(self.step)
                    with acc.accumulate(self.model):
                        loss, d_loss, m_loss, heads = self._micro_step(x, y, micro, want_heads)
                        # one tiny all-reduce: is the loss finite, is time up, was a stop signal received?
                        time_up = train_cfg.time_limit_minutes > 0 and time.time() - start_time > 60 * train_cfg.time_limit_minutes
                        flags = torch.tensor([float(not torch.isfinite(loss)), float(time_up), float(bool(received))],
                                             device=acc.device)  # fmt: skip
                        flags = acc.reduce(flags, reduction="sum") if self.world > 1 else flags
                        if flags[0] > 0:
                            self._stop_non_finite(d_loss, m_loss)
                        acc.backward(loss)
                        if acc.sync_gradients and self.config.optim.grad_clip > 0:
                            acc.clip_grad_norm_(self.model.parameters(), self.config.optim.grad_clip)
                        self.optimizer.step()
                        self.optimizer.zero_grad(set_to_none=True)
                    self.window.add(d_loss, m_loss)
                    last_heads = heads if heads is not None else last_heads
                    if stop is None and flags[2] > 0:
                        stop = signal.Signals(received[0]).name if received else "signal"
                    elif stop is None and flags[1] > 0:
                        stop = "time_limit"
                    if not acc.sync_gradients:
                        continue

                    # ---- one optimizer step done ----
                    self.step += 1
                    self.samples_seen += train_cfg.global_batch_size
                    window_steps += 1
                    if self.step % self.config.ema.update_every == 0:
                        self.ema.step(self.unwrapped.parameters())
                    on_boundary = self.step % log_cfg.log_every == 0
                    if on_boundary or self.step == train_cfg.max_steps:
                        d_mean, m_mean = self.window.means(acc)
                        elapsed = time.time() - window_start
                        record = {"step": self.step, "diffusion_loss": d_mean, "moh_loss": m_mean, "lr": lr_at(self.step - 1),
                                  "steps_per_s": window_steps / elapsed,
                                  "images_per_s": window_steps * train_cfg.global_batch_size / elapsed,
                                  "samples_seen": self.samples_seen}  # fmt: skip
                        if last_heads is not None:
                            record["head_usage"] = [m.float().mean(dim=(0, 1)).tolist() for m in last_heads]
                        self.metrics.write(record)
                        progress.update(0, loss=f"{d_mean:.4f}", moh=f"{m_mean:.3f}", img_s=f"{record['images_per_s']:.0f}")
                        if on_boundary:  # a last record between boundaries leaves the window open for a later resume
                            self.window.reset()
                            window_start, window_steps, last_heads = time.time(), 0, None
                    progress.update(1)
                    if self.step % train_cfg.checkpoint_every == 0:
                        self._checkpoint()
                    if log_cfg.sample_every > 0 and self.step % log_cfg.sample_every == 0 and log_cfg.sample_per_class:
                        self.save_sample_grid(f"step-{self.step:08d}")
                    if self.step >= train_cfg.max_steps or stop is not None:
                        break
        progress.close()
        if checkpoint_step(self.layout.latest_checkpoint() or "") != self.step:
            self._checkpoint()
        finished = stop in (None, "time_limit")  # a signal means "preempted": save and leave, quickly
        grid = self.save_sample_grid("final") if finished and log_cfg.sample_per_class > 0 else None
        pipeline_dir = self.export_pipeline() if finished else None
        self._record_event("stopped", reason=stop or "max_steps")
        acc.end_training()
        summary = {"step": self.step, "stop_reason": stop or "max_steps", "pipeline": str(pipeline_dir) if pipeline_dir else None,
                   "sample_grid": str(grid) if grid else None, "minutes": (time.time() - start_time) / 60}  # fmt: skip
        if acc.is_main_process:
            logger.info("done: %s", summary)
            if not finished:
                logger.warning("stopped by %s at step %d; continue with train.resume=latest", stop, self.step)
        return summary


def train(config: Config) -> dict[str, Any]:
    """Train according to ``config``; returns a summary (final step, stop reason, exported pipeline)."""
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.INFO)
    return Trainer(config).run()
