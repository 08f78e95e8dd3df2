"""Manifests and fingerprints: what made each artifact, so that a reader can check it before trusting it.

Every folder or file moh-dit writes records what produced it, and every reader checks that record before
it reuses or trusts the artifact. A mismatch stops with one line that names the difference and the way
out. The layouts (docs/artifacts.md has the whole list):

    run folder          manifest.json (kind "run": run id, config identity, data fingerprint, events)
                        config.yaml, metrics.jsonl, checkpoints/, pipeline/, samples/
    checkpoint          checkpoints/step-00001000/: manifest.json, trainer_state.json, model/, ema.safetensors,
                        optimizer.pt, scaler.pt, rng-rank<r>.{safetensors,json}
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
import os
import subprocess
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from moh_dit.errors import ArtifactError
from moh_dit.files import atomic_write_json, sibling

MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT = 1
# Weights of a healthy DiT stay far below this; a state beyond it has exploded (e.g. optim.lr=1e30) and is
# never written as a checkpoint.
MAX_SANE_WEIGHT = 1e4


# ----------------------------------------------------------------------------------------------------
# Provenance
# ----------------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=1)
def code_version() -> dict[str, Any]:
    """The moh-dit version, the git commit of the source tree when it is a checkout (``dirty`` when it has
    uncommitted changes), and the versions of the libraries that change numbers."""
    import diffusers

    from moh_dit import __version__

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


def fingerprint_file(path: str | os.PathLike, h: Any | None = None) -> str:
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


def read_manifest(folder_or_file: str | os.PathLike, kind: str | None = None) -> dict[str, Any] | None:
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


def pipeline_source(folder: str | os.PathLike) -> dict[str, Any]:
    """The ``source`` record of a pipeline folder's manifest (the run, its id and step that made it); ``{}`` where
    the folder or its record is missing."""
    if not Path(folder).is_dir():
        return {}
    return (read_manifest(folder, "pipeline") or {}).get("source") or {}


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


# identity keys an earlier moh-dit recorded and a later one no longer compares: a frozen model's ``source``, the path it
# was given by (moh-dit 0.5 to 0.6.x), is now provenance (a teacher is what it computes: its weights' fingerprint)
RETIRED_IDENTITY_KEYS = ("source",)


def without_retired_keys(recorded: Any, current: Any) -> Any:
    """``recorded`` without the :data:`RETIRED_IDENTITY_KEYS` that ``current`` lacks at the same place in a model's
    identity (a mapping that names its weights by ``sha256``), so that a run recorded by an earlier moh-dit resumes
    where only such a key differs."""
    if not isinstance(recorded, Mapping) or not isinstance(current, Mapping):
        return recorded
    retired = RETIRED_IDENTITY_KEYS if "sha256" in recorded else ()
    return {
        key: without_retired_keys(value, current.get(key))
        for key, value in recorded.items()
        if not (key in retired and key not in current)
    }


def _lookup(tree: Mapping[str, Any] | None, dotted: str) -> Any:
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
