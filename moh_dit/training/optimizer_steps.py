"""The optimizer step of the trainer (a part of :class:`moh_dit.training.trainer.Trainer`): the learning rate, the
backward with clipping and the update, the spike guard's verdict and its rollback, and what follows an update (the
step count, the EMAs, a post-hoc snapshot when one is due). In parts, so that ``benchmarks/config_throughput.py``
times exactly this code."""

from __future__ import annotations

import logging
import math

import torch

from moh_dit.errors import NonFiniteLossError
from moh_dit.snapshots import save_snapshot
from moh_dit.training.checkpoints import restore_weights
from moh_dit.training.gradients import average_gradients
from moh_dit.training.setup import learning_rate
from moh_dit.training.spike_guard import Verdict

__all__ = ["OptimizerSteps"]

logger = logging.getLogger("moh_dit.train")


class OptimizerSteps:
    """The trainer's optimizer step. Reads the trainer's accelerator, model, optimizer, objective, EMAs, guard, run
    record and config."""

    def set_learning_rate(self) -> None:
        """The schedule's learning rate for the coming optimizer step (times ``optim.new_lr_scale`` for the tensors
        the run did not take from its teacher or ``init_from``)."""
        lr = learning_rate(self.config, self.step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr * (self.config.optim.new_lr_scale if group.get("new") else 1.0)
        for companion in self.companions.values():  # the same schedule, at each one's own rate
            for group in companion.optimizer.param_groups:
                group["lr"] = lr * companion.lr_scale

    def apply_gradients(self, loss: torch.Tensor, measure_norm: bool = False, skip: bool = False) -> None:
        """Backward; on the last micro-batch of a step (inside ``accelerator.accumulate``) also clip and
        step the optimizer (accelerate makes ``step`` a no-op on the others). The gradient norm before
        clipping is kept in ``grad_norm`` when clipped, or when ``measure_norm`` (a step that is logged). With
        ``skip`` (the spike guard's verdict) the step's gradients are dropped instead of applied."""
        accelerator = self.accelerator
        accelerator.backward(loss)
        updating = self.objective.updates(self.step)
        companion = self.companions.get(updating)  # a network beside the student (DMD2's fake score), or None
        params = list(companion.module.parameters()) if companion is not None else None
        if (
            accelerator.sync_gradients
            and self.world > 1
            and (companion is not None or self.objective.runs_bare_module)
        ):
            # its forward bypassed DDP (MeanFlow's JVP; a companion's several passes): averaged here
            average_gradients(params if companion is not None else self.unwrapped.parameters())
        clip = self.config.optim.grad_clip
        if accelerator.sync_gradients and (clip > 0 or measure_norm):
            # without clipping, an infinite limit measures the norm and scales every gradient by exactly 1
            limit = clip if clip > 0 else math.inf
            self.grad_norm = (
                accelerator.clip_grad_norm_(self.model.parameters(), limit)
                if companion is None
                else torch.nn.utils.clip_grad_norm_(params, limit)
            )
        optimizer = self.optimizer if companion is None else companion.optimizer
        if not (skip and accelerator.sync_gradients):
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def judge_step(self, micro_loss_sum: float) -> Verdict | None:
        """Add one micro-batch's loss (summed over processes); on the step's last one, the guard's verdict."""
        self.step_loss += micro_loss_sum
        if not self.accelerator.sync_gradients:
            return None
        mean = self.step_loss / (self.world * self.config.train.grad_accum_steps)
        self.step_loss = 0.0
        return self.guard.judge(mean)

    def roll_back(self, why: str) -> None:
        """Weights, EMA and optimizer back to the newest checkpoint; the step and the data go on. Stops with one
        line when no checkpoint exists or ``train.max_rollbacks`` is used up."""
        newest, limit = self.layout.latest_checkpoint(), self.config.train.max_rollbacks
        if newest is None or self.guard.exhausted:
            reason = "no checkpoint to roll back to" if newest is None else f"train.max_rollbacks={limit} used up"
            if self.accelerator.is_main_process:
                self.record.write("stopped", step=self.step, reason=f"spike guard: {why}")
            raise NonFiniteLossError(
                f"training diverged at step {self.step + 1}: {why}; {reason} after {self.guard.rollbacks - 1} "
                f"rollback(s) and {self.guard.skipped} skipped update(s). Try a lower optim.lr or optim.grad_clip > 0"
            )
        restore_weights(newest, self.state, self.accelerator)
        logger.warning(
            "step %d: %s; rolled back to %s (rollback %d of %d)",
            self.step + 1,
            why,
            newest.name,
            self.guard.rollbacks,
            limit,
        )
        if self.accelerator.is_main_process:
            self.record.write("rollback", step=self.step + 1, to=str(newest), reason=why)

    def finish_step(self, updated: bool = True) -> None:
        """After an optimizer step: count it and update the EMAs (not after a skipped update); a post-hoc EMA snapshot
        when one is due."""
        self.step += 1
        batch, ema = self.config.train.global_batch_size, self.config.ema
        self.samples_seen += batch
        if updated and self.step % ema.update_every == 0:
            self.ema.step(self.unwrapped.parameters())
        if self.posthoc is None:
            return
        if updated:  # in training images, the same count on every process
            self.posthoc.update(self.samples_seen, batch)
        if self.samples_seen % ema.posthoc_every == 0 and self.accelerator.is_main_process:
            self.layout.posthoc.mkdir(exist_ok=True)
            path = self.layout.posthoc / f"step-{self.step:08d}.safetensors"
            save_snapshot(
                path, self.posthoc, self.state.param_names(), self.step, self.samples_seen, ema.posthoc_dtype
            )
