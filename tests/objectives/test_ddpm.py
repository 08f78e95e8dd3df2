"""DiT's objective against closed forms, hand-computed coefficients and torch.distributions."""

import math

import pytest
import torch
from torch.distributions import Normal, kl_divergence

from moh_dit.objectives.ddpm import DiffusionObjective, discretized_gaussian_log_likelihood, normal_kl

torch.set_default_dtype(torch.float32)


@pytest.fixture(scope="module")
def obj():
    return DiffusionObjective()


def test_schedule_and_hand_checked_coefficients(obj):
    betas = obj.betas
    assert len(betas) == 1000
    assert betas[0].item() == pytest.approx(1e-4) and betas[-1].item() == pytest.approx(0.02)
    # t = 1 by hand: a_bar_0 = 1 - b0, a_bar_1 = (1 - b0)(1 - b1), beta~_1 = b1 (1 - a_bar_0) / (1 - a_bar_1)
    b0, b1 = 1e-4, 1e-4 + (0.02 - 1e-4) / 999
    ab0, ab1 = 1 - b0, (1 - b0) * (1 - b1)
    assert obj.posterior_variance[1].item() == pytest.approx(b1 * (1 - ab0) / (1 - ab1), rel=1e-9)
    assert obj.posterior_variance[0].item() == 0.0
    # the clipped log-variance repeats beta~_1 at t = 0
    assert obj.posterior_log_variance_clipped[0].item() == pytest.approx(math.log(b1 * (1 - ab0) / (1 - ab1)))
    # t = 500 from an explicit product
    ab = 1.0
    for i in range(501):
        ab *= 1 - (1e-4 + (0.02 - 1e-4) * i / 999)
    assert obj.alphas_cumprod[500].item() == pytest.approx(ab, rel=1e-9)
    assert obj.sqrt_recipm1_alphas_cumprod[500].item() == pytest.approx(math.sqrt(1 / ab - 1), rel=1e-9)


def test_add_noise_matches_closed_form(obj):
    x0, noise = torch.randn(4, 3, 5, 5), torch.randn(4, 3, 5, 5)
    t = torch.tensor([0, 10, 500, 999])
    ab = obj.alphas_cumprod[t].float().view(-1, 1, 1, 1)
    torch.testing.assert_close(obj.add_noise(x0, noise, t), ab.sqrt() * x0 + (1 - ab).sqrt() * noise)


def test_normal_kl_matches_torch_distributions():
    m1, m2 = torch.randn(100, dtype=torch.float64), torch.randn(100, dtype=torch.float64)
    lv1, lv2 = torch.randn(100, dtype=torch.float64), torch.randn(100, dtype=torch.float64)
    expected = kl_divergence(Normal(m1, (0.5 * lv1).exp()), Normal(m2, (0.5 * lv2).exp()))
    torch.testing.assert_close(normal_kl(m1, lv1, m2, lv2), expected)


def _exact_discretized_ll(x, mean, log_scale):
    """Exact Gaussian mass of each 1/127.5-wide bin (float64, true normal CDF), edges open-ended."""
    d = Normal(mean.double(), log_scale.double().exp())
    upper = torch.where(x > 0.999, torch.ones_like(x.double()), d.cdf(x.double() + 1 / 255))
    lower = torch.where(x < -0.999, torch.zeros_like(x.double()), d.cdf(x.double() - 1 / 255))
    return torch.log(upper - lower)


def test_discretized_decoder_likelihood_against_exact_cdf():
    levels = torch.linspace(-1, 1, 256)
    x = levels[torch.randint(0, 256, (2000,))]
    mean = x + 0.02 * torch.randn(2000)
    log_scale = torch.full((2000,), math.log(0.03))
    ours = discretized_gaussian_log_likelihood(x, mean, log_scale)
    exact = _exact_discretized_ll(x, mean, log_scale).float()
    # the reference's tanh approximation of the normal CDF agrees to ~0.2% in log-probability
    torch.testing.assert_close(ours, exact, rtol=5e-3, atol=5e-3)


def test_discretized_likelihood_is_a_distribution_over_the_256_levels():
    levels = torch.linspace(-1, 1, 256)
    for mean, scale in [(0.0, 0.1), (0.7, 0.05), (-0.95, 0.3)]:
        ll = discretized_gaussian_log_likelihood(
            levels, torch.full_like(levels, mean), torch.full_like(levels, math.log(scale))
        )
        assert ll.exp().sum().item() == pytest.approx(1.0, abs=1e-4)


def _independent_vb(obj, eps, var_values, x0, xt, t):
    """VB term from the formulas, written with torch.distributions in float64."""
    out = []
    ac = obj.scheduler.alphas_cumprod.double()
    betas = obj.scheduler.betas.double()
    for i in range(x0.shape[0]):
        ti = int(t[i])
        ab, ab_prev = ac[ti], (ac[ti - 1] if ti > 0 else torch.tensor(1.0, dtype=torch.float64))
        beta = betas[ti]
        post_var = beta * (1 - ab_prev) / (1 - ab)
        post_var_1 = betas[1] * (1 - ac[0]) / (1 - ac[1])
        log_post = torch.log(post_var if ti > 0 else post_var_1)

        def mean_of(x_start):
            return (beta * ab_prev.sqrt() / (1 - ab)) * x_start + ((1 - ab_prev) * (1 - beta).sqrt() / (1 - ab)) * xt[
                i
            ].double()

        x0_hat = (xt[i].double() - (1 - ab).sqrt() * eps[i].double()) / ab.sqrt()
        f = (var_values[i].double() + 1) / 2
        log_var = f * torch.log(beta) + (1 - f) * log_post
        if ti == 0:
            nll = -_exact_discretized_ll(x0[i], mean_of(x0_hat), 0.5 * log_var).mean() / math.log(2)
            out.append(nll)
        else:
            kl = kl_divergence(
                Normal(mean_of(x0[i].double()), (0.5 * log_post).exp()), Normal(mean_of(x0_hat), (0.5 * log_var).exp())
            )
            out.append(kl.mean() / math.log(2))
    return torch.stack(out)


def test_vb_term_matches_independent_computation(obj):
    torch.manual_seed(0)
    n = 6
    x0 = torch.linspace(-1, 1, 256)[torch.randint(0, 256, (n, 2, 4, 4))]  # data on the 8-bit grid
    noise = torch.randn_like(x0)
    t = torch.tensor([0, 1, 5, 100, 600, 999])
    xt = obj.add_noise(x0, noise, t)
    eps = noise + 0.1 * torch.randn_like(noise)
    var_values = torch.rand_like(x0) * 2 - 1
    ours = obj.vb_terms_bpd(eps, var_values, x0, xt, t)
    ref = _independent_vb(obj, eps, var_values, x0, xt, t).float()
    torch.testing.assert_close(ours[1:], ref[1:], rtol=1e-3, atol=1e-5)  # KL terms
    torch.testing.assert_close(ours[:1], ref[:1], rtol=2e-2, atol=1e-3)  # decoder NLL (tanh CDF)


def test_perfect_model_has_near_zero_kl(obj):
    x0 = torch.randn(3, 2, 4, 4)
    noise = torch.randn_like(x0)
    t = torch.tensor([10, 300, 900])
    xt = obj.add_noise(x0, noise, t)
    var_values = -torch.ones_like(x0)  # f = 0: the model variance is exactly beta~_t
    vb = obj.vb_terms_bpd(noise, var_values, x0, xt, t)
    assert vb.abs().max().item() < 1e-4


def test_hybrid_loss_and_vb_gradient_reaches_only_variance_channels(obj):
    torch.manual_seed(0)
    x0 = torch.randn(4, 3, 4, 4).clamp(-1, 1)
    noise = torch.randn_like(x0)
    t = torch.tensor([0, 3, 400, 999])
    xt = obj.add_noise(x0, noise, t)
    output = torch.randn(4, 6, 4, 4, requires_grad=True)
    terms = obj.losses(output, x0, xt, t, noise)
    torch.testing.assert_close(terms.mse, ((noise - output[:, :3]) ** 2).mean(dim=(1, 2, 3)))
    torch.testing.assert_close(terms.loss, terms.mse + terms.vb)
    (grad,) = torch.autograd.grad(terms.vb.sum(), output)
    assert torch.count_nonzero(grad[:, :3]) == 0
    assert torch.count_nonzero(grad[:, 3:]) > 0


def test_without_learned_sigma_the_loss_is_plain_mse():
    obj = DiffusionObjective(learn_sigma=False)
    x0, noise = torch.randn(2, 3, 4, 4), torch.randn(2, 3, 4, 4)
    t = torch.tensor([5, 50])
    out = torch.randn(2, 3, 4, 4)
    terms = obj.losses(out, x0, obj.add_noise(x0, noise, t), t, noise)
    assert terms.vb is None
    torch.testing.assert_close(terms.loss, ((out - noise) ** 2).mean(dim=(1, 2, 3)))
    with pytest.raises(ValueError, match="3 output channels"):
        obj.losses(torch.randn(2, 6, 4, 4), x0, x0, t, noise)


def test_min_snr_weights_the_noise_mse_as_diffusers_compute_snr_gives():
    from diffusers.training_utils import compute_snr

    gamma = 5.0
    weighted = DiffusionObjective(snr_gamma=gamma)
    torch.manual_seed(0)
    x0, noise = torch.randn(5, 3, 4, 4).clamp(-1, 1), torch.randn(5, 3, 4, 4)
    t = torch.tensor([0, 10, 100, 500, 999])  # SNR from about 1e4 down to about 4e-5: both sides of gamma
    xt = weighted.add_noise(x0, noise, t)
    output = torch.randn(5, 6, 4, 4)
    plain, terms = DiffusionObjective().losses(output, x0, xt, t, noise), weighted.losses(output, x0, xt, t, noise)
    snr = compute_snr(weighted.scheduler, t).double()  # the library's SNR, then the paper's weight
    expected_w = torch.minimum(snr, torch.full_like(snr, gamma)) / snr
    assert (expected_w[:2] < 0.05).all() and (expected_w[3:] == 1).all()  # weighted down only above gamma
    torch.testing.assert_close(terms.mse, plain.mse)
    torch.testing.assert_close(terms.vb, plain.vb)
    torch.testing.assert_close(terms.loss, expected_w.float() * plain.mse + plain.vb, rtol=1e-5, atol=0)
    eps_only = DiffusionObjective(learn_sigma=False, snr_gamma=gamma)
    out = torch.randn(5, 3, 4, 4)
    torch.testing.assert_close(
        eps_only.losses(out, x0, xt, t, noise).loss, expected_w.float() * ((out - noise) ** 2).mean(dim=(1, 2, 3))
    )
    with pytest.raises(ValueError, match="snr_gamma"):
        DiffusionObjective(snr_gamma=0)


# ----------------------------------------------------------------------------------------------------
# The objective's interface: the draws and numbers of moh-dit 0.3's trainer
# ----------------------------------------------------------------------------------------------------
def test_noised_draws_the_timestep_then_the_noise_as_the_trainer_of_0_3_did():
    from moh_dit.objectives.ddpm import DDPM

    obj, x0 = DDPM(snr_gamma=5.0), torch.randn(4, 1, 8, 8)
    noised = obj.noised(x0, torch.Generator().manual_seed(3), torch.device("cpu"))
    g = torch.Generator().manual_seed(3)  # 0.3's Trainer._micro_step, by hand
    t = torch.randint(0, 1000, (4,), generator=g)
    noise = torch.randn(x0.shape, generator=g)
    assert torch.equal(noised.time, t) and torch.equal(noised.terms["noise"], noise)
    assert torch.equal(noised.x_t, obj.scheduler.add_noise(x0, noise, t))
    output = torch.randn(4, 2, 8, 8)
    assert torch.equal(obj.loss(output, noised).loss, obj.losses(output, x0, noised.x_t, t, noise).loss)
    assert obj.record() is None and DDPM.from_record(None, learn_sigma=False).out_channels(4) == 4


def test_ddpm_samplers_by_name_and_the_error_for_a_flow_sampler():
    from diffusers import DDPMScheduler, DPMSolverMultistepScheduler

    from moh_dit.errors import ConfigError
    from moh_dit.objectives.ddpm import DDPM

    obj = DDPM()
    for name in obj.samplers:
        assert obj.scheduler_name(obj.make_scheduler(name)) == name
    assert isinstance(obj.make_scheduler("ddpm"), DDPMScheduler)
    assert obj.make_scheduler("ddpm").config.variance_type == "learned_range"
    assert isinstance(obj.make_scheduler("dpm-solver"), DPMSolverMultistepScheduler)
    with pytest.raises(ConfigError, match=r"scheduler 'sde' samples flow models; this is a ddpm model"):
        obj.make_scheduler("sde")
    with pytest.raises(ConfigError, match="leave time_shift at 1"):
        obj.set_timesteps(obj.make_scheduler("ddim"), 10, 3.0, "cpu")
    sched = obj.make_scheduler("ddim")
    obj.set_timesteps(sched, 10, 1.0, "cpu")
    t = sched.timesteps[0]
    time, level = obj.step_time(sched, 0, t)
    assert time is t and level.timestep == int(t) == 999


def test_the_linear_paths_input_is_ddpms_at_the_same_noise_level_and_unit_variance_beyond():
    """Inside DiT's schedule ``sqrt(abar_tau) z / (1 - t)`` at the timestep ``tau`` of ``t / (1 - t)``; at ``t = 1``
    (past timestep 999) the noise itself at timestep 999, not the schedule's last input scale divided by zero."""
    from moh_dit.objectives.ddpm import linear_path_input, sigma_of_timestep

    z = torch.randn(3, 1, 4, 4, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    t = torch.tensor([0.3, 0.9, 1.0], dtype=torch.float64)
    model_in, tau = linear_path_input(z, t)
    abar = 1 / (1 + sigma_of_timestep(tau[:2]) ** 2)
    torch.testing.assert_close(model_in[:2], z[:2] * (abar.sqrt() / (1 - t[:2])).view(-1, 1, 1, 1))
    assert float(tau[2]) == 999.0 and torch.equal(model_in[2], z[2])
