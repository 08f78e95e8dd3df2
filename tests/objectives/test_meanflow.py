"""MeanFlow (moh_dit/objectives/meanflow.py): its loss against the authors' PyTorch code on their own draws (recorded by
tests/reference_outputs/record_meanflow.py), its target and samplers against a case whose average velocity is known in
closed form, its JVP against finite differences through MoH's routing, the guided target against the authors' JAX
formula written out, its time draws, and its place in configs, specs and the command line."""

from __future__ import annotations

import contextlib
import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from moh_dit.errors import ConfigError
from moh_dit.model.network import MoHDiT, MoHDiTOutput
from moh_dit.objectives import objective_from_record
from moh_dit.objectives.flow_schedulers import MeanFlowScheduler
from moh_dit.objectives.meanflow import MeanFlow

HERE = Path(__file__).resolve().parents[1] / "reference_outputs"
REC = load_file(HERE / "meanflow_official.safetensors")
SETTINGS = json.loads((HERE / "meanflow_official.json").read_text())
NO_AUTOCAST = contextlib.nullcontext


def tiny_model(signal_seed: int | None = 1, **overrides) -> MoHDiT:
    """The recorded tiny MoH-DiT (routed heads, every block option, two time inputs)."""
    config = dict(SETTINGS["tiny"], **overrides)
    torch.manual_seed(0)
    model = MoHDiT(**config)
    if signal_seed is not None:
        g = torch.Generator().manual_seed(signal_seed)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "adaLN" in name or "final_layer" in name:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return model.train()


# ----------------------------------------------------------------------------------------------------
# The authors' code
# ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("tag", list(SETTINGS["adaptive"]))
def test_the_loss_and_its_gradient_equal_the_authors_code_on_their_draws(tag):
    power, eps = SETTINGS["adaptive"][tag]
    model = MoHDiT(**SETTINGS["tiny"]).train()
    model.load_state_dict({k[len("model.") :]: v for k, v in REC.items() if k.startswith("model.")})
    objective = MeanFlow(adaptive_power=power, adaptive_eps=eps)
    x, labels = REC["x"], REC["labels"]
    noised = objective.interpolate(x, REC[f"{tag}.t"], REC[f"{tag}.r"], REC[f"{tag}.noise"])
    losses, _ = objective.forward_losses(model, noised, labels, torch.zeros_like(labels), False, NO_AUTOCAST)
    loss = losses.loss.mean()
    torch.testing.assert_close(loss, REC[f"{tag}.loss"], rtol=1e-5, atol=1e-6)
    loss.backward()
    torch.testing.assert_close(model.final_layer.linear.weight.grad, REC[f"{tag}.final_grad"], rtol=1e-4, atol=1e-7)
    # the logs follow the unweighted error per pixel: the plain loss over the pixel count
    if power == 0:
        torch.testing.assert_close(losses.followed.mean() * x[0].numel(), REC[f"{tag}.loss"], rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------------------------------
# A closed form: Gaussian data
# ----------------------------------------------------------------------------------------------------
SCALE = 0.5  # data x ~ N(0, SCALE^2 I)


def variance(t: torch.Tensor) -> torch.Tensor:
    """Var z_t of z_t = (1 - t) x + t eps."""
    return (1 - t) ** 2 * SCALE**2 + t**2


def true_velocity(z: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """E[eps - x | z_t] = (t - (1 - t) s^2) / V_t z."""
    return ((t - (1 - t) * SCALE**2) / variance(t)).view(-1, 1, 1, 1) * z


def true_average_velocity(z: torch.Tensor, t: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """The flow of this linear field is z_r = z_t sqrt(V_r / V_t), so u = z_t (1 - sqrt(V_r / V_t)) / (t - r) (the
    instantaneous velocity where r = t)."""
    span = t - r
    ratio = (1 - torch.sqrt(variance(r) / variance(t))) / torch.where(span > 0, span, torch.ones_like(span))
    factor = torch.where(span > 0, ratio, (t - (1 - t) * SCALE**2) / variance(t))
    return factor.view(-1, 1, 1, 1) * z


class GaussianAverageVelocity(torch.nn.Module):
    """A "network" that is the exact average velocity of Gaussian data, called as a MoHDiT (times ``(t, t - r)``)."""

    projectors, null_class_id = None, None

    def forward(self, z, times, y=None, force_drop_ids=None, return_head_masks=False, **_):
        t, h = times
        return MoHDiTOutput(sample=true_average_velocity(z, t, t - h), aux_loss=z.new_zeros(()))


def test_with_the_true_velocity_the_jvp_target_is_the_true_average_velocity():
    g = torch.Generator().manual_seed(0)
    t = torch.tensor([0.9, 0.7, 0.5, 0.3, 0.6, 1.0], dtype=torch.float64)
    r = torch.tensor([0.1, 0.7, 0.2, 0.0, 0.55, 0.0], dtype=torch.float64)
    x = SCALE * torch.randn(6, 1, 4, 4, generator=g, dtype=torch.float64)
    noised = MeanFlow().interpolate(x, t, r, torch.randn(6, 1, 4, 4, generator=g, dtype=torch.float64))
    noised.terms["velocity"] = true_velocity(noised.x_t, t)  # the target's expectation given z_t
    MeanFlow().forward_losses(GaussianAverageVelocity(), noised, None, None, False, NO_AUTOCAST)
    expected = true_average_velocity(noised.x_t, t, r)
    torch.testing.assert_close(noised.terms["target"], expected, rtol=1e-9, atol=1e-9)
    assert not torch.allclose(expected[2], noised.terms["velocity"][2])  # r < t: not the instantaneous velocity


@pytest.mark.parametrize("steps,shift", [(1, 1.0), (2, 1.0), (4, 1.0), (3, 3.0)])
def test_one_or_a_few_steps_of_the_true_average_velocity_carry_noise_to_the_data(steps, shift):
    # exact average velocities compose: any grid maps z_1 ~ N(0, I) to s z_1 ~ N(0, s^2 I), the data's law
    objective, scheduler = MeanFlow(), MeanFlowScheduler()
    objective.set_timesteps(scheduler, steps, shift, "cpu")
    assert len(scheduler.timesteps) == steps and scheduler.sigmas[0] == 1 and scheduler.sigmas[-1] == 0
    z1 = torch.randn(5, 1, 4, 4, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    net, z = GaussianAverageVelocity(), z1
    for index, t in enumerate(scheduler.timesteps):
        times, level = objective.step_time(scheduler, index, t)
        assert level.sigma == (math.inf if index == 0 else pytest.approx(float(times[0] / (1 - times[0]))))
        out = net(z, tuple(s.expand(5).double() for s in times)).sample
        z = scheduler.step(objective.scheduler_input(out, scheduler, 1, z, index), t, z).prev_sample
    torch.testing.assert_close(z, SCALE * z1, rtol=1e-6, atol=1e-6)


def test_the_two_step_grid_halves_time_and_a_shift_moves_its_middle_toward_the_noise():
    objective, scheduler = MeanFlow(), MeanFlowScheduler()
    objective.set_timesteps(scheduler, 2, 1.0, "cpu")
    assert scheduler.sigmas.tolist() == [1.0, 0.5, 0.0]
    objective.set_timesteps(scheduler, 2, 3.0, "cpu")
    assert scheduler.sigmas.tolist() == pytest.approx([1.0, 0.75, 0.0])
    with pytest.raises(ValueError, match="fall from noise to data"):
        scheduler.set_timesteps(sigmas=[0.5, 0.8])


# ----------------------------------------------------------------------------------------------------
# The JVP through MoH-DiT, and the guided target
# ----------------------------------------------------------------------------------------------------
def test_the_jvp_through_moh_routing_rope_and_qk_norm_equals_finite_differences():
    model = tiny_model().double()
    objective = MeanFlow()
    g = torch.Generator().manual_seed(4)
    x = torch.randn(6, 2, 8, 8, generator=g, dtype=torch.float64)
    t = torch.tensor([0.9, 0.8, 0.6, 0.5, 0.4, 0.3], dtype=torch.float64)
    r = torch.tensor([0.2, 0.8, 0.1, 0.25, 0.0, 0.1], dtype=torch.float64)
    noised = objective.interpolate(x, t, r, torch.randn(6, 2, 8, 8, generator=g, dtype=torch.float64))
    labels = torch.tensor([0, 1, 2, 0, 1, 2])
    objective.forward_losses(model, noised, labels, torch.zeros_like(labels), False, NO_AUTOCAST)
    v, eps = noised.terms["velocity"], 1e-3  # the time embedding is float32 (diffusers): not a smaller step

    def u(z, tt):
        with torch.no_grad():
            return model(z, (tt, tt - r), labels, force_drop_ids=torch.zeros_like(labels)).sample

    dudt = (u(noised.x_t + eps * v, t + eps) - u(noised.x_t - eps * v, t - eps)) / (2 * eps)
    expected = v - (t - r).view(-1, 1, 1, 1) * dudt
    torch.testing.assert_close(noised.terms["target"], expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("omega,kappa", [(2.0, 0.0), (1.0, 0.5)])
def test_the_guided_target_velocity_is_the_authors_mix_inside_the_guided_times_only(omega, kappa):
    model = tiny_model()
    objective = MeanFlow(guidance_scale=omega, guidance_mix=kappa, guidance_times=(0.3, 0.8))
    g = torch.Generator().manual_seed(5)
    x = torch.randn(6, 2, 8, 8, generator=g)
    t = torch.tensor([0.9, 0.7, 0.5, 0.3, 0.6, 0.2])  # 0.9 and 0.2 outside the guided times
    noised = objective.interpolate(x, t, t * 0.5, torch.randn(6, 2, 8, 8, generator=g))
    labels, drop = torch.tensor([0, 1, 2, 0, 1, 2]), torch.tensor([0, 0, 0, 0, 1, 0])  # sample 4's label dropped
    v_g = objective.guided_velocity(model, noised, labels, drop, NO_AUTOCAST)
    v = noised.terms["velocity"]
    for i in range(6):  # the JAX guidance_fn and cond_drop, one sample at a time
        inside = 0.3 <= t[i] <= 0.8
        w, k = (omega, kappa) if inside else (1.0, 0.0)

        def velocity(label):
            with torch.no_grad():
                y = torch.tensor([label])
                return model(noised.x_t[i : i + 1], (t[i : i + 1], torch.zeros(1)), y, torch.zeros(1)).sample[0]

        uncond, cond = velocity(3), velocity(int(labels[i]))  # 3: the null class
        expected = w * v[i] + (1 - w - k) * uncond + k * cond
        if drop[i]:
            expected = v[i]
        torch.testing.assert_close(v_g[i], expected, rtol=1e-4, atol=1e-5, msg=f"sample {i}")
    assert not torch.allclose(v_g[1], v[1])  # guided where it applies


def test_guidance_needs_a_null_class_and_an_unguided_objective_runs_no_extra_pass():
    objective = MeanFlow(guidance_scale=2.0)
    noised = objective.interpolate(
        torch.randn(2, 2, 8, 8), torch.tensor([0.5, 0.6]), torch.zeros(2), torch.randn(2, 2, 8, 8)
    )
    labels = torch.tensor([0, 1])
    with pytest.raises(ConfigError, match="needs label dropout"):
        objective.guided_velocity(tiny_model(class_dropout_prob=0.0), noised, labels, None, NO_AUTOCAST)

    class Refuses(torch.nn.Module):
        def forward(self, *a, **k):
            raise AssertionError("no guidance pass without guidance")

    assert MeanFlow().guided_velocity(Refuses(), noised, labels, None, NO_AUTOCAST) is noised.terms["velocity"]


def test_the_moh_loss_is_counted_once_and_head_usage_comes_from_one_more_forward():
    model = tiny_model()
    objective = MeanFlow(guidance_mix=0.5)
    x = torch.randn(4, 2, 8, 8, generator=torch.Generator().manual_seed(6))
    noised = objective.noised(x, torch.Generator().manual_seed(7), torch.device("cpu"))
    labels = torch.tensor([0, 1, 2, 0])
    drop = torch.zeros_like(labels)
    losses, out = objective.forward_losses(model, noised, labels, drop, True, NO_AUTOCAST)
    with torch.no_grad():
        plain = model(noised.x_t, noised.time, labels, force_drop_ids=drop, return_head_masks=True)
    torch.testing.assert_close(out.aux_loss, plain.aux_loss)  # the primal pass's, not a sum over passes
    assert [m.shape for m in out.head_masks] == [m.shape for m in plain.head_masks]
    assert all(torch.equal(a, b) for a, b in zip(out.head_masks, plain.head_masks))
    assert losses.loss.shape == (4,) and out.aux_loss.requires_grad


@pytest.mark.parametrize("jvp_autocast", [False, True])
def test_mixed_precision_trains_with_the_jvp_in_float32_or_in_bfloat16(jvp_autocast):
    model = tiny_model()
    objective = MeanFlow(guidance_mix=0.5, jvp_autocast=jvp_autocast)
    x = torch.randn(4, 2, 8, 8, generator=torch.Generator().manual_seed(8))
    noised = objective.noised(x, torch.Generator().manual_seed(9), torch.device("cpu"))
    labels = torch.tensor([0, 1, 2, 0])

    def bf16():
        return torch.autocast("cpu", dtype=torch.bfloat16)

    losses, out = objective.forward_losses(model, noised, labels, torch.zeros_like(labels), False, bf16)
    reference, _ = objective.forward_losses(
        model, objective.noised(x, torch.Generator().manual_seed(9), torch.device("cpu")), labels,
        torch.zeros_like(labels), False, NO_AUTOCAST,
    )  # fmt: skip
    assert out.sample.dtype == torch.float32 and torch.isfinite(losses.loss).all()
    if jvp_autocast:  # bfloat16 rounds the JVP: near, not equal
        torch.testing.assert_close(losses.mse, reference.mse, rtol=0.1, atol=0.05)
    else:  # only the guidance passes ran in bfloat16
        torch.testing.assert_close(losses.mse, reference.mse, rtol=0.02, atol=1e-3)
    losses.loss.mean().backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


# ----------------------------------------------------------------------------------------------------
# Time draws, records, the model's second time input
# ----------------------------------------------------------------------------------------------------
def test_times_are_two_ordered_logit_normal_draws_with_r_equal_t_for_the_first_share():
    n = 8
    t, r = MeanFlow().draw_times(n, torch.Generator().manual_seed(3))
    g = torch.Generator().manual_seed(3)
    a, b = (torch.sigmoid(-0.4 + torch.randn(n, generator=g)) for _ in range(2))
    assert torch.equal(t, torch.maximum(a, b))
    assert torch.equal(r[:6], t[:6]) and torch.equal(r[6:], torch.minimum(a, b)[6:])  # floor(8 * 0.75) = 6
    t, r = MeanFlow(time_sampling="uniform", equal_times=0.0).draw_times(1000, torch.Generator().manual_seed(0))
    assert (t >= r).all() and (t > r).all() and 0.6 < t.mean() < 0.73  # E[max of two uniforms] = 2/3


def test_the_record_carries_the_guidance_and_the_model_takes_two_times():
    objective = objective_from_record({"name": "meanflow", "guidance_scale": 1.0, "guidance_mix": 0.5})
    assert objective.record() == {
        "name": "meanflow",
        "guidance_scale": 1.0,
        "guidance_mix": 0.5,
        "guidance_times": [0.0, 1.0],
    }
    assert objective.model_config()["time_inputs"] == 2 and objective.guided
    assert "scale 2" in objective.describe() and "adaptively weighted" in objective.describe_loss()
    with pytest.raises(ConfigError, match="unknown keys"):
        objective_from_record({"name": "meanflow", "path": "linear"})
    with pytest.raises(ConfigError, match="learn_sigma must be false"):
        objective_from_record({"name": "meanflow"}, learn_sigma=True)
    with pytest.raises(ConfigError, match="guidance_times must satisfy"):
        MeanFlow(guidance_times=(0.8, 0.2))
    with pytest.raises(ConfigError, match="guidance_mix"):
        MeanFlow(guidance_mix=1.0)
    model = tiny_model()
    with pytest.raises(ValueError, match="takes 2 time input"):
        model(torch.randn(1, 2, 8, 8), torch.tensor([0.5]), torch.tensor([0]))
    assert model.h_embedder is not None and MoHDiT(**dict(SETTINGS["tiny"], time_inputs=1)).h_embedder is None


def test_a_sampler_or_protocol_of_another_objective_is_a_clear_error():
    from moh_dit.sampling.options import spec_from_args

    objective = MeanFlow()
    assert objective.samplers == ("meanflow",) and objective.protocol("paper") == ("meanflow", 1)
    assert objective.protocol("two-step") == ("meanflow", 2)
    with pytest.raises(ConfigError, match="scheduler 'euler' samples flow models; this is a meanflow model"):
        objective.check_sampler("euler")
    with pytest.raises(ConfigError, match="'sit-sde' is a protocol of flow models; this is a meanflow model"):
        objective.protocol("sit-sde")
    with pytest.raises(
        ConfigError, match="scheduler 'meanflow' samples meanflow and distill models; this is a flow model"
    ):
        objective_from_record({"name": "flow"}).check_sampler("meanflow")

    import argparse

    from moh_dit.cli.common import add_sampling_arguments

    def spec(argv, guidance, objective):
        parser = argparse.ArgumentParser()
        add_sampling_arguments(parser, guidance=guidance, protocol="paper", num_samples=10)
        return spec_from_args(parser.parse_args(argv), log=False, objective=objective)

    # evaluate's defaults: a MeanFlow model is guided in training and samples unguided, a DDPM model at 1.5
    assert (spec([], 1.5, "meanflow").guidance.scale, spec([], 1.5, "meanflow").sampler.num_steps) == (1.0, 1)
    assert spec([], 1.5, "ddpm").guidance.scale == 1.5
    assert spec(["--cfg-scale", "2"], 1.5, "meanflow").guidance.scale == 2.0  # asked for: given


# ----------------------------------------------------------------------------------------------------
# Configs and a run
# ----------------------------------------------------------------------------------------------------
def test_a_config_fills_each_objectives_time_defaults_and_refuses_keys_of_others():
    from moh_dit.training.config import load_config

    meanflow = load_config(None, ["objective.name=meanflow"])
    assert (meanflow.objective.time_sampling, meanflow.objective.time_mean) == ("logit-normal", -0.4)
    flow = load_config(None, ["objective.name=flow"])
    assert (flow.objective.time_sampling, flow.objective.time_mean, flow.objective.time_std) == ("uniform", 0.0, 1.0)
    ddpm = load_config(None, [])  # what moh-dit 0.4 wrote for keys DDPM does not use
    assert (ddpm.objective.time_sampling, ddpm.objective.time_mean) == ("uniform", 0.0)
    with pytest.raises(ConfigError, match="objective.equal_times applies to the meanflow objective"):
        load_config(None, ["objective.name=flow", "objective.equal_times=0.5"])
    with pytest.raises(
        ConfigError, match="objective.guidance_mix applies to the ddpm objective"
    ):  # and flow, meanflow
        load_config(None, ["objective.name=distill", "distill.teacher=t", "objective.guidance_mix=0.5"])
    with pytest.raises(ConfigError, match="objective.path applies to the flow objective"):
        load_config(None, ["objective.name=meanflow", "objective.path=gvp"])
    with pytest.raises(ConfigError, match="MeanFlow draws its times logit-normal or uniform"):
        load_config(None, ["objective.name=meanflow", "objective.time_sampling=lognormal"])
    twin = load_config(Path(__file__).resolve().parents[2] / "configs" / "fashion_mnist_moh_meanflow.yaml")
    assert twin.objective.guidance_mix == 0.5 and twin.preview.num_steps == 1 and twin.preview.guidance_scale == 1


def test_a_meanflow_model_is_not_exported_where_no_code_takes_its_second_time_input():
    from moh_dit.errors import ConversionError
    from moh_dit.interop.official import check_ddpm_export
    from moh_dit.interop.sit import to_flow_state_dict

    model = MoHDiT(**dict(SETTINGS["tiny"], block=None, num_shared_heads=None, top_k=0, attention_type="mha"))
    model.register_to_config(objective=MeanFlow().record())
    for fmt in ("sit", "repa"):
        with pytest.raises(ConversionError, match="this is MeanFlow: average velocity"):
            to_flow_state_dict(model, fmt)
    with pytest.raises(ConversionError, match="samples every checkpoint as DiT's DDPM.*this model is MeanFlow"):
        check_ddpm_export(model, "DiT's code")
