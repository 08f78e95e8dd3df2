"""The meanflow method's loss and stabilisers (moh_dit/objectives/distill/losses.py) against NVlabs/FastGen's
``_mf_pred_to_loss`` on fixed inputs (recorded by tests/reference_outputs/record_fastgen.py): ``opt_grad`` with and
without its spatial invariance, other norm constants and powers, the tangent warm-up part-way, ``l2`` warmed up; and
what FastGen does not have: the tangent clamp (FACM's), checked against its closed form."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from moh_dit.errors import ConfigError
from moh_dit.objectives.distill.losses import TangentLoss

HERE = Path(__file__).resolve().parents[2] / "reference_outputs"
REC = load_file(HERE / "fastgen_official.safetensors")
CASES = json.loads((HERE / "fastgen_official.json").read_text())["loss_cases"]


def fastgens_loss(case: dict) -> TangentLoss:
    power = float(case["norm_method"].split("_")[1])
    kind = "opt-grad" if case["loss_type"] == "opt_grad" else "l2"
    return TangentLoss(kind, power, case["norm_const"], case["spatial"], None, case["warmup"])


def derivative_term() -> torch.Tensor:
    return ((REC["t"] - REC["r"]).double().view(-1, 1, 1, 1) * REC["fd"].double()).float()


@pytest.mark.parametrize("name", sorted(CASES))
def test_each_loss_setting_equals_fastgens_loss_weight_tangent_and_gradient(name):
    case = CASES[name]
    loss_fn = fastgens_loss(case)
    u = REC["u"].clone().requires_grad_(True)
    loss, g, weight = loss_fn(u, REC["velocity"], derivative_term(), step=case["it"])
    loss.sum().backward()
    torch.testing.assert_close(loss.double(), REC[f"{name}.loss"], rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(weight, REC[f"{name}.weight"].flatten(), rtol=1e-6, atol=1e-9)
    if case["loss_type"] == "opt_grad":  # FastGen's tangent is the step itself; for l2 it is the target
        torch.testing.assert_close(g, REC[f"{name}.tangent"], rtol=1e-5, atol=1e-6)
    else:
        torch.testing.assert_close(REC["u"].double() + g, REC[f"{name}.tangent"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(u.grad, REC[f"{name}.grad"], rtol=1e-4, atol=1e-6)
    assert loss_fn.warm(case["it"]) == pytest.approx(float(REC[f"{name}.warm"]))


def test_the_warmup_ramps_the_derivative_term_and_nothing_else():
    loss_fn = TangentLoss("l2", warmup=100)
    assert [loss_fn.warm(s) for s in (0, 25, 100, 500, None)] == [0.0, 0.25, 1.0, 1.0, 1.0]
    u, v, d = torch.randn(3, 1, 2, 2), torch.randn(3, 1, 2, 2), torch.randn(3, 1, 2, 2)
    _, at_zero, _ = loss_fn(u, v, d, step=0)
    torch.testing.assert_close(at_zero, (v - u).double())  # the target is the teacher's velocity alone


def test_the_clamp_bounds_each_element_of_the_step_and_leaves_small_ones():
    u = torch.zeros(2, 1, 2, 2, requires_grad=True)
    v = torch.tensor([3.0, 0.5, -0.2, -4.0] * 2).view(2, 1, 2, 2)
    loss, g, _ = TangentLoss("l2", power=0.0, clamp=1.0)(u, v, torch.zeros_like(v))
    torch.testing.assert_close(g.float(), v.clamp(-1, 1))
    loss.sum().backward()
    torch.testing.assert_close(u.grad, -2 * v.clamp(-1, 1))  # the gradient of sum (u - sg(u + g))^2
    unclamped, _, _ = TangentLoss("l2", power=0.0)(u.detach(), v, torch.zeros_like(v))
    assert torch.all(loss.detach() < unclamped)


def test_without_its_stabilisers_the_l2_loss_is_meanflows_adaptively_weighted_error():
    u, v, d = torch.randn(4, 2, 3, 3), torch.randn(4, 2, 3, 3), torch.randn(4, 2, 3, 3)
    loss, _, _ = TangentLoss("l2", 1.0, 0.01)(u, v, d)
    error = ((u - (v - d)) ** 2).flatten(1).sum(1)
    torch.testing.assert_close(loss, error / (error + 0.01), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize(
    "kwargs, said",
    [
        (dict(kind="l1"), "distill.loss"),
        (dict(kind="l2", spatial_invariance=True), "opt-grad"),
        (dict(clamp=0.0), "tangent_clamp"),
        (dict(warmup=-5), "tangent_warmup"),
    ],
)
def test_a_bad_setting_is_one_clear_line(kwargs, said):
    with pytest.raises(ConfigError, match=said):
        TangentLoss(**kwargs)


def test_l2_on_a_config_with_spatial_invariance_names_the_key_to_change():
    """The flow twin's meanflow config takes opt-grad with spatial invariance: distill.loss=l2 there is refused with
    the key that must change with it (spatial_invariance), not with the one being changed."""
    from pathlib import Path

    from moh_dit.errors import ConfigError
    from moh_dit.training.config import load_config

    config = Path(__file__).resolve().parents[3] / "configs" / "fashion_mnist_moh_distill.yaml"
    with pytest.raises(ConfigError, match="with distill.loss=l2 set distill.spatial_invariance=false"):
        load_config(config, ["distill.loss=l2"])
    load_config(config, ["distill.loss=l2", "distill.spatial_invariance=false"])
