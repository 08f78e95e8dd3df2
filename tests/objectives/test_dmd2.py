"""DMD2's losses (moh_dit/objectives/dmd_losses.py) against NVlabs/FastGen's ``common_loss.py`` on fixed inputs
(recorded by tests/reference_outputs/record_fastgen_dmd.py): the variational score distillation loss and its gradient
(with and without a per-sample scale), the non-saturating GAN losses and their gradients, and the fake score's
denoising loss as the flow objective computes it (FastGen's ``flow`` prediction), with its gradient."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from moh_dit.objectives.dmd_losses import gan_discriminator_loss, gan_generator_loss, vsd_loss
from moh_dit.objectives.flow import Flow

REC = load_file(Path(__file__).resolve().parents[1] / "reference_outputs" / "fastgen_dmd.safetensors")


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
    from moh_dit.objectives.dmd2 import DMD2Distill

    objective = DMD2Distill(fake_updates=4)
    assert [objective.updates(s) for s in range(6)] == ["student", *["fake_score"] * 4, "student"]
    assert objective.frozen_models_for({"regression": 0.0}) == ("teacher",)
    assert objective.frozen_models_for({"regression": 0.5}) == ("teacher", "trajectories")
