"""What a run writes as it trains, apart from the step itself: its log records (with the hardware's numbers),
checkpoints, preview grids, evaluations during training, the exported pipeline and the summary its model card
shows. A mixin of :class:`~moh_dit.training.trainer.Trainer`, kept apart so that the trainer file holds the set-up
and the loop.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from moh_dit.manifests import pipeline_source
from moh_dit.model.network import MoHDiT
from moh_dit.model.presets import CUSTOM
from moh_dit.model.surgery import without_alignment
from moh_dit.progress import Progress
from moh_dit.sampling.card import push_folder
from moh_dit.sampling.grids import save_grid
from moh_dit.sampling.pipeline import MoHDiTPipeline
from moh_dit.sampling.spec import SamplingSpec
from moh_dit.training.checkpoints import save_checkpoint
from moh_dit.training.config import config_to_dict
from moh_dit.training.objective import run_sampling
from moh_dit.training.quality import EVALUATION, curve_points, read_records
from moh_dit.training.setup import learning_rate, non_finite_error
from moh_dit.training.throughput import peak_memory_gb

logger = logging.getLogger("moh_dit.train")


class RunOutputs:
    """The trainer's writing half: log records, checkpoints, previews, evaluations and the exported pipeline (it
    uses the trainer's state: ``config``, ``layout``, ``accelerator``, ``step``, ``ema``, ``data``, ...)."""

    # ------------------------------------------------------------------------------------------------
    # Log records
    # ------------------------------------------------------------------------------------------------
    def hardware_record(self, images_per_s: float) -> dict[str, float]:
        """The log record's numbers on the hardware: the gradient norm before clipping, model TFLOP/s over all
        processes, MFU (against the peak of every device) and this process's peak memory."""
        tflops = images_per_s * self.flops_per_image / 1e12
        record = {"grad_norm": float(self.grad_norm), "tflops": tflops}
        if self.peak_tflops:
            record["mfu"] = tflops / (self.peak_tflops * self.world)
        record["peak_memory_gb"] = peak_memory_gb(self.accelerator.device)
        return record

    def count_evaluations(self) -> int:
        """The frozen models' network evaluations since the run began (its teacher's), over all processes: this
        process's new ones summed over processes (a collective: every process calls it at the same points)."""
        new = self.frozen.evaluations() - self.evaluations_seen
        self.evaluations_seen += new
        if self.world > 1:
            new = int(self.accelerator.reduce(torch.tensor(float(new), device=self.accelerator.device), "sum"))
        self.teacher_evaluations += new
        return self.teacher_evaluations

    def count_step(self, updated: str | None) -> None:
        """What the optimizer step just made spent: one update of the network ``updated`` (``None``: a skipped one),
        and its networks' passes (the same count on every process: the global batch)."""
        if updated is not None:
            self.updates[updated] += 1
        beside = {role: c.module for role, c in self.companions.items()}
        per_image = self.objective.step_forwards(self.step, beside)
        self.network_evaluations += per_image * self.config.train.global_batch_size

    def updates_before(self, step: int) -> dict[str, int]:
        """The updates of each network in the first ``step`` steps by the objective's order (a checkpoint of moh-dit
        0.6 and earlier did not count them; skipped updates are not known there)."""
        counted = {role: 0 for role in self.updates}
        for s in range(step):
            counted[self.objective.updates(s)] += 1
        return counted

    def spent(self) -> dict[str, float]:
        """What training has spent so far, as the logs and the manifest record it: each network's updates by the
        objective's names (DMD2's ``generator_updates``, ``fake_score_updates``), the trained networks' passes
        (``network_evaluations``) and the teacher's (``teacher_evaluations``, counted apart)."""
        named = {
            self.objective.update_names[role]: n
            for role, n in self.updates.items()
            if role in self.objective.update_names
        }
        found = dict(named, network_evaluations=round(self.network_evaluations, 3))
        if self.teacher_evaluations:
            found["teacher_evaluations"] = self.teacher_evaluations
        return found

    def write_record(self, on_boundary: bool, heads, progress: Progress, made: int) -> None:
        """The log record of the steps since the last one (a last record between boundaries leaves the window open for
        a later resume). With the first record of this call of ``run`` (``made``: the steps it has made so far), the
        time the remaining steps will take at that speed."""
        lr = learning_rate(self.config, self.step - 1)
        record = self.window.record(self.accelerator, self.step, lr, self.samples_seen, heads, on_boundary)
        record.update(self.hardware_record(record["images_per_s"]))
        self.count_evaluations()  # a distillation's cost: its teacher's network evaluations, all processes
        record.update(self.spent())
        if self.guard.enabled:
            record.update(skipped_updates=self.guard.skipped, rollbacks=self.guard.rollbacks)
        self.metrics.write(record, progress)
        left = self.config.train.max_steps - self.step
        if not self.projected and left > 0 and record["steps_per_s"] > 0:
            self.projected = True
            logger.info(
                f"projected: {left / record['steps_per_s'] / 60:.3g} more minutes to step {self.config.train.max_steps} "
                f"at {record['steps_per_s']:.2f} steps/s (the speed of the first {made} steps; previews, evaluations "
                f"and the export come on top)"
            )

    # ------------------------------------------------------------------------------------------------
    # Checkpoints, previews, evaluations, export
    # ------------------------------------------------------------------------------------------------
    def periodic_outputs(self) -> None:
        """What is due after an optimizer step: a checkpoint, a preview grid, an evaluation."""
        preview = self.config.preview
        if self.step % self.config.train.checkpoint_every == 0:
            self.save_checkpoint()
        if preview.every > 0 and self.step % preview.every == 0 and preview.per_class:
            self.save_sample_grid(f"step-{self.step:08d}")
        if self.quality.due(self.step):
            self.evaluate_quality()

    def save_checkpoint(self, losses=None) -> Path:
        """``checkpoints/step-N``. Exploded or non-finite weights are never written (a stop instead); with
        ``losses`` (a non-finite loss at the next step) the rescue save never prunes, and the run stops."""
        info = dict(self.data.record(), samples_seen=self.samples_seen, **self.process_layout)
        info["frozen"] = self.frozen.identity()  # the models beside the student: a resume must have the same
        info["frozen_provenance"] = self.frozen.provenance()  # where they were loaded from (said, never compared)
        info["teacher_evaluations"] = self.count_evaluations()
        info["updates"], info["network_evaluations"] = dict(self.updates), self.network_evaluations
        info["batches_per_epoch"] = self.batches_per_epoch
        if self.guard.enabled:
            info["spike_guard"] = self.guard.state()
        keep = self.config.train.keep_last if losses is None else None
        path, peak = save_checkpoint(
            self.layout, self.step, self.state, self.accelerator, info, {"run_id": self.record.run_id}, keep
        )
        if path is not None and losses is None:
            return path
        if self.accelerator.is_main_process:
            self.record.write("stopped", step=self.step, reason="non-finite loss or exploded weights")
        raise non_finite_error(self.step, path, peak, self.layout.latest_checkpoint(), losses)

    def ema_pipeline(self, scheduler: str | None = None) -> MoHDiTPipeline:
        """The EMA weights with ``scheduler`` (default: the sampler of the objective's published protocol: DiT's
        DDPM, SiT's SDE), the VAE and the class names."""
        ema_model = MoHDiT.from_config(self.unwrapped.config).to(self.accelerator.device)
        self.ema.copy_to(ema_model.parameters())
        ema_model = without_alignment(ema_model)  # REPA's projectors train with the network; nothing samples them
        latent, names = self.data.vae_record is not None, self.data.id2label if ema_model.config.num_classes else {}
        return MoHDiTPipeline.build(ema_model, self.data.vae, names, scheduler, latent_space=latent)

    def preview_sampling(self) -> SamplingSpec:
        """How the previews are drawn (and the exported pipeline records): the ``preview`` section, its sampler
        resolved for the run's objective where it is unset."""
        return run_sampling(self.config.preview.sampling(), self.objective)

    @torch.no_grad()
    def save_sample_grid(self, tag: str, reuse: bool = False) -> Path | None:
        """A grid of EMA samples, one row per class (main process). With ``reuse`` an existing grid of that
        tag is kept when the settings are unchanged and the run's pipeline was exported at this step."""
        seed = self.config.train.seed
        if self.accelerator.is_main_process:
            # drawn by this call's weights: the run's pipeline was exported at this very step
            if reuse and (self.layout.samples / f"{tag}.png").is_file() and self.exported_at() == self.step:
                return self.layout.samples / f"{tag}.png"
            preview, spec = self.config.preview, self.preview_sampling()
            pipe = self.ema_pipeline(spec.sampler.scheduler)  # previews by autoguidance load the guide preview.guide
            path = save_grid(
                pipe, self.layout.samples / f"{tag}.png", preview.per_class, seed, spec, preview.max_classes
            )
            self.metrics.log_image("samples", path, self.step)
            return path

    @torch.no_grad()
    def evaluate_quality(self) -> None:
        """Sample and score the EMA weights at this step on every process (``log.eval_every``); the record goes to
        ``metrics.jsonl``, the trackers and the run's manifest."""
        record = self.quality.evaluate(
            self.ema_pipeline(self.quality.spec.sampler.scheduler), self.step, self.samples_seen
        )
        if record is not None:
            # the best model is kept before its record is written: a run cut between the two redoes both
            if self.quality.best_so_far(record, self.record.run_id):
                self.keep_best(record)
            self.metrics.write_evaluation(record)
            self.record.write("evaluation", **curve_points([record])[0], file=record["file"])
        self.accelerator.wait_for_everyone()
        self.window.start_clock()  # the speed of the next log record counts training only

    def keep_best(self, record: dict) -> None:
        """The EMA model of the best evaluation so far (``log.eval_keep_best``) as a pipeline in ``<run>/best``
        (main process; replaced atomically), the score and step in its manifest and in the run's."""
        key = self.config.log.eval_keep_best
        chosen = {"score": key, "value": record[key], "reference": record["reference"]}
        self._save_ema(self.layout.best, best=chosen)
        self.record.write("best", step=self.step, **chosen)
        logger.info(
            "step %d: %s %.4g is the run's best so far; its EMA model is in %s",
            self.step,
            key,
            record[key],
            self.layout.best,
        )

    def export_pipeline(self, reuse: bool = False) -> Path | None:
        """The EMA model as a self-describing pipeline folder (``<run>/pipeline``) with its manifest. With
        ``reuse`` a folder this run exported at this step is kept."""
        self.accelerator.wait_for_everyone()
        if self.accelerator.is_main_process:
            if reuse and self.exported_at() == self.step:
                return self.layout.pipeline
            path = self._save_ema(self.layout.pipeline)
            if self.config.train.push_to_hub:
                push_folder(path, self.config.train.push_to_hub)
            return path

    def _save_ema(self, folder: Path, **source: Any) -> Path:
        """The EMA model saved as a pipeline in ``folder`` (atomically), its manifest naming this run and step (and
        ``source``'s extra records)."""
        run = {"run": str(self.layout.root.resolve()), "run_id": self.record.run_id, "step": self.step}
        return self.ema_pipeline().save(
            folder,
            dict(run, weights="ema", **source, vae=self.data.vae_record, training=self.training_summary()),
            sampling=self.preview_sampling(),
        )

    def exported_at(self) -> int | None:
        """The step of this run's exported pipeline folder (None when there is none, or another run's)."""
        source = pipeline_source(self.layout.pipeline)
        return source.get("step") if source.get("run_id") == self.record.run_id else None

    def training_summary(self) -> dict:
        """What a model card says about the training (see ``moh_dit.sampling.card``)."""
        full = config_to_dict(self.config)
        keys = ("name", "count", "fingerprint", "split", "class_weights")
        data = {k: v for k, v in self.data.description.items() if k in keys}
        train = {k: full["train"][k] for k in ("global_batch_size", "moh_loss_coeff", "mixed_precision", "seed")}
        preset = None if self.config.model.preset == CUSTOM else self.config.model.preset
        summary = dict(train, preset=preset, data=data, optim=full["optim"], ema=full["ema"], spent=self.spent())
        summary["loss"] = self.objective.describe_loss()  # with the training options (a distillation's loss, ...)
        # settings a resume changed (the manifest's record of each resume): the card then says the run is not one recipe
        resumed = [(e["step"], e["changed"]) for e in (self.record.recorded or {}).get("events", [])
                   if e.get("event") == "resume" and e.get("changed")]  # fmt: skip
        if resumed:
            summary["changed_on_resume"] = [{"step": step, "changed": changed} for step, changed in resumed]
        if (
            "lead" in self.frozen
        ):  # trained for a hand-off: the lead its later steps expect (cards and samplers say so)
            lead = self.frozen["lead"]
            summary["lead"] = {"model": lead.provenance()["weights"], "sha256": lead.identity()["sha256"]}
        folded = self.objective.folded
        if folded.active:  # whether and from which step the guidance was folded into the target
            summary["folded_guidance"] = {"from_step": folded.warmup if self.step > folded.warmup else None,
                                          "warmup": folded.warmup}  # fmt: skip
        evaluations = read_records(self.layout.metrics, EVALUATION)
        if evaluations:  # the card's quality curve, and how its points were scored
            last = evaluations[-1]
            summary["quality_curve"] = curve_points(evaluations)
            summary["quality_protocol"] = {
                "extractor": last["extractor"],
                "reference": Path(last["reference"]).name,
                "sampling": last["sampling"],
            }
        return summary
