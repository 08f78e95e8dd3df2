r"""The teacher's own sampling trajectories, for trajectory distillation (``distill.method: trajectory``;
moh_dit/objectives/distill/trajectory.py, docs/objective.md#trajectory-distillation).

A trajectory is the teacher's sampler run from noise on the linear path (flow time 1 is noise), its states kept at
every time of its grid: the teacher's own steps (its recorded sampler and step count, or ``distill.trajectory_*``)
with the times the student samples at added (0.5 for two steps, ...), so that the student's own intervals are secants
of the trajectory. The velocity the sampler follows is the teacher's, guided as the distillation folds it in
(:meth:`moh_dit.training.distill.teacher.Teacher.velocity`: its recorded CFG or autoguidance in its interval); a share of the
trajectories (the teacher's label dropout) is unconditional and unguided, so that the student keeps its unconditional
branch.

Three sources (``distill.trajectories``): ``online`` (drawn for every batch, never stored), a folder recorded
before (by a run, or ``moh-dit trajectories``), or, unset, a set the run records into its own folder before it
trains. A stored set is sharded safetensors files, each written atomically; recording resumes where it stopped (on
any number of processes: shard ``k`` is drawn from seeds of its trajectory indices alone) with a progress bar, and is
refused when the folder holds trajectories of another teacher or other settings. The finished set's manifest records
the teacher's identity (its weights' fingerprint, objective and guidance: what it computes, not where it was loaded
from), the grid, the shards' SHA-256 and the cost (network evaluations, seconds); training refuses a set of another
teacher in one line, and names a shard that is missing or damaged.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from moh_dit.errors import ArtifactError, ConfigError
from moh_dit.files import atomic_path, atomic_write_json
from moh_dit.manifests import differences, fingerprint_file, format_differences
from moh_dit.objectives.distill import sampler_intervals
from moh_dit.seeding import index_generator, label_for_index, mix
from moh_dit.training.frozen import FrozenModel

__all__ = [
    "TRAJECTORY_SAMPLERS",
    "trajectory_grid",
    "run_teacher_sampler",
    "TrajectoryPlan",
    "record_trajectories",
    "StoredTrajectories",
    "OnlineTrajectories",
    "MANIFEST",
    "NOISE_STREAM",
]

logger = logging.getLogger("moh_dit.train")

TRAJECTORY_SAMPLERS = ("euler", "heun", "unipc")  # the flow samplers that take an explicit grid of times
FALLBACK_SAMPLER = "unipc"  # for a teacher recorded with another (DPM-Solver++ on DiT's timesteps): one NFE a step
MANIFEST = "trajectories.json"
_NULL_STREAM = 7_927  # the stream of a trajectory's draw of the null class (moh_dit.seeding.mix)
# The stream of a trajectory's noise. A run evaluates itself during training on sampling's images 0, 1, ... at its
# own seed (moh_dit.training.quality), the seed a run's set is recorded at: drawn as sampling's image noises, the
# set's first trajectories were those evaluation images' noises and labels, so the curve of a student trained on
# them scored inputs it had learned (the smaller the set, the more often: docs/results.md). A stream of its own keeps
# the set apart from every evaluation.
NOISE_STREAM = 6_131


def trajectory_grid(steps: int, student_steps: tuple[int, ...], extra: tuple[float, ...] = ()) -> list[float]:
    """The flow times a trajectory's states are kept at, from 1 to 0: the ``steps``-step uniform grid with the
    sampler's own times for ``student_steps`` and the ``extra`` times added (rounded to 1e-9)."""
    times = set(np.round(np.linspace(1.0, 0.0, steps + 1), 9).tolist())
    times |= {round(t, 9) for interval in sampler_intervals(student_steps) for t in interval}
    times |= {round(float(t), 9) for t in extra}
    return sorted(times, reverse=True)


def run_teacher_sampler(
    velocity: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
    noise: torch.Tensor,
    labels: torch.Tensor,
    grid: list[float],
    sampler: str,
) -> torch.Tensor:
    """The states (N, len(grid), C, H, W), float32, of diffusers' flow sampler ``sampler`` run from ``noise`` over
    ``grid`` (1 .. 0) with ``velocity(z, t, labels)`` (the teacher's guided velocity of the linear path, evaluated
    at the scheduler's own time of each call)."""
    from moh_dit.objectives.flow import Flow

    scheduler = Flow().make_scheduler(sampler)
    scheduler.set_timesteps(sigmas=np.asarray(grid[:-1], dtype=np.float64))  # the samplers append the last 0
    z, states = noise, [noise.float()]
    for index, timestep in enumerate(scheduler.timesteps):
        now = scheduler.sigmas[index].to(noise.device, torch.float32).expand(noise.shape[0])
        z = scheduler.step(velocity(z, now, labels).to(z.dtype), timestep, z).prev_sample
        last = index == len(scheduler.timesteps) - 1  # Heun's step to 0 is Euler's: one call
        if last or getattr(scheduler, "state_in_first_order", True):  # Heun's second call completes its step
            states.append(z.float())
    if len(states) != len(grid):
        raise RuntimeError(f"the {sampler} sampler kept {len(states)} states on a grid of {len(grid)} times")
    return torch.stack(states, dim=1)


class TrajectoryPlan:
    """What a set of trajectories is: the teacher's identity, the sampler, its grid, the count, the shard size, the
    seed, the share of unconditional trajectories, the classes and the image shape. Two plans are the same set."""

    def __init__(self, **fields: Any) -> None:
        self.fields = dict(fields)
        for key, value in fields.items():
            setattr(self, key, value)

    def record(self) -> dict[str, Any]:
        return dict(self.fields)

    @property
    def shards(self) -> int:
        return math.ceil(self.count / self.shard_size)

    def indices(self, shard: int) -> range:
        return range(shard * self.shard_size, min((shard + 1) * self.shard_size, self.count))

    def draw(self, indices: range, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The noise and label of each trajectory index: noise from the plan's own stream (``noise_stream``; a set
        recorded before it existed has none and drew sampling's image ``index`` at this seed), a class-balanced
        label, the null class with probability ``null_share`` from a stream of its own."""
        shape, stream = tuple(self.shape), self.fields.get("noise_stream")
        noise = torch.stack([torch.randn(shape, generator=_noise_generator(self.seed, i, stream)) for i in indices])
        labels = [label_for_index(self.seed, i, self.num_classes, "balanced") for i in indices]
        for n, i in enumerate(indices):
            g = torch.Generator().manual_seed(mix(self.seed, i, _NULL_STREAM))
            if self.null_id is not None and float(torch.rand((), generator=g)) < self.null_share:
                labels[n] = self.null_id
        return noise.to(device), torch.tensor(labels, device=device)


def _noise_generator(seed: int, index: int, stream: int | None) -> torch.Generator:
    """The generator of trajectory ``index``'s noise: its stream's, or sampling's image ``index`` (no stream)."""
    if stream is None:
        return index_generator(seed, index)
    return torch.Generator().manual_seed(mix(seed, index, stream))


def _shard_path(folder: Path, shard: int) -> Path:
    return folder / f"shard-{shard:05d}.safetensors"


def _cost_path(folder: Path, shard: int) -> Path:
    return folder / f"shard-{shard:05d}.cost.json"


def record_trajectories(
    folder: Path,
    plan: TrajectoryPlan,
    velocity: Callable,
    evaluations: Callable[[], int],
    device: torch.device,
    rank: int = 0,
    world: int = 1,
    barrier: Callable[[], None] = lambda: None,
    batch: int = 64,
) -> dict[str, Any]:
    """Record (or finish recording) the set ``plan`` into ``folder`` and return its manifest: every process draws
    the shards ``k`` with ``k % world == rank`` not written yet; the main process then writes the manifest with each
    shard's SHA-256 and the cost (``evaluations()``: the teacher's network evaluations so far, per process). A folder
    of another plan is a :class:`ConfigError` naming what differs, before anything is written."""
    from safetensors.torch import save_file

    from moh_dit.progress import Progress

    folder = Path(folder)
    existing = _read_manifest(folder)
    if existing is not None:
        wanted = plan.record()
        if existing.get("complete") and "noise_stream" not in existing["plan"]:
            # a finished set recorded before the noise had its own stream: its states are still the teacher's
            # trajectories, so it trains as it is (the run warns of it: sources.trajectory_source); an unfinished
            # one cannot be finished alike (refused below)
            wanted = {k: v for k, v in wanted.items() if k != "noise_stream"}
        changed = differences(existing["plan"], wanted)
        if changed:
            raise ConfigError(
                f"{folder} holds trajectories of another teacher or other settings ({format_differences(changed)}): "
                f"record into another folder (distill.trajectories), or delete it"
            )
        if existing.get("complete"):
            return existing
    barrier()  # every process has read the folder before the main one writes its plan
    if rank == 0:
        folder.mkdir(parents=True, exist_ok=True)
        atomic_write_json(folder / MANIFEST, {"plan": plan.record(), "complete": False})
    barrier()
    mine = [k for k in range(plan.shards) if k % world == rank and not _readable(_shard_path(folder, k), plan)]
    bar = Progress(plan.count, plan.count - sum(len(plan.indices(k)) for k in mine) if world == 1 else 0,
                   "trajectories", "trajectory", rank == 0)  # fmt: skip
    for shard in mine:
        start, before = time.time(), evaluations()
        parts = []
        for first in range(0, len(plan.indices(shard)), batch):
            indices = plan.indices(shard)[first : first + batch]
            noise, labels = plan.draw(indices, device)
            parts.append(run_teacher_sampler(velocity, noise, labels, plan.grid, plan.sampler).cpu())
            bar.update(len(indices))
        indices = plan.indices(shard)
        _, labels = plan.draw(indices, torch.device("cpu"))
        tensors = {"states": torch.cat(parts).contiguous(), "labels": labels, "index": torch.tensor(list(indices))}
        # the cost beside the shard, so that the shard's bytes are the same on any machine and at any speed
        atomic_write_json(
            _cost_path(folder, shard), {"evaluations": evaluations() - before, "seconds": time.time() - start}
        )
        with atomic_path(_shard_path(folder, shard), ".safetensors") as tmp:
            save_file(tensors, tmp)
    bar.close()
    barrier()
    if rank == 0:
        manifest = {"plan": plan.record(), "complete": True, "shards": {}, "cost": {"evaluations": 0, "seconds": 0.0}}
        for shard in range(plan.shards):
            path = _shard_path(folder, shard)
            manifest["shards"][path.name] = fingerprint_file(path)
            cost = json.loads(_cost_path(folder, shard).read_text()) if _cost_path(folder, shard).is_file() else {}
            manifest["cost"]["evaluations"] += int(cost.get("evaluations", 0))
            manifest["cost"]["seconds"] += float(cost.get("seconds", 0.0))
        manifest["cost"]["images"] = plan.count
        atomic_write_json(folder / MANIFEST, manifest)
    barrier()
    return _read_manifest(folder)


def _read_manifest(folder: Path) -> dict | None:
    path = Path(folder) / MANIFEST
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except ValueError as err:
        raise ArtifactError(f"{path} is damaged ({err}): delete the folder and record it again") from None


def _readable(path: Path, plan: TrajectoryPlan) -> bool:
    """A shard written before: complete and of this plan's shape (a damaged one is drawn again)."""
    if not path.is_file():
        return False
    try:
        from safetensors import safe_open

        with safe_open(path, "pt") as f:
            states = f.get_slice("states").get_shape()
        return list(states[1:]) == [len(plan.grid), *plan.shape]
    except Exception:  # a damaged file of our own: drawn again (the log says so)
        logger.warning("%s is damaged: drawing it again", path)
        return False


class StoredTrajectories(FrozenModel):
    """A finished set read lazily from its shards (memory-mapped): ``pairs`` gives two states of chosen
    trajectories. Its identity is the teacher's and the shards' fingerprints, not the folder's path."""

    role = "trajectories"

    def __init__(self, folder: Path, teacher_identity: dict[str, Any]) -> None:
        from safetensors import SafetensorError, safe_open

        self.folder = Path(folder)
        manifest = _read_manifest(self.folder)
        if manifest is None:
            raise ConfigError(f"{self.folder} holds no trajectories ({MANIFEST} is missing): record them first")
        if not manifest.get("complete"):
            raise ConfigError(
                f"{self.folder} is an unfinished set of trajectories: finish it (moh-dit trajectories, or the run that "
                f"records it) before training on it"
            )
        changed = differences(manifest["plan"]["teacher"], teacher_identity)
        if changed:
            raise ConfigError(
                f"{self.folder} holds trajectories of another teacher ({format_differences(changed)}): record this "
                f"teacher's (distill.trajectories unset records them into the run)"
            )
        self.plan, self.manifest = TrajectoryPlan(**manifest["plan"]), manifest
        self.files = []
        for name, digest in manifest["shards"].items():
            path = self.folder / name
            if not path.is_file():
                raise ArtifactError(f"{path} is missing: the set of trajectories is incomplete; {self._again()}")
            if fingerprint_file(path) != digest:
                raise ArtifactError(f"{path} is damaged (its SHA-256 is not the recorded one): {self._again()}")
            try:
                self.files.append(safe_open(path, "pt"))
            except SafetensorError as err:
                raise ArtifactError(f"{path} is damaged ({err}): {self._again()}") from None
        self.grid = torch.tensor(self.plan.grid, dtype=torch.float64)
        self.count = self.plan.count

    def _again(self) -> str:
        """How to record the set again: the folder deleted first (a finished set is never overwritten), then the run
        that recorded it (its own set) or moh-dit trajectories."""
        return (
            f"delete {self.folder} and record it again (the run records its own set when it finds none there; "
            f"moh-dit trajectories --config <the run's config> --out {self.folder} records one for several runs)"
        )

    def modules(self) -> list[torch.nn.Module]:
        return []

    def identity(self) -> dict[str, Any]:
        return {"teacher": self.plan.teacher, "grid": self.plan.grid, "shards": self.manifest["shards"]}

    def describe(self) -> str:
        return (
            f"{self.count} trajectories of the teacher ({self.plan.sampler}, {self.plan.steps} steps, states at "
            f"{len(self.plan.grid)} times) in {self.folder}"
        )

    def pairs(self, terms: dict[str, torch.Tensor], start: torch.Tensor, end: torch.Tensor, device: torch.device):
        """States ``start`` and ``end`` (grid indices) of the trajectories ``terms["pick"]`` chooses, with their
        labels."""
        return self.states(terms, (start, end), device)

    def states(self, terms: dict[str, torch.Tensor], indices: tuple[torch.Tensor, ...], device: torch.device):
        """The states at each of ``indices`` (grid indices, one per row) of the trajectories ``terms["pick"]``
        chooses, then their labels."""
        chosen = (terms["pick"].double() * self.count).long().clamp(max=self.count - 1).tolist()
        picked, labels = [[] for _ in indices], []
        for row_index, k in enumerate(chosen):
            f, row = self.files[k // self.plan.shard_size], k % self.plan.shard_size
            states = f.get_slice("states")
            for out, index in zip(picked, indices):
                out.append(states[row : row + 1, int(index[row_index])][0])
            labels.append(f.get_slice("labels")[row : row + 1])
        to = dict(device=device, dtype=torch.float32)
        return (*(torch.stack(out).to(**to) for out in picked), torch.cat(labels).to(device))


class OnlineTrajectories(FrozenModel):
    """Trajectories drawn for every batch from the step's own noise and labels (no storage; a teacher's sampler run
    per sample, so the costliest source)."""

    role = "trajectories"

    def __init__(self, plan: TrajectoryPlan, velocity: Callable) -> None:
        self.plan, self.velocity = plan, velocity
        self.grid = torch.tensor(plan.grid, dtype=torch.float64)
        self.count = None

    def modules(self) -> list[torch.nn.Module]:
        return []

    def identity(self) -> dict[str, Any]:
        plan = self.plan.record()
        return {"online": True, **{k: plan[k] for k in ("teacher", "sampler", "grid", "null_share")}}

    def describe(self) -> str:
        return f"the teacher's trajectories drawn online ({self.plan.sampler}, {len(self.plan.grid) - 1} steps)"

    def pairs(self, terms: dict[str, torch.Tensor], start: torch.Tensor, end: torch.Tensor, device: torch.device):
        """The trajectories of the step's noise ``terms["noise"]`` and labels (``terms["class_pick"]``: a uniform
        class; ``terms["null_pick"] < null_share``: the null class), run now; their states ``start`` and ``end``."""
        return self.states(terms, (start, end), device)

    def states(self, terms: dict[str, torch.Tensor], indices: tuple[torch.Tensor, ...], device: torch.device):
        """As :meth:`pairs`, the states at each of ``indices`` (one sampler run for all), then the labels."""
        plan = self.plan
        labels = (terms["class_pick"].double() * plan.num_classes).long().clamp(max=plan.num_classes - 1)
        if plan.null_id is not None:
            labels = torch.where(terms["null_pick"] < plan.null_share, torch.full_like(labels, plan.null_id), labels)
        states = run_teacher_sampler(self.velocity, terms["noise"], labels, plan.grid, plan.sampler)
        rows = torch.arange(states.shape[0], device=states.device)
        return (*(states[rows, index.to(states.device)] for index in indices), labels)
