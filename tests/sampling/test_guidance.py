"""Guidance beyond classifier-free: the rules against diffusers' guider classes on the same tensors, CFG byte for byte
as before, autoguidance against its formula (and by the model itself: exactly the unguided images), a guide that
cannot guide stopped in one line, and a sample set's identity holding its guide and rule."""

import json

import numpy as np
import pytest
import torch

from moh_dit.errors import ArtifactError, ConfigError
from moh_dit.sampling.guidance import StepEvaluation, guided_output
from moh_dit.sampling.guides import Guide, check_guide
from moh_dit.sampling.rules import check_rule_options, make_rule
from moh_dit.sampling.spec import GuideSpec, SamplingSpec

from ..helpers.factories import tiny_model, tiny_pipeline

STEPS = 4


def pair(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(3, 4, 8, 8, generator=g), torch.randn(3, 4, 8, 8, generator=g)


def diffusers_steps(guider, steps: int) -> list[torch.Tensor]:
    """A diffusers guider run over ``steps`` sampler steps on the same tensors (its state advanced as its pipelines
    advance it: set_state, then prepare_inputs, then forward)."""
    outs = []
    for step in range(steps):
        cond, uncond = pair(step)
        guider.set_state(step, STEPS, torch.tensor(float(step)))
        guider.prepare_inputs({})
        outs.append(guider.forward(cond, uncond).pred)
    return outs


@pytest.mark.parametrize(
    "name, options, make",
    [
        ("cfg", {}, lambda: __import__("diffusers").guiders.ClassifierFreeGuidance(guidance_scale=3.0)),
        (
            "apg",
            {"eta": 0.3, "momentum": -0.5, "norm_threshold": 40.0},
            lambda: __import__("diffusers").guiders.AdaptiveProjectedGuidance(
                guidance_scale=3.0,
                adaptive_projected_guidance_momentum=-0.5,
                adaptive_projected_guidance_rescale=40.0,
                eta=0.3,
            ),  # fmt: skip
        ),
        ("apg", {"momentum": None, "norm_threshold": 0.0, "eta": 1.0}, None),  # reduces to CFG
        (
            "cfg-zero-star",
            {"zero_init_steps": 2},
            lambda: __import__("diffusers").guiders.ClassifierFreeZeroStarGuidance(
                guidance_scale=3.0, zero_init_steps=2
            ),
        ),
    ],
)
def test_each_rule_equals_diffusers_guider_on_the_same_tensors(name, options, make):
    rule = make_rule(name, options)
    ours = [rule.combine(*pair(step), 3.0, step) for step in range(STEPS)]
    if make is None:  # APG with none of its changes is CFG
        theirs = [pair(step)[1] + 3.0 * (pair(step)[0] - pair(step)[1]) for step in range(STEPS)]
    else:
        theirs = diffusers_steps(make(), STEPS)
    for step, (a, b) in enumerate(zip(ours, theirs)):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=f"{name} step {step}")


def test_apg_momentum_follows_each_sample_when_grid_averaging_starts_and_stops():
    """A batch of rolled copies (grid averaging) continues each sample's momentum in its own frame: each copy's
    output, rolled back, is the output of the same rule on the unrolled batch (APG's norms are per sample, and a roll
    keeps them). Before, diffusers' buffer met a batch four times its size and stopped the sampler."""
    from moh_dit.sampling.guidance import grid_shifts

    shifts = grid_shifts(4)
    rolled = lambda x: torch.cat([torch.roll(x, (s, s), dims=(2, 3)) for s in shifts])  # noqa: E731
    plain, averaged = make_rule("apg", {"eta": 0.3}), make_rule("apg", {"eta": 0.3})
    for step in range(5):
        cond, uncond = pair(step)
        expected = plain.combine(cond, uncond, 3.0, step)
        copies = step in (2, 3)  # averaging starts at step 2 and stops at step 4
        if copies:
            out = averaged.combine(rolled(cond), rolled(uncond), 3.0, step, shifts)
            for chunk, s in zip(out.chunk(len(shifts)), shifts):
                torch.testing.assert_close(torch.roll(chunk, (-s, -s), dims=(2, 3)), expected, rtol=1e-5, atol=1e-5)
        else:
            torch.testing.assert_close(averaged.combine(cond, uncond, 3.0, step), expected, rtol=1e-5, atol=1e-5)


def test_apg_samples_with_grid_averaging_in_the_pipeline():
    pipe = tiny_pipeline(tiny_model(signal=0.1), scheduler="dpm-solver")
    spec = SamplingSpec.create(scheduler="dpm-solver", num_inference_steps=4, guidance_scale=2.0, guidance_rule="apg")
    images = pipe([0, 1], sampling=spec.replace(grid_averaging=500), output_type="latent", progress=False).images
    assert torch.isfinite(images).all()


def test_cfg_is_byte_identical_to_the_formula_it_always_was():
    model = tiny_model(signal=0.1).eval()  # DDPM with a learned variance: 2C output channels
    c = model.in_channels
    x, t, y = torch.randn(2, c, 8, 8), torch.tensor(300), torch.tensor([0, 1])
    with torch.no_grad():
        null = model.null_class_id
        out = model(torch.cat([x, x]), t.expand(4), torch.tensor([0, 1, null, null])).sample.float()
        cond, uncond = out.chunk(2)
        expected = torch.cat([uncond[:, :c] + 4.0 * (cond[:, :c] - uncond[:, :c]), cond[:, c:]], dim=1)
        assert torch.equal(guided_output(model, x, t, y, StepEvaluation(scale=4.0)), expected)


def test_autoguidance_is_guide_plus_scale_times_main_minus_guide_on_the_predicted_channels():
    main, guide = tiny_model(signal=0.1).eval(), tiny_model(signal=0.1, seed=5).eval()
    c = main.in_channels
    x, t, y = torch.randn(2, c, 8, 8), torch.tensor([300, 700]), torch.tensor([0, 1])
    with torch.no_grad():
        m, g = main(x, t, y).sample, guide(x, t, y).sample
        out = guided_output(main, x, t, y, StepEvaluation(scale=2.5, guide=guide))
    torch.testing.assert_close(out[:, :c], g[:, :c] + 2.5 * (m[:, :c] - g[:, :c]))
    assert torch.equal(out[:, c:], m[:, c:])  # the variance stays the main model's
    with torch.no_grad():  # guided by itself: the main model's output, exactly
        assert torch.equal(guided_output(main, x, t, y, StepEvaluation(scale=2.5, guide=main)), main(x, t, y).sample)
        apg = guided_output(
            main, x, t, y, StepEvaluation(2.5, rule=make_rule("apg"), guide=guide)
        )  # any rule, any pair
    assert not torch.equal(apg, out)


def test_guided_by_itself_a_sample_set_is_exactly_the_unguided_one(tmp_path, monkeypatch):
    from moh_dit.sampling.generation import GenerationSettings, generate_samples

    pipe = tiny_pipeline(tiny_model(signal=0.1))
    pipe.transformer.save_pretrained(tmp_path / "same")  # the same weights, loaded again as the guide
    base = SamplingSpec.create(None, 3, 3.0)

    def draw(folder, spec):
        return generate_samples(pipe, tmp_path / folder, GenerationSettings(4, 0, 4, sampling=spec))

    guided = base.replace(guide=str(tmp_path / "same"))  # the pipeline loads the guide the spec names
    from diffusers.models import modeling_utils

    warned = []
    monkeypatch.setattr(modeling_utils.logger, "warning", lambda message, *a, **k: warned.append(message))
    a, b = draw("guided", guided), draw("plain", base.replace(guidance_scale=1.0))
    assert np.array_equal(np.load(a)["arr_0"], np.load(b)["arr_0"])
    assert not [w for w in warned if "kept in float32" in w]  # diffusers' warning about no module at all
    identity = json.loads(str(np.load(a)["moh_dit_manifest"]))["identity"]
    assert identity["guide"]["transformer_sha256"] and identity["guidance_scale"] == 3.0
    # another guide (other weights) is another set: never resumed from this folder
    tiny_model(signal=0.1, seed=9).save_pretrained(tmp_path / "other")
    other = base.replace(guide=str(tmp_path / "other"))
    with pytest.raises(ArtifactError, match="guide.transformer_sha256"):
        draw("guided", other)


def test_a_guide_that_cannot_guide_is_one_line_before_any_image(tmp_path):
    main = tiny_model(signal=0.1)
    wrong = tiny_model(signal=0.1, num_classes=5)
    with pytest.raises(ConfigError, match=r"cannot guide this model: num_classes 5 \(the main model: 3\)"):
        check_guide(main, wrong, None, None, "runs/x")
    flow = tiny_model(
        signal=0.1, learn_sigma=False, objective={"name": "flow", "path": "linear", "convention": "moh-dit"}
    )
    with pytest.raises(ConfigError, match="objective"):
        check_guide(main, flow, None, None, "runs/x")
    with pytest.raises(ConfigError, match="latent space"):
        check_guide(main, main, None, {"kind": "AutoencoderKL"}, "runs/x")
    pipe = tiny_pipeline(main)
    wrong.save_pretrained(tmp_path / "wrong")
    with pytest.raises(ConfigError, match="cannot guide"):  # before any image is drawn
        pipe([0], sampling=SamplingSpec.create("ddim", 2, 2.0, guide=str(tmp_path / "wrong")), progress=False)
    given = Guide.of(tiny_model(signal=0.1, seed=5), GuideSpec("elsewhere"))
    with pytest.raises(ConfigError, match="is not the one the sampling spec names"):
        pipe([0], sampling=SamplingSpec.create("ddim", 2, 2.0, guide="runs/x"), guide=given, progress=False)


def test_the_guide_runs_only_where_guidance_applies():
    main, guide = tiny_model(signal=0.1).eval(), tiny_model(signal=0.1, seed=5).eval()
    pipe = tiny_pipeline(main, scheduler="ddim")
    calls = []
    guide.register_forward_hook(lambda *_: calls.append(1))
    spec = SamplingSpec.create("ddim", 10, 2.0, guidance_interval=(300, 700), guide="g")
    pipe([0, 1], sampling=spec, guide=Guide.of(guide, spec.guide), progress=False, output_type="pt")
    assert 0 < len(calls) < 10  # only the steps inside the interval, one batched forward each


def test_rules_and_guides_are_checked_recorded_and_described():
    spec = SamplingSpec.create(
        "ddim", 5, 3.0, guidance_rule="apg", rule_options={"eta": 0.5}, guide="runs/x", guide_step=2000
    )
    assert spec.guidance.options == {"eta": 0.5, "momentum": -0.5, "norm_threshold": 15.0}
    assert SamplingSpec.from_record(spec.record()) == spec and "-apg-" in spec.tag() and "-guide-" in spec.tag()
    assert spec.describe_guidance() == (
        "APG (eta 0.5, momentum -0.5, norm threshold 15) autoguidance 3 by runs/x (step 2000) at every step"
    )
    assert "guidance_rule" not in SamplingSpec().record() and "guide" not in SamplingSpec().record()  # as before
    with pytest.raises(ConfigError, match="apg takes eta, momentum, norm_threshold; got \\['beta'\\]"):
        check_rule_options("apg", {"beta": 1})
    with pytest.raises(ConfigError, match="guidance_rule must be one of cfg, apg, cfg-zero-star"):
        SamplingSpec.create(guidance_rule="pag")
    with pytest.raises(ConfigError, match=r"--guide-step and --guide-sigma-rel .* give --guide-model \(guide\) too"):
        SamplingSpec.create(guide_step=10)
    with pytest.raises(ConfigError, match="guide_sigma_rel must be a relative EMA width"):
        SamplingSpec.create(guide="runs/x", guide_sigma_rel=0.5)


def test_a_new_rule_is_one_class_and_one_table_entry(monkeypatch):
    """docs/development.md#add-a-guidance-rule: a subclass with its options and ``combine``, and its entry in RULES;
    the spec checks its options, the record and tag name it, the pipeline samples with it, the CLI offers it."""
    from moh_dit.sampling import rules
    from moh_dit.sampling.options import add_sampling_options

    class Halfway(rules.GuidanceRule):  # the unconditional prediction moved part of the way only
        name, title = "halfway", "half-way guidance"
        defaults = {"share": 0.5}

        def combine(self, cond, uncond, scale, step, shifts=None):
            return uncond + self.options["share"] * scale * (cond - uncond)

    monkeypatch.setitem(rules.RULES, Halfway.name, Halfway)
    spec = SamplingSpec.create("ddim", 3, 2.0, guidance_rule="halfway", rule_options={"share": 0.25})
    assert spec.record()["rule_options"] == {"share": 0.25} and "-halfway-" in spec.tag()
    assert spec.describe_guidance().startswith("half-way guidance (share 0.25) guidance 2")
    with pytest.raises(ConfigError, match="halfway takes share"):
        SamplingSpec.create(guidance_rule="halfway", rule_options={"eta": 1})
    pipe = tiny_pipeline(tiny_model(signal=0.1), scheduler="ddim")
    gen = lambda: [torch.Generator().manual_seed(i) for i in range(2)]  # noqa: E731
    ours = pipe([0, 1], sampling=spec, generator=gen(), output_type="pt").images
    cfg = pipe(
        [0, 1], sampling=spec.replace(guidance_rule="cfg", guidance_scale=0.5), generator=gen(), output_type="pt"
    )
    torch.testing.assert_close(ours, cfg.images)  # 0.25 * 2 is CFG at 0.5
    parser = __import__("argparse").ArgumentParser()
    add_sampling_options(parser, None, "fast")
    assert parser.parse_args(["--guidance-rule", "halfway"]).guidance_rule == "halfway"


def test_a_guide_is_checked_on_what_the_records_mean_not_how_they_are_written():
    """A record that leaves a default out (an older flow record without its convention) or one with guidance folded
    into training guides the same objective; another path does not."""
    from moh_dit.errors import ConfigError
    from moh_dit.sampling.guides import check_guide

    def flow(**record):
        return tiny_model(learn_sigma=False, objective={"name": "flow", "path": "linear", **record})

    main = flow(convention="moh-dit")
    check_guide(main, flow(), None, None, "here")  # the convention left to its default
    check_guide(main, flow(convention="moh-dit", guidance_scale=2.0, guidance_mix=0.0), None, None, "here")
    with pytest.raises(ConfigError, match="cannot guide this model: objective"):
        check_guide(main, flow(path="gvp"), None, None, "here")
