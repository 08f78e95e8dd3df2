"""The spike guard: a spike's update is skipped, spikes in a row or a NaN roll back exactly, then it stops."""

import json
import math

import pytest
import torch
from safetensors.torch import load_file

from moh_dit.errors import NonFiniteLossError
from moh_dit.training.config import load_config
from moh_dit.training.spike_guard import MIN_HISTORY, SpikeGuard
from moh_dit.training.trainer import Trainer

from ..helpers.factories import tiny_train_overrides


def test_the_verdicts_follow_the_running_median():
    guard = SpikeGuard(factor=3, window=20, patience=2, max_rollbacks=1)
    assert [guard.judge(1.0 + 0.01 * i).action for i in range(MIN_HISTORY)] == ["update"] * MIN_HISTORY
    assert guard.judge(2.9).action == "update"  # below 3 x the median (1.05)
    assert guard.judge(3.5).action == "skip" and guard.skipped == 1
    assert guard.judge(1.0).action == "update" and guard.in_a_row == 0  # a spike alone is forgiven
    assert [guard.judge(9.0).action for _ in range(2)] == ["skip", "rollback"]  # patience 2
    assert guard.judge(math.nan).action == "rollback" and guard.exhausted  # the second: over max_rollbacks 1
    restored = SpikeGuard(factor=3)
    restored.load(json.loads(json.dumps(guard.state())))  # as a checkpoint keeps it
    assert restored.state() == guard.state()


def guarded_trainer(out, image_dir, *extra):
    overrides = ["train.max_steps=16", "train.checkpoint_every=4", "train.spike_guard=3", "preview.per_class=0"]
    return Trainer(load_config(None, tiny_train_overrides(out, image_dir, *overrides, *extra)))


def inject(trainer, monkeypatch, faults):
    """Multiply the loss of the steps in ``faults`` (step index -> factor) and record the weights after every
    step (the model's, then the EMA's)."""
    original, finish, after = trainer._micro_step, trainer.finish_step, {}

    def faulty(x, y, micro, want_heads):
        loss, losses, h = original(x, y, micro, want_heads)
        return loss * faults.get(trainer.step, 1.0), losses, h

    def recorded(updated=True):
        finish(updated)
        model = {k: v.detach().clone() for k, v in trainer.unwrapped.state_dict().items()}
        after[trainer.step] = (model, [p.detach().clone() for p in trainer.ema.shadow_params])

    monkeypatch.setattr(trainer, "_micro_step", faulty)
    monkeypatch.setattr(trainer, "finish_step", recorded)
    return after


def same(a, b):
    return all(torch.equal(a[k], b[k]) for k in a)


def test_a_spike_is_skipped_and_a_nan_rolls_back_to_the_checkpoint_exactly(tmp_path, image_dir, monkeypatch):
    out = tmp_path / "run"
    trainer = guarded_trainer(out, image_dir)
    after = inject(trainer, monkeypatch, {11: 100.0, 13: math.nan})  # the updates of steps 12 and 14
    summary = trainer.run()
    assert summary["step"] == 16 and summary["stop_reason"] == "max_steps"  # the run went on
    assert same(after[12][0], after[11][0]) and all(map(torch.equal, after[12][1], after[11][1]))  # skipped
    assert not same(after[11][0], after[10][0])  # an ordinary step does move the weights
    checkpoint = out / "checkpoints" / "step-00000012"
    assert same(after[14][0], load_file(checkpoint / "model" / "diffusion_pytorch_model.safetensors"))
    ema = load_file(checkpoint / "ema.safetensors")
    names = [n for n, _ in trainer.unwrapped.named_parameters()]
    assert all(torch.equal(p, ema[n]) for n, p in zip(names, after[14][1]))  # the EMA too
    last = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][-1]
    assert (last["skipped_updates"], last["rollbacks"]) == (2, 1)
    events = json.loads((out / "manifest.json").read_text())["events"]
    assert [e["step"] for e in events if e["event"] == "rollback"] == [14]


def test_spikes_in_a_row_roll_back_and_too_many_rollbacks_stop_with_one_line(tmp_path, image_dir, monkeypatch):
    trainer = guarded_trainer(tmp_path / "a", image_dir, "train.spike_patience=2")
    after = inject(trainer, monkeypatch, {12: 50.0, 13: 50.0})  # steps 13 and 14: a skip, then a rollback
    trainer.run()
    checkpoint = tmp_path / "a" / "checkpoints" / "step-00000012"
    assert same(after[14][0], load_file(checkpoint / "model" / "diffusion_pytorch_model.safetensors"))
    trainer = guarded_trainer(tmp_path / "b", image_dir, "train.max_rollbacks=0")
    inject(trainer, monkeypatch, {13: math.nan})
    with pytest.raises(NonFiniteLossError, match=r"diverged at step 14: non-finite loss .*max_rollbacks=0 used up"):
        trainer.run()
