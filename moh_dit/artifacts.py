"""Artifacts: where moh-dit writes things, and the manifest that says what made each one.

Every folder or file moh-dit writes records what produced it, and every reader checks that record before
it reuses or trusts the artifact. A mismatch stops with one line that names the difference and the way
out. The layouts:

    run folder          manifest.json (kind "run": run id, config identity, data fingerprint, events)
                        config.yaml, metrics.jsonl, checkpoints/, pipeline/, samples/
    checkpoint          checkpoints/step-00001000/: manifest.json, trainer_state.json, model/ (config +
                        safetensors), ema.safetensors, optimizer.pt, scaler.pt, rng-rank<r>.{safetensors,json}
                        (written as .tmp-step-N and renamed when complete)
    pipeline            model_index.json, transformer/, scheduler/, vae/, manifest.json (source, step, weights)
    sample folder       000000.png ..., manifest.json; beside it <folder>.npz (ADM arrays + the manifest)
    metrics             <samples>.metrics.json (kind "metrics": numbers, the samples' manifest, reference)
    reference stats     <reference>.moh-dit-stats.<key>.npz (keyed by content, extractor, weights, crop)
    latents             <file>.npy and <file>.npy.json (kind "latents": data, VAE, shapes)

A fingerprint is a SHA-256: of a file's bytes, or of a model's tensors (names, dtypes, shapes, values), so
the same weights have the same fingerprint whatever file format or folder they come from.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import shutil
import subprocess
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional

import numpy as np
import torch

from .errors import ArtifactError, MohDitError, OutputError, blame_the_file

__all__ = [
    "MANIFEST_NAME",
    "CHECKPOINT_PREFIX",
    "MAX_SANE_WEIGHT",
    "RunLayout",
    "atomic_write_text",
    "atomic_write_json",
    "sibling",
    "ensure_writable_dir",
    "ensure_writable_file",
    "code_version",
    "utc_now",
    "fingerprint_tensors",
    "fingerprint_module",
    "fingerprint_file",
    "fingerprint_files",
    "write_manifest",
    "read_manifest",
    "differences",
    "format_differences",
    "find_checkpoint",
    "checkpoint_step",
    "weight_health",
    "sample_npz_path",
    "metrics_path_for",
    "prepare_sample_folder",
    "read_npz_manifest",
    "read_safetensors",
    "read_torch_file",
    "open_run_folder",
    "RunRecord",
    "TrainingState",
    "save_checkpoint",
    "restore_checkpoint",
    "read_checkpoint",
    "read_trainer_state",
    "prune_checkpoints",
    "set_aside_newer_checkpoints",
    "replace_folder",
]

logger = logging.getLogger(__name__)
MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT = 1
CHECKPOINT_PREFIX = "step-"
# Weights of a healthy DiT stay far below this; a state beyond it has exploded (e.g. optim.lr=1e30) and is
# never written as a checkpoint.
MAX_SANE_WEIGHT = 1e4


# ----------------------------------------------------------------------------------------------------
# Files
# ----------------------------------------------------------------------------------------------------
def sibling(path: str | os.PathLike, suffix: str) -> Path:
    """``path`` with ``suffix`` appended to its name (``out/cfg1.5`` -> ``out/cfg1.5.npz``); unlike
    ``Path.with_suffix`` it never cuts a name at a dot."""
    path = Path(str(path).rstrip("/"))
    return path.with_name(path.name + suffix)


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` to a temporary file beside ``path`` and rename it: readers see the old or the new
    file, never a partial one."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)
    return path


def atomic_write_json(path: str | os.PathLike, obj: Any) -> Path:
    return atomic_write_text(path, json.dumps(obj, indent=2, default=_json_default) + "\n")


def _json_default(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, (np.integer, np.floating)):
        return obj.item()
    if isinstance(obj, Path):
        return str(obj)
    return str(obj)


def ensure_writable_dir(path: str | os.PathLike, what: str) -> Path:
    """Create ``path`` (and parents) if needed and check that files can be written in it, before any long
    work starts; an :class:`OutputError` names the folder otherwise."""
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".write-test-"):
            pass
    except OSError as err:
        raise OutputError(f"{what} {path} is not writable ({err.strerror or err})") from None
    return path


def ensure_writable_file(path: str | os.PathLike, what: str) -> Path:
    """Check that ``path`` can be written (its folder is created if needed) without touching an existing
    file."""
    path = Path(path)
    if path.is_dir():
        raise OutputError(f"{what} {path} is a folder; give a file name")
    ensure_writable_dir(path.parent, f"the folder of {what}")
    if path.exists() and not os.access(path, os.W_OK):
        raise OutputError(f"{what} {path} exists and is not writable")
    return path


# ----------------------------------------------------------------------------------------------------
# Provenance
# ----------------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=1)
def code_version() -> dict[str, Any]:
    """The moh-dit version, the git commit of the source tree when it is a checkout (``dirty`` when it has
    uncommitted changes), and the versions of the libraries that change numbers."""
    import diffusers

    from . import __version__

    info: dict[str, Any] = {
        "moh_dit": __version__,
        "git_commit": None,
        "torch": torch.__version__,
        "diffusers": diffusers.__version__,
    }
    root = Path(__file__).resolve().parents[1]
    if (root / ".git").exists():
        try:
            head = subprocess.run(
                ["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5, check=True
            ).stdout.strip()
            dirty = subprocess.run(
                ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                capture_output=True,
                text=True,
                timeout=5,
            ).stdout.strip()
            info["git_commit"] = head + ("-dirty" if dirty else "")
        except (OSError, subprocess.SubprocessError):
            pass
    return info


def utc_now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


# ----------------------------------------------------------------------------------------------------
# Fingerprints
# ----------------------------------------------------------------------------------------------------
def fingerprint_tensors(named: Iterable[tuple[str, torch.Tensor]]) -> str:
    """SHA-256 of tensors by sorted name, with dtype, shape and raw bytes: equal for equal weights."""
    h = hashlib.sha256()
    for name, tensor in sorted(named, key=lambda kv: kv[0]):
        t = tensor.detach().to("cpu").contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        if t.numel():
            h.update(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
    return h.hexdigest()


def fingerprint_module(module: torch.nn.Module) -> str:
    """Fingerprint of a module's state dict (parameters and buffers)."""
    return fingerprint_tensors(module.state_dict().items())


def fingerprint_file(path: str | os.PathLike, h: Optional[Any] = None) -> str:
    h = h or hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def fingerprint_files(root: str | os.PathLike, files: Iterable[str | os.PathLike], content: bool = True) -> str:
    """SHA-256 over a set of files: their paths relative to ``root`` and, with ``content``, their bytes
    (without it, a listing fingerprint: names only)."""
    root = Path(root)
    h = hashlib.sha256()
    for f in sorted(Path(p) for p in files):
        try:
            rel = f.relative_to(root).as_posix()
        except ValueError:
            rel = f.as_posix()
        h.update(rel.encode() + b"\0")
        if content:
            h.update(hashlib.sha256(f.read_bytes()).digest())
    return h.hexdigest()


def short(value: Any) -> str:
    """A value for one-line messages: fingerprints cut to 12 characters."""
    if isinstance(value, str) and len(value) == 64 and all(c in "0123456789abcdef" for c in value):
        return value[:12]
    return repr(value)


# ----------------------------------------------------------------------------------------------------
# Manifests
# ----------------------------------------------------------------------------------------------------
def write_manifest(folder_or_file: str | os.PathLike, kind: str, **fields: Any) -> dict[str, Any]:
    """Write ``manifest.json`` into a folder (or ``<file>.json`` beside a file) with the kind, the format,
    the time, the code version and ``fields``; returns the manifest."""
    target = Path(folder_or_file)
    manifest = {"kind": kind, "format": MANIFEST_FORMAT, "created": utc_now(), "code": code_version(), **fields}
    path = target / MANIFEST_NAME if target.is_dir() else sibling(target, ".json")
    atomic_write_json(path, manifest)
    return manifest


def read_manifest(folder_or_file: str | os.PathLike, kind: Optional[str] = None) -> Optional[dict[str, Any]]:
    """The manifest of a folder or file, or ``None`` when it has none; damaged or of another kind ->
    :class:`ArtifactError`."""
    target = Path(folder_or_file)
    path = target / MANIFEST_NAME if target.is_dir() else sibling(target, ".json")
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ArtifactError(f"{path} is damaged ({err}); remove it or the folder it describes") from None
    if not isinstance(manifest, dict):
        raise ArtifactError(f"{path} is not a moh-dit manifest")
    if kind is not None and manifest.get("kind") != kind:
        raise ArtifactError(f"{path} describes a {manifest.get('kind')!r}, not a {kind!r}")
    return manifest


def _normalise(value: Any) -> Any:
    if isinstance(value, tuple):
        return [_normalise(v) for v in value]
    if isinstance(value, list):
        return [_normalise(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _normalise(v) for k, v in value.items()}
    return value


_MISSING = "<absent>"


def differences(
    recorded: Mapping[str, Any], current: Mapping[str, Any], prefix: str = ""
) -> list[tuple[str, Any, Any]]:
    """``(dotted key, recorded value, current value)`` for every leaf that differs."""
    out = []
    for key in sorted(set(recorded) | set(current), key=str):
        a, b = _normalise(recorded.get(key, _MISSING)), _normalise(current.get(key, _MISSING))
        if isinstance(a, dict) and isinstance(b, dict):
            out += differences(a, b, f"{prefix}{key}.")
        elif a != b:
            out.append((f"{prefix}{key}", a, b))
    return out


def _lookup(tree: Optional[Mapping[str, Any]], dotted: str) -> Any:
    """The value at ``a.b.c`` in nested mappings, or ``_MISSING``."""
    for key in dotted.split("."):
        if not isinstance(tree, Mapping) or key not in tree:
            return _MISSING
        tree = tree[key]
    return _normalise(tree)


def format_differences(diffs: list[tuple[str, Any, Any]], limit: int = 6) -> str:
    """``key: recorded -> now`` pairs on one line."""
    text = ", ".join(f"{k}: {short(a)} -> {short(b)}" for k, a, b in diffs[:limit])
    return text + (f" and {len(diffs) - limit} more" if len(diffs) > limit else "")


# ----------------------------------------------------------------------------------------------------
# Run folders and checkpoints
# ----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RunLayout:
    """Paths inside a training run folder."""

    root: Path

    def __post_init__(self) -> None:
        object.__setattr__(self, "root", Path(self.root))

    @property
    def manifest(self) -> Path:
        return self.root / MANIFEST_NAME

    @property
    def config(self) -> Path:
        return self.root / "config.yaml"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def pipeline(self) -> Path:
        return self.root / "pipeline"

    @property
    def samples(self) -> Path:
        return self.root / "samples"

    @property
    def tracker_state(self) -> Path:
        return self.root / "trackers.json"

    def checkpoint(self, step: int) -> Path:
        return self.checkpoints / f"{CHECKPOINT_PREFIX}{step:08d}"

    def checkpoint_tmp(self, step: int) -> Path:
        return self.checkpoints / f".tmp-{CHECKPOINT_PREFIX}{step:08d}"

    def list_checkpoints(self) -> list[tuple[int, Path]]:
        """Complete checkpoints as ``(step, folder)``, oldest first (by step number, not by name)."""
        if not self.checkpoints.is_dir():
            return []
        found = []
        for p in self.checkpoints.iterdir():
            step = checkpoint_step(p)
            if step is not None and p.is_dir() and (p / "trainer_state.json").is_file():
                found.append((step, p))
        return sorted(found)

    def latest_checkpoint(self) -> Optional[Path]:
        found = self.list_checkpoints()
        return found[-1][1] if found else None

    def existing_contents(self) -> list[Path]:
        """What an earlier run left here (the things a new run would mix with or overwrite)."""
        names = [
            self.manifest,
            self.config,
            self.metrics,
            self.checkpoints,
            self.pipeline,
            self.samples,
            self.root / "model_config.json",
            self.tracker_state,
        ]
        return (
            [p for p in names if p.exists()] + sorted(self.root.glob("tensorboard*")) + sorted(self.root.glob("wandb"))
        )

    def describe_existing(self) -> Optional[str]:
        """One phrase about an earlier run in this folder, or ``None`` when there is none."""
        latest = self.latest_checkpoint()
        if latest is not None:
            return f"a run with checkpoints up to step {checkpoint_step(latest)}"
        if self.metrics.is_file() and self.metrics.stat().st_size:
            lines = [ln for ln in self.metrics.read_text().splitlines() if ln.strip()]
            last = json.loads(lines[-1]).get("step") if lines else None
            return f"a run that logged up to step {last} (no complete checkpoint)"
        if self.manifest.is_file() or self.pipeline.exists():
            return "an earlier run"
        return None

    def clear(self) -> list[Path]:
        """Remove what moh-dit wrote here (unknown files are left alone); returns what was removed."""
        removed = self.existing_contents()
        for p in removed:
            shutil.rmtree(p) if p.is_dir() else p.unlink()
        return removed


def checkpoint_step(path: str | os.PathLike) -> Optional[int]:
    """The step of a checkpoint folder named ``step-N``, else ``None``."""
    name = Path(path).name
    if not name.startswith(CHECKPOINT_PREFIX):
        return None
    digits = name[len(CHECKPOINT_PREFIX) :]
    return int(digits) if digits.isdigit() else None


def find_checkpoint(output_dir: str | os.PathLike, which: str = "latest") -> Optional[Path]:
    """``latest`` -> the newest complete checkpoint of the run in ``output_dir`` (or ``None``); a path ->
    that checkpoint, which must be complete."""
    if which != "latest":
        path = Path(which)
        if not (path / "trainer_state.json").is_file():
            raise ArtifactError(f"{path} is not a complete checkpoint (no trainer_state.json)")
        return path
    return RunLayout(Path(output_dir)).latest_checkpoint()


def weight_health(tensors: Iterable[torch.Tensor]) -> tuple[bool, float]:
    """``(sane, max |value|)``: sane means every value is finite and below :data:`MAX_SANE_WEIGHT`."""
    peak = 0.0
    for t in tensors:
        if t.numel() == 0:
            continue
        if not torch.isfinite(t).all():
            return False, float("inf")
        peak = max(peak, float(t.detach().abs().max()))
    return peak <= MAX_SANE_WEIGHT, peak


def replace_folder(tmp: Path, final: Path) -> None:
    """Rename a complete ``tmp`` folder to ``final``, replacing an existing ``final`` (``os.replace`` cannot
    rename over a non-empty folder)."""
    if final.exists():
        old = final.with_name(f".old-{final.name}")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)


# ----------------------------------------------------------------------------------------------------
# Runs: refusing to mix runs, and the run manifest
# ----------------------------------------------------------------------------------------------------
def open_run_folder(layout: RunLayout, resume: Optional[str], overwrite: bool, clear: bool) -> Optional[Path]:
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


class RunRecord:
    """The run manifest of a run folder: the run's identity, its settings and its events.

    Made at the start of every run or resume (by every process; only the main process writes): a
    recorded identity other than ``identity`` (architecture, data, seed, global batch) is another run, and
    stops with one line. Settings may change; :attr:`changes` lists them. A setting the record lacks (one
    added by a later moh-dit) is no change when it has its value in ``defaults``, the settings of a default
    config: runs made before it existed behaved as that default.
    """

    def __init__(self, layout: RunLayout, identity: dict, settings: dict, defaults: Optional[dict] = None) -> None:
        self.layout, self.identity, self.settings = layout, identity, settings
        self.recorded = read_manifest(layout.root, "run")
        diffs = differences(self.recorded.get("identity", {}), identity) if self.recorded else []
        if diffs:
            raise ArtifactError(
                f"{layout.root} holds a run with another set-up ({format_differences(diffs)}); resuming would mix two "
                f"runs: choose a new train.output_dir, or train.overwrite=true without train.resume to start over"
            )
        changes = differences(self.recorded.get("settings", {}), settings) if self.recorded else []
        self.changes = [(k, a, b) for k, a, b in changes if not (a == _MISSING and _lookup(defaults, k) == b)]

    @property
    def run_id(self) -> Optional[str]:
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


# ----------------------------------------------------------------------------------------------------
# Checkpoint files
# ----------------------------------------------------------------------------------------------------
@dataclass
class CheckpointContents:
    """Everything one process reads back from a checkpoint."""

    path: Path
    model_state: dict[str, torch.Tensor]
    ema_state: dict[str, torch.Tensor]
    optimizer_state: Any
    scaler_state: Any
    rank_tensors: dict[str, torch.Tensor]
    rank_python: dict[str, Any]
    trainer_state: dict[str, Any]
    manifest: Optional[dict[str, Any]]


@dataclass
class TrainingState:
    """The live objects a training checkpoint saves and restores (the model unwrapped from accelerate)."""

    model: torch.nn.Module
    ema: Any  # diffusers' EMAModel
    optimizer: Any
    scaler: Any  # accelerate's grad scaler, or None
    window: Any  # moh_dit.tracking.LossWindow

    def param_names(self) -> list[str]:
        return [n for n, _ in self.model.named_parameters()]

    def health(self) -> tuple[bool, float]:
        return weight_health([*self.model.parameters(), *self.ema.shadow_params])


def save_checkpoint(
    layout: RunLayout,
    step: int,
    state: TrainingState,
    accelerator,
    trainer_state: dict,
    manifest: dict,
    keep_last: Optional[int],
) -> tuple[Optional[Path], float]:
    """Write ``checkpoints/step-N`` from every process (the main one writes the shared files, each its own
    RNG states) into a temporary folder renamed when complete. Writes nothing and returns ``(None, peak)``
    when the weights or EMA are not finite or have exploded: such a state never replaces a good checkpoint.
    ``keep_last`` prunes older checkpoints (``None``: never, as for a rescue save)."""
    from safetensors.torch import save_file

    sane, peak = state.health()  # identical on every process (DDP keeps the weights equal)
    if not sane:
        return None, peak
    main = accelerator.is_main_process
    tmp, final = layout.checkpoint_tmp(step), layout.checkpoint(step)
    if main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    accelerator.wait_for_everyone()
    if main:
        state.model.save_pretrained(tmp / "model", safe_serialization=True)
        ema = {n: p.detach().cpu().contiguous() for n, p in zip(state.param_names(), state.ema.shadow_params)}
        save_file(ema, tmp / "ema.safetensors")
        torch.save(state.optimizer.state_dict(), tmp / "optimizer.pt")
        if state.scaler is not None:
            torch.save(state.scaler.state_dict(), tmp / "scaler.pt")
        manifest = dict(
            manifest,
            step=step,
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
    accelerator.wait_for_everyone()
    if main:
        ema_step = state.ema.optimization_step
        (tmp / "trainer_state.json").write_text(
            json.dumps(dict(trainer_state, step=step, ema_optimization_step=ema_step), indent=2)
        )
        write_manifest(tmp, "checkpoint", **manifest)
        replace_folder(tmp, final)
        if keep_last:
            prune_checkpoints(layout, keep_last)
        logger.info("saved checkpoint %s", final)
    accelerator.wait_for_everyone()
    return final, peak


def restore_checkpoint(path: Path, state: TrainingState, accelerator, run_id: Optional[str]) -> dict:
    """Restore everything a checkpoint holds into ``state`` (and this process's RNG states); it must be of
    the same architecture and, when both record one, of the same run. Returns the trainer state."""
    path = Path(path)
    contents = read_checkpoint(path, accelerator.process_index)
    owner = (contents.manifest or {}).get("run_id")
    if run_id and owner and owner != run_id:
        raise ArtifactError(f"{path} belongs to another run ({owner[:12]}) than this run folder ({run_id[:12]})")
    saved = json.loads((path / "model" / "config.json").read_text())
    diffs = [
        (k, saved.get(k), _normalise(v))
        for k, v in state.model.config.items()
        if not k.startswith("_") and saved.get(k) != _normalise(v)
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
    state.optimizer.load_state_dict(contents.optimizer_state)
    if state.scaler is not None and contents.scaler_state is not None:
        state.scaler.load_state_dict(contents.scaler_state)
    rng = contents.rank_tensors
    if "torch" in rng:
        torch.set_rng_state(rng["torch"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
        _set_python_rng_state(contents.rank_python)
    state.window.load(rng.get("window"))
    return contents.trainer_state


def _python_rng_state() -> dict[str, Any]:
    import random

    py, npy = random.getstate(), np.random.get_state()
    return {"python": [py[0], list(py[1]), py[2]], "numpy": [npy[0], npy[1].tolist(), *npy[2:]]}


def _set_python_rng_state(state: dict[str, Any]) -> None:
    import random

    py, npy = state["python"], state["numpy"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    np.random.set_state((npy[0], np.array(npy[1], dtype=np.uint32), *npy[2:]))


def set_aside_newer_checkpoints(layout: RunLayout, step: int) -> Optional[Path]:
    """Move the complete checkpoints after ``step`` into ``checkpoints/set-aside-after-step-N-<time>/`` (where
    no resume looks), for a run that continues from ``step``; returns that folder, or ``None`` when there
    were none. They are kept, not deleted: they may be all that is left of a longer run."""
    newer = [path for s, path in layout.list_checkpoints() if s > step]
    if not newer:
        return None
    aside = layout.checkpoints / f"set-aside-after-{CHECKPOINT_PREFIX}{step:08d}-{time.strftime('%Y%m%dT%H%M%S')}"
    aside.mkdir()
    for path in newer:
        os.replace(path, aside / path.name)
    return aside


def prune_checkpoints(layout: RunLayout, keep_last: int) -> list[Path]:
    """Remove all but the newest ``keep_last`` complete checkpoints (by step)."""
    found = layout.list_checkpoints()
    stale = [p for _, p in found[:-keep_last]] if keep_last > 0 else []
    for p in stale:
        shutil.rmtree(p, ignore_errors=True)
    return stale


def read_safetensors(path: Path, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """A safetensors file's tensors on ``device``; missing or damaged -> one-line :class:`ArtifactError`.

    The file is read on the CPU and only then moved: safetensors rejects some device names that torch
    accepts (``cpu:0``, which accelerate hands out on multi-process CPU runs), and it raises the same error
    type for a bad device as for a damaged header, so the device never reaches it.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    target = torch.device(device)  # a bad device name is the caller's bug and fails here, not as "damaged"
    if not path.is_file():
        raise ArtifactError(f"{path} is missing: the checkpoint is incomplete")
    # on the CPU, with a path that exists: what fails is the file's own header or length
    with blame_the_file(
        lambda err: ArtifactError(f"{path} is damaged ({str(err).splitlines()[0]})"), (SafetensorError,)
    ):
        tensors = load_file(path)
    return tensors if target.type == "cpu" else {name: t.to(target) for name, t in tensors.items()}


def read_torch_file(path: Path, error: type[MohDitError] = ArtifactError, what: str = "plain tensor file") -> Any:
    """``torch.load(weights_only=True)`` on the CPU: plain tensors and containers only (pickled code is
    refused). A damaged file, or one holding anything else, is an ``error`` naming it; a bug or a lack of
    memory propagates as itself (see :func:`moh_dit.errors.raised_by_the_file`)."""
    import pickle

    if not path.is_file():
        raise error(f"{path} is missing")

    def refused(err: BaseException) -> MohDitError:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        return error(f"{path} is damaged or not a {what}; refusing to unpickle it ({first})")

    with blame_the_file(refused, (pickle.UnpicklingError, EOFError, RuntimeError, zipfile.BadZipFile, ValueError)):
        # map_location="cpu": the file's own tensors, never a device question (callers move what they need)
        return torch.load(path, map_location="cpu", weights_only=True)


def read_trainer_state(path: Path) -> dict[str, Any]:
    """A checkpoint's ``trainer_state.json`` (step, data position, process layout, VAE, class names)."""
    try:
        return json.loads((Path(path) / "trainer_state.json").read_text())
    except (OSError, ValueError) as err:
        raise ArtifactError(f"{path}/trainer_state.json is unreadable ({err})") from None


def read_checkpoint(path: Path, rank: int) -> CheckpointContents:
    """Read a checkpoint written by the trainer, on the CPU (``load_state_dict`` and ``copy_`` put each tensor
    where its parameter lives); damaged or missing files stop with one line."""
    path = Path(path)
    trainer_state = read_trainer_state(path)
    model_state = read_safetensors(path / "model" / "diffusion_pytorch_model.safetensors")
    ema_state = read_safetensors(path / "ema.safetensors")
    optimizer_state = read_torch_file(path / "optimizer.pt")
    scaler_state = read_torch_file(path / "scaler.pt") if (path / "scaler.pt").is_file() else None
    rank_file = path / f"rng-rank{rank}.safetensors"
    rank_tensors = read_safetensors(rank_file) if rank_file.is_file() else {}
    rank_json = path / f"rng-rank{rank}.json"
    rank_python = json.loads(rank_json.read_text()) if rank_json.is_file() else {}
    return CheckpointContents(
        path,
        model_state,
        ema_state,
        optimizer_state,
        scaler_state,
        rank_tensors,
        rank_python,
        trainer_state,
        read_manifest(path, "checkpoint"),
    )


# ----------------------------------------------------------------------------------------------------
# Sample folders
# ----------------------------------------------------------------------------------------------------
def sample_npz_path(sample_dir: str | os.PathLike) -> Path:
    """The ADM ``.npz`` beside a sample folder: ``out/cfg1.5`` -> ``out/cfg1.5.npz``."""
    return sibling(sample_dir, ".npz")


def metrics_path_for(samples: str | os.PathLike, extractor: str = "inception") -> Path:
    """Default metrics JSON beside the samples (``x.npz`` -> ``x.metrics.json``; other extractors than
    Inception get their name in it, so evaluations with different features do not overwrite each other)."""
    path = Path(str(samples).rstrip("/"))
    base = path.with_name(path.name[: -len(".npz")]) if path.name.endswith(".npz") else path
    tag = "" if extractor in ("inception", "inception-v3-compat") else f"-{extractor.replace('/', '-')}"
    return sibling(base, f".metrics{tag}.json")


def read_npz_manifest(npz: str | os.PathLike) -> Optional[dict[str, Any]]:
    """The sample manifest stored inside a moh-dit ``.npz`` (``None`` for other files)."""
    try:
        with np.load(npz) as data:
            if "moh_dit_manifest" not in data.files:
                return None
            return json.loads(str(data["moh_dit_manifest"]))
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as err:
        raise ArtifactError(f"{npz} is not a readable array file ({err}); truncated?") from None


def _png_files(sample_dir: Path) -> list[Path]:
    return sorted(p for p in sample_dir.glob("*.png") if p.stem.isdigit())


def prepare_sample_folder(sample_dir: Path, manifest: dict[str, Any], overwrite: bool, write: bool) -> None:
    """Check a sample folder (and its ``.npz``) against the manifest of the samples about to be made.

    A folder is resumed only when its recorded ``identity`` (model and VAE fingerprints and every setting
    that changes the pixels) equals the new one. Images without a manifest, or from other settings, stop
    with one line naming the difference, unless ``overwrite`` (then they are removed). With ``write``
    (the main process) the manifest is written; every process calls this so that all raise alike.
    """
    npz = sample_npz_path(sample_dir)
    new = manifest["identity"]
    problems = []
    if sample_dir.is_dir():
        old = read_manifest(sample_dir, "samples")
        pngs = _png_files(sample_dir)
        if old is not None and differences(old.get("identity", {}), new):
            problems.append(
                f"{sample_dir} holds samples made with other settings "
                f"({format_differences(differences(old.get('identity', {}), new))})"
            )
        elif old is None and pngs:
            problems.append(
                f"{sample_dir} holds {len(pngs)} images without a moh-dit manifest "
                f"(from another tool or an older version)"
            )
    if npz.is_file():
        old_npz = read_npz_manifest(npz)
        if old_npz is None or differences(old_npz.get("identity", {}), new):
            what = (
                "no manifest" if old_npz is None else format_differences(differences(old_npz.get("identity", {}), new))
            )
            problems.append(f"{npz} was made by something else ({what})")
    if problems and not overwrite:
        raise ArtifactError(f"{'; '.join(problems)}: use a new --sample-dir, or pass --overwrite to replace them")
    if not write:
        return
    if problems:  # overwrite: clear what would otherwise be mixed in
        for p in _png_files(sample_dir) if sample_dir.is_dir() else []:
            p.unlink()
        for stale in (sample_dir / MANIFEST_NAME, sample_dir / "settings.json", npz):
            if stale.exists():
                stale.unlink()
    ensure_writable_dir(sample_dir, "sample folder")
    for partial in sample_dir.glob("*.png.tmp"):  # an image a killed process was writing (not yet renamed)
        partial.unlink()
    ensure_writable_file(npz, "the samples' .npz")
    write_manifest(sample_dir, "samples", **{k: v for k, v in manifest.items() if k not in ("kind", "format")})
