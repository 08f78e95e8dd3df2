"""The training loop: DiT/MoH-DiT training on accelerate, from one CPU to many GPUs and nodes.

What it adds over the reference scripts: exact resume (model, EMA, optimizer, grad scaler, step, RNG
states and data position; a SIGKILLed run resumes to the same per-step losses), atomic checkpoints,
mixed precision, gradient accumulation and checkpointing, the diffusion loss and the MoH loss logged
separately and averaged over processes, per-layer head usage, and a clean stop on a non-finite loss.

All randomness of a step (flips, timesteps, noise, label dropout, posterior draws) comes from a
generator seeded by (seed, rank, step, micro-batch), and the data order is a pure function of
(seed, epoch, rank); that is what makes a resumed run bit-identical to an uninterrupted one.
"""
from __future__ import annotations

import json
import logging
import os
import random
import shutil
import time
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
import yaml
from accelerate import Accelerator
from accelerate.utils import set_seed
from diffusers.training_utils import EMAModel
from safetensors.torch import load_file, save_file
from torch.utils.data import DataLoader, Dataset, Subset
from tqdm.auto import tqdm

from .config import Config, EMASection, config_to_dict
from .data import FashionMNIST, ImageFolderDataset, ShardedEpochBatchSampler, subset_indices
from .diffusion import DiffusionObjective
from .images import make_grid
from .latents import LatentDataset, encode_posterior, load_vae, sample_posterior
from .model import MoHDiT
from .generate import sample_grid
from .pipeline import MoHDiTPipeline, make_scheduler
from .presets import preset_config

__all__ = ["train", "Trainer", "NonFiniteLossError", "find_checkpoint", "build_dataset", "build_model", "make_ema"]

logger = logging.getLogger("moh_dit.train")
CHECKPOINT_PREFIX = "step-"


class NonFiniteLossError(RuntimeError):
    """Training stopped because the loss became NaN or infinite."""


# ----------------------------------------------------------------------------------------------------
# Data and model construction
# ----------------------------------------------------------------------------------------------------
def build_dataset(config: Config) -> Dataset:
    d = config.data
    if d.name == "fashion-mnist":
        ds = FashionMNIST(d.path, split=d.split, image_size=d.image_size, channels=d.channels, download=d.download)
    elif d.name == "folder":
        if not d.path:
            raise ValueError("data.name=folder needs data.path (a folder with one sub-folder per class)")
        ds = ImageFolderDataset(d.path, d.image_size, channels=d.channels, max_bad_fraction=d.max_bad_fraction)
    else:
        if not d.path:
            raise ValueError("data.name=latents needs data.path (a file written by `python -m moh_dit.latents`)")
        ds = LatentDataset(d.path)
    if d.subset_per_class > 0:
        return Subset(ds, subset_indices(ds.targets, d.subset_per_class))
    return ds


def build_model(config: Config, in_channels: int, sample_size: int, num_classes: int) -> MoHDiT:
    """The preset with overrides; data-derived fields filled in, and checked when given explicitly."""
    if config.model.init_from:
        path = Path(config.model.init_from)
        sub = "transformer" if (path / "transformer" / "config.json").exists() else None
        model = MoHDiT.from_pretrained(path, subfolder=sub)
    else:
        derived = dict(in_channels=in_channels, sample_size=sample_size, num_classes=num_classes)
        overrides = dict(config.model.overrides)
        for key, value in derived.items():
            overrides.setdefault(key, value)
        model = MoHDiT(**preset_config(config.model.preset, **overrides))
    cfg = model.config
    for key, value in dict(in_channels=in_channels, sample_size=sample_size).items():
        if cfg[key] != value:
            raise ValueError(f"model {key}={cfg[key]} does not match the data ({key}={value})")
    if cfg.num_classes != num_classes:
        raise ValueError(f"model has num_classes={cfg.num_classes} but the data set has {num_classes} classes")
    return model


# ----------------------------------------------------------------------------------------------------
# Checkpoints
# ----------------------------------------------------------------------------------------------------
def find_checkpoint(output_dir: str | os.PathLike, which: str = "latest") -> Optional[Path]:
    """``latest`` -> the newest complete checkpoint under ``output_dir/checkpoints`` (or None); a path ->
    that checkpoint, which must exist."""
    if which != "latest":
        path = Path(which)
        if not (path / "trainer_state.json").is_file():
            raise FileNotFoundError(f"{path} is not a complete checkpoint (no trainer_state.json)")
        return path
    root = Path(output_dir) / "checkpoints"
    done = [p for p in root.glob(f"{CHECKPOINT_PREFIX}*") if p.is_dir() and (p / "trainer_state.json").is_file()]
    return max(done, key=lambda p: int(p.name[len(CHECKPOINT_PREFIX) :]), default=None)


def _rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state()}
    return {
        "python": [state["python"][0], list(state["python"][1]), state["python"][2]],
        "numpy": [state["numpy"][0], state["numpy"][1].tolist(), *state["numpy"][2:]],
    }


def _set_rng_state(state: dict[str, Any]) -> None:
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    npy = state["numpy"]
    np.random.set_state((npy[0], np.array(npy[1], dtype=np.uint32), *npy[2:]))


def make_ema(model: torch.nn.Module, ec: EMASection) -> EMAModel:
    """diffusers' EMA configured as DiT: a copy of the model at step 0, then a constant ``decay`` from the
    first update on (``update_after_step=-1``; with 0 diffusers' first update would copy the weights).
    ``ec.warmup`` switches to diffusers' warm-up schedule instead."""
    return EMAModel(
        model.parameters(),
        decay=ec.decay,
        min_decay=0.0 if ec.warmup else ec.decay,
        update_after_step=0 if ec.warmup else -1,
        use_ema_warmup=ec.warmup,
        inv_gamma=ec.inv_gamma,
        power=ec.power,
        foreach=True,
    )


class Trainer:
    """Owns the accelerator, model, EMA, optimizer and data; ``run()`` trains to ``train.max_steps``."""

    def __init__(self, config: Config) -> None:
        self.config = config
        tc = config.train
        self.output_dir = Path(tc.output_dir)
        cpu = not torch.cuda.is_available()  # Accelerator(cpu=True) makes CPU processes see each other
        self.accelerator = Accelerator(
            mixed_precision=tc.mixed_precision,
            gradient_accumulation_steps=tc.grad_accum_steps,
            cpu=cpu,
            log_with="tensorboard" if config.log.tensorboard else None,
            project_dir=str(self.output_dir),
        )
        acc = self.accelerator
        self.world, self.rank = acc.num_processes, acc.process_index
        per_step = self.world * tc.grad_accum_steps
        if tc.global_batch_size % per_step:
            raise ValueError(
                f"train.global_batch_size={tc.global_batch_size} is not divisible by "
                f"{self.world} processes x {tc.grad_accum_steps} accumulation steps"
            )
        self.micro_batch = tc.global_batch_size // per_step
        if torch.cuda.is_available():
            torch.backends.cuda.matmul.allow_tf32 = tc.allow_tf32
            torch.backends.cudnn.allow_tf32 = tc.allow_tf32

        # data
        self.dataset = build_dataset(config)
        base = self.dataset.dataset if isinstance(self.dataset, Subset) else self.dataset  # class names live here
        self.id2label = getattr(base, "id2label", None) or {}
        self.vae = None
        self.scaling_factor = 1.0
        self.latent_input = isinstance(base, LatentDataset)
        if self.latent_input:
            self.scaling_factor = base.scaling_factor
            in_ch, size = base.latent_shape[0], base.latent_shape[-1]
            # the VAE is only needed to decode previews and for the exported pipeline
            spec = config.data.vae if config.data.vae != "none" else base.meta.get("vae")
            self.vae_spec = spec
            try:
                self.vae = load_vae(spec, device=acc.device)
            except (RuntimeError, OSError) as err:
                logger.warning("latents were made with VAE %r, which cannot be loaded (%s): no sample grids, and the "
                               "exported pipeline will have no VAE; pass data.vae=PATH to fix", spec, err)
        else:
            self.vae = load_vae(config.data.vae, device=acc.device)
            self.vae_spec = config.data.vae
            if self.vae is not None:
                self.scaling_factor = float(self.vae.config.scaling_factor)
                factor = 2 ** (len(self.vae.config.block_out_channels) - 1)
                in_ch, size = self.vae.config.latent_channels, config.data.image_size // factor
            else:
                in_ch, size = config.data.channels, config.data.image_size
        num_classes = len(self.id2label) if self.id2label else len(set(getattr(base, "targets", None) or [0]))

        # model, EMA, optimizer (identical initialisation on every rank)
        set_seed(tc.seed)
        model = build_model(config, in_ch, size, num_classes)
        if tc.gradient_checkpointing:
            model.enable_gradient_checkpointing()
        model.train()
        self.ema = make_ema(model, config.ema)
        self.ema.to(acc.device)
        oc = config.optim
        optimizer = torch.optim.AdamW(model.parameters(), lr=oc.lr, betas=tuple(oc.betas), eps=oc.eps,
                                      weight_decay=oc.weight_decay)  # fmt: skip
        self.model, self.optimizer = acc.prepare(model, optimizer)
        if tc.compile:
            self.model = torch.compile(self.model)
        self.objective = DiffusionObjective(learn_sigma=model.config.learn_sigma)
        self.step = 0
        self.samples_seen = 0
        self.sampler_args = dict(dataset_size=len(self.dataset), batch_size=self.micro_batch,
                                 num_replicas=self.world, rank=self.rank, seed=tc.seed)  # fmt: skip
        self.batches_per_epoch = ShardedEpochBatchSampler(**self.sampler_args).batches_per_epoch

    # ------------------------------------------------------------------------------------------------
    @property
    def unwrapped(self) -> MoHDiT:
        return self.accelerator.unwrap_model(self.model)

    def _step_generator(self, micro: int) -> torch.Generator:
        seed = ((self.config.train.seed * 1_000_003 + self.rank) * 1_000_003 + self.step) * 64 + micro
        return torch.Generator().manual_seed(seed % (2**63))

    def _prepare_batch(self, x: torch.Tensor, y: torch.Tensor, gen: torch.Generator):
        """Flip, encode (or draw from pre-extracted posteriors) and noise a micro-batch."""
        device = self.accelerator.device
        n = x.shape[0]
        flip = torch.rand(n, generator=gen) < 0.5 if self.config.data.random_flip else torch.zeros(n, dtype=torch.bool)
        if self.latent_input:  # x: (N, 2 flips, 2 [mean, std], c, h, w)
            moments = x[torch.arange(n), flip.long()]
            x0 = sample_posterior(moments[:, 0], moments[:, 1], self.scaling_factor, gen).to(device)
        else:
            x = torch.where(flip[:, None, None, None], x.flip(-1), x).to(device)
            if self.vae is not None:
                mean, std = encode_posterior(self.vae, x)
                eps = torch.randn(mean.shape, generator=gen).to(device)
                x0 = (mean + std * eps) * self.scaling_factor
            else:
                x0 = x
        t = torch.randint(0, self.objective.num_timesteps, (n,), generator=gen).to(device)
        noise = torch.randn(x0.shape, generator=gen).to(device)
        drop = (torch.rand(n, generator=gen) < self.unwrapped.config.class_dropout_prob).long().to(device)
        return x0, y.to(device), t, noise, drop

    def _micro_step(self, x, y, micro: int, want_heads: bool):
        gen = self._step_generator(micro)
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
    # Checkpointing
    # ------------------------------------------------------------------------------------------------
    def save_checkpoint(self) -> Path:
        """Write ``checkpoints/step-N`` atomically (a temp folder renamed when every rank is done)."""
        acc = self.accelerator
        root = self.output_dir / "checkpoints"
        final = root / f"{CHECKPOINT_PREFIX}{self.step:08d}"
        tmp = root / f".tmp-{CHECKPOINT_PREFIX}{self.step:08d}"
        if acc.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        acc.wait_for_everyone()
        if acc.is_main_process:
            self.unwrapped.save_pretrained(tmp / "model")
            ema_state = {n: p.detach().cpu().contiguous() for n, p in zip(self._param_names(), self.ema.shadow_params)}
            save_file(ema_state, tmp / "ema.safetensors")
            torch.save(self.optimizer.state_dict(), tmp / "optimizer.pt")
            if acc.scaler is not None:
                torch.save(acc.scaler.state_dict(), tmp / "scaler.pt")
        rng = {"torch": torch.get_rng_state()}
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.get_rng_state()
        save_file(rng, tmp / f"rng-rank{self.rank}.safetensors")
        (tmp / f"rng-rank{self.rank}.json").write_text(json.dumps(_rng_state()))
        acc.wait_for_everyone()
        if acc.is_main_process:
            state = {
                "step": self.step,
                "samples_seen": self.samples_seen,
                "ema_optimization_step": self.ema.optimization_step,
                "micro_batches_per_rank": self.step * self.config.train.grad_accum_steps,
                "batches_per_epoch": self.batches_per_epoch,
                "world_size": self.world,
                "id2label": {str(k): v for k, v in self.id2label.items()},
                "vae": self.vae_spec,
            }
            (tmp / "trainer_state.json").write_text(json.dumps(state, indent=2))
            os.replace(tmp, final)  # atomic: a checkpoint folder without .tmp is complete
            old = sorted(p for p in root.glob(f"{CHECKPOINT_PREFIX}*") if p.is_dir())
            for stale in old[: -self.config.train.keep_last]:
                shutil.rmtree(stale, ignore_errors=True)
            logger.info("saved checkpoint %s", final)
        acc.wait_for_everyone()
        return final

    def _param_names(self) -> list[str]:
        return [n for n, _ in self.unwrapped.named_parameters()]

    def load_checkpoint(self, path: Path) -> None:
        state = json.loads((path / "trainer_state.json").read_text())
        model = self.unwrapped
        weights = path / "model" / "diffusion_pytorch_model.safetensors"
        if not weights.is_file():
            raise FileNotFoundError(f"checkpoint {path} has no model weights ({weights})")
        saved_cfg = json.loads((path / "model" / "config.json").read_text())
        mismatched = {k: (saved_cfg.get(k), v) for k, v in model.config.items() if not k.startswith("_")
                      and saved_cfg.get(k) != (list(v) if isinstance(v, tuple) else v)}  # fmt: skip
        if mismatched:
            diff = ", ".join(f"{k}: checkpoint {a!r} vs config {b!r}" for k, (a, b) in mismatched.items())
            raise ValueError(f"checkpoint {path} is for another architecture ({diff})")
        model.load_state_dict(load_file(weights, device=str(self.accelerator.device)))
        ema = load_file(path / "ema.safetensors", device=str(self.accelerator.device))
        for name, shadow in zip(self._param_names(), self.ema.shadow_params):
            shadow.copy_(ema[name])
        self.ema.optimization_step = state["ema_optimization_step"]
        opt = torch.load(path / "optimizer.pt", map_location=self.accelerator.device, weights_only=True)
        self.optimizer.load_state_dict(opt)
        if self.accelerator.scaler is not None and (path / "scaler.pt").is_file():
            self.accelerator.scaler.load_state_dict(torch.load(path / "scaler.pt", weights_only=True))
        rng_file = path / f"rng-rank{self.rank}.safetensors"
        if rng_file.is_file():
            rng = load_file(rng_file)
            torch.set_rng_state(rng["torch"])
            if "cuda" in rng and torch.cuda.is_available():
                torch.cuda.set_rng_state(rng["cuda"])
            _set_rng_state(json.loads((path / f"rng-rank{self.rank}.json").read_text()))
        if state.get("world_size") != self.world or state.get("batches_per_epoch") != self.batches_per_epoch:
            logger.warning("resuming with a different number of processes or data size: data order will differ")
        self.step = state["step"]
        self.samples_seen = state["samples_seen"]

    # ------------------------------------------------------------------------------------------------
    # Logging helpers
    # ------------------------------------------------------------------------------------------------
    def _metrics_path(self) -> Path:
        return self.output_dir / "metrics.jsonl"

    def _truncate_metrics(self) -> None:
        """After a resume, drop log lines from steps the interrupted run did after its checkpoint."""
        path = self._metrics_path()
        if self.accelerator.is_main_process and path.exists():
            lines = [ln for ln in path.read_text().splitlines() if ln.strip() and json.loads(ln).get("step", 0) <= self.step]
            path.write_text("".join(ln + "\n" for ln in lines))

    @staticmethod
    def head_usage(head_masks) -> list[list[float]]:
        """Per layer, the fraction of tokens that used each head."""
        return [m.float().mean(dim=(0, 1)).tolist() for m in head_masks]

    def ema_pipeline(self) -> MoHDiTPipeline:
        """The EMA weights in a pipeline with DiT's sampler, the VAE and the class names."""
        ema_model = MoHDiT.from_config(self.unwrapped.config).to(self.accelerator.device)
        self.ema.copy_to(ema_model.parameters())
        return MoHDiTPipeline(ema_model.eval(), make_scheduler("ddpm", ema_model.config.learn_sigma), self.vae,
                              self.id2label)  # fmt: skip

    @torch.no_grad()
    def save_sample_grid(self, tag: str) -> Optional[Path]:
        """A grid of EMA samples, one row per class (main process)."""
        if not self.accelerator.is_main_process:
            return None
        lc = self.config.log
        pipe = self.ema_pipeline()
        pipe.set_progress_bar_config(disable=True)
        classes = list(range(min(pipe.transformer.config.num_classes, lc.sample_max_classes)))
        images, names = sample_grid(pipe, classes, lc.sample_per_class, self.config.train.seed, lc.sample_cfg_scale,
                                    lc.sample_steps)  # fmt: skip
        grid = make_grid(images, ncols=lc.sample_per_class, row_labels=names)
        out = self.output_dir / "samples" / f"{tag}.png"
        out.parent.mkdir(parents=True, exist_ok=True)
        grid.save(out)
        return out

    def export_pipeline(self) -> Optional[Path]:
        """The EMA model as a self-describing pipeline folder (``output_dir/pipeline``)."""
        acc = self.accelerator
        acc.wait_for_everyone()
        if not acc.is_main_process:
            return None
        pipe = self.ema_pipeline()
        out = self.output_dir / "pipeline"
        tmp = self.output_dir / ".tmp-pipeline"
        shutil.rmtree(tmp, ignore_errors=True)
        pipe.save_pretrained(tmp, safe_serialization=True)
        shutil.rmtree(out, ignore_errors=True)
        os.replace(tmp, out)
        return out

    # ------------------------------------------------------------------------------------------------
    # Main loop
    # ------------------------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        acc, tc, lc = self.accelerator, self.config.train, self.config.log
        if acc.is_main_process:
            self.output_dir.mkdir(parents=True, exist_ok=True)
            (self.output_dir / "config.yaml").write_text(yaml.safe_dump(config_to_dict(self.config), sort_keys=False))
            (self.output_dir / "model_config.json").write_text(json.dumps(dict(self.unwrapped.config), indent=2))
        if tc.resume:
            ckpt = find_checkpoint(self.output_dir, tc.resume)
            if ckpt is not None:
                self.load_checkpoint(ckpt)
                logger.info("resumed from %s at step %d", ckpt, self.step)
            elif tc.resume != "latest":
                raise FileNotFoundError(f"no checkpoint at {tc.resume}")
            self._truncate_metrics()
        if self.config.log.tensorboard:
            acc.init_trackers("tensorboard")

        n_params = sum(p.numel() for p in self.unwrapped.parameters())
        active, total = self.unwrapped.head_counts()
        logger.info(
            "training %s: %s parameters, %d/%d heads active, %d processes x %d images x %d accumulation = %d per step",
            self.config.model.preset, f"{n_params:,}", active, total, self.world, self.micro_batch,
            tc.grad_accum_steps, tc.global_batch_size,
        )  # fmt: skip
        lr_at = lambda s: self.config.optim.lr * min(1.0, (s + 1) / max(1, self.config.optim.warmup_steps))  # noqa: E731
        start_time = time.time()
        window_start, window_steps = time.time(), 0
        sums = torch.zeros(3, device=acc.device)  # diffusion loss, moh loss, count since the last log
        last_heads = None
        stop_reason = "max_steps"
        bar = tqdm(total=tc.max_steps, initial=self.step, disable=not acc.is_local_main_process, desc="train",
                   unit="step", dynamic_ncols=True)  # fmt: skip
        micro_total = self.step * tc.grad_accum_steps
        while self.step < tc.max_steps and stop_reason == "max_steps":
            epoch, start_batch = divmod(micro_total, self.batches_per_epoch)
            sampler = ShardedEpochBatchSampler(**self.sampler_args, epoch=epoch, start_batch=start_batch)
            loader = DataLoader(self.dataset, batch_sampler=sampler, num_workers=self.config.data.num_workers,
                                pin_memory=torch.cuda.is_available())  # fmt: skip
            for x, y in loader:
                micro = micro_total % tc.grad_accum_steps
                micro_total += 1
                want_heads = lc.head_usage and (self.step + 1) % lc.log_every == 0 and micro == 0
                for group in self.optimizer.param_groups:
                    group["lr"] = lr_at(self.step)
                with acc.accumulate(self.model):
                    loss, d_loss, m_loss, heads = self._micro_step(x, y, micro, want_heads)
                    # one tiny all-reduce: do all ranks agree the loss is finite / time is not up?
                    flags = torch.tensor([float(not torch.isfinite(loss)),
                                          float(tc.time_limit_minutes > 0 and time.time() - start_time > 60 * tc.time_limit_minutes)],
                                         device=acc.device)  # fmt: skip
                    flags = acc.reduce(flags, reduction="sum") if self.world > 1 else flags
                    if flags[0] > 0:
                        self.optimizer.zero_grad(set_to_none=True)
                        path = self.save_checkpoint()  # weights are still those of the last good step
                        raise NonFiniteLossError(
                            f"non-finite loss at step {self.step + 1} (diffusion {d_loss.item():.4g}, "
                            f"MoH {m_loss.item():.4g}); the state before this step is saved in {path}. "
                            f"Try a lower optim.lr, optim.grad_clip > 0, or train.mixed_precision=bf16/no."
                        )
                    acc.backward(loss)
                    if acc.sync_gradients and self.config.optim.grad_clip > 0:
                        acc.clip_grad_norm_(self.model.parameters(), self.config.optim.grad_clip)
                    self.optimizer.step()
                    self.optimizer.zero_grad(set_to_none=True)
                sums += torch.stack([d_loss, m_loss, torch.ones((), device=acc.device)])
                if heads is not None:
                    last_heads = heads
                if flags[1] > 0:
                    stop_reason = "time_limit"
                if not acc.sync_gradients:
                    continue

                # ---- one optimizer step done ----
                self.step += 1
                self.samples_seen += tc.global_batch_size
                window_steps += 1
                if self.step % self.config.ema.update_every == 0:
                    self.ema.step(self.unwrapped.parameters())
                bar.update(1)
                if self.step % lc.log_every == 0 or self.step == tc.max_steps:
                    avg = acc.reduce(sums, reduction="sum") if self.world > 1 else sums
                    d_mean, m_mean = (avg[0] / avg[2]).item(), (avg[1] / avg[2]).item()
                    elapsed = time.time() - window_start
                    record = {
                        "step": self.step,
                        "diffusion_loss": d_mean,
                        "moh_loss": m_mean,
                        "lr": lr_at(self.step - 1),
                        "steps_per_s": window_steps / elapsed,
                        "images_per_s": window_steps * tc.global_batch_size / elapsed,
                        "samples_seen": self.samples_seen,
                    }
                    if last_heads is not None:
                        record["head_usage"] = self.head_usage(last_heads)
                    self._log(record)
                    bar.set_postfix(loss=f"{d_mean:.4f}", moh=f"{m_mean:.3f}", img_s=f"{record['images_per_s']:.0f}")
                    sums.zero_()
                    window_start, window_steps, last_heads = time.time(), 0, None
                if self.step % tc.checkpoint_every == 0:
                    self.save_checkpoint()
                if lc.sample_every > 0 and self.step % lc.sample_every == 0 and (self.vae or not self.latent_input):
                    self.save_sample_grid(f"step-{self.step:08d}")
                if self.step >= tc.max_steps or stop_reason != "max_steps":
                    break
        bar.close()
        if not (self.output_dir / "checkpoints" / f"{CHECKPOINT_PREFIX}{self.step:08d}").exists():
            self.save_checkpoint()
        can_preview = lc.sample_per_class > 0 and (self.vae is not None or not self.latent_input)
        grid = self.save_sample_grid("final") if can_preview else None
        pipeline_dir = self.export_pipeline()
        acc.end_training()
        summary = {"step": self.step, "stop_reason": stop_reason, "pipeline": str(pipeline_dir) if pipeline_dir else None,
                   "sample_grid": str(grid) if grid else None, "minutes": (time.time() - start_time) / 60}  # fmt: skip
        if acc.is_main_process:
            logger.info("done: %s", summary)
        return summary

    def _log(self, record: dict[str, Any]) -> None:
        acc = self.accelerator
        if not acc.is_main_process:
            return
        with open(self._metrics_path(), "a") as f:
            f.write(json.dumps(record) + "\n")
        scalars = {f"train/{k}": v for k, v in record.items() if isinstance(v, (int, float)) and k != "step"}
        for layer, usage in enumerate(record.get("head_usage", [])):
            mean = sum(usage) / len(usage)
            scalars[f"heads/layer{layer:02d}_active_fraction"] = mean
            scalars[f"heads/layer{layer:02d}_max_over_mean_load"] = max(usage) / mean if mean > 0 else 0.0
        if self.config.log.tensorboard:
            acc.log(scalars, step=record["step"])
        logger.info(
            "step %d | diffusion loss %.4f | moh loss %.4f | %.2f steps/s | %.1f images/s | lr %.2e",
            record["step"], record["diffusion_loss"], record["moh_loss"], record["steps_per_s"],
            record["images_per_s"], record["lr"],
        )  # fmt: skip


def train(config: Config) -> dict[str, Any]:
    """Train according to ``config``; returns a summary (final step, stop reason, exported pipeline)."""
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.INFO)
    return Trainer(config).run()
