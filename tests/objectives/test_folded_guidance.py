"""Guidance folded into the training target (moh_dit/objectives/folded_guidance.py), shared by DDPM, flow and MeanFlow:
the mix on the guided rows only, its fixed point (classifier-free guidance of scale omega / (1 - kappa)), the warm-up,
DDPM's and flow's losses against the guided target built by hand, with no gradient through the predictions, and the
checks of its settings."""

import pytest
import torch

from moh_dit.errors import ConfigError
from moh_dit.objectives.ddpm import DDPM, sigma_of_timestep
from moh_dit.objectives.flow import Flow
from moh_dit.objectives.folded_guidance import FoldedGuidance

from ..helpers.factories import tiny_model


def no_autocast():
    return torch.autocast("cpu", enabled=False)


def test_the_mix_applies_to_the_guided_rows_only():
    g = torch.Generator().manual_seed(0)
    target, uncond, cond = (torch.randn(6, 2, generator=g) for _ in range(3))
    labels, null = torch.tensor([0, 1, 2, 0, 1, 2]), 3
    t = torch.tensor([0.1, 0.5, 0.9, 0.5, 0.5, 0.95])
    drop = torch.tensor([0, 0, 0, 1, 0, 0])
    guidance = FoldedGuidance.create(scale=1.5, mix=0.4, times=[0.2, 0.9], warmup=10)
    rows = guidance.rows(t, drop, step=10)
    assert rows.tolist() == [1, 2, 4]  # inside the times, label kept
    assert guidance.rows(t, drop, step=9).numel() == 0  # the warm-up: not yet

    def predict(index, y):  # the unconditional half first, then the conditional one
        assert torch.equal(y, torch.cat([torch.full((3,), null), labels[rows]]))
        return torch.cat([uncond[index[:3]], cond[index[3:]]])

    folded = guidance.fold(target, rows, labels, null, predict)
    expected = target.clone()
    expected[rows] = 1.5 * target[rows] + (1 - 1.5 - 0.4) * uncond[rows] + 0.4 * cond[rows]
    torch.testing.assert_close(folded, expected)
    plain = FoldedGuidance.create(scale=2.0).fold(target, rows, labels, null, lambda i, y: uncond[i])
    torch.testing.assert_close(plain[rows], uncond[rows] + 2.0 * (target[rows] - uncond[rows]))


@pytest.mark.parametrize("omega,kappa", [(1.0, 0.5), (2.0, 0.0), (1.0, 0.75), (1.5, 0.2)])
def test_its_fixed_point_is_classifier_free_guidance_of_scale_omega_over_one_minus_kappa(omega, kappa):
    """A network that regresses on the folded target, its own conditional prediction inside it, settles where its
    conditional prediction is CFG of scale omega / (1 - kappa) on the true conditional and unconditional ones (Model
    Guidance's w is kappa with omega 1)."""
    g = torch.Generator().manual_seed(1)
    true_cond, true_uncond = torch.randn(4, generator=g), torch.randn(4, generator=g)
    guidance = FoldedGuidance.create(scale=omega, mix=kappa)
    mine = true_cond.clone()
    for _ in range(200):  # the regression's fixed-point iteration: the prediction becomes the target's mean
        mine = guidance.fold(
            true_cond[None], torch.tensor([0]), torch.tensor([0]), 1,
            lambda index, y: torch.cat([true_uncond[None], mine[None]]) if kappa > 0 else true_uncond[None],
        )[0]  # fmt: skip
    assert guidance.effective_scale == pytest.approx(omega / (1 - kappa))
    torch.testing.assert_close(mine, true_uncond + guidance.effective_scale * (true_cond - true_uncond))


def guided_by_hand(objective, model, noised, labels, term, prediction):
    """The guided target as the formula says, with the model's predictions computed here."""
    folded = objective.folded
    rows = folded.rows(objective.flow_times(noised), torch.zeros_like(labels), None)
    with torch.no_grad():
        nulls = torch.full_like(labels, model.null_class_id)
        kept = torch.zeros_like(labels)  # the labels as given (no random dropout in training mode)
        uncond = prediction(model(noised.x_t, noised.time, nulls, force_drop_ids=kept).sample, noised)
        cond = prediction(model(noised.x_t, noised.time, labels, force_drop_ids=kept).sample, noised)
    target = noised.terms[term].clone()
    target[rows] = (
        folded.omega * target[rows] + (1 - folded.omega - folded.kappa) * uncond[rows] + folded.kappa * cond[rows]
    )
    return target, rows


@pytest.mark.parametrize("name", ["ddpm", "flow", "flow-x"])
def test_ddpm_and_flow_regress_on_the_guided_target_without_gradient_through_it(name):
    torch.manual_seed(0)
    settings = dict(guidance_scale=1.0, guidance_mix=0.5, guidance_times=[0.3, 0.7])
    if name == "ddpm":
        objective, model = DDPM(**settings), tiny_model(signal=0.3)
    else:
        prediction = "x" if name == "flow-x" else "velocity"
        objective = Flow(prediction=prediction, **settings)
        model = tiny_model(signal=0.3, **objective.model_config())
    model.train()
    g = torch.Generator().manual_seed(3)
    x0, labels = torch.randn(6, 1, 8, 8, generator=g), torch.tensor([0, 1, 2, 0, 1, 2])
    noised = objective.noised(x0, g, "cpu")
    if name == "ddpm":
        term = "noise"

        def prediction(out, n):
            return out[:, :1]
    else:
        term = "velocity"

        def prediction(out, n):
            return objective.velocity_of(out, n.x_t, n.terms["s"])

    target, rows = guided_by_hand(objective, model, noised, labels, term, prediction)
    assert 0 < rows.numel() < 6  # some samples outside the guided times keep their target
    losses, out = objective.forward_losses(model, noised, labels, torch.zeros_like(labels), False, no_autocast)
    torch.testing.assert_close(noised.terms[term], target, rtol=1e-5, atol=1e-5)
    # the loss regresses on the guided target as a constant: its gradient is the plain loss's with that target
    model.zero_grad()
    losses.loss.mean().backward()
    folded_grad = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    model.zero_grad()
    out = model(noised.x_t, noised.time, labels, force_drop_ids=torch.zeros_like(labels)).sample
    objective.loss(out.float(), noised).loss.mean().backward()
    for a, b in zip(folded_grad, [p.grad for p in model.parameters() if p.grad is not None]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert objective.record()["guidance_mix"] == 0.5 and "CFG 2" in objective.describe()


def test_ddpm_guides_at_the_flow_times_of_its_noise_levels():
    objective = DDPM(guidance_scale=2.0, guidance_times=[0.0, 0.5])
    t = torch.tensor([0, 100, 500, 999])
    noised = type("N", (), {"terms": {"t": t}})()
    sigma = sigma_of_timestep(t.double())
    torch.testing.assert_close(objective.flow_times(noised).double(), sigma / (1 + sigma), rtol=1e-6, atol=1e-6)
    assert DDPM().record() is None and DDPM(guidance_scale=1.0).record() is None  # off: DiT's model, unchanged


def test_bad_settings_are_one_line_each():
    with pytest.raises(ConfigError, match="objective.guidance_mix \\(kappa\\) must be a number in"):
        FoldedGuidance.create(mix=1.0)
    with pytest.raises(ConfigError, match="objective.guidance_times must satisfy"):
        FoldedGuidance.create(times=[0.8, 0.2])
    with pytest.raises(ConfigError, match="objective.guidance_warmup must be a number of steps"):
        FoldedGuidance.create(warmup=-1)
    with pytest.raises(ConfigError, match="objective.guidance_source must be one of model, ema"):
        FoldedGuidance.create(source="teacher")
    with pytest.raises(ConfigError, match="needs label dropout"):
        FoldedGuidance.create(scale=2.0).fold(torch.zeros(2), torch.tensor([0]), torch.tensor([0, 1]), None, None)


def test_the_logged_flops_count_the_passes_folded_guidance_adds():
    """A training step's forwards per image (TFLOP/s and MFU in the logs): 3 without folded guidance; the
    unconditional prediction adds one, with kappa the conditional one too; MeanFlow's JVP step counts them the same."""
    from moh_dit.objectives.meanflow import MeanFlow

    assert DDPM().training_forwards() == Flow().training_forwards() == 3.0
    assert DDPM(guidance_scale=2.0).training_forwards() == Flow(guidance_scale=2.0).training_forwards() == 4.0
    assert Flow(guidance_scale=2.0, guidance_mix=0.5).training_forwards() == 5.0
    assert MeanFlow().training_forwards() == 4.0
    assert MeanFlow(guidance_scale=2.0, guidance_mix=0.5).training_forwards() == 6.0
