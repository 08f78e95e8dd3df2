"""A hand-off (moh_dit/sampling/leads.py): the lead model's first steps then the main model's, against the two jumps
composed by hand; a lead of the same weights draws exactly the images of none; a lead that cannot start the main
model's images, a lead with too many steps, with a guide or a cache, each one line before any image; a sample set
names its lead's weights; the spec records, tags and says its lead, and the command line builds it."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest
import torch

from moh_dit.errors import ArtifactError, ConfigError
from moh_dit.objectives import objective_of
from moh_dit.sampling.spec import SamplingSpec
from tests.helpers.factories import tiny_model, tiny_pipeline

MEANFLOW = {"name": "meanflow", "guidance_scale": 1.0, "guidance_mix": 0.0, "guidance_times": [0.0, 1.0]}


def meanflow_model(seed: int):
    return tiny_model(signal=0.1, learn_sigma=False, objective=MEANFLOW, time_inputs=2, seed=seed).eval()


@torch.no_grad()
def jump(model, x: torch.Tensor, t: float, r: float, y: torch.Tensor) -> torch.Tensor:
    """A flow map's jump from ``t`` to ``r``, by its objective's average velocity: ``x - (t - r) u(x, t, r)``."""
    ones = torch.ones(len(x))
    return x - (t - r) * objective_of(model).average_velocity(model, x, t * ones, r * ones, y).sample


def test_the_lead_takes_the_first_step_and_the_model_the_second_as_composed_by_hand(tmp_path):
    main, lead = meanflow_model(0), meanflow_model(3)
    lead.save_pretrained(tmp_path / "lead")
    pipe = tiny_pipeline(main, scheduler="meanflow")
    z, y = torch.randn(3, 1, 8, 8, generator=torch.Generator().manual_seed(0)), torch.tensor([0, 1, 2])
    spec = SamplingSpec.create("meanflow", 2, 1.0, lead_model=str(tmp_path / "lead"))
    out = pipe(y.tolist(), sampling=spec, latents=z, output_type="latent", progress=False).images
    by_hand = jump(main, jump(lead, z, 1.0, 0.5, y), 0.5, 0.0, y)
    torch.testing.assert_close(out, by_hand, rtol=1e-5, atol=1e-5)
    alone = pipe(y.tolist(), sampling=spec.replace(lead_model=None), latents=z, output_type="latent", progress=False)
    torch.testing.assert_close(alone.images, jump(main, jump(main, z, 1.0, 0.5, y), 0.5, 0.0, y), rtol=1e-5, atol=1e-5)
    # two of three steps by the lead: its jumps to 2/3 and 1/3, then the model's
    three = pipe(y.tolist(), sampling=SamplingSpec.create("meanflow", 3, 1.0, lead_model=str(tmp_path / "lead"),
                                                         lead_steps=2), latents=z, output_type="latent", progress=False)  # fmt: skip
    middle = jump(lead, jump(lead, z, 1.0, 2 / 3, y), 2 / 3, 1 / 3, y)
    torch.testing.assert_close(three.images, jump(main, middle, 1 / 3, 0.0, y), rtol=1e-5, atol=1e-5)


def test_each_model_steps_with_its_own_scheduler_and_the_models_starts_where_the_lead_stopped(tmp_path):
    """A renoising generator (DMD2's sampler) led by a deterministic flow map: the lead jumps to the middle as it does
    alone, and the generator's scheduler takes its second interval, not its first again. A flow model led by another
    on Euler's grid: the lead's Euler step, then the model's from there."""
    from moh_dit.objectives.flow_schedulers import MeanFlowScheduler

    main, lead = meanflow_model(0), meanflow_model(3)
    lead.save_pretrained(tmp_path / "lead")
    pipe = tiny_pipeline(main, scheduler="meanflow")
    pipe.scheduler = MeanFlowScheduler(num_train_timesteps=1000, renoise=True)  # the generator's own sampler
    z, y = torch.randn(2, 1, 8, 8, generator=torch.Generator().manual_seed(1)), torch.tensor([0, 2])
    spec = SamplingSpec.create("meanflow", 2, 1.0, lead_model=str(tmp_path / "lead"))
    out = pipe(y.tolist(), sampling=spec, latents=z, output_type="latent", progress=False).images
    # the generator's last step from 1/2 predicts the data: x - 1/2 u(x, 1/2 -> 0), the flow map's jump to 0
    torch.testing.assert_close(out, jump(main, jump(lead, z, 1.0, 0.5, y), 0.5, 0.0, y), rtol=1e-5, atol=1e-5)

    flow = {"name": "flow", "path": "linear", "convention": "moh-dit"}
    main, lead = (tiny_model(signal=0.1, learn_sigma=False, objective=flow, seed=s).eval() for s in (0, 4))
    lead.save_pretrained(tmp_path / "flow-lead")
    pipe = tiny_pipeline(main, scheduler="euler")
    spec = SamplingSpec.create("euler", 3, 1.0, lead_model=str(tmp_path / "flow-lead"))
    out = pipe(y.tolist(), sampling=spec, latents=z, output_type="latent", progress=False).images
    pipe.scheduler.set_timesteps(sigmas=[1.0, 2 / 3, 1 / 3])  # the grid the spec puts it on (no shift)
    times, x = pipe.scheduler.sigmas.tolist(), z
    with torch.no_grad():
        for i, (now, then) in enumerate(zip(times[:-1], times[1:])):
            net = lead if i == 0 else main
            x = x + (then - now) * net(x, torch.full((2,), now * 1000), y).sample
    torch.testing.assert_close(out, x, rtol=1e-4, atol=1e-5)


def test_a_lead_of_the_same_weights_draws_exactly_the_images_of_none_and_a_sample_set_names_its_lead(tmp_path):
    from moh_dit.sampling.generation import GenerationSettings, generate_samples

    pipe = tiny_pipeline(tiny_model(signal=0.1), scheduler="ddim")
    pipe.transformer.save_pretrained(tmp_path / "same")
    base = SamplingSpec.create("ddim", 3, 2.0)

    def draw(folder, spec):
        return generate_samples(pipe, tmp_path / folder, GenerationSettings(4, 0, 4, sampling=spec))

    led, plain = draw("led", base.replace(lead_model=str(tmp_path / "same"))), draw("plain", base)
    assert np.array_equal(np.load(led)["arr_0"], np.load(plain)["arr_0"])
    identity = json.loads(str(np.load(led)["moh_dit_manifest"]))["identity"]
    assert identity["lead"]["steps"] == 1 and identity["lead"]["transformer_sha256"]
    assert "lead" not in json.loads(str(np.load(plain)["moh_dit_manifest"]))["identity"]
    tiny_model(signal=0.1, seed=9).save_pretrained(tmp_path / "other")  # other weights: another set, never resumed
    with pytest.raises(ArtifactError, match="lead.transformer_sha256"):
        draw("led", base.replace(lead_model=str(tmp_path / "other")))


def test_a_lead_that_cannot_start_the_images_is_one_line_before_any_image(tmp_path):
    pipe = tiny_pipeline(meanflow_model(0), scheduler="meanflow")
    meanflow_model(1).save_pretrained(tmp_path / "fine")
    tiny_model(signal=0.1, learn_sigma=False, objective=MEANFLOW, time_inputs=2, num_classes=5).save_pretrained(
        tmp_path / "classes"
    )
    flow = {"name": "flow", "path": "linear", "convention": "moh-dit"}
    tiny_model(signal=0.1, learn_sigma=False, objective=flow).save_pretrained(tmp_path / "flow")
    drawn = []
    pipe.transformer.register_forward_hook(lambda *_: drawn.append(1))
    for name, why in [("classes", r"num_classes 5 \(the main model: 3\)"), ("flow", "not sampled by .* meanflow")]:
        spec = SamplingSpec.create("meanflow", 2, 1.0, lead_model=str(tmp_path / name))
        with pytest.raises(ConfigError, match=f"the lead model .*{name} cannot take the first steps .*{why}"):
            pipe([0], sampling=spec, progress=False)
    assert not drawn
    with pytest.raises(ConfigError, match=r"lead_steps must be below num_inference_steps \(2\)"):
        SamplingSpec.create("meanflow", 2, 1.0, lead_model="runs/x", lead_steps=2)
    with pytest.raises(ConfigError, match="lead_steps must be a number of sampling steps >= 1"):
        SamplingSpec.create("meanflow", 2, 1.0, lead_model="runs/x", lead_steps=0)
    with pytest.raises(ConfigError, match="give --lead-model too"):
        SamplingSpec.create("meanflow", 2, 1.0, lead_steps=1)
    with pytest.raises(ConfigError, match="does not combine with autoguidance's guide"):
        SamplingSpec.create("ddim", 4, 2.0, guide="runs/g", lead_model="runs/x")
    with pytest.raises(ConfigError, match="does not combine with a sampling cache"):
        SamplingSpec.create("ddim", 4, 2.0, cache="first-block", lead_model="runs/x")


def test_the_spec_records_tags_and_says_its_lead_and_the_command_line_builds_it():
    from moh_dit.sampling.options import add_sampling_options, spec_from_args

    spec = SamplingSpec.create("meanflow", 2, 1.0, lead_model="runs/ect")
    assert spec.lead.steps == 1 and spec.record()["lead"] == {"model": "runs/ect", "steps": 1}
    assert SamplingSpec.from_record(spec.record()) == spec and "-lead1-" in spec.tag()
    assert spec.describe().endswith(", the first step by runs/ect")
    assert "lead" not in SamplingSpec().record() and "-lead" not in SamplingSpec().tag()  # as before
    parser = argparse.ArgumentParser()
    add_sampling_options(parser, None, "fast")
    args = parser.parse_args(["--scheduler", "meanflow", "--num-steps", "3", "--cfg-scale", "1", "--lead-model", "runs/ect", "--lead-steps", "2"])  # fmt: skip
    assert spec_from_args(args, objective="meanflow", log=False).lead.record() == {"model": "runs/ect", "steps": 2}
    # a recorded hand-off is kept unless --lead-model none drops it
    plain = parser.parse_args(["--scheduler", "meanflow", "--num-steps", "2", "--cfg-scale", "1"])
    assert spec_from_args(plain, spec, objective="meanflow", log=False).lead == spec.lead
    dropped = parser.parse_args(["--scheduler", "meanflow", "--num-steps", "2", "--cfg-scale", "1", "--lead-model", "none"])  # fmt: skip
    assert spec_from_args(dropped, spec, objective="meanflow", log=False).lead is None
