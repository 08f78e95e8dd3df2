"""Opening a run folder: a new run, or the same run again (resume), never a mix of two runs; and the run's
manifest, which records its identity and every start, resume and stop.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from moh_dit.errors import ArtifactError, ConfigError
from moh_dit.files import atomic_write_json, ensure_writable_dir
from moh_dit.manifests import (
    _MISSING,
    MANIFEST_FORMAT,
    _lookup,
    code_version,
    differences,
    format_differences,
    read_manifest,
    utc_now,
    without_retired_keys,
)
from moh_dit.objectives.registry import DEFAULT_OBJECTIVE
from moh_dit.run_folder import RunLayout, checkpoint_step, find_checkpoint, read_trainer_state

logger = logging.getLogger(__name__)


# ----------------------------------------------------------------------------------------------------
# Runs: refusing to mix runs, and the run manifest
# ----------------------------------------------------------------------------------------------------
def check_resume_step(checkpoint: Path | None, max_steps: int) -> None:
    """A checkpoint past ``train.max_steps`` has nothing left to train: say so, before anything is loaded or
    written (a resume would otherwise rewrite the run's config, records and pipeline for another step)."""
    step = checkpoint_step(checkpoint) if checkpoint is not None else 0
    if step > max_steps:
        raise ConfigError(
            f"{checkpoint} is at step {step}, already past train.max_steps={max_steps}: there is nothing to train, "
            f"and nothing was changed; raise train.max_steps to train on, or resume from an earlier checkpoint "
            f"(train.resume=PATH) to retrain from there"
        )


def open_run_folder(layout: RunLayout, resume: str | None, overwrite: bool, clear: bool) -> Path | None:
    """Decide how a run starts in ``layout.root``: the checkpoint to resume from, or ``None`` to start fresh.

    An earlier run in the folder is never mixed with a new one: without ``resume`` it is an error that names
    what was found and the ways out, unless ``overwrite`` (then, with ``clear``, i.e. on the main process,
    what moh-dit wrote there is removed). ``resume="latest"`` continues from the newest complete checkpoint
    (starting fresh when there is none); a path resumes from that checkpoint, which must belong to this
    folder unless the folder is empty.
    """
    ensure_writable_dir(layout.root, "train.output_dir")
    existing = layout.describe_existing()
    if resume is None:
        if existing and not overwrite:
            raise ArtifactError(
                f"{layout.root} already holds {existing}: continue it with train.resume=latest, choose a new "
                f"train.output_dir, or pass train.overwrite=true to clear it"
            )
        if existing and clear:
            removed = layout.clear()
            logger.warning("train.overwrite=true: removed %s", ", ".join(p.name for p in removed))
        return None
    if resume == "latest":
        return layout.latest_checkpoint()
    ckpt = find_checkpoint(layout.root, resume)
    inside = layout.checkpoints.resolve() in ckpt.resolve().parents
    if not inside and existing:
        raise ArtifactError(
            f"{layout.root} already holds {existing}; resuming {ckpt} (from another run) there would "
            f"mix the two: choose an empty train.output_dir"
        )
    return ckpt


def check_process_layout(resume_from: Path | None, layout: dict[str, int], elastic: bool) -> dict | None:
    """A resume on another process ``layout`` (processes and accumulation steps) than the checkpoint's keeps the global
    batch and the data of every step, but not the per-process random draws (keyed by rank and micro-step), so it
    cannot reproduce the uninterrupted run: refused unless ``elastic`` (``train.elastic_resume``). Returns the
    checkpoint's layout when it differs (and is allowed to)."""
    if resume_from is None:
        return None
    state = read_trainer_state(resume_from)
    # checkpoints of moh-dit 0.2 recorded the process count only (their accumulation was the config's)
    saved = {k: state.get(k, layout[k]) for k in layout}
    if saved == layout:
        return None
    was, now = (f"{d['world_size']} processes x {d['grad_accum_steps']} accumulation steps" for d in (saved, layout))
    if not elastic:
        raise ConfigError(
            f"{resume_from} was written by {was}, this run has {now}: another layout keeps the global "
            f"batch and the data of every step but draws other noise, timesteps and flips, so the run would "
            f"not continue as it would have. Resume with the same layout, or pass train.elastic_resume=true "
            f"to continue anyway (recorded in the run's manifest)"
        )
    logger.warning("train.elastic_resume: continuing a run of %s with %s (other random draws)", was, now)
    return saved


def objective_first(recorded: dict, identity: dict, diffs: list[tuple[str, Any, Any]]) -> list[tuple[str, Any, Any]]:
    """The differences of two run identities with another objective said first, by name (``objective: flow ->
    ddpm``), instead of the record keys and the output head it implies (``model.learn_sigma`` first)."""
    old, new = ((ident.get("model") or {}).get("objective") or {} for ident in (recorded, identity))
    was, now = old.get("name", DEFAULT_OBJECTIVE), new.get("name", DEFAULT_OBJECTIVE)
    if was == now:
        return diffs
    return [("objective", was, now), *(d for d in diffs if not d[0].startswith("model.objective"))]


def in_config_words(diffs: list[tuple[str, Any, Any]]) -> list[tuple[str, Any, Any]]:
    """Differences of two run identities named by the config keys that set them (``distill.guidance_scale``, not
    ``model.objective.guidance.scale`` and ``frozen.teacher.guidance.scale``), each key once; another distillation
    method alone, as what the others follow from."""
    from moh_dit.objectives.distill import user_key

    named: dict[str, tuple[str, Any, Any]] = {}
    # the objective's record first: its values are the config's (the model's copy may be absent in older runs)
    for key, was, now in sorted(diffs, key=lambda d: not d[0].startswith("model.objective.")):
        named.setdefault(user_key(key), (user_key(key), was, now))
    if "distill.method" in named:  # another method is another student: the rest (its frozen models) follows from it
        return [named["distill.method"]]
    return list(named.values())


class RunRecord:
    """The run manifest of a run folder: the run's identity, its settings and its events.

    Made at the start of every run or resume (by every process; only the main process writes): a
    recorded identity other than ``identity`` (architecture, data, seed, global batch) is another run, and
    stops with one line. Settings may change; :attr:`changes` lists them. A setting the record lacks (one
    added by a later moh-dit) is no change when it has its value in ``defaults``, the settings of a default
    config: runs made before it existed behaved as that default.
    """

    def __init__(self, layout: RunLayout, identity: dict, settings: dict, defaults: dict | None = None) -> None:
        self.layout, self.identity, self.settings = layout, identity, settings
        self.recorded = read_manifest(layout.root, "run")
        recorded_identity = without_retired_keys((self.recorded or {}).get("identity", {}), identity)
        # a run of moh-dit 0.5 or earlier recorded no frozen models (REPA's encoders were its only ones): not compared
        compared = identity if "frozen" in recorded_identity else {k: v for k, v in identity.items() if k != "frozen"}
        diffs = differences(recorded_identity, compared) if self.recorded else []
        if diffs:
            diffs = in_config_words(objective_first(recorded_identity, identity, diffs))
        if diffs:
            raise ArtifactError(
                f"{layout.root} holds a run with another set-up ({format_differences(diffs)}); resuming would mix two "
                f"runs: choose a new train.output_dir, or train.overwrite=true without train.resume to start over"
            )
        changes = differences(self.recorded.get("settings", {}), settings) if self.recorded else []
        self.changes = [(k, a, b) for k, a, b in changes if not (a == _MISSING and _lookup(defaults, k) == b)]

    @property
    def run_id(self) -> str | None:
        return self.recorded["run_id"] if self.recorded else None

    def write(self, event: str, **fields: Any) -> dict:
        """Create the manifest, or append an event (start, resume, stopped) to it."""
        import uuid

        previous = self.recorded or {}
        self.recorded = {
            "kind": "run",
            "format": MANIFEST_FORMAT,
            "run_id": previous.get("run_id") or uuid.uuid4().hex,
            "created": previous.get("created") or utc_now(),
            "code": code_version(),
            "identity": self.identity,
            "settings": self.settings,
            "events": previous.get("events", []) + [dict(event=event, **fields, time=utc_now(), code=code_version())],
        }
        atomic_write_json(self.layout.manifest, self.recorded)
        return self.recorded
