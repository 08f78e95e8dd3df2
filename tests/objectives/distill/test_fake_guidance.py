"""The fake score's own guidance (moh_dit/objectives/distill/fake_guidance.py, SiD-LSG's kappa_1 and kappa_2): its
scales, what a step of DMD2 and SiD costs with it (two halves per guided pass), its record and the resume that
changes it. The guided passes themselves: tests/training/distill/test_companions.py."""

from __future__ import annotations

import re

import pytest

from moh_dit.errors import ConfigError
from moh_dit.objectives.distill.dmd2 import DMD2Distill
from moh_dit.objectives.distill.sid import SiDDistill


def test_the_training_scale_defaults_to_unguided_and_the_reading_scale_to_the_training_one():
    plain, trained, both = DMD2Distill(), DMD2Distill(fake_guidance=2), DMD2Distill(fake_guidance_eval=3)
    assert (plain.fake_train_scale, plain.fake_read_scale) == (1.0, 1.0)
    assert (trained.fake_train_scale, trained.fake_read_scale) == (2.0, 2.0)
    assert (both.fake_train_scale, both.fake_read_scale) == (1.0, 3.0)
    assert plain.describe_fake() == "" and "fake" not in " ".join(plain.record())
    assert "the fake score guided at 2 in training (SiD-LSG)" in trained.describe_loss()
    assert "the fake score guided at 1 in training, read at 3" in both.describe_loss()


@pytest.mark.parametrize("method", [DMD2Distill, SiDDistill])
@pytest.mark.parametrize(("train", "read"), [(2.0, None), (None, 3.0), (2.0, 3.0)])
def test_each_guided_pass_of_the_fake_score_costs_two(method, train, read):
    """A fake-score step: the generator's forward, the fake score's forward and backward (3; 6 trained guided); a
    generator step: its own forward and backward and the fake score's pass (the score's passes; twice read guided).
    The teacher's passes do not change."""
    plain = method(dmd_steps=[1], fake_updates=2)
    guided = method(dmd_steps=[1], fake_updates=2, fake_guidance=train, fake_guidance_eval=read)
    fake_step, generator_step = 1, 0
    trained = 3.0 if guided.fake_train_scale != 1 else 0.0
    assert guided.step_forwards(fake_step) == plain.step_forwards(fake_step) + trained
    read_extra = plain.score_passes if guided.fake_read_scale != 1 else 0.0
    assert guided.step_forwards(generator_step) == plain.step_forwards(generator_step) + read_extra
    assert guided.teacher_forwards() == plain.teacher_forwards()


def test_the_scales_are_recorded_and_a_resume_that_changes_one_is_refused_in_one_line():
    recorded = DMD2Distill(fake_guidance=2, fake_guidance_eval=3).record()
    assert (recorded["fake_guidance"], recorded["fake_guidance_eval"]) == (2.0, 3.0)
    again = DMD2Distill.from_record(recorded, fake_guidance=2.0, fake_guidance_eval=3.0)
    assert (again.fake_guidance, again.fake_guidance_eval) == (2.0, 3.0)
    with pytest.raises(
        ConfigError, match=re.escape("distill.fake_guidance_eval=4.0: this generator was trained with 3.0")
    ):
        DMD2Distill.from_record(recorded, fake_guidance=2.0, fake_guidance_eval=4.0)


@pytest.mark.parametrize("bad", [0.5, float("inf"), "x", True])
def test_a_scale_below_1_or_no_number_is_refused_in_one_line(bad):
    for key in ("fake_guidance", "fake_guidance_eval"):
        with pytest.raises(ConfigError, match=re.escape(f"distill.{key} must be a guidance scale >= 1")) as caught:
            DMD2Distill(**{key: bad})
        assert "\n" not in str(caught.value)
