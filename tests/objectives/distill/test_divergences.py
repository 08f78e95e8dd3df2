"""The divergences a DMD2 generator follows (moh_dit/objectives/distill/divergences.py): each weight h(r) against
f''(r) r^2 differentiated from the divergence's own f, the batch normalisation (finite where exp(logit) is not), the
generator's loss weighted sample by sample by the discriminator's logits that its GAN term reads (VSD alone until the
discriminator trains), and every wrong setting refused in one line that names the key."""

from __future__ import annotations

import contextlib
import math
import re

import pytest
import torch
import torch.nn.functional as F

from moh_dit.errors import ConfigError
from moh_dit.objectives.base import Noised
from moh_dit.objectives.distill.divergences import DIVERGENCES, vsd_divergence
from moh_dit.objectives.distill.dmd2 import DMD2Distill

# each divergence's generator f of D_f(p || q) = E_q f(p / q), written out here apart from the module
GENERATORS = {
    "reverse_kl": lambda r: -torch.log(r),
    "js": lambda r: r * torch.log(r) - (r + 1) * torch.log((r + 1) / 2),
    "forward_kl": lambda r: r * torch.log(r),
}


def test_every_divergence_has_its_generator_written_out_here():
    assert set(GENERATORS) == set(DIVERGENCES)


@pytest.mark.parametrize("name", sorted(GENERATORS))
def test_each_weight_is_the_second_derivative_of_its_f_times_the_ratio_squared(name):
    r = torch.tensor([0.05, 0.3, 1.0, 2.5, 40.0], dtype=torch.float64, requires_grad=True)
    (first,) = torch.autograd.grad(GENERATORS[name](r).sum(), r, create_graph=True)
    (second,) = torch.autograd.grad(first.sum(), r)
    h = DIVERGENCES[name]().log_weight(torch.log(r.detach())).exp()
    torch.testing.assert_close(h, second * r.detach() ** 2, rtol=1e-10, atol=1e-12)


def test_the_weights_are_divided_by_their_batch_mean_and_stay_finite_past_exps_range():
    logits = torch.tensor([[-3.0], [0.0], [2.0], [1.5]])
    js = vsd_divergence("js", gan_weight=1e-3).weights(logits)
    torch.testing.assert_close(js, torch.sigmoid(logits.flatten()) / torch.sigmoid(logits.flatten()).mean())
    forward = vsd_divergence("forward_kl", gan_weight=1e-3).weights(logits)
    torch.testing.assert_close(forward, logits.flatten().exp() / logits.flatten().exp().mean())
    huge = vsd_divergence("forward_kl", gan_weight=1e-3).weights(torch.tensor([900.0, 899.0, -900.0]))
    assert torch.isfinite(huge).all() and math.isclose(huge.sum().item(), 3.0, rel_tol=1e-6)
    torch.testing.assert_close(huge[:2], 3 * torch.softmax(torch.tensor([1.0, 0.0]), 0))
    assert torch.equal(vsd_divergence("reverse_kl").weights(logits), torch.ones(4))


class _Discriminator:
    """A fake score whose discriminator returns fixed logits (N, 1), counting its calls."""

    def __init__(self, logits: torch.Tensor) -> None:
        self.logits, self.calls = logits, 0

    def discriminate(self, z, t, labels, drop, autocast):
        self.calls += 1
        return self.logits + 0 * z.flatten(1).sum(1, keepdim=True)  # a gradient path to the sample, as the real one


def _generator_loss(objective: DMD2Distill, logits: torch.Tensor, step: int):
    n = logits.shape[0]
    x = torch.randn(n, 1, 4, 4, generator=torch.Generator().manual_seed(0), requires_grad=True)
    terms = {"start": torch.ones(n), "t": torch.full((n,), 0.5), "noise": torch.zeros(n, 1, 4, 4)}
    objective.generate = lambda *args, **kwargs: (x, None)
    vsd = (x**2).flatten(1).mean(1)  # a per-sample loss with its gradient, in place of the scores' VSD
    objective.distribution_loss = lambda *args, **kwargs: vsd
    fake = _Discriminator(logits)
    losses, _ = objective._generator_losses(
        None, Noised(x, None, terms), None, None, False, contextlib.nullcontext, {"teacher": None},
        {"fake_score": fake}, step,
    )  # fmt: skip
    return losses, vsd.detach(), fake.calls


def test_the_generators_loss_weighs_each_samples_vsd_by_its_discriminator_logit_once_the_gan_trains():
    logits = torch.tensor([[-2.0], [0.5], [3.0]])
    objective = DMD2Distill(gan_weight=0.01, gan_start=5, vsd_divergence="js")
    losses, vsd, calls = _generator_loss(objective, logits, step=5)
    weights = torch.sigmoid(logits.flatten()) / torch.sigmoid(logits.flatten()).mean()
    torch.testing.assert_close(losses.loss, vsd * weights + 0.01 * F.softplus(-logits.flatten()))
    assert calls == 1  # the GAN term's pass is the one the weights read
    torch.testing.assert_close(losses.extras["vsd_loss"], vsd)  # logged unweighted
    before, vsd, calls = _generator_loss(objective, logits, step=4)  # the discriminator not yet trained: VSD
    assert torch.equal(before.loss, vsd) and calls == 0


def test_reverse_kl_leaves_the_generators_loss_as_vsd_plus_the_gan_term():
    logits = torch.tensor([[-2.0], [0.5], [3.0]])
    losses, vsd, _ = _generator_loss(DMD2Distill(gan_weight=0.01), logits, step=0)
    torch.testing.assert_close(losses.loss, vsd + 0.01 * F.softplus(-logits.flatten()), rtol=0, atol=0)


@pytest.mark.parametrize(
    ("overrides", "says"),
    [
        (
            ["distill.vsd_divergence=kl"],
            "unknown distill.vsd_divergence 'kl'; choose one of reverse_kl, js, forward_kl",
        ),
        (
            ["distill.vsd_divergence=js"],
            "distill.vsd_divergence=js weighs VSD by the GAN discriminator's density ratio",
        ),
        (
            ["distill.vsd_divergence=forward_kl", "distill.gan_weight=0.001", "distill.gan_time=[0.02,0.4]"],
            "distill.vsd_divergence=forward_kl reads the density ratio at the VSD loss's own noised samples",
        ),
        (
            ["distill.method=sid", "distill.vsd_divergence=js", "distill.gan_weight=0.001"],
            "distill.vsd_divergence: not an option of distill.method=sid",
        ),
    ],
)
def test_a_wrong_divergence_is_refused_in_one_line_that_names_the_key(overrides, says, tmp_path):
    from moh_dit.training.config import load_config

    config = {"objective": {"name": "distill"}, "distill": {"method": "dmd2", "teacher": "runs/x"},
              "train": {"output_dir": str(tmp_path)}}  # fmt: skip
    with pytest.raises(ConfigError, match=re.escape(says)) as caught:
        load_config(config, overrides)
    assert "\n" not in str(caught.value)
