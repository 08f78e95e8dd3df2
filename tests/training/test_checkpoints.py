"""Pruning and setting aside checkpoints on a fake run folder: no training run needed."""

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
