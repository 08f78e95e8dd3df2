"""moh-dit's flow matching against what the official SiT and REPA code computed on tiny seeded inputs (recorded by
tests/reference_outputs/record_flow.py from willisma/SiT and sihyun-yu/REPA; only the outputs are kept here):
paths and conversions, both checkpoint formats through the loader, the loss with fixed draws, one velocity,
classifier-free guidance on 3 channels, a whole Euler ODE run, SiT's and REPA's SDE with the noise replayed, and
REPA's Euler and Heun samplers with a guidance interval."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from moh_dit.interop.sit import load_flow_checkpoint, to_flow_state_dict
from moh_dit.objectives.flow import Flow
from moh_dit.objectives.flow_schedulers import noise_from_velocity, path_coefficients
from moh_dit.objectives.noise import flow_sigma
from moh_dit.sampling.guidance import StepEvaluation, guided_output
from moh_dit.sampling.pipeline import MoHDiTPipeline
from moh_dit.sampling.spec import SamplingSpec

HERE = Path(__file__).resolve().parents[1] / "reference_outputs"
REC = load_file(HERE / "flow_official.safetensors")
SETTINGS = json.loads((HERE / "flow_official.json").read_text())
STEPS = SETTINGS["ode_steps"]


def official(prefix: str) -> dict[str, torch.Tensor]:
    return {k[len(prefix) :]: v for k, v in REC.items() if k.startswith(prefix)}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """The official tiny SiT (2C head) and REPA SiT (projector) saved as their train.py saves, loaded by moh-dit."""
    folder = tmp_path_factory.mktemp("official")
    torch.save({"ema": official("sit.model."), "args": None}, folder / "sit.pt")
    torch.save({"ema": official("repa.model."), "steps": 3}, folder / "repa.pt")
    sit, report = load_flow_checkpoint(folder / "sit.pt", "sit", num_heads=4)
    repa, repa_report = load_flow_checkpoint(folder / "repa.pt", "repa", num_heads=4)
    assert report["dropped"] == ["the unused variance half of the output head"]
    assert repa_report["dropped"] == ["12 REPA projector tensors"]
    return sit, repa


def pipe(model, scheduler):
    p = MoHDiTPipeline.build(model, None, {}, scheduler)
    p.set_progress_bar_config(disable=True)
    return p


# ----------------------------------------------------------------------------------------------------
# Paths and conversions (SiT's time t = 1 - s, its velocity -v)
# ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("path", ["linear", "gvp"])
def test_paths_and_targets_equal_sits_plans(path):
    noise, data, t = REC["sit.paths.x0"], REC["sit.paths.x1"], REC["sit.paths.t"]
    ours = Flow(path).interpolate(data, 1 - t, noise)
    torch.testing.assert_close(ours.x_t, REC[f"sit.{path}.xt"], rtol=0, atol=1e-6)
    torch.testing.assert_close(ours.terms["velocity"], -REC[f"sit.{path}.ut"], rtol=0, atol=1e-6)


@pytest.mark.parametrize("path", ["linear", "gvp"])
def test_noise_and_score_from_a_velocity_equal_sits_conversions(path):
    t = torch.tensor([0.1, 0.3, 0.5, 0.7, 0.9]).reshape(-1, 1, 1, 1)
    x, u = REC[f"sit.{path}.xt"], REC[f"sit.{path}.velocity"]
    eps = noise_from_velocity(-u, x, 1 - t, path)
    torch.testing.assert_close(eps, REC[f"sit.{path}.noise"], rtol=1e-5, atol=1e-5)
    _, b, _, _ = path_coefficients(1 - t, path)
    torch.testing.assert_close(-eps / b, REC[f"sit.{path}.score"], rtol=1e-5, atol=1e-5)
    if path == "linear":  # at the noise end (SiT's t = 0) the score of the linear path is -x
        x1, x0 = REC["sit.paths.x1"], REC["sit.paths.x0"]
        score = -noise_from_velocity(-x1, x0, torch.ones(5, 1, 1, 1), "linear")
        torch.testing.assert_close(score, REC["sit.linear.score_at_noise"], rtol=0, atol=1e-6)


# ----------------------------------------------------------------------------------------------------
# The networks: one velocity, guidance, the loss, and the way back to their layouts
# ----------------------------------------------------------------------------------------------------
def test_one_velocity_of_each_official_model(models):
    sit, repa = models
    for model, prefix in ((sit, "sit"), (repa, "repa")):
        x, t, y = REC[f"{prefix}.forward.x"], REC[f"{prefix}.forward.t"], REC[f"{prefix}.forward.y"]
        with torch.no_grad():
            out = model(x, t, y).sample
        torch.testing.assert_close(out, REC[f"{prefix}.forward.out"], rtol=1e-5, atol=1e-6)


def test_guidance_on_three_channels_equals_sits_forward_with_cfg(models):
    sit, _ = models
    half, t = REC["sit.forward.x"][:3], REC["sit.forward.t"][:3]
    with torch.no_grad():
        how = StepEvaluation(scale=2.5, channels=3)
        guided = guided_output(pipe(sit, "euler").transformer, half, t, torch.tensor([0, 1, 2]), how)
    torch.testing.assert_close(guided, REC["sit.cfg.out"][:3], rtol=1e-5, atol=1e-6)


def test_the_loss_with_fixed_draws_equals_sits_and_repas(models):
    sit, repa = models
    flow = Flow("linear", "sit")
    noised = flow.interpolate(REC["sit.loss.data"], 1 - REC["sit.loss.t"], REC["sit.loss.noise"])
    with torch.no_grad():
        out = sit(noised.x_t, noised.time, torch.tensor([0, 1, 2, 0, 1, 2])).sample
    torch.testing.assert_close(flow.loss(out, noised).loss, REC["sit.loss.values"], rtol=1e-5, atol=1e-7)
    flow = Flow("linear", "repa")
    for weighting in ("uniform", "lognormal"):
        noised = flow.interpolate(
            REC["repa.loss.data"], REC[f"repa.loss.{weighting}.t"], REC[f"repa.loss.{weighting}.noise"]
        )
        with torch.no_grad():
            out = repa(noised.x_t, noised.time, REC["repa.forward.y"]).sample
        torch.testing.assert_close(
            flow.loss(out, noised).loss, REC[f"repa.loss.{weighting}.values"], rtol=1e-5, atol=1e-7
        )


def test_back_to_sits_and_repas_layouts(models):
    sit, repa = models
    back = to_flow_state_dict(sit, "sit")
    original = official("sit.model.")
    assert back.keys() == original.keys()
    c, p = 4, 2
    for key, value in back.items():
        if key.startswith("final_layer.linear"):  # the variance half comes back as zeros (it was never used)
            per = value.reshape(p * p, 2 * c, *value.shape[1:])
            torch.testing.assert_close(per[:, :c], original[key].reshape(p * p, 2 * c, *value.shape[1:])[:, :c])
            assert not per[:, c:].any()
        else:
            assert torch.equal(value, original[key]), key
    repa_back = to_flow_state_dict(repa, "repa")
    assert all(torch.equal(v, REC[f"repa.model.{k}"]) for k, v in repa_back.items())
    assert not any(k.startswith("projectors") for k in repa_back)
    from moh_dit.errors import ConversionError

    with pytest.raises(ConversionError, match="train in objective.convention=repa to export to repa"):
        to_flow_state_dict(sit, "repa")
    from moh_dit.interop.official import check_ddpm_export

    # DiT's code and diffusers' DiTPipeline would sample a flow model as DDPM: refused, with where it can go
    with pytest.raises(ConversionError, match=r"samples every checkpoint as DiT's DDPM.*flow matching.*--to sit"):
        check_ddpm_export(sit, "DiT's and MoH-DiT's code")


# ----------------------------------------------------------------------------------------------------
# Whole sampling runs
# ----------------------------------------------------------------------------------------------------
def test_a_euler_ode_run_equals_sits_sample_ode(models):
    sit, _ = models
    spec = SamplingSpec.create("euler", STEPS, 1.0)
    x = pipe(sit, "euler")([0, 1, 2], latents=REC["sit.ode.noise"], sampling=spec, output_type="latent").images
    torch.testing.assert_close(x, REC["sit.ode.x"], rtol=1e-5, atol=1e-5)


def test_an_sde_run_equals_sits_sample_sde_with_its_noise_replayed(models):
    sit, _ = models
    spec = SamplingSpec.create("sde", STEPS, 1.0)
    generator = torch.Generator().manual_seed(SETTINGS["sde_seed"])  # SiT draws from the seeded CPU generator
    x = pipe(sit, "sde")(
        [0, 1, 2], latents=REC["sit.ode.noise"], sampling=spec, generator=generator, output_type="latent"
    )
    torch.testing.assert_close(x.images, REC["sit.sde.x"], rtol=1e-5, atol=1e-5)


def test_repas_euler_and_heun_samplers_with_a_guidance_interval(models):
    _, repa = models
    noise, labels = REC["repa.samplers.noise"], [0, 1, 2]
    # REPA guides while t <= 0.7: the noise levels up to that of s = 0.7
    euler = SamplingSpec.create("euler", STEPS, 2.0, guidance_noise=(0.0, flow_sigma(0.7)))
    x = pipe(repa, "euler")(labels, latents=noise, sampling=euler, output_type="latent").images
    torch.testing.assert_close(x, REC["repa.euler.x"].float(), rtol=1e-5, atol=1e-5)
    # REPA decides a Heun step's guidance by the step's start for both of its evaluations, moh-dit by each
    # evaluation's own noise level: they agree where no step straddles an end of the interval, as with guidance at
    # every step (recorded so)
    heun = SamplingSpec.create("heun", STEPS, 2.0)
    x = pipe(repa, "heun")(labels, latents=noise, sampling=heun, output_type="latent").images
    torch.testing.assert_close(x, REC["repa.heun.x"].float(), rtol=1e-5, atol=1e-5)


def test_repas_sde_sampler_with_its_noise_replayed(models, monkeypatch):
    import moh_dit.objectives.flow_schedulers as schedulers

    _, repa = models
    draws = list(REC["repa.sde.noise"].float())  # REPA draws float64 noise; its values, replayed
    monkeypatch.setattr(schedulers, "randn_tensor", lambda shape, **kw: draws.pop(0))
    spec = SamplingSpec.create("sde", STEPS, 2.0, guidance_noise=(0.0, flow_sigma(0.7)))
    x = pipe(repa, "sde")([0, 1, 2], latents=REC["repa.samplers.noise"], sampling=spec, output_type="latent").images
    assert not draws  # one draw per stochastic step, none for the last
    torch.testing.assert_close(x, REC["repa.sde.x"].float(), rtol=1e-5, atol=1e-5)
