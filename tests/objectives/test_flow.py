"""Flow matching: paths and losses against closed forms, time sampling, conventions, the samplers on a Gaussian toy
whose exact velocity is known (they must land on the data, not on noise), and the errors for wrong combinations."""

import math

import pytest
import torch

from moh_dit.errors import ConfigError
from moh_dit.model.network import MoHDiT, MoHDiTOutput
from moh_dit.objectives.flow import Flow, shifted
from moh_dit.objectives.flow_schedulers import (
    FlowHeunScheduler,
    FlowSDEScheduler,
    noise_from_velocity,
    path_coefficients,
)
from moh_dit.sampling.pipeline import MoHDiTPipeline
from moh_dit.sampling.spec import SamplingSpec


# ----------------------------------------------------------------------------------------------------
# Paths, targets, the loss
# ----------------------------------------------------------------------------------------------------
def test_linear_and_gvp_paths_and_their_velocities_are_the_closed_forms():
    g = torch.Generator().manual_seed(0)
    x, eps, s = torch.randn(5, 2, 4, 4, generator=g), torch.randn(5, 2, 4, 4, generator=g), torch.rand(5, generator=g)
    col = s.reshape(-1, 1, 1, 1)
    linear = Flow("linear").interpolate(x, s, eps)
    torch.testing.assert_close(linear.x_t, (1 - col) * x + col * eps, rtol=0, atol=1e-6)
    torch.testing.assert_close(linear.terms["velocity"], eps - x, rtol=0, atol=1e-6)
    gvp = Flow("gvp").interpolate(x, s, eps)
    half = math.pi / 2
    torch.testing.assert_close(gvp.x_t, torch.cos(half * col) * x + torch.sin(half * col) * eps, rtol=0, atol=1e-6)
    velocity = half * (torch.cos(half * col) * eps - torch.sin(half * col) * x)
    torch.testing.assert_close(gvp.terms["velocity"], velocity, rtol=0, atol=1e-6)
    # the velocity is the derivative of the path: a central difference agrees
    h = 1e-3
    ahead, behind = Flow("gvp").interpolate(x, s + h, eps).x_t, Flow("gvp").interpolate(x, s - h, eps).x_t
    torch.testing.assert_close((ahead - behind) / (2 * h), velocity, rtol=1e-3, atol=1e-3)


def test_the_loss_is_each_samples_mean_squared_velocity_error_in_every_convention():
    g = torch.Generator().manual_seed(1)
    x, eps, s = torch.randn(3, 4, 4, 4, generator=g), torch.randn(3, 4, 4, 4, generator=g), torch.rand(3, generator=g)
    out = torch.randn(3, 4, 4, 4, generator=g)
    for convention, sign in (("moh-dit", 1.0), ("repa", 1.0), ("sit", -1.0)):
        flow = Flow("linear", convention)
        noised = flow.interpolate(x, s, eps)
        brute = torch.stack([((sign * out[i] - (eps[i] - x[i])) ** 2).mean() for i in range(3)])
        losses = flow.loss(out, noised)
        torch.testing.assert_close(losses.loss, brute, rtol=1e-6, atol=0)
        assert losses.vb is None
    times = {c: Flow("linear", c).model_time(torch.tensor([0.25])).item() for c in ("moh-dit", "repa", "sit")}
    assert times == {"moh-dit": 250.0, "repa": 0.25, "sit": 0.75}
    with pytest.raises(ValueError, match="outputs 4 channels, got 8"):
        Flow().loss(torch.randn(3, 8, 4, 4), Flow().interpolate(x, s, eps))


def test_time_sampling_uniform_logit_normal_and_repas_lognormal():
    n, g = 200_000, lambda: torch.Generator().manual_seed(2)
    uniform = Flow(time_sampling="uniform").draw_time(n, g())
    assert uniform.min() >= 0 and uniform.max() < 1 and abs(uniform.mean() - 0.5) < 0.005
    logit = Flow(time_sampling="logit-normal", time_mean=0.5, time_std=0.8).draw_time(n, g())
    z = torch.log(logit / (1 - logit))
    assert abs(z.mean() - 0.5) < 0.01 and abs(z.std() - 0.8) < 0.01
    # REPA's lognormal: sigma = exp(N(m, s)), then the path's time of sigma; on the linear path the same law (and,
    # from the same generator, the same draws) as the logit-normal
    linear = Flow("linear", time_sampling="lognormal", time_mean=0.5, time_std=0.8).draw_time(n, g())
    torch.testing.assert_close(linear, logit, rtol=0, atol=1e-6)
    gvp = Flow("gvp", time_sampling="lognormal").draw_time(8, g())
    normal = torch.randn(8, generator=g())
    torch.testing.assert_close(gvp, 2 / math.pi * torch.atan(normal.exp()), rtol=0, atol=1e-6)


def test_noised_draws_the_time_then_the_noise():
    flow, x0 = Flow(time_sampling="uniform"), torch.randn(4, 1, 8, 8)
    noised = flow.noised(x0, torch.Generator().manual_seed(5), torch.device("cpu"))
    g = torch.Generator().manual_seed(5)
    s, noise = torch.rand(4, generator=g), torch.randn(x0.shape, generator=g)
    torch.testing.assert_close(noised.x_t, flow.interpolate(x0, s, noise).x_t, rtol=0, atol=0)
    assert torch.equal(noised.time, 1000 * s)


def test_the_score_and_noise_from_a_velocity_are_the_posterior_means_of_the_path():
    g = torch.Generator().manual_seed(3)
    x, eps, s = torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g), torch.tensor([0.1, 0.4, 0.7, 1.0])
    for path in ("linear", "gvp"):
        a, b, da, db = (c[:, None] for c in path_coefficients(s, path))
        x_s, v = a * x + b * eps, da * x + db * eps  # the velocity of this very eps: the noise comes back
        torch.testing.assert_close(noise_from_velocity(v, x_s, s[:, None], path), eps, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------------------------------
# Samplers on a Gaussian toy: data N(mu, std^2) per dimension, whose velocity is known exactly
# ----------------------------------------------------------------------------------------------------
class ExactVelocity(MoHDiT):
    """A MoHDiT (for the pipeline's sake) whose output is the exact velocity of data ``N(mu, std^2)``, in its
    objective's convention."""

    def __init__(
        self, mu: float, std: float, path: str = "linear", convention: str = "moh-dit", prediction: str = "velocity"
    ) -> None:
        objective = {"name": "flow", "path": path, "convention": convention}
        objective |= {"prediction": prediction} if prediction != "velocity" else {}
        super().__init__(
            sample_size=8,
            patch_size=2,
            in_channels=1,
            hidden_size=32,
            depth=1,
            num_heads=4,
            num_classes=0,
            learn_sigma=False,
            objective=objective,
        )
        self.mu, self.std, self.flow = mu, std, Flow(path, convention, prediction=prediction)

    def forward(self, x, t, y=None, **kwargs):
        t = torch.as_tensor(t, dtype=torch.float64).reshape(-1, 1, 1, 1).expand(x.shape[0], 1, 1, 1)
        s = {"moh-dit": t / 1000, "repa": t, "sit": 1 - t}[self.flow.convention]
        a, b, da, db = path_coefficients(s, self.flow.path)
        x = x.double()
        resid, var = x - a * self.mu, a**2 * self.std**2 + b**2
        clean = self.mu + a * self.std**2 / var * resid  # E[x | x_s]
        if self.flow.prediction == "x":
            return MoHDiTOutput(sample=clean.float(), aux_loss=torch.zeros(()))
        velocity = da * clean + db * (b / var * resid)
        return MoHDiTOutput(sample=(self.flow.sign * velocity).float(), aux_loss=torch.zeros(()))


def toy_samples(scheduler, steps, path="linear", convention="moh-dit", shift=1.0, n=200, prediction="velocity"):
    pipe = MoHDiTPipeline.build(ExactVelocity(2.0, 0.5, path, convention, prediction), None, {}, scheduler)
    pipe.set_progress_bar_config(disable=True)
    spec = SamplingSpec.create(scheduler, steps, 1.0, time_shift=shift)
    return pipe(num_images=n, sampling=spec, generator=torch.Generator().manual_seed(0), output_type="latent").images


@pytest.mark.parametrize(
    "scheduler,steps,path,tolerance",
    [
        ("euler", 50, "linear", 0.03),
        ("heun", 25, "linear", 0.02),
        ("dpm-solver", 25, "linear", 0.02),
        ("unipc", 25, "linear", 0.02),
        ("sde", 100, "linear", 0.05),
        ("euler", 50, "gvp", 0.03),
        ("heun", 25, "gvp", 0.02),
        ("sde", 100, "gvp", 0.05),
    ],
)
def test_every_flow_sampler_lands_on_the_data_distribution(scheduler, steps, path, tolerance):
    x = toy_samples(scheduler, steps, path)
    assert abs(x.mean().item() - 2.0) < tolerance, x.mean()  # pure noise would have mean 0 and std 1
    assert abs(x.std().item() - 0.5) < 2 * tolerance, x.std()


def test_conventions_and_a_time_shift_sample_the_same_distribution():
    base = toy_samples("heun", 25)
    for convention in ("sit", "repa"):
        torch.testing.assert_close(toy_samples("heun", 25, convention=convention), base, rtol=1e-4, atol=1e-4)
    shifted_samples = toy_samples("euler", 50, shift=3.0)
    assert abs(shifted_samples.mean().item() - 2.0) < 0.03 and abs(shifted_samples.std().item() - 0.5) < 0.06


# ----------------------------------------------------------------------------------------------------
# Grids and the two schedulers of our own
# ----------------------------------------------------------------------------------------------------
def test_grids_are_explicit_shifted_and_end_at_zero():
    flow = Flow()
    euler = flow.make_scheduler("euler")
    flow.set_timesteps(euler, 4, 3.0, "cpu")
    grid = torch.linspace(1, 0, 5, dtype=torch.float64)[:-1]
    expected = (3 * grid / (1 + 2 * grid)).float()
    torch.testing.assert_close(euler.sigmas, torch.cat([expected, torch.zeros(1)]), rtol=0, atol=1e-7)
    torch.testing.assert_close(shifted(torch.tensor([0.5]), 3.0), torch.tensor([0.75]))
    sde = flow.make_scheduler("sde")
    flow.set_timesteps(sde, 5, 1.0, "cpu")
    torch.testing.assert_close(sde.sigmas, torch.tensor([1.0, 0.76, 0.52, 0.28, 0.04, 0.0]), rtol=0, atol=1e-6)
    dpm = flow.make_scheduler("dpm-solver")
    flow.set_timesteps(dpm, 10, 2.0, "cpu")
    assert dpm.config.flow_shift == 2.0 and dpm.sigmas[-1] == 0


def test_heun_on_an_explicit_grid_is_diffusers_heun_on_its_own():
    from diffusers import FlowMatchHeunDiscreteScheduler

    ours, theirs = FlowHeunScheduler(), FlowMatchHeunDiscreteScheduler()
    theirs.set_timesteps(6)
    ours.set_timesteps(sigmas=theirs.sigmas[0:-1:2].tolist())  # diffusers' grid, given explicitly
    torch.testing.assert_close(ours.sigmas, theirs.sigmas)
    torch.testing.assert_close(ours.timesteps, theirs.timesteps)


def test_the_sde_scheduler_is_euler_maruyama_with_a_noise_free_last_step():
    """SiT's update (sigma diffusion, linear path) by hand: x += (-v + s * score) dt + sqrt(2 s dt) z, then a last
    step without noise."""
    torch.manual_seed(0)
    velocity = lambda x, s: 0.3 * x - s  # noqa: E731 (any field will do)
    sched = FlowSDEScheduler()
    sched.set_timesteps(4)
    x = ours = torch.randn(2, 3)
    g_ours, g_hand = torch.Generator().manual_seed(9), torch.Generator().manual_seed(9)
    sigmas = sched.sigmas.tolist()
    for i, t in enumerate(sched.timesteps):
        s, s_next = sigmas[i], sigmas[i + 1]
        ours = sched.step(velocity(ours, s), t, ours, generator=g_ours).prev_sample
        v = velocity(x, s)
        score = -(x + (1 - s) * v) / s
        x = x + (-v + s * score) * (s - s_next)
        if i < len(sched.timesteps) - 1:
            x = x + math.sqrt(2 * s * (s - s_next)) * torch.randn(x.shape, generator=g_hand)
    torch.testing.assert_close(ours, x, rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------------------------------
# What is an error
# ----------------------------------------------------------------------------------------------------
def test_wrong_combinations_are_errors_that_say_what_applies():
    with pytest.raises(ConfigError, match=r"scheduler 'ddpm' samples ddpm models; this is a flow model.*euler, heun"):
        Flow().make_scheduler("ddpm")
    with pytest.raises(ConfigError, match=r"does not apply to this flow model \(path=gvp; .*linear path only\)"):
        Flow("gvp").make_scheduler("dpm-solver")
    assert "dpm-solver" not in Flow("gvp").samplers and "dpm-solver" in Flow().samplers
    # a protocol the user chose stays an error; a default one falls back to a sampler the path offers
    assert Flow("gvp").protocol("fast", given=False) == ("euler", 25) and Flow().protocol("fast") == ("dpm-solver", 25)
    with pytest.raises(ConfigError, match="linear path only"):
        Flow("gvp").protocol("fast")
    assert Flow("gvp").protocol("paper") == ("sde", 250)
    with pytest.raises(ConfigError, match="learn_sigma must be false"):
        Flow.from_record({"name": "flow"}, learn_sigma=True)
    with pytest.raises(ConfigError, match="objective.path must be one of linear, gvp"):
        Flow("vp")
    with pytest.raises(ConfigError, match="time_sampling must be one of"):
        Flow(time_sampling="mode")
    with pytest.raises(ConfigError, match="unknown keys"):
        Flow.from_record({"name": "flow", "sigma_min": 0.1})
    with pytest.raises(ValueError, match="at least 2 steps"):
        FlowSDEScheduler().set_timesteps(1)


# ----------------------------------------------------------------------------------------------------
# x-prediction (JiT)
# ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("path", ["linear", "gvp"])
def test_x_prediction_stands_for_the_velocity_of_the_path_solved_for_the_noise(path):
    """The clean image as output: ``a' x + b' eps`` with the noise the path gives back (linear: ``(x_s - x) / s``),
    so the exact clean image is the exact velocity; the loss is on that velocity; below b = 0.05 the divisor holds."""
    g = torch.Generator().manual_seed(0)
    x, eps = torch.randn(4, 3, 4, 4, generator=g), torch.randn(4, 3, 4, 4, generator=g)
    s = torch.tensor([0.9, 0.5, 0.2, 0.06])
    objective = Flow(path, prediction="x")
    noised = objective.interpolate(x, s, eps)
    torch.testing.assert_close(objective.velocity_of(x, noised.x_t, s), noised.terms["velocity"], rtol=1e-4, atol=1e-4)
    if path == "linear":
        guess = torch.randn(4, 3, 4, 4, generator=g)
        by_hand = (noised.x_t - guess) / s.reshape(-1, 1, 1, 1)
        losses = objective.loss(guess, noised)
        torch.testing.assert_close(losses.loss, ((by_hand - noised.terms["velocity"]) ** 2).mean(dim=(1, 2, 3)))
        late = torch.tensor([0.01])
        torch.testing.assert_close(objective.velocity_of(guess[:1], x[:1], late), (x[:1] - guess[:1]) / 0.05)
    assert objective.record() == {"name": "flow", "path": path, "convention": "moh-dit", "prediction": "x"}
    assert Flow(path).record() == {"name": "flow", "path": path, "convention": "moh-dit"}  # as before: unchanged


@pytest.mark.parametrize("scheduler,steps", [("euler", 10), ("heun", 10), ("dpm-solver", 10)])
def test_an_exact_x_predictor_samples_as_the_exact_velocity_does(scheduler, steps):
    """On grids whose noisiest-but-last times stay above JiT's clamp the two models give the same samples; the
    samplers take the velocity either way."""
    x_pred = toy_samples(scheduler, steps, prediction="x")
    torch.testing.assert_close(x_pred, toy_samples(scheduler, steps), rtol=1e-4, atol=1e-4)


def test_x_prediction_is_refused_where_it_does_not_apply(tmp_path):
    from moh_dit.errors import ConfigError, ConversionError
    from moh_dit.interop.sit import to_flow_state_dict
    from moh_dit.training.config import load_config

    with pytest.raises(ConfigError, match="objective.prediction applies to the flow objective"):
        load_config(None, ["objective.prediction=x"])  # DDPM: noise prediction with a learned variance
    with pytest.raises(ConfigError, match="objective.prediction applies to the flow objective"):
        load_config(None, ["objective.name=meanflow", "objective.prediction=x", "train.snr_gamma=null"])
    with pytest.raises(ConfigError, match="objective.prediction must be one of velocity, x"):
        load_config(None, ["objective.name=flow", "objective.prediction=eps", "train.snr_gamma=null"])
    model = ExactVelocity(0.0, 1.0, convention="repa", prediction="x")
    with pytest.raises(ConversionError, match="predicts the clean image"):
        to_flow_state_dict(model, "repa")
