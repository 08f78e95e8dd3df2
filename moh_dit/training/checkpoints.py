"""Writing, restoring, pruning and setting aside checkpoints.

A checkpoint is written into ``.tmp-step-N`` and renamed when complete, only from finite, sane weights; it
holds everything an exact resume needs (model, EMA, optimizer, scaler, step, every rank's RNG states, the
data position and the open loss window).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from moh_dit.errors import ArtifactError
from moh_dit.files import (
    DiskFullError,
    check_free_space,
    folder_size,
    read_safetensors,
    read_torch_file,
    replace_folder,
    writing,
)
from moh_dit.manifests import (
    _normalise,
    fingerprint_module,
    fingerprint_tensors,
    format_differences,
    weight_health,
    without_retired_keys,
    write_manifest,
)
from moh_dit.model.presets import model_config_defaults
from moh_dit.run_folder import CHECKPOINT_PREFIX, CheckpointContents, RunLayout, read_checkpoint

logger = logging.getLogger(__name__)
POSTHOC_STATE = "posthoc_ema.safetensors"  # a checkpoint's power-function EMAs (post-hoc EMA)
COMPANIONS = "companions"  # a checkpoint's networks trained beside the student (DMD2's fake score), with optimizers


@dataclass
class TrainingState:
    """The live objects a training checkpoint saves and restores (the model unwrapped from accelerate)."""

    model: torch.nn.Module
    ema: Any  # diffusers' EMAModel
    optimizer: Any
    scaler: Any  # accelerate's grad scaler, or None
    window: Any  # moh_dit.training.tracking.LossWindow
    posthoc: Any = None  # moh_dit.posthoc_ema.PowerFunctionEMAs, or None
    companions: dict = field(
        default_factory=dict
    )  # role -> moh_dit.training.distill.companions.Companion (DMD2's fake score)

    def param_names(self) -> list[str]:
        return [n for n, _ in self.model.named_parameters()]

    def health(self) -> tuple[bool, float]:
        posthoc = [t for ema in self.posthoc.emas for t in ema] if self.posthoc is not None else []
        beside = [p for companion in self.companions.values() for p in companion.module.parameters()]
        return weight_health([*self.model.parameters(), *self.ema.shadow_params, *posthoc, *beside])


def save_checkpoint(
    layout: RunLayout,
    step: int,
    state: TrainingState,
    accelerator,
    trainer_state: dict,
    manifest: dict,
    keep_last: int | None,
) -> tuple[Path | None, float]:
    """Write ``checkpoints/step-N`` from every process (the main one writes the shared files, each its own
    RNG states) into a temporary folder renamed when complete. Writes nothing and returns ``(None, peak)``
    when the weights or EMA are not finite or have exploded: such a state never replaces a good checkpoint.
    ``keep_last`` prunes older checkpoints (``None``: never, as for a rescue save).

    A disk without room for another checkpoint as large as the last stops the run before writing; one that fills
    while writing stops it with one line naming the checkpoint, the folder and the space left, after removing the
    unfinished folder. Every process stops with the same :class:`DiskFullError`; earlier checkpoints are intact."""
    sane, peak = state.health()  # identical on every process (DDP keeps the weights equal)
    if not sane:
        return None, peak
    main = accelerator.is_main_process
    tmp, final = layout.checkpoint_tmp(step), layout.checkpoint(step)
    what, written = f"checkpoint step {step}", {}

    def prepare() -> None:
        shutil.rmtree(tmp, ignore_errors=True)
        previous = layout.latest_checkpoint()  # holds the same tensors: what this one needs
        if previous is not None:
            check_free_space(layout.checkpoints, folder_size(previous), f"{what} (as large as {previous.name})")
        tmp.mkdir(parents=True)

    def files() -> None:
        written["manifest"] = _write_checkpoint_files(tmp, state, accelerator, dict(manifest, step=step), peak)

    def finish() -> None:
        ema_step = state.ema.optimization_step
        (tmp / "trainer_state.json").write_text(
            json.dumps(dict(trainer_state, step=step, ema_optimization_step=ema_step), indent=2)
        )
        write_manifest(tmp, "checkpoint", **written["manifest"])
        replace_folder(tmp, final)

    for phase, everyone in ((prepare, False), (files, True), (finish, False)):
        failure = None
        if everyone or main:
            try:
                with writing(what, layout.checkpoints, tmp):
                    phase()
            except DiskFullError as err:
                failure = str(err)
        failure = first_failure(accelerator, failure)  # also the barrier between the phases
        if failure is not None:
            if main:
                shutil.rmtree(tmp, ignore_errors=True)
            raise DiskFullError(failure)
    if main:
        if keep_last:
            prune_checkpoints(layout, keep_last)
        logger.info("saved checkpoint %s", final)
    accelerator.wait_for_everyone()
    return final, peak


def _write_checkpoint_files(tmp: Path, state: TrainingState, accelerator, manifest: dict, peak: float) -> dict:
    """The files of a checkpoint: the shared ones from the main process, each process's RNG states; returns the
    manifest with the weights' fingerprints."""
    from safetensors.torch import save_file

    if accelerator.is_main_process:
        state.model.save_pretrained(tmp / "model", safe_serialization=True)
        ema = {n: p.detach().cpu().contiguous() for n, p in zip(state.param_names(), state.ema.shadow_params)}
        save_file(ema, tmp / "ema.safetensors")
        if state.posthoc is not None:  # the power-function EMAs of post-hoc EMA, for an exact resume
            save_file(state.posthoc.state_dict(state.param_names()), tmp / POSTHOC_STATE)
        torch.save(state.optimizer.state_dict(), tmp / "optimizer.pt")
        if state.scaler is not None:
            torch.save(state.scaler.state_dict(), tmp / "scaler.pt")
        for (
            role,
            companion,
        ) in state.companions.items():  # the networks trained beside the student, and their optimizers
            (tmp / COMPANIONS).mkdir(exist_ok=True)
            weights = {n: t.detach().cpu().contiguous() for n, t in companion.module.state_dict().items()}
            save_file(weights, tmp / COMPANIONS / f"{role}.safetensors")
            torch.save(companion.optimizer.state_dict(), tmp / COMPANIONS / f"{role}.optimizer.pt")
            manifest = dict(manifest, **{f"{role}_sha256": fingerprint_tensors(weights.items())})
        manifest = dict(
            manifest,
            max_abs_weight=peak,
            model_sha256=fingerprint_module(state.model),
            ema_sha256=fingerprint_tensors(ema.items()),
        )
    rank = accelerator.process_index
    rng = {"torch": torch.get_rng_state(), "window": state.window.state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state()
    save_file(rng, tmp / f"rng-rank{rank}.safetensors")
    (tmp / f"rng-rank{rank}.json").write_text(json.dumps(_python_rng_state()))
    return manifest


def first_failure(accelerator, failure: str | None) -> str | None:
    """The first process's failure (in rank order), known to every process, so that all stop together instead of
    some waiting for the others at the next barrier (this is a barrier itself)."""
    if accelerator.num_processes == 1:
        return failure
    from accelerate.utils import gather_object

    return next((f for f in gather_object([failure]) if f), None)


def restore_checkpoint(path: Path, state: TrainingState, accelerator, run_id: str | None) -> dict:
    """Restore everything a checkpoint holds into ``state`` (and this process's RNG states); it must be of
    the same architecture and, when both record one, of the same run. Returns the trainer state."""
    contents = restore_weights(path, state, accelerator, run_id)
    rng = contents.rank_tensors
    if "torch" in rng:
        torch.set_rng_state(rng["torch"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
        _set_python_rng_state(contents.rank_python)
    state.window.load(rng.get("window"))
    return contents.trainer_state


def restore_weights(path: Path, state: TrainingState, accelerator, run_id: str | None = None) -> CheckpointContents:
    """Restore a checkpoint's model, EMA, optimizer and grad-scaler states into ``state``, not the step, the
    random states or the loss window (what the spike guard's rollback needs); checked as
    :func:`restore_checkpoint` checks. Returns what was read."""
    path = Path(path)
    contents = read_checkpoint(path, accelerator.process_index)
    owner = (contents.manifest or {}).get("run_id")
    if run_id and owner and owner != run_id:
        raise ArtifactError(f"{path} belongs to another run ({owner[:12]}) than this run folder ({run_id[:12]})")
    saved = json.loads((path / "model" / "config.json").read_text())
    defaults = model_config_defaults()  # a key a checkpoint of an older moh-dit lacks had its default then
    # a key an older moh-dit recorded and no longer compares (a teacher's path in the objective's record) is not one
    was = {
        k: without_retired_keys(saved.get(k, defaults.get(k)), _normalise(v)) for k, v in state.model.config.items()
    }
    diffs = [
        (k, was[k], _normalise(v))
        for k, v in state.model.config.items()
        if not k.startswith("_") and was[k] != _normalise(v)
    ]
    if diffs:
        raise ArtifactError(f"checkpoint {path} is for another architecture ({format_differences(diffs)})")
    state.model.load_state_dict(contents.model_state)
    names = state.param_names()
    missing = [n for n in names if n not in contents.ema_state]
    if missing:
        raise ArtifactError(f"{path}/ema.safetensors does not match the model: missing {missing[:5]}")
    for name, shadow in zip(names, state.ema.shadow_params):
        shadow.copy_(contents.ema_state[name])
    state.ema.optimization_step = contents.trainer_state["ema_optimization_step"]
    if state.posthoc is not None:
        if not (path / POSTHOC_STATE).is_file():
            raise ArtifactError(
                f"{path} holds no post-hoc EMA state ({POSTHOC_STATE}): it was written without ema.posthoc_every, and "
                f"the power-function EMAs cannot start halfway through a run; resume without ema.posthoc_every"
            )
        try:
            state.posthoc.load_state_dict(read_safetensors(path / POSTHOC_STATE, "cpu"), names)
        except KeyError as err:
            raise ArtifactError(
                f"{path}/{POSTHOC_STATE}: {err.args[0]}; keep the run's ema.posthoc_sigma_rels"
            ) from None
    saved, ours = len(contents.optimizer_state["param_groups"]), len(state.optimizer.param_groups)
    if saved != ours:  # torch's own error names no cause
        raise ArtifactError(
            f"{path}/optimizer.pt has {saved} parameter group(s) and this run {ours}: optim.new_lr_scale was 1 in one "
            f"of them and not in the other (1 trains every tensor alike); resume with the run's own value"
        )
    state.optimizer.load_state_dict(contents.optimizer_state)
    if state.scaler is not None and contents.scaler_state is not None:
        state.scaler.load_state_dict(contents.scaler_state)
    for role, companion in state.companions.items():
        weights, optimizer = path / COMPANIONS / f"{role}.safetensors", path / COMPANIONS / f"{role}.optimizer.pt"
        if not weights.is_file():
            raise ArtifactError(f"{path} holds no {role} ({weights.name}): it was written by another method's run")
        try:
            companion.module.load_state_dict(read_safetensors(weights, "cpu"))
        except RuntimeError as err:
            raise ArtifactError(f"{weights} is for another architecture ({str(err).splitlines()[0]})") from None
        companion.optimizer.load_state_dict(read_torch_file(optimizer))
    return contents


def _python_rng_state() -> dict[str, Any]:
    import random

    py, npy = random.getstate(), np.random.get_state()
    return {"python": [py[0], list(py[1]), py[2]], "numpy": [npy[0], npy[1].tolist(), *npy[2:]]}


def _set_python_rng_state(state: dict[str, Any]) -> None:
    import random

    py, npy = state["python"], state["numpy"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    np.random.set_state((npy[0], np.array(npy[1], dtype=np.uint32), *npy[2:]))


def set_aside_the_future(layout: RunLayout, step: int) -> dict[str, str]:
    """A resume from an older checkpoint rewinds the run: the newer checkpoints and post-hoc snapshots hold another past
    and must never be taken for this run's (by ``train.resume=latest`` after a crash, or as its final checkpoint).
    Both are set aside; returns the checkpoints' new folder for the run's record (``{}`` when there were none)."""
    record = {}
    aside = set_aside_newer_checkpoints(layout, step)
    if aside is not None:
        logger.warning("resuming at step %d: the newer checkpoints were moved to %s", step, aside)
        record["set_aside"] = str(aside)
    later = [p for s, p in layout.list_snapshots() if s > step]  # another past's EMAs
    aside = set_aside(layout.posthoc, later, step)
    if aside is not None:
        logger.warning("resuming at step %d: the newer post-hoc EMA snapshots were moved to %s", step, aside)
    return record


def set_aside_newer_checkpoints(layout: RunLayout, step: int) -> Path | None:
    """Move the complete checkpoints after ``step`` into ``checkpoints/set-aside-after-step-N-<time>/`` (where
    no resume looks), for a run that continues from ``step``; returns that folder, or ``None`` when there
    were none. They are kept, not deleted: they may be all that is left of a longer run."""
    return set_aside(layout.checkpoints, [path for s, path in layout.list_checkpoints() if s > step], step)


def set_aside(folder: Path, paths: list[Path], step: int) -> Path | None:
    """Move ``paths`` (a run's artifacts of steps after ``step``) into ``folder/set-aside-after-step-N-<time>/``;
    returns that folder, or ``None`` when there is nothing to move."""
    if not paths:
        return None
    aside = folder / f"set-aside-after-{CHECKPOINT_PREFIX}{step:08d}-{time.strftime('%Y%m%dT%H%M%S')}"
    aside.mkdir()
    for path in paths:
        os.replace(path, aside / path.name)
    return aside


def prune_checkpoints(layout: RunLayout, keep_last: int) -> list[Path]:
    """Remove all but the newest ``keep_last`` complete checkpoints (by step)."""
    found = layout.list_checkpoints()
    stale = [p for _, p in found[:-keep_last]] if keep_last > 0 else []
    for p in stale:
        shutil.rmtree(p, ignore_errors=True)
    return stale
