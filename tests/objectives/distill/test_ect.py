"""Consistency post-training with a small fixed step (moh_dit/objectives/distill/ect.py): the target is the jump of
one step followed by the student's own jump; with the exact teacher and the exact student it is the exact average
velocity, to second order in the step (and MeanFlow's target as the step shrinks); the data's step is the noised
sample's own velocity; its keys are refused in one line; and it counts its passes (a run of it: tests/training/distill/test_ect.py)."""

from __future__ import annotations

import contextlib
import re

import pytest
import torch

from moh_dit.errors import ConfigError
from moh_dit.objectives.distill import ECTDistill
from moh_dit.objectives.distill.ect import consistency_target
from moh_dit.training.config import load_config
from moh_dit.training.distill.teacher import TeacherGuidance

from ..test_meanflow import SCALE, GaussianAverageVelocity, true_average_velocity, true_velocity

NO_AUTOCAST = contextlib.nullcontext


class ExactTeacher:
    guidance = TeacherGuidance()

    def velocity(self, z, t, labels, drop, autocast):
        return true_velocity(z, t)


def test_the_target_is_one_step_then_the_students_own_jump_and_the_teachers_velocity_where_r_is_t():
    """Landing where the step then the jump land: ``z_t - (t - r) u_tgt = z_s - (s - r) u(z_s)``; at ``r = t`` the
    step's velocity itself."""
    g = torch.Generator().manual_seed(0)
    v, jump, z = (torch.randn(4, 1, 2, 2, generator=g, dtype=torch.float64) for _ in range(3))
    t = torch.tensor([0.9, 0.5, 0.3, 0.6], dtype=torch.float64)
    r = torch.tensor([0.1, 0.495, 0.3, 0.0], dtype=torch.float64)
    s = torch.maximum(t - 0.01, r)
    target = consistency_target(v, jump, t, s, r)
    col = lambda x: x.view(-1, 1, 1, 1)  # noqa: E731
    landed = z - col(t - r) * target
    expected = (z - col(t - s) * v) - col(s - r) * jump
    torch.testing.assert_close(landed[[0, 1, 3]], expected[[0, 1, 3]])
    torch.testing.assert_close(target[2], v[2])  # r = t
    torch.testing.assert_close(target[1], v[1])  # an interval shorter than the step: the step alone


def _exact_target(dt: float) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    t = torch.tensor([0.9, 0.7, 0.5, 0.3, 0.6], dtype=torch.float64)
    r = torch.tensor([0.1, 0.7, 0.2, 0.0, 0.55], dtype=torch.float64)
    x = SCALE * torch.randn(5, 1, 4, 4, generator=g, dtype=torch.float64)
    objective = ECTDistill(time="repa", ect_dt=dt)
    noised = objective.interpolate(x, t, r, torch.randn(5, 1, 4, 4, generator=g, dtype=torch.float64))
    objective.forward_losses(
        GaussianAverageVelocity(), noised, None, None, False, NO_AUTOCAST, {"teacher": ExactTeacher()}
    )
    return noised.terms["target"].double(), true_average_velocity(noised.x_t, t, r)


def test_with_the_exact_teacher_and_student_the_target_is_the_exact_average_velocity_to_second_order():
    """The Euler step's error is second order in the step: a tenth of the step, a hundredth of the error (an
    ordering or weighting slip would leave a first-order error, or none that shrinks)."""
    errors = []
    for dt in (1e-2, 1e-3):
        target, exact = _exact_target(dt)
        errors.append((target - exact).abs().max().item())
    assert errors[1] < 2e-5 and 60 < errors[0] / errors[1] < 160


def test_the_datas_step_takes_the_noised_samples_own_velocity_and_no_teacher():
    class NoTeacher:
        def velocity(self, *args, **kwargs):
            raise AssertionError("the data's step evaluates no teacher")

    g = torch.Generator().manual_seed(1)
    objective = ECTDistill(time="repa", ect_dt=0.05, ect_step="data")
    x, noise = (torch.randn(3, 1, 4, 4, generator=g, dtype=torch.float64) for _ in range(2))
    t, r = torch.tensor([0.8, 0.5, 0.04], dtype=torch.float64), torch.tensor([0.0, 0.5, 0.0], dtype=torch.float64)
    noised = objective.interpolate(x, t, r, noise)
    student = GaussianAverageVelocity()
    objective.forward_losses(student, noised, None, None, False, NO_AUTOCAST, {"teacher": NoTeacher()})
    v = noise - x
    s = torch.maximum(t - 0.05, r)
    jump = true_average_velocity(noised.x_t - (t - s).view(-1, 1, 1, 1) * v, s, r)
    torch.testing.assert_close(noised.terms["target"].double(), consistency_target(v, jump, t, s, r))
    assert objective.teacher_forwards() == 0.0 and objective.student_forwards() == 4.0
    guided = ECTDistill(guidance={"scale": 3.0})
    assert guided.teacher_forwards() == 2.0 and guided.teacher_forwards_at(7) == 2.0


def test_ects_curriculum_halves_the_step_down_to_the_fixed_one_and_the_target_takes_the_steps_own():
    """``Δt_k = max(Δt, Δt_0 / 2^floor(k / every))``; the target at step ``k`` is the fixed-step target with that
    step; without ``ect_dt_start`` (or without a step) the step is fixed."""
    objective = ECTDistill(time="repa", ect_dt=0.01, ect_dt_start=0.4, ect_dt_every=10)
    sizes = [objective.step_size(k) for k in (0, 9, 10, 25, 39, 50, 60, 10_000)]
    assert sizes == [0.4, 0.4, 0.2, 0.1, 0.05, 0.0125, 0.01, 0.01] and objective.step_size(None) == 0.01
    assert ECTDistill(time="repa", ect_dt=0.02).step_size(10_000) == 0.02
    assert "0.4 halved every 10 steps down to 0.01" in objective.describe_loss()
    g = torch.Generator().manual_seed(3)
    x, noise = (SCALE * torch.randn(4, 1, 4, 4, generator=g, dtype=torch.float64) for _ in range(2))
    t, r = torch.tensor([0.9, 0.8, 0.5, 0.3]), torch.tensor([0.0, 0.6, 0.1, 0.3])
    targets = {}
    for name, ect, step in [("curriculum", objective, 25), ("fixed", ECTDistill(time="repa", ect_dt=0.1), None)]:
        noised = ect.interpolate(x, t.double(), r.double(), noise)
        frozen = {"teacher": ExactTeacher()}
        ect.forward_losses(GaussianAverageVelocity(), noised, None, None, False, NO_AUTOCAST, frozen, step=step)
        targets[name] = noised.terms["target"]
    torch.testing.assert_close(targets["curriculum"], targets["fixed"])
    early = ECTDistill(time="repa", ect_dt=0.01, ect_dt_start=0.4, ect_dt_every=10)
    noised = early.interpolate(x, t.double(), r.double(), noise)
    early.forward_losses(GaussianAverageVelocity(), noised, None, None, False, NO_AUTOCAST, frozen, step=0)
    assert not torch.allclose(noised.terms["target"], targets["fixed"])  # the step is the schedule's, not the end's


@pytest.mark.parametrize(
    ("override", "says"),
    [
        ("distill.ect_dt=0", "distill.ect_dt must be a step in flow time between 0 and 1"),
        ("distill.ect_dt=1.5", "distill.ect_dt must be a step in flow time between 0 and 1"),
        ("distill.ect_step=heun", "distill.ect_step must be teacher or data"),
        ("distill.ect_dt_start=0.005", "distill.ect_dt_start must be null (a fixed step) or a step above"),
        ("distill.ect_dt_start=1.5", "distill.ect_dt_start must be null (a fixed step) or a step above"),
        ("distill.ect_dt_every=0", "distill.ect_dt_every must be a whole number of training steps of at least 1"),
        ("distill.fake_updates=3", "distill.fake_updates: not an option of distill.method=ect"),
    ],
)
def test_a_wrong_ect_key_is_refused_in_one_line(override, says, tmp_path):
    config = {"objective": {"name": "distill"}, "distill": {"method": "ect", "teacher": "runs/x"},
              "train": {"output_dir": str(tmp_path)}}  # fmt: skip
    with pytest.raises(ConfigError, match=re.escape(says)) as caught:
        load_config(config, [override])
    assert "\n" not in str(caught.value)


def test_the_datas_step_is_refused_for_a_student_that_folds_guidance_and_another_methods_run_of_its_key():
    with pytest.raises(ConfigError, match="distill.ect_step=data steps along the data's unguided flow"):
        ECTDistill(ect_step="data", guidance={"scale": 3.0})
    config = {"objective": {"name": "distill"}, "distill": {"method": "trajectory", "teacher": "runs/x"}}
    with pytest.raises(ConfigError, match=re.escape("distill.ect_dt: not an option of distill.method=trajectory")):
        load_config(config, ["distill.ect_dt=0.02"])
