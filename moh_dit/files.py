"""Atomic file I/O: every write moh-dit makes goes through a temporary file or folder and a rename, so a
reader finds the old content or the new one, never half of each; and the two safe weight readers
(safetensors, and ``torch.load`` with ``weights_only=True``) that blame a file only for what the file caused.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch

from moh_dit.errors import ArtifactError, MohDitError, OutputError, blame_the_file


# ----------------------------------------------------------------------------------------------------
# Files
# ----------------------------------------------------------------------------------------------------
def sibling(path: str | os.PathLike, suffix: str) -> Path:
    """``path`` with ``suffix`` appended to its name (``out/cfg1.5`` -> ``out/cfg1.5.npz``); unlike
    ``Path.with_suffix`` it never cuts a name at a dot."""
    path = Path(str(path).rstrip("/"))
    return path.with_name(path.name + suffix)


@contextmanager
def atomic_path(path: str | os.PathLike, suffix: str = "") -> Iterator[Path]:
    """The one way moh-dit writes a file: the block writes to the temporary path this yields (beside ``path``,
    hidden, ending in ``suffix`` for writers that add their own, as ``np.savez`` adds ``.npz``), which is
    renamed onto ``path`` when the block ends. Readers see the old or the new file, never a partial one; a
    block that raises leaves ``path`` as it was and removes the temporary file.

        with atomic_path(out, ".npz") as tmp:
            np.savez(tmp, arr_0=images)
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}{TMP_MARK}{os.getpid()}{suffix}")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


# what marks an unfinished file of atomic_path: ``.<name>.tmp-<pid>[suffix]``
TMP_MARK = ".tmp-"


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` atomically (see :func:`atomic_path`)."""
    with atomic_path(path) as tmp:
        tmp.write_text(text)
    return Path(path)


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

    import argparse

    # map_location="cpu": the file's own tensors, never a device question (callers move what they need).
    # argparse.Namespace, in which the train.py scripts of DiT, SiT and REPA store their arguments beside the
    # weights, is allowed: unpickling it only sets attributes.
    errors = (pickle.UnpicklingError, EOFError, RuntimeError, zipfile.BadZipFile, ValueError)
    with blame_the_file(refused, errors), torch.serialization.safe_globals([argparse.Namespace]):
        return torch.load(path, map_location="cpu", weights_only=True)
