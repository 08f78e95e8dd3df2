"""Atomic file I/O: every write moh-dit makes goes through a temporary file or folder and a rename, so a
reader finds the old content or the new one, never half of each; and the two safe weight readers
(safetensors, and ``torch.load`` with ``weights_only=True``) that blame a file only for what the file caused.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import struct
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


# ----------------------------------------------------------------------------------------------------
# A full disk: one line naming what was being written, where, and the space left; never half a file
# ----------------------------------------------------------------------------------------------------
class DiskFullError(OutputError):
    """The device ran out of space while (or before) writing; unfinished files were removed."""


# what torch's zip writer says when a write fails (it drops the OS error: "[enforce fail at inline_container.cc]
# . unexpected pos", "PytorchStreamWriter failed writing file"); a full disk is by far its most common cause
_FULL_MESSAGES = ("no space left on device", "disk quota exceeded", "unexpected pos", "failed writing file")


def size_text(n: int) -> str:
    """A byte count for people (``1.2 GB``)."""
    return next(
        f"{n / f:.1f} {unit}" for f, unit in ((1e9, "GB"), (1e6, "MB"), (1e3, "kB"), (1, "bytes")) if n >= f or f == 1
    )


def free_bytes(path: str | os.PathLike) -> int:
    """Free space on the device that holds ``path`` (its nearest existing folder)."""
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


def is_disk_full(err: BaseException | None) -> bool:
    """Whether ``err`` (or an error it was raised from) is the device running out of space or quota."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if isinstance(err, DiskFullError) or any(m in str(err).lower() for m in _FULL_MESSAGES):
            return True
        err = err.__cause__ or err.__context__
    return False


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


@contextmanager
def writing(what: str, where: str | os.PathLike, *unfinished: str | os.PathLike) -> Iterator[None]:
    """Run a block that writes ``what`` into the folder ``where``; if the disk fills inside it, remove the
    ``unfinished`` files and folders and raise one :class:`DiskFullError` line instead of the writer's traceback.
    Complete files written before are left as they are."""
    try:
        yield
    except DiskFullError:
        for path in unfinished:
            _remove(Path(path))
        raise
    except BaseException as err:
        if not is_disk_full(err):
            raise
        for path in unfinished:
            _remove(Path(path))
        raise DiskFullError(
            f"no space left on the device while writing {what} to {where} ({size_text(free_bytes(where))} free there "
            f"after removing the unfinished files): free some space or write elsewhere"
        ) from None


def check_free_space(
    where: str | os.PathLike,
    needed: int,
    what: str,
    *,
    freed: int = 0,
    advice: str = "free some space or write elsewhere",
) -> None:
    """Stop before writing about ``needed`` bytes of ``what`` into ``where`` when its device has less free
    (``freed``: bytes of the files the write replaces, which count as free)."""
    free = free_bytes(where) + freed
    if needed > free:
        raise DiskFullError(
            f"not enough space for {what} in {where}: it needs about {size_text(needed)} and "
            f"{size_text(free)} is free; {advice}"
        )


def folder_size(path: str | os.PathLike) -> int:
    """Bytes of the files under ``path`` (0 when it does not exist)."""
    path = Path(path)
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else 0


@contextmanager
def atomic_path(path: str | os.PathLike, suffix: str = "") -> Iterator[Path]:
    """The one way moh-dit writes a file: the block writes to the temporary path this yields (beside ``path``,
    hidden, ending in ``suffix`` for writers that add their own, as ``np.savez`` adds ``.npz``), which is
    renamed onto ``path`` when the block ends. Readers see the old or the new file, never a partial one; a
    block that raises leaves ``path`` as it was and removes the temporary file (a full disk is one
    :class:`DiskFullError` line).

        with atomic_path(out, ".npz") as tmp:
            np.savez(tmp, arr_0=images)
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}{TMP_MARK}{os.getpid()}{suffix}")
    try:
        with writing(path.name, path.parent, tmp):
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


def json_text(obj: Any) -> str:
    """``obj`` as the JSON files moh-dit writes hold it: indented, numpy values and paths as plain ones, a final
    newline."""
    return json.dumps(obj, indent=2, default=_json_default) + "\n"


def atomic_write_json(path: str | os.PathLike, obj: Any) -> Path:
    return atomic_write_text(path, json_text(obj))


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


@contextmanager
def atomic_folder(folder: str | os.PathLike, what: str) -> Iterator[Path]:
    """The folder counterpart of :func:`atomic_path`: the block fills the temporary folder this yields (beside
    ``folder``, ``.tmp-<name>``), which replaces ``folder`` when the block ends. A block that raises leaves
    ``folder`` as it was and removes the temporary one; a full disk is one :class:`DiskFullError` line about
    ``what``."""
    folder = Path(folder)
    tmp = folder.with_name(f".tmp-{folder.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        with writing(what, folder.parent, tmp):
            tmp.mkdir(parents=True)
            yield tmp
            replace_folder(tmp, folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


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


def unpickler_reason(err: BaseException) -> str:
    """What torch's restricted unpickler refused, in one line, without torch's advice to retry with
    ``weights_only=False`` (moh-dit never unpickles code from a file): ``Unsupported operand 35``, ``Unsupported
    global: GLOBAL os.system``; an opcode the unpickler does not know (a ``KeyError`` on junk bytes) is named as one."""
    if isinstance(err, KeyError):
        return f"unknown pickle opcode {err.args[0] if err.args else ''}".strip()
    text = str(err).strip()
    if "WeightsUnpickler error:" in text:
        detail = text.split("WeightsUnpickler error:", 1)[1].strip().splitlines()
        return next((line.strip() for line in detail if line.strip()), "a type it may not unpickle")
    return text.splitlines()[0] if text else type(err).__name__


def read_torch_file(path: Path, error: type[MohDitError] = ArtifactError, what: str = "plain tensor file") -> Any:
    """``torch.load(weights_only=True)`` on the CPU: plain tensors and containers only (pickled code is
    refused). A damaged file, or one holding anything else, is an ``error`` naming it; a bug or a lack of
    memory propagates as itself (see :func:`moh_dit.errors.raised_by_the_file`)."""
    import pickle

    if not path.is_file():
        raise error(f"{path} is missing")

    def refused(err: BaseException) -> MohDitError:
        return error(f"{path} is damaged or not a {what}; refusing to unpickle it ({unpickler_reason(err)})")

    import argparse

    # map_location="cpu": the file's own tensors, never a device question (callers move what they need).
    # argparse.Namespace, in which the train.py scripts of DiT, SiT and REPA store their arguments beside the
    # weights, is allowed: unpickling it only sets attributes.
    # junk bytes end in whatever the unpickler trips on: an unknown opcode is a KeyError, a truncated one an
    # IndexError or a struct error, text a UnicodeDecodeError (a ValueError)
    errors = (pickle.UnpicklingError, EOFError, RuntimeError, zipfile.BadZipFile, ValueError, KeyError, IndexError,
              struct.error)  # fmt: skip
    with blame_the_file(refused, errors), torch.serialization.safe_globals([argparse.Namespace]):
        return torch.load(path, map_location="cpu", weights_only=True)
