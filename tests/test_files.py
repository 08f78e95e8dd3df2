"""Atomic writes (moh_dit.files), with no training run: a write is all or nothing."""

import json
import os

import numpy as np
import pytest

from moh_dit.files import atomic_path, atomic_write_json, atomic_write_text


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
