"""MeanFlow distilled from a teacher (moh_dit/objectives/distill/meanflow.py, moh_dit/training/distill/teacher.py): the teacher's guided
velocity, the finite-difference derivative in its central, forward and backward cases, and the loss against NVlabs/
FastGen's code on fixed inputs (recorded by tests/reference_outputs/record_fastgen.py); the finite difference against
the exact JVP, through MoH's routing held too; every objective's velocity of the linear path against a closed form; the
target with an exact teacher against the exact average velocity; and a student that starts as its teacher."""

from __future__ import annotations

import contextlib
import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from moh_dit.errors import ConfigError
from moh_dit.model.network import MoHDiT
from moh_dit.objectives.ddpm import DDPM, sigma_of_timestep, timestep_of_sigma
from moh_dit.objectives.distill import TIME_CONVENTIONS, MeanFlowDistill, finite_difference_times
from moh_dit.objectives.flow import Flow
from moh_dit.objectives.meanflow import MeanFlow
from moh_dit.objectives.noise import ddpm_timestep
from moh_dit.training.distill.teacher import TeacherGuidance, guided_velocity

from ...helpers.toy_velocity import CLASSES, ToyAverageVelocity, ToyTeacher
from ..test_meanflow import SCALE, GaussianAverageVelocity, true_average_velocity, true_velocity

HERE = Path(__file__).resolve().parents[2] / "reference_outputs"
REC = load_file(HERE / "fastgen_official.safetensors")
SETTINGS = json.loads((HERE / "fastgen_official.json").read_text())
NO_AUTOCAST = contextlib.nullcontext


def recorded_networks() -> tuple[ToyAverageVelocity, ToyTeacher]:
    student, teacher = ToyAverageVelocity(), ToyTeacher()
    student.load_state_dict({k[len("student.") :]: v for k, v in REC.items() if k.startswith("student.")})
    teacher.load_state_dict({k[len("teacher.") :]: v for k, v in REC.items() if k.startswith("teacher.")})
    return student, teacher


# ----------------------------------------------------------------------------------------------------
# FastGen's code
# ----------------------------------------------------------------------------------------------------
def test_the_teachers_guided_velocity_equals_fastgens_target():
    """CFG 3 inside flow times 0.3-0.8, the conditional velocity outside (FastGen's use_cd with teacher guidance)."""
    _, teacher = recorded_networks()
    guidance = TeacherGuidance(SETTINGS["guidance_scale"], (SETTINGS["guidance_t_start"], SETTINGS["guidance_t_end"]))
    with torch.no_grad():
        ours = guided_velocity(teacher, REC["x_t"], REC["t"], REC["labels"], None, CLASSES, guidance)
    torch.testing.assert_close(ours, REC["velocity"], rtol=1e-5, atol=1e-6)
    inside = (REC["t"] >= 0.3) & (REC["t"] <= 0.8)
    with torch.no_grad():
        plain = teacher(REC["x_t"], REC["t"], REC["labels"])
    assert torch.equal(ours[~inside], plain[~inside]) and not torch.allclose(ours[inside], plain[inside])


def test_the_finite_difference_equals_fastgens_in_every_case():
    """Central (t = 0.5, 0.35), forward (t - eps reaches r), backward (t + eps passes FastGen's 0.999) and neither (a
    derivative of 0), in float64 along the teacher's velocity; at r = t the derivative does not enter the loss.

    Both codes evaluate the network in float32 and divide the difference of two outputs by a step of 1e-4 or 2e-4: the
    outputs' rounding (a few ulps of |u|) grows by 1 / step, and another CPU's kernels round otherwise (an AMD EPYC
    gave 2.4e-3 apart where the recording CPU gave under 1e-5). So the recorded values are compared within that bound,
    and the same difference with the network in float64 (rounding far below it) lies within it of both."""
    student, _ = recorded_networks()
    objective = MeanFlowDistill(time="repa", derivative="finite-difference", fd_eps=SETTINGS["eps"])
    noised = objective.interpolate(REC["x"], REC["t"], REC["r"], REC["noise"])
    noised.x_t = REC["x_t"]
    bounds = (0.0, 0.999)
    out, dudt = objective.finite_difference(student, noised, REC["velocity"], REC["labels"], None, NO_AUTOCAST, bounds)
    moving = REC["t"] > REC["r"]  # where r = t, du/dt is multiplied by 0: moh-dit skips its shifted forwards
    _, _, per_step = finite_difference_times(REC["t"], REC["r"], SETTINGS["eps"], *bounds)
    largest = out.sample.double().abs().flatten(1).amax(dim=1)
    rounding = (16 * torch.finfo(torch.float32).eps * largest * per_step).reshape(-1, 1, 1, 1)
    assert torch.all((dudt.double() - REC["fd"]).abs()[moving] <= rounding.expand_as(dudt)[moving])
    noised64 = objective.interpolate(*(REC[k].double() for k in ("x", "t", "r", "noise")))
    noised64.x_t = REC["x_t"].double()
    _, exact = objective.finite_difference(
        student.double(), noised64, REC["velocity"].double(), REC["labels"], None, NO_AUTOCAST, bounds
    )
    for rounded in (dudt.double(), REC["fd"]):
        assert torch.all((exact - rounded).abs()[moving] <= rounding.expand_as(dudt)[moving])
    assert (exact - REC["fd"]).abs()[moving].max() > 0 and rounding.max() < 0.05 * REC["fd"].abs().max()
    assert torch.all(dudt[~moving] == 0)
    t_plus, t_minus, _ = finite_difference_times(REC["t"], REC["r"], SETTINGS["eps"], 0.0, 0.999)
    central, forward, backward = (t_plus > REC["t"]) & (t_minus < REC["t"]), t_minus == REC["t"], t_plus == REC["t"]
    assert central.tolist() == [True, False, False, False, False, True]
    assert (forward & ~backward).tolist() == [False, True, False, True, False, False]
    assert (backward & ~forward).tolist() == [False, False, True, False, False, False]
    assert torch.all(REC["fd"][4] == 0) and torch.all(dudt[4] == 0)  # neither side fits


def test_the_loss_equals_fastgens():
    """FastGen's l2 loss with the poly_1.0 weight (c = 0.01) is MeanFlow's adaptively weighted loss."""
    objective = MeanFlowDistill(time="repa", adaptive_eps=SETTINGS["norm_const"])
    noised = objective.interpolate(REC["x"], REC["t"], REC["r"], REC["noise"])
    span = (REC["t"] - REC["r"]).clamp(0, 1).view(-1, 1, 1, 1)
    noised.terms["target"] = (REC["velocity"] - span * REC["fd"].float()).float()
    losses = objective.loss(REC["u"], noised)
    torch.testing.assert_close(losses.loss.double(), REC["loss"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(noised.terms["target"].double(), REC["tangent"], rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------------------------------
# The finite difference against the exact JVP
# ----------------------------------------------------------------------------------------------------
def tiny_student(**config) -> MoHDiT:
    torch.manual_seed(0)
    tiny = dict(sample_size=8, patch_size=2, in_channels=1, hidden_size=32, depth=2, num_heads=4, num_classes=3)
    model = MoHDiT(**(tiny | dict(learn_sigma=False, time_inputs=2) | config))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "adaLN" in name or "final_layer" in name or "router" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return model.double().train()


@pytest.mark.parametrize(
    "config",
    [
        dict(attention_type="mha"),  # dense
        dict(num_shared_heads=[2, 4], top_k=[1, 0]),  # MoH with a routed layer: the routing held at the primal's
        dict(attention_type="mha", end_time_blocks=1),  # Decoupled MeanFlow's split
    ],
    ids=["dense", "moh", "split"],
)
def test_the_finite_difference_is_the_exact_jvp(config):
    """To the difference's own error (raw times: the timestep embedding's float32 sinusoid limits a smaller step;
    with times scaled by 1000, moh-dit's, the same step errs by 0.1-3%: docs/objective.md#distillation)."""
    model = tiny_student(**config)
    g = torch.Generator().manual_seed(2)
    x, noise = (
        torch.randn(4, 1, 8, 8, generator=g, dtype=torch.float64),
        torch.randn(4, 1, 8, 8, generator=g, dtype=torch.float64),
    )
    t, r = (
        torch.tensor([0.8, 0.5, 0.3, 0.9], dtype=torch.float64),
        torch.tensor([0.1, 0.49995, 0.0, 0.45], dtype=torch.float64),
    )
    labels, v = torch.tensor([0, 1, 2, 0]), torch.randn(4, 1, 8, 8, generator=g, dtype=torch.float64)
    split = config.get("end_time_blocks", 0)
    jvp = MeanFlowDistill(time="repa", end_time_blocks=split)
    fd = MeanFlowDistill(time="repa", end_time_blocks=split, derivative="finite-difference", fd_eps=1e-4)
    drop = torch.tensor([0, 0, 1, 0])  # the labels as given (one dropped), as the trainer gives them
    out_j, exact = jvp.velocity_and_derivative(model, jvp.interpolate(x, t, r, noise), v, labels, drop, NO_AUTOCAST)
    out_f, differenced = fd.velocity_and_derivative(
        model, fd.interpolate(x, t, r, noise), v, labels, drop, NO_AUTOCAST
    )
    error = (differenced - exact).flatten(1).norm(dim=1) / exact.flatten(1).norm(dim=1)
    assert error[[0, 2, 3]].max() < 2e-5 and error[1] < 3e-4, error  # central; sample 1 (t - eps < r): forward, O(eps)
    torch.testing.assert_close(out_f.sample.double(), out_j.sample.double(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out_f.aux_loss, out_j.aux_loss)  # the load-balance loss of the primal pass, once


def test_the_finite_difference_holds_the_routing_of_the_primal_input(monkeypatch):
    """A shifted evaluation whose own top-k would pick other heads takes the primal's: the jump of a flip never enters
    the difference."""
    from moh_dit.model.attention import MoHAttention

    model = tiny_student(num_shared_heads=[2, 4], top_k=[1, 0])
    chosen, compute = [], MoHAttention.compute_gates

    def spy(self, x):
        gates, probs, mask = compute(self, x)
        if mask is not None:
            chosen.append(mask.clone())
        return gates, probs, mask

    monkeypatch.setattr(MoHAttention, "compute_gates", spy)
    g = torch.Generator().manual_seed(3)
    x, noise = (
        torch.randn(2, 1, 8, 8, generator=g, dtype=torch.float64),
        torch.randn(2, 1, 8, 8, generator=g, dtype=torch.float64),
    )
    objective = MeanFlowDistill(derivative="finite-difference", fd_eps=0.2)  # a step large enough to flip choices
    t, r = torch.tensor([0.6, 0.7], dtype=torch.float64), torch.tensor([0.0, 0.1], dtype=torch.float64)
    v = 5 * torch.randn(2, 1, 8, 8, generator=g, dtype=torch.float64)
    objective.velocity_and_derivative(
        model, objective.interpolate(x, t, r, noise), v, torch.tensor([0, 1]), None, NO_AUTOCAST
    )
    assert len(chosen) == 3 and all(torch.equal(c, chosen[0]) for c in chosen)
    free = [model(x + 0.2 * v, (1000 * (t + 0.2), 1000 * (t + 0.2 - r)), torch.tensor([0, 1])).sample]
    assert len(chosen) == 4 and not torch.equal(chosen[3], chosen[0]) and free  # unheld, the choice flips


# ----------------------------------------------------------------------------------------------------
# Every objective's velocity of the linear path: closed forms on Gaussian data
# ----------------------------------------------------------------------------------------------------
class ExactNoise(torch.nn.Module):
    """The MMSE noise prediction of Gaussian data N(0, SCALE^2) under DiT's DDPM at (fractional) timestep ``tau``:
    ``E[eps | x_tau] = sqrt(1 - abar) / (abar s^2 + 1 - abar) x_tau``, and a variance channel."""

    null_class_id = None

    def forward(self, x, tau, y=None, force_drop_ids=None, **_):
        abar = (1 / (1 + sigma_of_timestep(torch.as_tensor(tau)) ** 2)).view(-1, 1, 1, 1)
        eps = torch.sqrt(1 - abar) / (abar * SCALE**2 + 1 - abar) * x.double()
        return type("Out", (), {"sample": torch.cat([eps, torch.zeros_like(eps)], dim=1)})()


class ExactGVPVelocity(torch.nn.Module):
    """The MMSE velocity of Gaussian data on the GVP path in moh-dit's convention (time 1000 s)."""

    def forward(self, xs, time, y=None, force_drop_ids=None, **_):
        s = (torch.as_tensor(time) / 1000).double().view(-1, 1, 1, 1)
        a, b = torch.cos(math.pi / 2 * s), torch.sin(math.pi / 2 * s)
        da, db = -math.pi / 2 * b, math.pi / 2 * a
        # E[x | x_s] = a s^2 / (a^2 s^2 + b^2) x_s, E[eps | x_s] = b / (a^2 s^2 + b^2) x_s
        var = a**2 * SCALE**2 + b**2
        return type("Out", (), {"sample": (da * a * SCALE**2 / var + db * b / var) * xs.double()})()


@pytest.mark.parametrize(
    "objective, net", [(DDPM(), ExactNoise()), (Flow("gvp"), ExactGVPVelocity())], ids=["ddpm", "gvp"]
)
def test_a_teachers_velocity_of_the_linear_path_is_the_exact_one_at_the_same_noise_level(objective, net):
    """A DDPM teacher at the timestep of the same noise level, a GVP flow teacher at its time of the same level: the
    exact predictions of each, converted, are the exact velocity of the linear path (DDPM: ``(eps_hat - z) / (1 -
    t)``), within DiT's schedule's range."""
    g = torch.Generator().manual_seed(0)
    t = torch.tensor([0.05, 0.3, 0.5, 0.8, 0.95], dtype=torch.float64)
    z = torch.randn(5, 1, 4, 4, generator=g, dtype=torch.float64)
    torch.testing.assert_close(
        objective.linear_velocity(net, z, t, None).double(), true_velocity(z, t), rtol=1e-5, atol=1e-6
    )


def test_the_fractional_ddpm_timestep_inverts_the_noise_level_as_the_scalar_one_does():
    sigma = torch.tensor([0.005, 0.02, 0.5, 1.0, 10.0, 100.0, 1000.0], dtype=torch.float64)
    tau = timestep_of_sigma(sigma)
    assert tau.tolist() == pytest.approx([ddpm_timestep(float(s)) for s in sigma], abs=1e-9)
    inside = (tau > 0) & (tau < 999)
    torch.testing.assert_close(sigma_of_timestep(tau)[inside], sigma[inside])


def test_with_the_exact_teacher_the_target_is_the_exact_average_velocity():
    """A teacher whose velocity is exact (Gaussian data) and a student that is the exact average velocity: the
    distillation's target is the exact average velocity, by a JVP and by finite differences."""

    class ExactTeacher:
        guidance = TeacherGuidance()

        def velocity(self, z, t, labels, drop, autocast):
            return true_velocity(z, t)

    g = torch.Generator().manual_seed(0)
    t = torch.tensor([0.9, 0.7, 0.5, 0.3, 0.6], dtype=torch.float64)
    r = torch.tensor([0.1, 0.7, 0.2, 0.0, 0.55], dtype=torch.float64)
    x = SCALE * torch.randn(5, 1, 4, 4, generator=g, dtype=torch.float64)
    for derivative, tolerance in (("jvp", 1e-9), ("finite-difference", 1e-6)):
        objective = MeanFlowDistill(time="repa", derivative=derivative, fd_eps=1e-5)
        noised = objective.interpolate(x, t, r, torch.randn(5, 1, 4, 4, generator=g, dtype=torch.float64))
        frozen = {"teacher": ExactTeacher()}
        objective.forward_losses(GaussianAverageVelocity(), noised, None, None, False, NO_AUTOCAST, frozen)
        expected = true_average_velocity(noised.x_t, t, r)
        torch.testing.assert_close(noised.terms["target"], expected, rtol=tolerance, atol=tolerance)


# ----------------------------------------------------------------------------------------------------
# Records and conventions
# ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("time", ["moh-dit", "repa", "sit", "ddpm"])
def test_each_time_convention_feeds_the_teachers_time_and_the_end_time_or_the_interval(time):
    t, r = torch.tensor([0.6, 0.2]), torch.tensor([0.1, 0.2])
    interval, split = MeanFlowDistill(time=time), MeanFlowDistill(time=time, end_time_blocks=2)
    start, h = interval.network_time(t, r)
    expected = {"moh-dit": 1000 * t, "repa": t, "sit": 1 - t}.get(time)
    if expected is None:  # the DiT timestep of the noise level t / (1 - t)
        expected = torch.tensor([ddpm_timestep(float(s / (1 - s))) for s in t])
    torch.testing.assert_close(start.float(), expected.float(), rtol=1e-5, atol=1e-4)
    assert torch.equal(h, t - r)  # the interval raw in every convention (as MeanFlow's own network)
    assert torch.equal(split.network_time(t, r)[1], split.network_time(r, r)[0])  # the end time, as a start time
    record = MeanFlowDistill(time=time, end_time_blocks=2, teacher={"source": "runs/x"}).record()
    again = MeanFlowDistill.from_record(record)
    assert again.record() == record and "distilled from runs/x" in again.describe()
    assert MeanFlowDistill.from_record(record).model_config()["end_time_blocks"] == 2
    assert not isinstance(MeanFlow(), MeanFlowDistill) and again.samplers == ("meanflow",)


def test_the_finite_differences_step_follows_the_time_convention():
    """5e-3 where the network sees times x1000 (its sinusoid's wiggles), FastGen's 1e-4 for raw times; a given step
    is kept, a step out of range refused."""
    steps = {time: MeanFlowDistill(time=time, derivative="finite-difference").fd_eps for time in TIME_CONVENTIONS}
    assert steps == {"moh-dit": 5e-3, "ddpm": 5e-3, "repa": 1e-4, "sit": 1e-4}
    assert MeanFlowDistill(time="moh-dit", fd_eps=1e-3).fd_eps == 1e-3
    with pytest.raises(ConfigError, match="distill.fd_eps must be a step in time between 0 and 0.5"):
        MeanFlowDistill(fd_eps=0.7)


def test_a_ddpm_teachers_velocity_stays_finite_and_near_the_exact_one_beyond_its_schedule():
    """Past DiT's noisiest level (t > 0.99369) ``(eps_hat - z) / (1 - t)`` is infinite at t = 1 (it was: targets of
    1e12 wrecked DDPM students and their trajectories); the teacher's clean estimate at timestep 999 gives the velocity
    there, finite and near the exact one of Gaussian data (whose clean estimate at t = 1 is 0: v = z)."""
    g = torch.Generator().manual_seed(0)
    t = torch.tensor([0.9936, 0.9938, 0.9999, 1.0], dtype=torch.float64)
    z = torch.randn(4, 1, 4, 4, generator=g, dtype=torch.float64)
    ours = DDPM().linear_velocity(ExactNoise(), z, t, None).double()
    assert torch.isfinite(ours).all()
    torch.testing.assert_close(ours, true_velocity(z, t), rtol=0, atol=0.02 * float(z.abs().max()))
    torch.testing.assert_close(ours[-1], z[-1], rtol=0, atol=0.02 * float(z.abs().max()))
