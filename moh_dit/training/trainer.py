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

import dataclasses
import logging
import math
import signal
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import torch
import yaml
from accelerate.utils import set_seed

from moh_dit.data.batches import ShardedEpochBatchSampler
from moh_dit.data.training_data import load_training_data
from moh_dit.files import atomic_write_text
from moh_dit.logs import setup_logging
from moh_dit.manifests import format_differences
from moh_dit.model.network import MoHDiT
from moh_dit.model.presets import CUSTOM, match_preset
from moh_dit.model.surgery import with_alignment
from moh_dit.model.token_routing import draw_route
from moh_dit.posthoc_ema import PowerFunctionEMAs
from moh_dit.progress import Progress
from moh_dit.run_folder import RunLayout, checkpoint_step
from moh_dit.seeding import step_generator
from moh_dit.training.checkpoints import TrainingState, restore_checkpoint, set_aside_the_future
from moh_dit.training.config import Config, config_to_dict
from moh_dit.training.distill import build_companions
from moh_dit.training.frozen import check_resume_beside, recorded_frozen
from moh_dit.training.frozen_roles import load_frozen_models
from moh_dit.training.objective import run_objective, run_objective_class
from moh_dit.training.optimizer_steps import OptimizerSteps
from moh_dit.training.outputs import RunOutputs
from moh_dit.training.quality import QualityCurve
from moh_dit.training.repa import alignment_loss
from moh_dit.training.run_identity import default_config_like, run_identity, run_settings
from moh_dit.training.runs import RunRecord, check_process_layout, check_resume_step, open_run_folder
from moh_dit.training.setup import (
    EMANetwork,
    build_model,
    describe_tokens,
    make_accelerator,
    make_ema,
    make_optimizer,
    micro_batch_size,
    stop_signals,
    token_routing,
    warn_if_never_folded,
)
from moh_dit.training.spike_guard import SpikeGuard
from moh_dit.training.throughput import training_cost
from moh_dit.training.tracking import LossWindow, MetricsLog, start_trackers

logger = logging.getLogger("moh_dit.train")


# ----------------------------------------------------------------------------------------------------
# The trainer
# ----------------------------------------------------------------------------------------------------
class Trainer(RunOutputs, OptimizerSteps):
    """Set-up, one micro-step, and ``run()``: the loop that trains to ``train.max_steps``."""

    def __init__(self, config: Config) -> None:
        self.config, self.layout = config, RunLayout(config.train.output_dir)
        self.accelerator = accelerator = make_accelerator(config)
        self.world, self.rank = accelerator.num_processes, accelerator.process_index
        logger.info("%d process(es) on %s", self.world, accelerator.device)
        self.micro_batch = micro_batch_size(config, self.world)
        # the run folder first: an earlier run there is refused before any data or model is loaded
        train_cfg = config.train
        self.resume_from = open_run_folder(
            self.layout, train_cfg.resume, train_cfg.overwrite, accelerator.is_main_process
        )
        check_resume_step(self.resume_from, train_cfg.max_steps)  # before anything in the run folder changes
        self.layout_change = check_process_layout(self.resume_from, self.process_layout, train_cfg.elastic_resume)
        # a missing reference or extractor stops the run now, not at its first evaluation
        self.quality = QualityCurve(config.log, train_cfg.seed, self.layout, accelerator, config.data.image_size)
        accelerator.wait_for_everyone()
        self.data = load_training_data(config.data, accelerator.device)

        # the models beside the student it may start from (a teacher), loaded before it is built; a resumed run's own
        # (the teacher's weights it was trained beside, though its run folder has trained on)
        recorded = recorded_frozen(self.resume_from)
        self.frozen = load_frozen_models(
            config, run_objective_class(config), self.data, accelerator.device, recorded=recorded
        )
        set_seed(train_cfg.seed)  # identical initialisation on every rank
        model, self.init_report = build_model(config, self.data, self.frozen)
        if (
            self.init_report
        ):  # weights from elsewhere (init_from, a teacher) name the architecture; config and card say so
            preset = match_preset(model.config) or CUSTOM
            if preset != config.model.preset:
                logger.info(
                    "architecture from the weights: %s (model.preset %s is not used)", preset, config.model.preset
                )
                self.config = config = dataclasses.replace(
                    config, model=dataclasses.replace(config.model, preset=preset)
                )
        self.objective = run_objective(config, model.config.objective or {}, model.config.learn_sigma)
        # and those beside it (REPA's encoders): loaded, frozen and placed by training, never trained
        beside = load_frozen_models(config, self.objective, self.data, accelerator.device, student=model)
        self.frozen = self.frozen.with_models(beside)
        for role, frozen in self.frozen.items():
            logger.info("beside the student, frozen: %s (%s)", frozen.describe(), role)
        self.repa = self.frozen.get("repa_encoder")
        if self.repa is not None:  # REPA's projectors, one per encoder (kept when init_from already has them)
            model = with_alignment(model, config.repa.depth, self.repa.dims, config.repa.projector_dim)
            logger.info(
                "REPA: block %d aligned to %s, weight %g", config.repa.depth, self.repa.describe(), config.repa.coeff
            )
        if train_cfg.gradient_checkpointing:
            model.enable_gradient_checkpointing()
        self.ema = make_ema(model.train(), config.ema)
        self.ema.to(accelerator.device)
        self.route_span, self.routed_count = token_routing(config.token_routing, model)
        # folded guidance from the EMA's predictions needs the EMA weights as a network
        folded = self.objective.folded
        self.ema_network = EMANetwork(model, self.ema) if folded.active and folded.source == "ema" else None
        self.model, self.optimizer = accelerator.prepare(
            model, make_optimizer(model, config, (self.init_report or {}).get("new", ()))
        )
        # the networks the objective trains beside the student (DMD2's fake score), each with its own optimizer
        self.companions = build_companions(config, self.objective, self.frozen, accelerator.device)
        if train_cfg.compile and self.objective.runs_bare_module:
            logger.warning("train.compile: %s runs the uncompiled network (a JVP)", self.objective.name)
        elif train_cfg.compile:
            self.model = torch.compile(self.model)
        lead = self.frozen.get("lead")  # a generator trained for a hand-off is evaluated in it
        self.quality.use_objective(self.objective, lead.lead if lead is not None else None)
        warn_if_never_folded(self.objective.folded, train_cfg.max_steps)  # before training; the card says it too
        # each objective names its loss in the logs (diffusion_loss, flow_loss, ...)
        self.loss_names = (
            self.objective.loss_name,
            "moh_loss",
            *(("repa_loss",) if self.repa is not None else ()),
            *self.objective.logged_terms,
        )
        self.window = LossWindow(accelerator.device, train_cfg.global_batch_size, self.loss_names)
        self.grad_norm = math.nan  # before clipping, at the last logged step
        t = config.train
        self.guard = SpikeGuard(t.spike_guard, t.spike_window, t.spike_patience, t.max_rollbacks)
        self.step_loss = 0.0  # the sum over this step's micro-batches and processes (for the guard)
        self.posthoc = (
            PowerFunctionEMAs(model.parameters(), config.ema.posthoc_sigma_rels) if config.ema.posthoc_every else None
        )
        self.state = TrainingState(
            model, self.ema, self.optimizer, accelerator.scaler, self.window, self.posthoc, self.companions
        )
        defaults = run_settings(config_to_dict(default_config_like(config)))
        self.frozen.check_apart(model)  # never the student's, never trained
        self.record = RunRecord(self.layout, *run_identity(config, self.data, model, self.frozen.identity()), defaults)
        self.metrics = MetricsLog(self.layout.metrics, accelerator, bool(config.log.trackers))
        self.step = self.samples_seen = 0
        # a distillation's teacher evaluations while training (a set of trajectories recorded above counts its own)
        self.teacher_evaluations, self.evaluations_seen = 0, self.frozen.evaluations()
        # what training spends: each trained network's updates, their passes (Objective.step_forwards)
        self.updates, self.network_evaluations = {role: 0 for role in ("student", *self.companions)}, 0.0
        self.projected = False  # the projected time is logged once, with the first log record
        self.sampler = partial(
            ShardedEpochBatchSampler,
            len(self.data.dataset),
            self.micro_batch,
            self.world,
            self.rank,
            train_cfg.seed,
            draws=self.data.draws,
        )
        self.batches_per_epoch = self.sampler().batches_per_epoch

    @property
    def process_layout(self) -> dict[str, int]:
        """How the global batch is split: processes and accumulation steps (their product fixes the
        micro-batch, hence the data each process sees and the random draws of each micro-step)."""
        return {"world_size": self.world, "grad_accum_steps": self.config.train.grad_accum_steps}

    @property
    def unwrapped(self) -> MoHDiT:
        return self.accelerator.unwrap_model(self.model)

    def _batches(self) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
        """Micro-batches ``(index within the step, x, y)`` from the current step on, epoch after epoch."""
        accumulation = self.config.train.grad_accum_steps
        micro_total = self.step * accumulation
        while True:
            epoch, start = divmod(micro_total, self.batches_per_epoch)
            for x, y in self.data.loader(self.sampler(epoch=epoch, start_batch=start), self.config.data.num_workers):
                yield micro_total % accumulation, x, y
                micro_total += 1

    def _micro_step(self, x, y, micro: int, want_heads: bool):
        """Noise one micro-batch and compute its losses: ``(loss, logged losses (the objective's, MoH's and REPA's
        when it trains, detached), head masks)``."""
        gen = step_generator(self.config.train.seed, self.rank, self.step, micro, self.config.train.grad_accum_steps)
        device, n = self.accelerator.device, x.shape[0]
        flip = torch.rand(n, generator=gen) < 0.5 if self.config.data.random_flip else torch.zeros(n, dtype=torch.bool)
        x0 = self.data.clean_latents(x, flip, gen, device)
        noised = self.objective.noised(x0, gen, device)  # the objective's draws of time and noise
        drop = (torch.rand(n, generator=gen) < self.unwrapped.config.class_dropout_prob).long().to(device)
        y_in = y.to(device) if self.unwrapped.config.num_classes > 0 else None
        drop = drop if y_in is not None else None
        # TREAD: the tokens that skip the span, drawn last so that the other draws are those of a run without it
        route = None
        if self.route_span is not None:
            route = draw_route(
                n, self.unwrapped.num_tokens, self.config.token_routing.share, self.route_span, gen, device
            )
        # the objective runs the network: one forward (DDPM, flow) or a JVP (MeanFlow); a network trained beside the
        # student (DMD2's fake score) takes gradients only on the steps that update it
        updating = self.objective.updates(self.step)
        for companion in self.companions.values():
            companion.set_trainable(companion.role == updating)
        beside = {"companions": {role: c.module for role, c in self.companions.items()}} if self.companions else {}
        with self.unwrapped.routed_tokens(route):
            losses, out = self.objective.forward_losses(
                self.model, noised, y_in, drop, want_heads, self.accelerator.autocast, self.frozen, self.step,
                self.ema_network.current() if self.ema_network is not None else None, **beside,
            )  # fmt: skip
        moh_loss = out.aux_loss.float()
        loss = losses.loss.mean() + self.config.train.moh_loss_coeff * moh_loss
        # the logs follow the objective's error (MeanFlow's weighted loss stays near 1: its logs show the error)
        logged = [losses.followed.mean().detach(), moh_loss.detach()]
        if self.repa is not None:  # the encoders see the clean images, flipped as the model's input
            targets = self.repa.features(self.data.encoder_images(x, flip))
            if route is not None and route.aligns_kept_tokens(self.unwrapped.config.repa_depth):
                targets = [route.gather(z) for z in targets]  # the aligned block saw the kept tokens only
            repa_loss = alignment_loss(out.aligned, targets)
            loss = loss + self.config.repa.coeff * repa_loss
            logged.append(repa_loss.detach())
        logged.extend(losses.extras[name].float().mean().detach() for name in self.objective.logged_terms)
        return loss, tuple(logged), out.head_masks

    # ------------------------------------------------------------------------------------------------
    # The loop
    # ------------------------------------------------------------------------------------------------
    def _start(self) -> None:
        """Resume from the chosen checkpoint (if any), and record the start in the run folder."""
        if self.resume_from is not None:
            state = restore_checkpoint(self.resume_from, self.state, self.accelerator, self.record.run_id)
            check_resume_beside(self.resume_from, state.get("frozen"), self.frozen.identity())
            self.step, self.samples_seen = state["step"], state["samples_seen"]
            self.teacher_evaluations = state.get("teacher_evaluations", 0)
            self.updates |= state.get("updates") or self.updates_before(state["step"])
            self.network_evaluations = state.get("network_evaluations", 0.0)  # 0.6 and earlier did not count them
            self.guard.load(state.get("spike_guard"))
            logger.info("resumed from %s at step %d", self.resume_from, self.step)
        if self.record.changes:
            logger.warning("resuming with changed settings: %s", format_differences(self.record.changes, limit=20))
        self.metrics.truncate_after(self.step)
        self.quality.resume(self.step)
        if self.accelerator.is_main_process:
            atomic_write_text(self.layout.config, yaml.safe_dump(config_to_dict(self.config), sort_keys=False))
            changed = {k: [a, b] for k, a, b in self.record.changes}
            init = {"init": self.init_report} if self.init_report and not self.step else {}
            if self.layout_change:
                init["elastic_from"] = self.layout_change
            init.update(set_aside_the_future(self.layout, self.step))
            event = "resume" if self.step else "start"
            self.record.write(event, step=self.step, world_size=self.world, changed=changed, **init)
        self.accelerator.wait_for_everyone()
        if self.config.log.trackers:
            start_trackers(
                self.accelerator,
                self.config.log.trackers,
                self.config.log.project,
                self.layout.tracker_state,
                config_to_dict(self.config),
                self.step,
            )
        train_cfg = self.config.train
        (active, total), params = self.unwrapped.head_counts(), sum(p.numel() for p in self.unwrapped.parameters())
        logger.info(
            f"training {self.config.model.preset}: {params:,} parameters, {active}/{total} heads active, {self.world} "
            f"processes x {self.micro_batch} images x {train_cfg.grad_accum_steps} accumulation = {train_cfg.global_batch_size} per step"
        )
        logger.info(describe_tokens(self.unwrapped.config, self.data.vae_record))
        # model FLOPs of one image's training step (the heads each token uses; MeanFlow's JVP costs more than a
        # backward), and the hardware's peak for MFU
        routed = None if self.route_span is None else (self.route_span, self.unwrapped.num_tokens - self.routed_count)
        self.flops_per_image, self.peak_tflops = training_cost(
            self.unwrapped, self.objective.training_forwards(), self.accelerator.device, train_cfg, self.config.log,
            routed,
        )  # fmt: skip
        if self.quality.enabled:
            logger.info("evaluation during training: %s", self.quality.describe())

    def run(self) -> dict[str, Any]:
        accelerator, train_cfg, log_cfg = self.accelerator, self.config.train, self.config.log
        preview = self.config.preview
        self._start()
        if self.quality.due(self.step):  # due at the checkpoint's step, but cut short (or never begun) before
            self.evaluate_quality()
        start_time, last_heads, stop, first_step = time.time(), None, None, self.step
        self.window.start_clock()
        progress = Progress(train_cfg.max_steps, self.step, "train", "step", accelerator.is_local_main_process)
        with stop_signals() as received:
            for micro, x, y in self._batches() if self.step < train_cfg.max_steps else ():
                want_heads = log_cfg.head_usage and (self.step + 1) % log_cfg.log_every == 0 and micro == 0
                self.set_learning_rate()
                with accelerator.accumulate(self.model):
                    loss, losses, heads = self._micro_step(x, y, micro, want_heads)
                    # one tiny all-reduce: is the loss finite, is time up, was a stop signal received?
                    time_up = 0 < train_cfg.time_limit_minutes < (time.time() - start_time) / 60
                    flags = torch.tensor(
                        [not torch.isfinite(loss), time_up, bool(received)], device=accelerator.device
                    )
                    if self.guard.enabled:  # and the loss, for a verdict every process reaches alike
                        flags = torch.cat([flags.float(), loss.detach().float().reshape(1)])
                    flags = accelerator.reduce(flags.float(), reduction="sum") if self.world > 1 else flags
                    if flags[0] and not self.guard.enabled:
                        self.save_checkpoint(losses=losses)  # saves what is sane, then stops
                    verdict = self.judge_step(float(flags[3])) if self.guard.enabled else None
                    logged = (self.step + 1) % log_cfg.log_every == 0 or self.step + 1 == train_cfg.max_steps
                    skip = verdict is not None and verdict.action != "update"
                    updated_student = self.objective.updates(self.step) == "student"
                    self.apply_gradients(loss, measure_norm=logged and not skip, skip=skip)
                self.window.add(*losses)
                last_heads = heads if heads is not None else last_heads
                if stop is None and (flags[2] or flags[1]):
                    stop = (signal.Signals(received[0]).name if received else "signal") if flags[2] else "time_limit"
                if not accelerator.sync_gradients:
                    continue

                # ---- one optimizer step done ----
                if verdict is not None and verdict.action == "rollback":
                    self.roll_back(verdict.why)
                elif verdict is not None and verdict.action == "skip":
                    logger.warning("step %d: update skipped, %s", self.step + 1, verdict.why)
                self.count_step(None if skip else self.objective.updates(self.step))
                self.finish_step(updated=not skip and updated_student)  # the EMAs follow the student's updates
                self.window.steps += 1
                on_boundary = self.step % log_cfg.log_every == 0
                if on_boundary or self.step == train_cfg.max_steps:
                    self.write_record(on_boundary, last_heads, progress, self.step - first_step)
                    last_heads = None if on_boundary else last_heads
                progress.update(1)
                self.periodic_outputs()
                if self.step >= train_cfg.max_steps or stop is not None:
                    break
        progress.close()
        if checkpoint_step(self.layout.latest_checkpoint() or "") != self.step:
            self.save_checkpoint()
        finished = stop in (None, "time_limit")  # a signal means "preempted": save and leave, quickly
        # a run that had finished before this call, resumed with the same settings: its final grid and
        # pipeline are kept, so rerunning a finished command is a quick check rather than minutes of sampling
        untouched = self.step == first_step and not self.record.changes
        grid = self.save_sample_grid("final", untouched) if finished and preview.per_class > 0 else None
        if finished and self.quality.due(self.step, final=True):
            self.evaluate_quality()
        pipeline = self.export_pipeline(untouched) if finished else None
        if accelerator.is_main_process:
            self.record.write("stopped", step=self.step, reason=stop or "max_steps", **self.spent())
        accelerator.end_training()
        minutes = (time.time() - start_time) / 60
        summary = dict(
            step=self.step, stop_reason=stop or "max_steps", pipeline=pipeline, sample_grid=grid, minutes=minutes
        )
        if accelerator.is_main_process:
            logger.info("done: %s", summary)
            if not finished:
                logger.warning("stopped by %s at step %d; continue with train.resume=latest", stop, self.step)
        return summary


def train(config: Config) -> dict[str, Any]:
    """Train according to ``config``; returns a summary (final step, stop reason, exported pipeline). A start that
    fails before writing anything leaves no output folder behind (the run folder it made, still empty)."""
    setup_logging()
    out = Path(config.train.output_dir)
    made = not out.exists()
    try:
        trainer = Trainer(config)
    except BaseException:
        if made and out.is_dir() and not any(out.iterdir()):
            out.rmdir()
        raise
    return trainer.run()
