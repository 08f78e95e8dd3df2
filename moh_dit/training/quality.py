"""Evaluation during training: a run's quality curve (``log.eval_every``).

Every ``log.eval_every`` steps, and at the end of a run that finishes, ``log.eval_samples`` class-balanced
images of the EMA weights are sampled on every process and scored on the main process against
``log.eval_reference`` with ``log.eval_extractor``, by :func:`moh_dit.evaluation.model_scores.sample_and_score`:
the function ``moh-dit evaluate --model`` calls. The images are those the command makes for the checkpoint of
the same step with the same settings (seed ``train.seed``, ``--label-mode balanced``, ``--sample-batch-size
log.eval_batch_size``, fp32, the sampling of ``log.eval_sampling``), so the scores are too, to the last digit.

A generator trained for a hand-off (``distill.dmd_input: lead``) is evaluated as it is sampled: at every step count
above the lead's steps (``log.eval_sampling``'s and ``log.eval_also_steps``'), after ``distill.lead_model``'s first
step (the weights the run trains after, not a second copy), as ``--lead-model`` samples it; at one step, alone.
``moh-dit evaluate --lead-model none`` scores the generator alone at a step count the curve gives as the hand-off.

Each evaluation writes ``eval/step-N.metrics.json`` (every number, the settings, the samples' manifest), a
record of kind ``evaluation`` in ``metrics.jsonl``, the trackers' ``eval/*`` scalars and an ``evaluation`` event
in the run's manifest. A resumed run drops the records after its checkpoint (as it drops the loss records) and
first makes up an evaluation that was due at its step but did not finish, so the curve has one point per
evaluated step, none missing.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from moh_dit.errors import ConfigError
from moh_dit.evaluation.reference import resolve_reference
from moh_dit.evaluation.scoring import ScoringOptions, write_metrics
from moh_dit.files import DiskFullError, check_free_space
from moh_dit.logs import plural
from moh_dit.manifests import pipeline_source
from moh_dit.run_folder import CHECKPOINT_PREFIX, RunLayout, checkpoint_step
from moh_dit.sampling.generation import GenerationSettings
from moh_dit.sampling.sample_sets import metrics_path_for, sample_npz_path
from moh_dit.training.checkpoints import first_failure, set_aside
from moh_dit.training.config_sections import LogSection
from moh_dit.training.objective import run_sampling
from moh_dit.training.tracking import EVAL_SCORE_NAMES

if TYPE_CHECKING:
    from moh_dit.objectives.base import Objective
    from moh_dit.sampling.leads import Lead
    from moh_dit.sampling.spec import SamplingSpec

logger = logging.getLogger("moh_dit.train")

EVALUATION = "evaluation"  # the ``kind`` of an evaluation record in metrics.jsonl (loss records have none)
# the scores a record and the model card's curve carry (those the extractor provides)
SCORES = tuple(EVAL_SCORE_NAMES)
# the scores log.eval_keep_best may select by, and of them those where lower is better
SELECTABLE = tuple(k for k in SCORES if k != "kid_std")
LOWER_IS_BETTER = ("kid", "fid", "sfid")


def check_keep_best(log: LogSection) -> None:
    """``log.eval_keep_best`` names a score the evaluations record: ``kid``, or ``kid@2`` at one of
    ``log.eval_also_steps``, with evaluations on."""
    key = log.eval_keep_best
    score, _, steps = str(key).partition("@")
    if not isinstance(key, str) or score not in SELECTABLE or (steps and not steps.isdigit()):
        raise ConfigError(
            f"log.eval_keep_best must be a score the evaluations record ({', '.join(SELECTABLE)}; kid@2 at one of "
            f"log.eval_also_steps), got {key!r}"
        )
    if steps and int(steps) not in log.eval_also_steps:
        raise ConfigError(
            f"log.eval_keep_best={key} selects by a score at {steps} steps, which log.eval_also_steps="
            f"{list(log.eval_also_steps)} does not score: add {steps} to it or select by {score}"
        )
    if not log.eval_every:
        raise ConfigError(
            f"log.eval_keep_best={key} selects among the evaluations during training: set log.eval_every"
        )


def improves(key: str, value: float, best: float | None) -> bool:
    """Whether ``value`` of the score ``key`` beats ``best`` (``None``: nothing yet); a tie keeps the earlier."""
    if best is None:
        return value == value  # a NaN never becomes the best
    return value < best if key.split("@")[0] in LOWER_IS_BETTER else value > best


def read_records(path: Path, kind: str | None = None) -> list[dict[str, Any]]:
    """The records of a run's ``metrics.jsonl``: the loss records (``kind=None``) or those of a kind
    (``evaluation``)."""
    if not path.is_file():
        return []
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in records if r.get("kind") == kind]


class QualityCurve:
    """The evaluations of a run: when one is due, running it, and the curve so far.

    Made on every process; the extractor is loaded on the main process only (it alone computes features). A
    missing or unreadable reference, or a missing extractor, stops the run at its start rather than at the first
    evaluation: the main process computes the reference's statistics for ``image_size`` images there (cached, so
    the evaluations reuse them)."""

    def __init__(self, log: LogSection, seed: int, layout: RunLayout, accelerator, image_size: int) -> None:
        self.every, self.layout, self.accelerator = log.eval_every, layout, accelerator
        self.keep_samples = log.eval_keep_samples
        self.keep_best = log.eval_keep_best  # checked with the config: only where evaluations are on
        self.done: set[int] = set()
        self.spec = log.eval_sampling.sampling()
        self.lead: Lead | None = None  # a hand-off's lead: the run's frozen copy (its spec names it)
        self.settings = GenerationSettings(log.eval_samples, seed, log.eval_batch_size, "balanced", self.spec)
        self.also_steps = tuple(log.eval_also_steps)  # more step counts of the same sampler, e.g. a few-step model's
        self.options = ScoringOptions()  # evaluate's defaults: the numbers its command line gives
        self.reference = resolve_reference(log.eval_reference) if log.eval_reference and self.every else None
        self.extractor = None
        if not self.enabled:
            return
        if not self.reference.exists():
            raise ConfigError(
                f"log.eval_reference {self.reference} does not exist: download the reference batch (docs/evaluation.md) "
                f"or make one with `moh-dit reference`, or set log.eval_every=0"
            )
        from moh_dit.evaluation.features import import_extractor_module, resolve_extractor

        import_extractor_module(log.eval_extractor_module, "log.eval_extractor_module")
        self.extractor_name = log.eval_extractor
        if accelerator.is_main_process:
            from moh_dit.evaluation.statistics import reference_statistics

            device = str(accelerator.device)
            self.extractor = resolve_extractor(log.eval_extractor, log.eval_extractor_weights, device)
            options = self.options
            info = reference_statistics(
                self.reference, self.extractor, options.batch_size, options.cache, image_size=image_size
            )["info"]
            logger.info("evaluation reference %s: %s", self.reference, info.get("statistics", "ready"))

    def best_so_far(self, record: dict[str, Any], run_id: str) -> bool:
        """Whether ``record`` (on the main process) beats the model in ``<run>/best`` by ``log.eval_keep_best``: the
        value its manifest records, where this run kept it by the same score against the same reference (else there
        is nothing to beat). Compared with the kept model rather than the curve, so that what it beats is on disk:
        after a rewound run sets a later best aside, the next evaluation is kept, and every better one after it."""
        key = self.keep_best
        if not key or key not in record:
            return False
        source = pipeline_source(self.layout.best)
        kept = source.get("best") or {}
        kept_by = (source.get("run_id"), kept.get("score"), kept.get("reference"))
        same = kept_by == (run_id, key, record["reference"])
        return improves(key, record[key], kept.get("value") if same else None)

    def use_objective(self, objective: Objective, lead: Lead | None = None) -> None:
        """Resolve an unset ``log.eval_sampling.scheduler`` for the run's objective (known once the model is); with the
        ``lead`` a generator trains after (its frozen lead), sample as the hand-off."""
        self.lead = lead
        self.spec = self.spec_at(self.spec.sampler.num_steps, run_sampling(self.spec, objective))
        self.settings.sampling = self.spec

    def spec_at(self, steps: int, spec: SamplingSpec | None = None) -> SamplingSpec:
        """How the evaluations sample at ``steps`` (from ``spec``, else theirs): the hand-off after the lead where it
        takes fewer steps, the model alone where it does not (a one-step score beside a two-step hand-off)."""
        spec = (spec or self.spec).replace(num_inference_steps=steps, lead_model=None)
        return spec.replace(lead=self.lead.spec) if self._led(steps) else spec

    def _led(self, steps: int) -> bool:
        """Whether ``steps`` are sampled as the hand-off: a lead, and more steps than it takes."""
        return self.lead is not None and steps > self.lead.spec.steps

    def led_steps(self) -> list[int]:
        """The step counts evaluated as the hand-off."""
        return [n for n in (self.spec.sampler.num_steps, *self.also_steps) if self._led(n)]

    @property
    def enabled(self) -> bool:
        return self.every > 0

    def resume(self, step: int) -> None:
        """Read which steps were evaluated (after ``metrics.jsonl`` dropped the records past the checkpoint at
        ``step``); the main process reads, every process learns it. The files of evaluations after ``step`` belong
        to a past this run no longer has: the main process moves them to ``eval/set-aside-after-step-N-<time>``."""
        if self.accelerator.is_main_process and self.layout.evaluations.is_dir():
            self._set_aside_after(step)
        if self.accelerator.is_main_process and self.layout.best.is_dir():
            self._set_aside_best_after(step)
        if not self.enabled:
            return
        main = self.accelerator.is_main_process
        steps = [sorted(r["step"] for r in read_records(self.layout.metrics, EVALUATION)) if main else None]
        if self.accelerator.num_processes > 1:
            from accelerate.utils import broadcast_object_list

            broadcast_object_list(steps, from_process=0)
        self.done = set(steps[0])

    def _set_aside_best_after(self, step: int) -> None:
        """The best pipeline of a step after ``step`` is another past's: moved to ``set-aside-after-step-N-<time>/``
        in the run folder; the next evaluation is kept in its place, and every better one after it."""
        source = pipeline_source(self.layout.best)
        if (source.get("step") or 0) > step:
            aside = set_aside(self.layout.root, [self.layout.best], step)
            logger.warning(
                "resuming at step %d: the best pipeline of step %s was moved to %s", step, source["step"], aside
            )

    def _set_aside_after(self, step: int) -> None:
        newer = [
            p
            for p in self.layout.evaluations.glob(f"{CHECKPOINT_PREFIX}*")
            if (checkpoint_step(p.name.split(".")[0]) or 0) > step
        ]
        aside = set_aside(self.layout.evaluations, newer, step)
        if aside is not None:
            logger.warning("resuming at step %d: the evaluations of later steps were moved to %s", step, aside)

    def due(self, step: int, final: bool = False) -> bool:
        """Whether ``step`` needs an evaluation: every ``eval_every`` steps, or at the end of the run (``final``),
        unless it has one."""
        return self.enabled and step > 0 and step not in self.done and (final or step % self.every == 0)

    def sample_dir(self, step: int) -> Path:
        return self.layout.evaluations / f"step-{step:08d}"

    def evaluate(self, pipe, step: int, samples_seen: int) -> dict[str, Any] | None:
        """Sample and score ``pipe`` (the EMA weights at ``step``) on every process. Returns the record on the
        main process (written to ``eval/step-N.metrics.json``), ``None`` elsewhere."""
        start, folder = time.time(), self.sample_dir(step)
        failure = None
        if self.accelerator.is_main_process:  # stop before sampling for minutes into a disk that cannot hold them
            try:
                needed = samples_bytes(pipe, self.settings.num_samples)
                check_free_space(self.layout.evaluations, needed, f"the evaluation samples of step {step}")
            except DiskFullError as err:
                failure = str(err)
        failure = first_failure(self.accelerator, failure)
        if failure is not None:
            raise DiskFullError(failure)
        if self.lead is not None:  # the weights the run trains after, already on the device
            pipe.adopt_lead(self.lead)
        result, metrics_file = self._score(pipe, folder, self.settings)
        extra = {}
        for steps in self.also_steps:  # the same weights at other step counts (a few-step model: 1, 2, 4)
            settings = dataclasses.replace(self.settings, sampling=self.spec_at(steps))
            also, _ = self._score(pipe, folder.with_name(f"{folder.name}-{steps}steps"), settings)
            if also is not None:
                extra |= {f"{k}@{steps}": also["metrics"][k] for k in SCORES if k in also["metrics"]}
        self.done.add(step)
        if result is None:
            return None
        scores = {k: result["metrics"][k] for k in SCORES if k in result["metrics"]}
        at = self.led_steps()
        led = {"lead": {**self.lead.spec.record(), "at_steps": at}} if at else {}
        return {
            "step": step,
            "kind": EVALUATION,
            **scores,
            **extra,
            "num_samples": result["num_samples"],
            "samples_seen": samples_seen,
            "extractor": result["extractor"],
            "reference": str(self.reference),
            "sampling": self.spec.record(),
            **led,
            "seconds": time.time() - start,
            "file": str(metrics_file.relative_to(self.layout.root)),
        }

    def _score(self, pipe, folder: Path, settings: GenerationSettings) -> tuple[dict | None, Path | None]:
        """One sample set of ``pipe`` scored (on every process; the result and its metrics file on the main one). The
        folder is the trainer's own: samples of other weights there (a run rewound by an elastic resume) are
        replaced, samples of these weights (an evaluation a crash cut short) are completed."""
        from moh_dit.evaluation.model_scores import sample_and_score

        result = sample_and_score(
            pipe, folder, settings, self.reference, self.extractor, self.options, self.accelerator, overwrite=True
        )
        if result is None:
            return None, None
        metrics_file = write_metrics(metrics_path_for(sample_npz_path(folder), self.extractor_name), result)
        if not self.keep_samples:  # 10,000 ImageNet samples are 2 GB; their scores and manifest stay
            shutil.rmtree(folder)
            sample_npz_path(folder).unlink()
        return result, metrics_file

    def describe(self) -> str:
        """``10000 samples every 50000 steps (dpm-solver, 25 steps, guidance 1 at every step), KID/FID against
        ref.npz with inception``, for the log at the start."""
        also = f"; also at {', '.join(map(str, self.also_steps))} steps" if self.also_steps else ""
        led = [n for n in self.led_steps() if n in self.also_steps]  # the main count's spec says its own
        if led:  # the hand-off a generator trained for a lead is sampled with
            also += f"; at {', '.join(map(str, led))} steps the hand-off after {self.lead.spec.describe()}"
        return (
            f"{self.settings.num_samples} samples every {plural(self.every, 'step')} ({self.spec.describe()}{also}), scored "
            f"against {self.reference} with {self.extractor_name}"
        )


def samples_bytes(pipe, count: int) -> int:
    """About what ``count`` evaluation samples of ``pipe`` take on disk: the PNGs (at most about their raw size)
    and the ``.npz`` (raw uint8)."""
    config = pipe.transformer.config
    side = config.sample_size * pipe.space.downsample_factor
    channels = config.in_channels if pipe.vae is None else pipe.vae.config.get("out_channels", 3)
    return 2 * count * side * side * channels


def curve_points(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The points of a model card's quality curve: the step, the sample count and the scores of each record."""
    return [{k: r[k] for k in ("step", "num_samples", *SCORES) if k in r} for r in records]
