"""Pruning and setting aside checkpoints on a fake run folder (no training run needed), and a full disk during a
checkpoint (tiny runs)."""

import pytest
import torch

from moh_dit.run_folder import RunLayout
from moh_dit.training.checkpoints import prune_checkpoints, set_aside_newer_checkpoints


def fake_checkpoints(root, steps, complete=True):
    layout = RunLayout(root)
    for step in steps:
        folder = layout.checkpoint(step)
        folder.mkdir(parents=True)
        if complete:
            (folder / "trainer_state.json").write_text("{}")
    return layout


def test_pruning_keeps_the_newest_complete_checkpoints_by_step(tmp_path):
    layout = fake_checkpoints(tmp_path, [5, 40, 100, 300])  # by step, not by name: 300 > 40
    layout.checkpoint_tmp(400).mkdir()  # one being written
    removed = prune_checkpoints(layout, keep_last=2)
    assert [p.name for p in removed] == ["step-00000005", "step-00000040"]
    assert [step for step, _ in layout.list_checkpoints()] == [100, 300]
    assert layout.checkpoint_tmp(400).is_dir()  # never touched by pruning


def test_a_folder_without_its_state_is_no_checkpoint(tmp_path):
    layout = fake_checkpoints(tmp_path, [10], complete=False)
    assert layout.list_checkpoints() == [] and layout.latest_checkpoint() is None


def test_an_older_resume_sets_the_newer_checkpoints_aside(tmp_path):
    layout = fake_checkpoints(tmp_path, [10, 20, 30])
    moved = set_aside_newer_checkpoints(layout, 10)
    assert [step for step, _ in layout.list_checkpoints()] == [10]
    assert sorted(p.name for p in moved.iterdir()) == ["step-00000020", "step-00000030"]
    assert moved.parent == layout.checkpoints and moved.name.startswith("set-aside-after-step-00000010-")


# ----------------------------------------------------------------------------------------------------
# A full disk: one line, no unfinished folder, the previous checkpoint intact and resumable
# ----------------------------------------------------------------------------------------------------
def _fingerprints(folder):
    return {p.relative_to(folder): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("disk", ["tmpfs", "enospc"])
def test_a_full_disk_stops_a_run_with_one_line_and_the_run_resumes_when_there_is_room(
    disk, tmp_path, image_dir, mount_small_disk, monkeypatch
):
    """``tmpfs``: a real small filesystem, filled by a ballast file; ``enospc``: a writer that raises ENOSPC (where
    no tmpfs can be mounted). First the check before a checkpoint (room for less than the last one), then a disk
    that fills during the write; then room is made and the run resumes to the end."""
    from moh_dit.files import DiskFullError, folder_size, free_bytes
    from moh_dit.training import checkpoints

    from ..helpers.factories import train_tiny

    first = ["train.checkpoint_every=2", "preview.per_class=0"]
    root = mount_small_disk(8_000_000) if disk == "tmpfs" else tmp_path / "disk"
    run = root / "run"
    train_tiny(run, image_dir, "train.max_steps=2", *first)
    step2 = run / "checkpoints" / "step-00000002"
    kept, size = _fingerprints(step2), folder_size(step2)
    resume = ["train.max_steps=4", "train.resume=latest", *first]

    # 1. room for half a checkpoint: stopped before writing, with the sizes
    ballast = root / "ballast"
    if disk == "tmpfs":
        ballast.write_bytes(b"\0" * (free_bytes(root) - size // 2))
    else:
        monkeypatch.setattr("moh_dit.files.free_bytes", lambda path: size // 2)
    with pytest.raises(DiskFullError, match=r"not enough space for checkpoint step 4 \(as large as step-00000002\)"):
        train_tiny(run, image_dir, *resume)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-00000002"]

    # 2. the check passes but the disk fills while writing: the unfinished folder is removed
    monkeypatch.setattr(checkpoints, "check_free_space", lambda *args: None)
    if disk == "enospc":
        monkeypatch.undo()
        monkeypatch.setattr(checkpoints, "check_free_space", lambda *args: None)
        real = torch.save

        def full(obj, path, *args, **kwargs):
            real(obj, path, *args, **kwargs)
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 1024 vs 0")

        monkeypatch.setattr(torch, "save", full)
    with pytest.raises(DiskFullError) as caught:
        train_tiny(run, image_dir, *resume)
    message = str(caught.value)
    assert message.startswith(f"no space left on the device while writing checkpoint step 4 to {run / 'checkpoints'}")
    assert "\n" not in message and "free there after removing the unfinished files" in message
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-00000002"]
    assert _fingerprints(step2) == kept

    # 3. room made: the run resumes from step 2 and finishes
    monkeypatch.undo()
    ballast.unlink(missing_ok=True)
    summary = train_tiny(run, image_dir, *resume)
    assert summary["step"] == 4 and (run / "checkpoints" / "step-00000004").is_dir()
