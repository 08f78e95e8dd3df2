"""rCM's route (moh_dit/objectives/distill/rcm.py): the schedule of its two networks, its keys refused in one line,
what it records and says, and its count of passes against its two parts' (the secants' and DMD2's)."""

from __future__ import annotations

import re

import pytest

from moh_dit.errors import ConfigError
from moh_dit.objectives.distill import DMD2Distill, RCMDistill, TrajectoryDistill


def test_the_fake_score_takes_one_step_in_student_updates_plus_one():
    objective = RCMDistill(student_updates=4)
    assert [objective.updates(s) for s in range(10)] == (["student"] * 4 + ["fake_score"]) * 2
    assert objective.frozen_models_for({}) == ("teacher", "trajectories") and objective.trained_models == (
        "fake_score",
    )


def test_its_passes_are_the_secants_and_dmd2s_generator_step_once_the_vsd_term_is_on():
    objective = RCMDistill(student_updates=4, vsd_start=10, dmd_steps=[1], gan_weight=0.001)
    dmd = DMD2Distill(dmd_steps=[1], gan_weight=0.001)
    assert objective.step_forwards(0) == 3.0  # the secants alone before vsd_start
    assert objective.step_forwards(10) == 3.0 + dmd.step_forwards(0)  # + DMD2's generator step
    assert objective.step_forwards(14) == dmd.step_forwards(1)  # a fake-score step is DMD2's
    secants = TrajectoryDistill().teacher_forwards()
    assert objective.teacher_forwards_at(0) == secants and objective.teacher_forwards_at(10) == secants + 1.0
    assert objective.teacher_forwards_at(4) == 0.0


@pytest.mark.parametrize(
    ("override", "says"),
    [
        ("distill.student_updates=0", "distill.student_updates must be a whole number >= 1"),
        ("distill.vsd_start=-1", "distill.vsd_start must be a whole number >= 0"),
        ("distill.fake_updates=3", "distill.fake_updates: not an option of distill.method=rcm"),
    ],
)
def test_a_wrong_rcm_key_is_refused_in_one_line(override, says, tmp_path):
    from moh_dit.training.config import load_config

    config = {"objective": {"name": "distill"}, "distill": {"method": "rcm", "teacher": "runs/x"},
              "train": {"output_dir": str(tmp_path)}}  # fmt: skip
    with pytest.raises(ConfigError, match=re.escape(says)) as caught:
        load_config(config, [override])
    assert "\n" not in str(caught.value)


def test_it_records_what_a_dmd2_generator_records_and_says_both_losses():
    objective = RCMDistill(real_guidance=1.5, vsd_start=830, vsd_weight=0.5, teacher={"sha256": "ab" * 32})
    assert objective.record()["method"] == "rcm" and objective.record()["real_guidance"] == 1.5
    assert RCMDistill.from_record(objective.record()).real_guidance == 1.5
    said = objective.describe_loss()
    assert "secants of the teacher's trajectories" in said and "0.5 x VSD" in said and "from step 830" in said
    assert objective.describe().startswith("A flow map regularised by DMD2 distilled from")
