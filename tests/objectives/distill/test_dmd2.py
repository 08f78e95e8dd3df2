"""DMD2's losses (moh_dit/objectives/distill/dmd_losses.py) against NVlabs/FastGen's ``common_loss.py`` on fixed inputs
(recorded by tests/reference_outputs/record_fastgen_dmd.py): the variational score distillation loss and its gradient
(with and without a per-sample scale), the non-saturating GAN losses and their gradients, and the fake score's
denoising loss as the flow objective computes it (FastGen's ``flow`` prediction), with its gradient."""

from __future__ import annotations

import contextlib
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from moh_dit.objectives.distill.dmd_losses import gan_discriminator_loss, gan_generator_loss, vsd_loss
from moh_dit.objectives.flow import Flow

REC = load_file(Path(__file__).resolve().parents[2] / "reference_outputs" / "fastgen_dmd.safetensors")


def mean_and_grad(fn, *inputs):
    leaves = [x.clone().requires_grad_(True) for x in inputs]
    value = fn(*leaves).mean()
    value.backward()
    return value.detach(), [x.grad for x in leaves]


def test_the_vsd_loss_and_its_gradient_equal_fastgens():
    for name, scale in (("vsd", None), ("vsd_scaled", REC["scale"])):
        value, (grad,) = mean_and_grad(lambda x: vsd_loss(x, REC["teacher_x0"], REC["fake_x0"], scale), REC["gen"])
        torch.testing.assert_close(value, REC[name], rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(grad, REC[f"{name}.grad"], rtol=1e-5, atol=1e-8)


def test_the_vsd_gradient_is_the_normalised_gap_between_the_two_scores():
    """d/dx of the mean loss = w (x0_fake - x0_real) / numel, w = 1 / (mean |x - x0_real| + 1e-6) per sample."""
    gen, real, fake = REC["gen"], REC["teacher_x0"], REC["fake_x0"]
    _, (grad,) = mean_and_grad(lambda x: vsd_loss(x, real, fake), gen)
    w = 1 / ((gen - real).abs().flatten(1).mean(1) + 1e-6)
    torch.testing.assert_close(grad, w.view(-1, 1, 1, 1) * (fake - real) / gen.numel(), rtol=1e-5, atol=1e-8)


def test_the_gan_losses_and_their_gradients_equal_fastgens():
    value, (grad,) = mean_and_grad(gan_generator_loss, REC["fake_logits"])
    torch.testing.assert_close(value, REC["gan_gen"])
    torch.testing.assert_close(grad, REC["gan_gen.grad"])
    value, (real, fake) = mean_and_grad(gan_discriminator_loss, REC["real_logits"], REC["fake_logits"])
    torch.testing.assert_close(value, REC["gan_disc"])
    torch.testing.assert_close(real, REC["gan_disc.grad_real"])
    torch.testing.assert_close(fake, REC["gan_disc.grad_fake"])


def test_the_fake_scores_denoising_loss_is_the_flow_objectives_own():
    """The fake score trains with its teacher's objective: for a flow teacher the velocity error, FastGen's ``flow``
    denoising loss (mean reduction), with the same gradient in the prediction."""
    objective = Flow()
    t = torch.rand(5, generator=torch.Generator().manual_seed(0))
    noised = objective.interpolate(REC["x0"], t, REC["eps"])
    value, (grad,) = mean_and_grad(lambda y: objective.loss(y, noised).loss, REC["pred"])
    torch.testing.assert_close(value, REC["dsm_flow"], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(grad, REC["dsm_flow.grad"], rtol=1e-5, atol=1e-8)


def test_the_renoising_sampler_predicts_the_data_and_noises_it_afresh_at_each_grid_time():
    """One step is MeanFlow's step to 0; two steps are x = z - t u at 1, then (1 - r) x + r eps at r = 0.5 with eps
    from the step's generator, then that sample's data prediction."""
    from moh_dit.objectives.flow_schedulers import MeanFlowScheduler

    z, u1, u2 = (torch.randn(2, 1, 2, 2, generator=torch.Generator().manual_seed(i)) for i in range(3))
    plain, renoised = MeanFlowScheduler(), MeanFlowScheduler(renoise=True)
    for scheduler in (plain, renoised):
        scheduler.set_timesteps(sigmas=[1.0])
    torch.testing.assert_close(renoised.step(u1, 1000, z).prev_sample, plain.step(u1, 1000, z).prev_sample)
    renoised.set_timesteps(sigmas=[1.0, 0.5])
    middle = renoised.step(u1, 1000, z, generator=torch.Generator().manual_seed(7)).prev_sample
    eps = torch.randn(z.shape, generator=torch.Generator().manual_seed(7))
    torch.testing.assert_close(middle, 0.5 * (z - u1) + 0.5 * eps)
    torch.testing.assert_close(renoised.step(u2, 500, middle).prev_sample, middle - 0.5 * u2)


def test_of_every_fake_updates_plus_one_steps_the_first_updates_the_generator():
    from moh_dit.objectives.distill.dmd2 import DMD2Distill

    objective = DMD2Distill(fake_updates=4)
    assert [objective.updates(s) for s in range(6)] == ["student", *["fake_score"] * 4, "student"]
    assert objective.frozen_models_for({"regression": 0.0}) == ("teacher",)
    assert objective.frozen_models_for({"regression": 0.5}) == ("teacher", "trajectories")


# ----------------------------------------------------------------------------------------------------
# Grids, backward simulation, the real score's guidance, the keys
# ----------------------------------------------------------------------------------------------------
def test_the_grids_put_the_two_step_middle_at_the_midpoint_and_each_start_follows_its_coarsest_grid():
    from moh_dit.objectives.distill.dmd2 import DMD2Distill
    from moh_dit.objectives.distill.grids import generator_grids

    assert generator_grids((1, 2)) == {1: [1.0], 2: [1.0, 0.5]}
    assert generator_grids((2,), 0.3)[2] == pytest.approx([1.0, 0.3])
    shift = 0.3 / 0.7  # SD3's shift that moves 0.5 to 0.3, applied to every point of the four-step grid
    assert generator_grids((4,), 0.3)[4] == pytest.approx(
        [1.0] + [shift * a / (1 + (shift - 1) * a) for a in (0.75, 0.5, 0.25)]
    )
    objective = DMD2Distill(dmd_steps=[1, 2, 4], dmd_input="generator")
    assert objective.start_times == [1.0, 0.75, 0.5, 0.25]
    # 0.5 is on the two-step grid: one step from noise reaches it; 0.25 only on the four-step one
    assert objective.paths == {1.0: [], 0.5: [1.0], 0.75: [1.0], 0.25: [1.0, 0.75, 0.5]}
    assert objective.simulated_forwards() == pytest.approx((0 + 1 + 1 + 3) / 4)
    assert DMD2Distill(dmd_steps=[1, 2]).simulated_forwards() == 0  # the data noised: no simulation


def test_the_sampler_steps_on_the_grid_the_generator_trained_at():
    from moh_dit.objectives.distill.dmd2 import DMD2Distill

    objective = DMD2Distill(dmd_steps=[1, 2], dmd_midpoint=0.3)
    scheduler = objective.make_scheduler("meanflow")
    objective.set_timesteps(scheduler, 2, 1.0, "cpu")
    assert scheduler.sigmas.tolist() == pytest.approx([1.0, 0.3, 0.0])
    objective.set_timesteps(scheduler, 2, 2.0, "cpu")  # a sampler's own shift on top: shifts multiply
    assert scheduler.sigmas[1].item() == pytest.approx(2 * 0.3 / 0.7 * 0.5 / (1 + (2 * 0.3 / 0.7 - 1) * 0.5))
    plain = DMD2Distill(dmd_steps=[1, 2])
    plain.set_timesteps(scheduler, 2, 1.0, "cpu")
    assert scheduler.sigmas.tolist() == [1.0, 0.5, 0.0]


class _CountingGenerator(torch.nn.Module):
    """A generator called as a MoHDiT: ``u = z + t`` (so its data prediction from z at t is ``z - t (z + t)``),
    counting the rows of every call."""

    def __init__(self):
        super().__init__()
        self.rows = []

    def forward(self, z, times, y=None, force_drop_ids=None, **_):
        from moh_dit.model.network import MoHDiTOutput

        self.rows.append(z.shape[0])
        t = torch.as_tensor(times[0], dtype=z.dtype).expand(z.shape[0]).reshape(-1, 1, 1, 1)
        return MoHDiTOutput(sample=z + t / 1000, aux_loss=z.new_zeros(()))


def test_backward_simulation_runs_each_start_from_noise_down_its_own_path_and_only_those_rows():
    from moh_dit.objectives.distill.dmd2 import DMD2Distill

    objective = DMD2Distill(dmd_steps=[1, 2, 4], dmd_input="generator")
    net = _CountingGenerator()
    start = torch.tensor([1.0, 0.25, 0.5, 0.75, 0.25, 1.0])
    noise = torch.randn(6, 1, 2, 2, generator=torch.Generator().manual_seed(0))
    x = objective.backward_simulation(net, noise, start, None, None, contextlib.nullcontext)
    for i, s in enumerate(start.tolist()):  # brute force, one sample at a time down its path
        path = objective.paths[s]
        if not path:
            assert torch.all(x[i] == 0)
            continue
        z = noise[i]
        for k, now in enumerate(path):
            predicted = z - now * (z + now)  # the toy's u at network time 1000 t
            after = path[k + 1] if k + 1 < len(path) else s
            z = (1 - after) * predicted + after * noise[i]
        torch.testing.assert_close(x[i], predicted)
    assert sum(net.rows) == sum(len(objective.paths[s]) for s in start.tolist()) == 1 + 3 + 1 + 3


def test_backward_simulation_noised_afresh_takes_a_noise_of_its_own_at_every_forward_as_dmd2s_code_does():
    """distill.dmd_input: generator_fresh. The path starts from its own pure noise and each renoising takes the next
    of its own draws (brute force, sample by sample), so the prediction does not depend on the start's noise (which
    the caller adds at the start time) and differs from the start-noise simulation; the draws come after every other
    draw of the step, which stay as the start-noise input's; a one-step generator draws none."""
    from moh_dit.objectives.distill.dmd2 import DMD2Distill

    objective = DMD2Distill(dmd_steps=[1, 2, 4], dmd_input="generator_fresh")
    assert "; backward simulation, noised afresh" in objective.describe_loss()
    net = _CountingGenerator()
    start = torch.tensor([1.0, 0.25, 0.5, 0.75, 0.25, 1.0])
    noise = torch.randn(6, 1, 2, 2, generator=torch.Generator().manual_seed(0))
    path_noise = objective.path_draws(noise.shape, torch.Generator().manual_seed(1))["path_noise"]
    assert path_noise.shape == (6, 3, 1, 2, 2)  # the longest path (to 0.25 on the four-step grid) has three forwards
    x = objective.backward_simulation(net, noise, start, None, None, contextlib.nullcontext, path_noise)
    for i, s in enumerate(start.tolist()):
        path = objective.paths[s]
        if not path:
            assert torch.all(x[i] == 0)
            continue
        z = path_noise[i, 0]
        for k, now in enumerate(path):
            predicted = z - now * (z + now)
            if k + 1 < len(path):
                z = (1 - path[k + 1]) * predicted + path[k + 1] * path_noise[i, k + 1]
        torch.testing.assert_close(x[i], predicted)
    other = objective.backward_simulation(net, -noise, start, None, None, contextlib.nullcontext, path_noise)
    torch.testing.assert_close(other, x)  # the start's noise is not read along the path
    shared = objective.backward_simulation(net, noise, start, None, None, contextlib.nullcontext)
    assert not torch.allclose(shared[1], x[1])
    x0 = torch.randn(8, 1, 4, 4)
    plain = DMD2Distill(dmd_steps=[1, 2], dmd_input="generator").noised(x0, torch.Generator().manual_seed(3), "cpu")
    fresh = DMD2Distill(dmd_steps=[1, 2], dmd_input="generator_fresh").noised(x0, torch.Generator().manual_seed(3), "cpu")  # fmt: skip
    assert set(fresh.terms) == {*plain.terms, "path_noise"} and fresh.terms["path_noise"].shape == (8, 1, 1, 4, 4)
    for key in plain.terms:
        torch.testing.assert_close(fresh.terms[key], plain.terms[key])
    one = DMD2Distill(dmd_steps=[1], dmd_input="generator_fresh").noised(x0, torch.Generator().manual_seed(3), "cpu")
    assert "path_noise" not in one.terms


@pytest.mark.parametrize(
    ("override", "says"),
    [
        ("distill.real_guidance=0.5", "distill.real_guidance must be a guidance scale >= 1"),
        ("distill.real_guidance_later=0.5", "distill.real_guidance_later must be a guidance scale >= 1"),
        ("distill.real_guidance_later=2", "distill.dmd_steps=[1] has none: give a multi-step grid (e.g. [1, 2])"),
        ("distill.real_guidance_end=0.5", "distill.real_guidance_end must be a guidance scale >= 1"),
        ("distill.real_guidance_ramp=0", "distill.real_guidance_ramp must be a count of training steps >= 1"),
        ("distill.real_guidance_end=3", "distill.real_guidance_end and distill.real_guidance_ramp go together"),
        ("distill.real_guidance_ramp=100", "distill.real_guidance_end and distill.real_guidance_ramp go together"),
        ("distill.fake_guidance=0.5", "distill.fake_guidance must be a guidance scale >= 1"),
        ("distill.fake_guidance_eval=0", "distill.fake_guidance_eval must be a guidance scale >= 1"),
        ("distill.dmd_first_share=1", "distill.dmd_first_share must be a share between 0 and 1"),
        ("distill.dmd_first_share=0", "distill.dmd_first_share must be a share between 0 and 1"),
        ("distill.dmd_first_share=0.75", "distill.dmd_first_share=0.75 shapes the generator's later"),
        ("distill.gan_weight=-0.001", "distill.gan_weight must be a weight >= 0"),
        ("distill.dmd_midpoint=1.0", "distill.dmd_midpoint must be a flow time between 0 and 1"),
        ("distill.dmd_midpoint=0", "distill.dmd_midpoint must be a flow time between 0 and 1"),
        ("distill.vsd_weight=0", "distill.vsd_weight=0 leaves the generator nothing to learn"),
        ("distill.gan_start=-5", "distill.gan_start must be a training step >= 0"),
        ("distill.gan_time=[0.5,0.1]", "distill.gan_time must be [first, last] flow times in (0, 1]"),
        ("distill.gan_time=[0,0.5]", "distill.gan_time must be [first, last] flow times in (0, 1]"),
        ("distill.gan_time=[0.1,0.5,0.9]", "distill.gan_time must be [first, last] flow times in (0, 1]"),
        ("distill.dmd_time_sampling=lognormal", "distill.dmd_time_sampling must be one of uniform, karras"),
        (
            "distill.dmd_time_sampling=karras",  # with dmd_time up to 1: an infinite sigma
            "distill.dmd_time_sampling=karras needs distill.dmd_time's last time below 1",
        ),
        ("distill.regression_distance=lpips", "unknown distill.regression_distance 'lpips'; choose one of mse,"),
        (
            "distill.regression_distance=teacher_features",
            "its settings need DMD's regression on (distill.regression > 0)",
        ),
        ("distill.regression_feature_time=0.1", "its settings need DMD's regression on (distill.regression > 0)"),
    ],
)
def test_a_wrong_dmd2_key_is_refused_in_one_line_that_names_it(override, says, tmp_path):
    from moh_dit.errors import ConfigError
    from moh_dit.training.config import load_config

    config = {"objective": {"name": "distill"}, "distill": {"method": "dmd2"}, "train": {"output_dir": str(tmp_path)}}
    extra = ["distill.dmd_time=[0.02,1.0]"] if override == "distill.dmd_time_sampling=karras" else []
    with pytest.raises(ConfigError, match=re.escape(says)) as caught:
        load_config(config, [*extra, override])
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize(
    ("key", "says"),
    [
        ("fake_updates", "distill.fake_updates must be a count"),
        ("fake_lr", "distill.fake_lr must be a learning rate"),
        ("real_guidance", "distill.real_guidance must be a guidance scale"),
        ("real_guidance_later", "distill.real_guidance_later must be a guidance scale"),
        ("dmd_first_share", "distill.dmd_first_share must be a share"),
        ("real_guidance_end", "distill.real_guidance_end must be a guidance scale"),
        ("real_guidance_ramp", "distill.real_guidance_ramp must be a count of training steps"),
        ("fake_guidance", "distill.fake_guidance must be a guidance scale"),
        ("fake_guidance_eval", "distill.fake_guidance_eval must be a guidance scale"),
        ("gan_start", "distill.gan_start must be a training step"),
        ("dmd_midpoint", "distill.dmd_midpoint must be a flow time"),
    ],
)
def test_a_yaml_true_is_no_number_for_a_dmd2_key(key, says):
    # True == 1 passes every range check; YAML's `true` where a count or a scale belongs is a typo, not 1
    from moh_dit.errors import ConfigError
    from moh_dit.objectives.distill.dmd2 import DMD2Distill

    with pytest.raises(ConfigError, match=re.escape(says)):
        DMD2Distill(**{key: True})


def test_the_discriminators_own_times_are_drawn_in_their_range_and_leave_every_other_draw_as_it_was():
    """distill.gan_time: the real images' times are the same uniform draws mapped onto its range, the generated
    images' own times are drawn after every other draw (so a run without the key draws exactly as before), and the
    discriminator reads the generated images at those times with the VSD loss's noise; without the key it reads the
    VSD loss's noised sample itself."""
    from moh_dit.objectives.distill.dmd2 import DMD2Distill

    x0 = torch.randn(64, 1, 4, 4)
    plain = DMD2Distill(dmd_steps=[1, 2], dmd_input="generator").noised(
        x0, torch.Generator().manual_seed(3), x0.device
    )
    low = DMD2Distill(dmd_steps=[1, 2], dmd_input="generator", gan_time=[0.02, 0.4])
    drawn = low.noised(x0, torch.Generator().manual_seed(3), x0.device)
    assert set(drawn.terms) == {*plain.terms, "gan_t"}
    for key in plain.terms:
        if key != "real_t":
            torch.testing.assert_close(drawn.terms[key], plain.terms[key])
    unit = (plain.terms["real_t"] - 0.02) / 0.96  # the same uniform draws, onto [0.02, 0.4]
    torch.testing.assert_close(drawn.terms["real_t"], 0.02 + 0.38 * unit)
    assert float(drawn.terms["gan_t"].min()) >= 0.02 and float(drawn.terms["gan_t"].max()) <= 0.4
    x = torch.randn_like(x0)
    read, at = DMD2Distill().gan_input(x, plain)  # the VSD loss's noised sample
    t = plain.terms["t"].reshape(-1, 1, 1, 1)
    torch.testing.assert_close(read, (1 - t) * x + t * plain.terms["noise"])
    assert at is plain.terms["t"]
    read, at = low.gan_input(x, drawn)
    gan_t = drawn.terms["gan_t"].reshape(-1, 1, 1, 1)
    torch.testing.assert_close(read, (1 - gan_t) * x + gan_t * drawn.terms["noise"])
    assert at is drawn.terms["gan_t"]
    assert "at flow times (0.02, 0.4)" in DMD2Distill(gan_weight=0.001, gan_time=[0.02, 0.4]).describe_loss()


def test_karras_vsd_times_are_edms_sigmas_uniform_over_their_index_and_leave_every_other_draw_as_it_was():
    """distill.dmd_time_sampling=karras: the VSD loss's times are the flow times of EDM's Karras sigmas (rho 7) between
    the range's ends, drawn uniformly over their index: 1000 evenly spaced draws land on EDM's 1000 discrete sigmas
    (brute force: EDM's formula from the largest sigma down, reversed), their quantiles are the closed form's, and
    every other draw of the step is the uniform law's (the same uniform numbers feed both)."""
    from moh_dit.objectives.distill.dmd2 import DMD2Distill
    from moh_dit.objectives.distill.times import vsd_times

    low, high, n = 0.02, 0.98, 1000
    s_min, s_max = low / (1 - low), high / (1 - high)
    i = torch.arange(n, dtype=torch.float64)
    edm = (s_max ** (1 / 7) + i / (n - 1) * (s_min ** (1 / 7) - s_max ** (1 / 7))) ** 7  # EDM's, largest first
    drawn = vsd_times(i / (n - 1), low, high, "karras")
    torch.testing.assert_close(drawn, (edm / (1 + edm)).flip(0))
    assert float(drawn[0]) == pytest.approx(low) and float(drawn[-1]) == pytest.approx(high)
    assert bool((drawn[1:] > drawn[:-1]).all())  # increasing in the uniform draw
    median = float(vsd_times(torch.tensor([0.5], dtype=torch.float64), low, high, "karras"))
    sigma = ((s_min ** (1 / 7) + s_max ** (1 / 7)) / 2) ** 7
    assert median == pytest.approx(sigma / (1 + sigma)) and median == pytest.approx(0.737, abs=1e-3)
    torch.testing.assert_close(vsd_times(i / n, low, high), low + (high - low) * i / n)  # uniform: as before

    x0 = torch.randn(256, 1, 4, 4)
    plain = DMD2Distill(dmd_steps=[1, 2], dmd_input="generator").noised(
        x0, torch.Generator().manual_seed(5), x0.device
    )
    karras = DMD2Distill(dmd_steps=[1, 2], dmd_input="generator", dmd_time_sampling="karras")
    drawn = karras.noised(x0, torch.Generator().manual_seed(5), x0.device)
    for key in plain.terms:
        if key != "t":
            torch.testing.assert_close(drawn.terms[key], plain.terms[key])
    unit = (plain.terms["t"] - low) / (high - low)
    torch.testing.assert_close(drawn.terms["t"], vsd_times(unit, low, high, "karras"))
    assert float((drawn.terms["t"] > 0.737).float().mean()) == pytest.approx(0.5, abs=0.1)
    assert "(Karras sigmas)" in karras.describe_loss() and "Karras" not in DMD2Distill().describe_loss()


def test_the_real_guidance_and_the_midpoint_are_recorded_and_a_generator_keeps_its_own():
    from moh_dit.errors import ConfigError
    from moh_dit.objectives.distill.dmd2 import DMD2Distill

    plain = DMD2Distill()
    assert "real_guidance" not in plain.record() and "dmd_midpoint" not in plain.record()  # as moh-dit 0.6 wrote it
    own = DMD2Distill(real_guidance=1.0, dmd_midpoint=0.4)
    assert own.record()["real_guidance"] == 1.0 and own.record()["dmd_midpoint"] == 0.4
    again = DMD2Distill.from_record(own.record())
    assert (again.real_guidance, again.dmd_midpoint) == (1.0, 0.4) and again.record() == own.record()
    assert "real score unguided" in again.describe() and "two-step middle 0.4" in again.describe_loss()
    with pytest.raises(ConfigError, match=r"distill.real_guidance=2.0: this generator was trained with 1.0"):
        DMD2Distill.from_record(own.record(), real_guidance=2.0)
    later = DMD2Distill(real_guidance=8.0, real_guidance_later=3.0, dmd_steps=[1, 2])  # the later steps' own scale
    assert later.record()["real_guidance_later"] == 3.0 and "real_guidance_later" not in own.record()
    assert DMD2Distill.from_record(later.record(), dmd_steps=[1, 2]).real_guidance_later == 3.0
    with pytest.raises(ConfigError, match=r"distill.real_guidance_later=1.0: this generator was trained with 3.0"):
        DMD2Distill.from_record(later.record(), dmd_steps=[1, 2], real_guidance_later=1.0)


def test_a_ramped_real_score_scale_moves_linearly_then_holds_and_is_refused_where_it_has_no_one_scale_to_move():
    """distill.real_guidance_end over distill.real_guidance_ramp: the scale at step s is r + (end - r) min(1, s / ramp)
    (closed form), the same at every start time of the grids; the teacher's evaluations per image count two while it is
    guided and one once it reaches 1; recorded, and a record that disagrees is refused naming the key; without
    distill.real_guidance, or beside distill.real_guidance_later, refused in one line."""
    from moh_dit.errors import ConfigError
    from moh_dit.objectives.distill.dmd2 import DMD2Distill

    ramped = DMD2Distill(real_guidance=8.0, real_guidance_end=2.0, real_guidance_ramp=100, dmd_steps=[1, 2])
    for step, scale in ((0, 8.0), (25, 6.5), (50, 5.0), (100, 2.0), (1000, 2.0)):
        assert ramped.real_scales(step) == [scale, scale]
    to_one = DMD2Distill(real_guidance=3.0, real_guidance_end=1.0, real_guidance_ramp=10)
    assert [to_one.teacher_forwards_at(s) for s in (0, 5, 10, 15)] == [2.0, 2.0, 1.0, 1.0]
    assert ramped.record()["real_guidance_end"] == 2.0 and ramped.record()["real_guidance_ramp"] == 100
    again = DMD2Distill.from_record(ramped.record(), dmd_steps=[1, 2])
    assert again.real_scales(50) == [5.0, 5.0] and again.record() == ramped.record()
    with pytest.raises(ConfigError, match=r"distill.real_guidance_ramp=50: this generator was trained with 100"):
        DMD2Distill.from_record(ramped.record(), dmd_steps=[1, 2], real_guidance_ramp=50)
    for options in ({}, {"real_guidance": 8.0, "real_guidance_later": 3.0, "dmd_steps": [1, 2]}):
        with pytest.raises(ConfigError, match=r"moves the one scale distill.real_guidance sets") as caught:
            DMD2Distill(real_guidance_end=2.0, real_guidance_ramp=10, **options)
        assert "\n" not in str(caught.value)


def test_the_real_score_is_the_teacher_at_its_own_guidance_scale():
    """``scale`` replaces the teacher's guidance scale, over its flow times: 1 is its conditional velocity alone."""
    from moh_dit.training.distill.teacher import Teacher, TeacherGuidance, guided_velocity

    from ...helpers.toy_velocity import ToyTeacher

    toy = ToyTeacher()

    class Model(torch.nn.Module):  # a teacher network with a null class, as Teacher reads it
        null_class_id = 3

        def __init__(self):
            super().__init__()
            self.toy = toy

    teacher = Teacher.__new__(Teacher)
    teacher.model, teacher.source, teacher.evaluations = Model(), "toy", 0
    teacher.guidance = TeacherGuidance(3.0, (0.2, 0.9))
    teacher.objective = type("O", (), {"linear_velocity": staticmethod(lambda net, z, t, y: toy(z, t, y))})()
    z, t = torch.randn(4, 2, 4, 4), torch.tensor([0.1, 0.5, 0.7, 0.95])
    labels = torch.tensor([0, 1, 2, 0])
    own = teacher.velocity(z, t, labels, None, contextlib.nullcontext)
    assert teacher.evaluations == 4 + 2  # the two guided rows' unconditional halves
    unguided = teacher.velocity(z, t, labels, None, contextlib.nullcontext, scale=1.0)
    torch.testing.assert_close(unguided, toy(z, t, labels))
    assert teacher.evaluations == 6 + 4
    at_two = teacher.velocity(z, t, labels, None, contextlib.nullcontext, scale=2.0)
    expected = guided_velocity(toy, z, t, labels, None, 3, TeacherGuidance(2.0, (0.2, 0.9)))
    torch.testing.assert_close(at_two, expected)
    torch.testing.assert_close(own, guided_velocity(toy, z, t, labels, None, 3, teacher.guidance))
    assert not torch.allclose(at_two, own)


def test_the_first_share_draws_that_share_from_pure_noise_and_the_costs_weigh_each_start_by_its_share():
    """distill.dmd_first_share: the start times drawn at that share from the first (1), the rest alike over the later
    ones; without it the draws are as before (one per sample, every start alike). The backward simulation's passes
    and the real score's evaluations the study plans by weigh each start time by its share."""
    from moh_dit.objectives.distill.dmd2 import DMD2Distill

    x0 = torch.zeros(20000, 1, 1, 1)
    plain = DMD2Distill(dmd_steps=[1, 2], dmd_input="generator")
    start = plain.noised(x0, torch.Generator().manual_seed(0), x0.device).terms["start"]
    expected = torch.tensor(plain.start_times)[torch.randint(2, (20000,), generator=torch.Generator().manual_seed(0))]
    assert torch.equal(start, expected)  # a run without the key draws exactly as before
    for share in (0.75, 0.25):
        shared = DMD2Distill(dmd_steps=[1, 2, 4], dmd_input="generator", dmd_first_share=share)
        start = shared.noised(x0, torch.Generator().manual_seed(0), x0.device).terms["start"]
        counts = {s: float((start == s).float().mean()) for s in shared.start_times}
        assert sorted(counts) == sorted(shared.start_times) and abs(counts[1.0] - share) < 0.015
        for later in shared.start_times[1:]:  # the rest alike over the three later start times
            assert abs(counts[later] - (1 - share) / 3) < 0.015
        assert shared.start_shares() == pytest.approx([share] + [(1 - share) / 3] * 3)
        paths = [len(shared.paths[s]) for s in shared.start_times]
        assert shared.simulated_forwards() == pytest.approx(sum(p * w for p, w in zip(paths, shared.start_shares())))
    assert plain.simulated_forwards() == 0.5  # half the samples start at the middle, one pass each
    quarter = DMD2Distill(dmd_steps=[1, 2], dmd_input="generator", dmd_first_share=0.75, real_guidance=3.0,
                          real_guidance_later=1.0)  # fmt: skip
    assert quarter.simulated_forwards() == 0.25
    assert quarter.teacher_forwards_at(0) == 0.75 * 2 + 0.25 * 1  # the first step's guided rows, the later's unguided
    assert "0.75 of the samples from pure noise" in quarter.describe_loss()


def test_a_first_share_of_0_puts_every_sample_on_the_leads_later_steps_and_is_refused_without_a_lead():
    """distill.dmd_first_share 0 with the lead's input: every start drawn at the middle, each costing the lead's one
    jump, the real score guided at the first step's scale there as well; without a lead, the generator's own first step
    would never train, so 0 is refused there in one line."""
    from moh_dit.errors import ConfigError
    from moh_dit.objectives.distill.dmd2 import DMD2Distill

    last = DMD2Distill(dmd_steps=[1, 2], dmd_input="lead", lead_model="x", dmd_first_share=0.0, real_guidance=3.0)
    x0 = torch.zeros(1000, 1, 1, 1)
    start = last.noised(x0, torch.Generator().manual_seed(0), x0.device).terms["start"]
    assert torch.equal(start, torch.full_like(start, 0.5))
    assert last.start_shares() == [0.0, 1.0] and last.simulated_forwards() == 1.0
    assert last.teacher_forwards_at(0) == 2.0  # guided at every sample
    assert "none from noise; later steps from the lead x's" in last.describe_loss()
    for dmd_input in ("generator", "data"):
        with pytest.raises(ConfigError, match=r"0 only with distill.dmd_input=lead\) .* got 0.0$") as caught:
            DMD2Distill(dmd_steps=[1, 2], dmd_input=dmd_input, dmd_first_share=0.0)
        assert "\n" not in str(caught.value)
