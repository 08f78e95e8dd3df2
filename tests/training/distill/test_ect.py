"""A run of consistency post-training (distill.method: ect, moh_dit/objectives/distill/ect.py) from another student:
it trains, records its method in the exported student and its card, and a run stopped and resumed is the uninterrupted
one, loss for loss (ECT's curriculum halving its step at the resumed step)."""

from __future__ import annotations

import json

import pytest

from moh_dit.training.config import load_config
from moh_dit.training.trainer import train

from ...helpers.factories import tiny_train_config, train_tiny

ECT = ["objective.name=distill", "distill.method=ect", "distill.ect_dt=0.05", "distill.guidance_scale=2.0",
       "distill.grid_share=0.5", "preview.per_class=0", "train.checkpoint_every=2"]  # fmt: skip


def test_a_run_from_another_student_trains_records_its_method_and_resumes_as_an_uninterrupted_one(image_dir, tmp_path):
    teacher = tmp_path / "teacher"
    train_tiny(teacher, image_dir, "objective.name=flow", "train.max_steps=4", "preview.per_class=0")
    start = tmp_path / "start"
    train(load_config(tiny_train_config(start, image_dir), [f"distill.teacher={teacher}", *ECT, "train.max_steps=2"]))
    curriculum = ["distill.ect_dt_start=0.4", "distill.ect_dt_every=2"]  # 0.4 for steps 0-1, 0.2 from the resumed 2
    origin = [f"distill.teacher={teacher}", f"distill.student_from={start}", *ECT, *curriculum]

    def run(out, *more):
        return train(load_config(tiny_train_config(out, image_dir), [*origin, *more]))

    whole = run(tmp_path / "whole", "train.max_steps=4")
    run(tmp_path / "cut", "train.max_steps=2")
    cut = run(tmp_path / "cut", "train.max_steps=4", "train.resume=latest")
    assert whole["step"] == cut["step"] == 4

    def losses(out):
        lines = (out / "metrics.jsonl").read_text().splitlines()
        return [(r["step"], r["distill_loss"], r["ect_dt"]) for r in map(json.loads, lines) if "distill_loss" in r]

    assert losses(tmp_path / "whole") == losses(tmp_path / "cut") and len(losses(tmp_path / "whole")) == 4
    assert [size for *_, size in losses(tmp_path / "cut")] == pytest.approx(
        [0.4, 0.4, 0.2, 0.2]
    )  # the curriculum's step, logged
    transformer = tmp_path / "whole" / "pipeline" / "transformer" / "config.json"
    assert json.loads(transformer.read_text())["objective"]["method"] == "ect"
    card = (tmp_path / "whole" / "pipeline" / "README.md").read_text()
    assert "post-trained by consistency" in card
