"""Atomic writes (moh_dit.files), with no training run: a write is all or nothing."""

import errno
import json
import os

import numpy as np
import pytest

from moh_dit import files
from moh_dit.files import (
    DiskFullError,
    atomic_folder,
    atomic_path,
    atomic_write_json,
    atomic_write_text,
    check_free_space,
    free_bytes,
    is_disk_full,
    size_text,
    writing,
)


def test_a_write_that_fails_leaves_the_old_file_and_no_temporary_one(tmp_path):
    target = tmp_path / "out.txt"
    atomic_write_text(target, "old")
    with pytest.raises(RuntimeError, match="disk full"), atomic_path(target) as tmp:
        tmp.write_text("half of the new")
        raise RuntimeError("disk full")
    assert target.read_text() == "old" and os.listdir(tmp_path) == ["out.txt"]


def test_a_write_that_completes_replaces_the_file_in_one_rename(tmp_path):
    target = tmp_path / "m.json"
    atomic_write_json(target, {"a": 1})
    with atomic_path(target) as tmp:
        tmp.write_text(json.dumps({"a": 2}))
        assert json.loads(target.read_text()) == {"a": 1}  # readers see the old file until the rename
        assert tmp.parent == target.parent and tmp.name.startswith(".")  # beside it (one file system), hidden
    assert json.loads(target.read_text()) == {"a": 2} and os.listdir(tmp_path) == ["m.json"]


def test_writers_that_add_their_own_suffix_get_it(tmp_path):
    target = tmp_path / "images.npz"
    with atomic_path(target, ".npz") as tmp:
        np.savez(tmp, arr_0=np.arange(3))  # np.savez would append .npz to a name without it
    assert np.load(target)["arr_0"].tolist() == [0, 1, 2] and os.listdir(tmp_path) == ["images.npz"]


# ----------------------------------------------------------------------------------------------------
# A full disk
# ----------------------------------------------------------------------------------------------------
def _no_space(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


def test_a_full_disk_during_a_write_is_one_line_and_leaves_the_old_file(tmp_path):
    target = tmp_path / "samples.npz"
    target.write_text("the earlier, complete file")
    with pytest.raises(DiskFullError) as caught, atomic_path(target, ".npz") as tmp:
        tmp.write_text("half of it")
        _no_space()
    message = str(caught.value)
    assert "\n" not in message and message.startswith("no space left on the device while writing samples.npz to ")
    assert str(tmp_path) in message and " free there" in message
    assert target.read_text() == "the earlier, complete file" and os.listdir(tmp_path) == ["samples.npz"]


def test_torchs_zip_writer_failure_is_recognised_as_a_full_disk(tmp_path):
    """torch.save on a full disk raises a RuntimeError that has lost the OS error ("unexpected pos")."""
    bug = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 64 vs 0")
    assert is_disk_full(bug) and is_disk_full(RuntimeError("wrapped").with_traceback(None)) is False
    wrapped = ValueError("a reader's message")
    wrapped.__cause__ = OSError(errno.EDQUOT, "Disk quota exceeded")
    assert is_disk_full(wrapped)
    with (
        pytest.raises(DiskFullError, match="while writing the model to"),
        atomic_folder(tmp_path / "model", "the model") as tmp,
    ):
        (tmp / "config.json").write_text("{}")
        raise bug
    assert not (tmp_path / "model").exists() and os.listdir(tmp_path) == []


def test_other_errors_pass_through_unchanged(tmp_path):
    with pytest.raises(PermissionError), writing("x", tmp_path, tmp_path / "x"):
        raise PermissionError("not ours to translate")


def test_a_write_known_not_to_fit_stops_before_it_starts(tmp_path, monkeypatch):
    monkeypatch.setattr(files, "free_bytes", lambda path: 1_500_000)
    check_free_space(tmp_path, 1_000_000, "the checkpoint")
    with pytest.raises(DiskFullError, match=r"not enough space for the checkpoint in .*: it needs about 2.0 MB and "):
        check_free_space(tmp_path, 2_000_000, "the checkpoint")
    assert free_bytes(tmp_path / "does" / "not" / "exist") > 0  # the nearest folder that exists
    assert size_text(0) == "0.0 bytes" and size_text(1_234_567_890) == "1.2 GB"


def test_a_folder_written_on_a_real_small_disk_fails_cleanly(small_disk):
    """A tmpfs of 1 MB: a 2 MB pipeline-like folder fills it; the one line says how much is free afterwards."""
    with (
        pytest.raises(
            DiskFullError, match=r"while writing the pipeline to .* \((1\.0 MB|1048\.6 kB|[0-9.]+ [kM]B) free"
        ),
        atomic_folder(small_disk / "pipeline", "the pipeline") as tmp,
    ):
        (tmp / "weights.bin").write_bytes(b"\0" * 2_000_000)
    assert list(small_disk.iterdir()) == []
