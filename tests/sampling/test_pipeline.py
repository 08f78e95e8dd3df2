"""MoHDiTPipeline: DiT's DDPM-250 sampler reproduced from the formulas, guidance, labels, save/load."""

import json

import numpy as np
import pytest
import torch

from moh_dit import MoHDiT
from moh_dit.sampling.guidance import StepEvaluation, guided_output
from moh_dit.sampling.labels import resolve_class_labels
from moh_dit.sampling.pipeline import MoHDiTPipeline, to_uint8
from moh_dit.sampling.schedulers import make_scheduler

from ..helpers.factories import TINY_NAMES as NAMES
from ..helpers.factories import tiny_model as _tiny_model
from ..helpers.factories import tiny_pipeline as pipe_for
from ..helpers.factories import tiny_vae


def tiny_model(**config) -> MoHDiT:
    return _tiny_model(signal=0.1, **config).eval()


# ----------------------------------------------------------------------------------------------------
# DiT's sampler, written from the formulas (docs/objective.md)
# ----------------------------------------------------------------------------------------------------
def dit_reference_sampler(model, labels, noise_gen, steps, scale):
    """Respaced ancestral DDPM with the learned-range variance, from DiT's equations, in float64."""
    betas = np.linspace(1e-4, 0.02, 1000, dtype=np.float64)
    alphas_cumprod = np.cumprod(1 - betas)
    stride = (1000 - 1) / (steps - 1)
    kept = sorted({round(i * stride) for i in range(steps)})  # DiT's space_timesteps
    ac = alphas_cumprod[kept]
    ac_prev = np.append(1.0, ac[:-1])
    new_betas = 1 - ac / ac_prev
    post_var = new_betas * (1 - ac_prev) / (1 - ac)
    post_log_var = np.log(np.append(post_var[1], post_var[1:]))
    coef1 = new_betas * np.sqrt(ac_prev) / (1 - ac)
    coef2 = (1 - ac_prev) * np.sqrt(1 - new_betas) / (1 - ac)

    c, s = model.in_channels, model.config.sample_size
    x = torch.randn((len(labels), c, s, s), generator=noise_gen).double()
    y = torch.tensor(labels)
    for i in reversed(range(steps)):
        t = torch.full((len(labels),), kept[i])
        with torch.no_grad():
            out_c = model(x.float(), t, y).sample.double()
            out_u = model(x.float(), t, torch.full_like(y, model.config.num_classes)).sample.double()
        eps = out_u[:, :c] + scale * (out_c[:, :c] - out_u[:, :c])
        frac = (out_c[:, c:] + 1) / 2
        log_var = frac * np.log(new_betas[i]) + (1 - frac) * post_log_var[i]
        x0 = np.sqrt(1 / ac[i]) * x - np.sqrt(1 / ac[i] - 1) * eps
        mean = coef1[i] * x0 + coef2[i] * x
        x = mean + torch.exp(0.5 * log_var) * torch.randn(x.shape, generator=noise_gen).double() if i > 0 else mean
    return x


@pytest.mark.parametrize("steps,scale", [(250, 1.0), (25, 4.0)])
def test_ddpm_matches_dit_reference_sampler(steps, scale):
    model = tiny_model()
    labels = [0, 2, 1]
    ours = pipe_for(model)(
        labels,
        guidance_scale=scale,
        num_inference_steps=steps,
        generator=torch.Generator().manual_seed(5),
        output_type="pt",
    ).images
    ref = dit_reference_sampler(model, labels, torch.Generator().manual_seed(5), steps, scale)
    torch.testing.assert_close(ours.double(), ref, rtol=1e-3, atol=1e-3)


def test_respaced_timesteps_are_dits():
    sched = make_scheduler("ddpm")
    sched.set_timesteps(250)
    stride = 999 / 249
    assert sorted(sched.timesteps.tolist()) == sorted({round(i * stride) for i in range(250)})


# ----------------------------------------------------------------------------------------------------
# Guidance
# ----------------------------------------------------------------------------------------------------
@torch.no_grad()
def cond_and_uncond(model, x, t, y):
    """Separate conditional and null-class forwards, the two halves guidance must combine."""
    tt = t.expand(len(x))
    return model(x, tt, y).sample, model(x, tt, torch.full_like(y, model.null_class_id)).sample


def test_scale_one_is_the_conditional_model_and_cfg_batches_both_halves():
    model = tiny_model(in_channels=4)
    pipe = pipe_for(model)
    x, t, y = torch.randn(2, 4, 8, 8), torch.tensor(500), torch.tensor([0, 1])
    cond, uncond = cond_and_uncond(model, x, t, y)
    with torch.no_grad():
        calls = []
        hook = model.register_forward_hook(lambda m, a, o: calls.append(a[0].shape[0]))
        one = evaluate(pipe, x, t, y, 1.0)
        guided = evaluate(pipe, x, t, y, 3.0)
        hook.remove()
    torch.testing.assert_close(one, cond)
    assert calls == [2, 4]  # scale 1: conditional only; otherwise one batched forward of both halves
    torch.testing.assert_close(
        guided[:, :4], uncond[:, :4] + 3.0 * (cond[:, :4] - uncond[:, :4]), rtol=1e-4, atol=1e-5
    )
    torch.testing.assert_close(guided[:, 4:], cond[:, 4:], rtol=1e-5, atol=1e-6)  # variance from the conditional half


def test_three_channel_guidance_leaves_channel_four_unguided():
    model = tiny_model(in_channels=4)
    pipe = pipe_for(model)
    x, t, y = torch.randn(2, 4, 8, 8), torch.tensor(100), torch.tensor([2, 0])
    cond, uncond = cond_and_uncond(model, x, t, y)
    with torch.no_grad():
        out = evaluate(pipe, x, t, y, 4.0, channels=3)
    torch.testing.assert_close(out[:, :3], uncond[:, :3] + 4.0 * (cond[:, :3] - uncond[:, :3]), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(out[:, 3], cond[:, 3], rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------------------------------
# Labels
# ----------------------------------------------------------------------------------------------------
def test_class_names_and_ids():
    assert resolve_class_labels(["CAT", 2, "dog", "1"], 3, NAMES) == [0, 2, 1, 1]
    assert resolve_class_labels("sneaker", 3, NAMES) == [2]
    assert resolve_class_labels(1, 3, NAMES) == [1]
    with pytest.raises(ValueError, match=r"unknown class name 'horse' \(known classes: 'cat', 'dog', 'Sneaker'\)"):
        resolve_class_labels(["horse"], 3, NAMES)
    with pytest.raises(ValueError, match="out of range"):
        resolve_class_labels([3], 3, NAMES)
    with pytest.raises(ValueError, match="out of range"):
        resolve_class_labels([-1], 3, NAMES)


def test_close_and_ambiguous_class_names():
    names = {0: "Cardigan", 1: "cardigan", 2: "golden retriever"}
    assert resolve_class_labels(["Cardigan", "cardigan", "Golden Retriever"], 3, names) == [0, 1, 2]
    with pytest.raises(ValueError, match="'CARDIGAN' is ambiguous \\('Cardigan' = 0, 'cardigan' = 1\\)"):
        resolve_class_labels(["CARDIGAN"], 3, names)
    with pytest.raises(ValueError, match="did you mean 'golden retriever'"):
        resolve_class_labels(["golden retreiver"], 3, names)


def test_pipeline_rejects_bad_requests():
    pipe = pipe_for(tiny_model())
    with pytest.raises(ValueError, match="known classes"):
        pipe(["horse"], num_inference_steps=2)
    with pytest.raises(ValueError, match="class_labels are required"):
        pipe(None, num_inference_steps=2)
    with pytest.raises(ValueError, match="output_type"):
        pipe([0], num_inference_steps=2, output_type="jpeg")
    no_null = tiny_model()
    no_null.y_embedder.has_null_class = False
    with pytest.raises(ValueError, match="no null class"):
        pipe_for(no_null)([0], guidance_scale=2.0, num_inference_steps=2)


def test_unconditional_model_samples_without_labels():
    pipe = pipe_for(tiny_model(num_classes=0))
    images = pipe(num_images=3, num_inference_steps=3, output_type="np").images
    assert images.shape == (3, 8, 8, 1)
    kwargs = dict(num_images=3, num_inference_steps=3, output_type="np")
    plain = pipe(**kwargs, generator=torch.Generator().manual_seed(0)).images
    averaged = pipe(**kwargs, generator=torch.Generator().manual_seed(0), grid_averaging=999).images
    assert averaged.shape == (3, 8, 8, 1) and np.isfinite(averaged).all() and not np.array_equal(averaged, plain)


# ----------------------------------------------------------------------------------------------------
# Schedulers, output types, save/load
# ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["ddim", "dpm-solver", "dpm-solver-sde", "unipc"])
def test_fast_solvers_get_noise_channels_only(name):
    """DDIM and DPM-Solver++ must see the noise prediction only (C channels); DiT's DDPM the learned
    variance too (2C), which its learned-range step needs."""
    pipe = pipe_for(tiny_model(), scheduler=name)
    seen = []
    step = pipe.scheduler.step
    pipe.scheduler.step = lambda output, *a, **k: seen.append(output.shape[1]) or step(output, *a, **k)
    images = pipe(
        [0, 1], guidance_scale=2.0, num_inference_steps=5, generator=torch.Generator().manual_seed(0), output_type="pt"
    ).images
    assert images.shape == (2, 1, 8, 8) and torch.isfinite(images).all()
    assert seen == [1] * 5
    ddpm = pipe_for(tiny_model(), scheduler="ddpm")
    step = ddpm.scheduler.step
    ddpm.scheduler.step = lambda output, *a, **k: seen.append(output.shape[1]) or step(output, *a, **k)
    ddpm([0, 1], num_inference_steps=3, output_type="pt")
    assert seen[5:] == [2] * 3


def test_the_stochastic_solver_draws_its_noise_from_the_generator():
    """DPM-Solver++ SDE adds noise at every step: with the caller's generator it is reproducible whatever
    the global RNG does, and another seed gives other images."""
    pipe = pipe_for(tiny_model(), scheduler="dpm-solver-sde")

    def run(seed, global_seed):
        torch.manual_seed(global_seed)
        gen = torch.Generator().manual_seed(seed)
        return pipe([0, 1], guidance_scale=2.0, num_inference_steps=5, generator=gen, output_type="pt").images

    first = run(0, global_seed=1)
    assert torch.equal(first, run(0, global_seed=2))
    assert not torch.equal(first, run(1, global_seed=1))


def test_uint8_quantisation_follows_adm():
    x = torch.tensor([-1.0, -0.999, 0.0, 0.5, 0.9999, 1.0]).view(1, 1, 1, 6)
    expected = np.clip(127.5 * x.numpy() + 128, 0, 255).astype(np.uint8)
    np.testing.assert_array_equal(to_uint8(x)[0, 0, :, 0], expected[0, 0, 0])


def test_output_types_agree():
    pipe = pipe_for(tiny_model())

    def run(kind):
        return pipe([0, 1], num_inference_steps=3, generator=torch.Generator().manual_seed(1), output_type=kind).images

    pt, arr, u8, pil = run("pt"), run("np"), run("uint8"), run("pil")
    np.testing.assert_allclose(arr, ((pt + 1) / 2).clamp(0, 1).permute(0, 2, 3, 1).numpy(), atol=1e-6)
    assert u8.dtype == np.uint8 and len(pil) == 2 and pil[0].size == (8, 8)


@pytest.mark.parametrize("with_vae", [False, True])
def test_save_and_load_round_trip(tmp_path, with_vae):
    model = tiny_model(in_channels=4 if with_vae else 1)
    vae = tiny_vae() if with_vae else None
    pipe = pipe_for(model, vae)
    pipe.save_pretrained(tmp_path / "p")
    loaded = MoHDiTPipeline.from_pretrained(tmp_path / "p")
    loaded.set_progress_bar_config(disable=True)
    assert loaded.id2label == NAMES and (loaded.vae is not None) == with_vae
    assert loaded.transformer.config.num_shared_heads == [2, 4]
    kwargs = dict(guidance_scale=3.0, num_inference_steps=4, output_type="pt")
    a = pipe(["dog", 2], generator=torch.Generator().manual_seed(3), **kwargs).images
    b = loaded(["dog", 2], generator=torch.Generator().manual_seed(3), **kwargs).images
    assert torch.equal(a, b)
    if with_vae:
        assert a.shape == (2, 3, 16, 16)
    # one token's patch in output pixels: image side / token grid side
    assert loaded.patch_pixels == a.shape[-1] // (model.config.sample_size // model.config.patch_size)


@pytest.mark.parametrize("scheduler", ["sde", pytest.param("heun", marks=pytest.mark.slow)])
def test_a_saved_flow_pipeline_loads_in_a_fresh_interpreter_and_draws_the_same_images(tmp_path, scheduler):
    """diffusers only resolves a scheduler class from modules already imported; a user's fresh process that imports
    nothing but the pipeline must still load moh-dit's flow schedulers."""
    import subprocess
    import sys

    model = tiny_model(learn_sigma=False, objective={"name": "flow", "path": "linear", "convention": "moh-dit"})
    pipe = pipe_for(model, scheduler=scheduler)
    pipe.save_pretrained(tmp_path / "p")
    kwargs = dict(guidance_scale=2.0, num_inference_steps=4, output_type="pt")
    torch.save(pipe(["dog", 2], generator=torch.Generator().manual_seed(3), **kwargs).images, tmp_path / "a.pt")
    script = (
        "import sys, torch\n"
        "from moh_dit.sampling.pipeline import MoHDiTPipeline\n"
        "pipe = MoHDiTPipeline.from_pretrained(sys.argv[1])\n"
        "pipe.set_progress_bar_config(disable=True)\n"
        f"kwargs = {kwargs!r}\n"
        "images = pipe(['dog', 2], generator=torch.Generator().manual_seed(3), **kwargs).images\n"
        "print(type(pipe.scheduler).__name__, torch.equal(images, torch.load(sys.argv[2])))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "p"), str(tmp_path / "a.pt")], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == [type(pipe.scheduler).__name__, "True"]


# ----------------------------------------------------------------------------------------------------
# Guidance in an interval of timesteps
# ----------------------------------------------------------------------------------------------------
def spy_on_steps(monkeypatch) -> list[tuple[int, float, bool]]:
    """Every later denoising step appends ``(timestep, guidance scale, grid averaged)`` to the returned list."""
    from moh_dit.sampling import pipeline

    seen, inner = [], pipeline.guided_output

    def spy(transformer, x, t, labels, how, *rest):
        seen.append((int(t), how.scale, how.average))
        return inner(transformer, x, t, labels, how, *rest)

    monkeypatch.setattr(pipeline, "guided_output", spy)
    return seen


def evaluate(pipe, x, t, labels, scale, channels=None, average=False):
    """One guided evaluation of ``pipe``'s transformer (CFG)."""
    return guided_output(pipe.transformer, x, t, labels, StepEvaluation(scale, channels, average=average))


@pytest.mark.parametrize("name", ["ddpm", "dpm-solver"])
def test_guidance_interval_guides_exactly_the_steps_inside(name, monkeypatch):
    pipe = pipe_for(tiny_model(), scheduler=name)
    seen = spy_on_steps(monkeypatch)
    kwargs = dict(guidance_scale=3.0, num_inference_steps=10, output_type="pt")
    gen = lambda: torch.Generator().manual_seed(5)  # noqa: E731
    banded = pipe([0, 1], guidance_interval=(300, 700), generator=gen(), **kwargs).images
    steps = [t for t, _, _ in seen]
    assert any(300 <= t <= 700 for t in steps) and any(not 300 <= t <= 700 for t in steps)
    assert all(scale == (3.0 if 300 <= t <= 700 else 1.0) for t, scale, _ in seen)
    # the two ends: an interval holding every step is plain guidance, one holding none is no guidance
    everywhere = pipe([0, 1], guidance_interval=(0, 999), generator=gen(), **kwargs).images
    plain = pipe([0, 1], generator=gen(), **kwargs).images
    nowhere = pipe([0, 1], guidance_interval=(998, 998), generator=gen(), **dict(kwargs, guidance_scale=3.0)).images
    unguided = pipe([0, 1], generator=gen(), **dict(kwargs, guidance_scale=1.0)).images
    assert torch.equal(everywhere, plain) and torch.equal(nowhere, unguided)
    assert not torch.equal(banded, plain) and not torch.equal(banded, unguided)


def test_guidance_interval_is_checked():
    from moh_dit.errors import ConfigError
    from moh_dit.sampling.spec import SamplingSpec

    def check_guidance_interval(interval):
        return SamplingSpec.create(guidance_interval=interval).guidance.interval

    assert check_guidance_interval([100, 600]) == (100, 600)
    assert check_guidance_interval((0, 999)) is None  # every step: the same pixels, the same record
    assert check_guidance_interval(None) is None
    for bad in ([600, 100], [-1, 5], [0, 1000], [5], "100,600", [1.5, 3], [True, 3]):
        with pytest.raises(ConfigError, match=r"guidance_interval must be two timesteps \[first, last\]"):
            check_guidance_interval(bad)
    with pytest.raises(ConfigError, match="guidance_interval"):
        pipe_for(tiny_model())([0], num_inference_steps=2, guidance_interval=(5, 1))


# ----------------------------------------------------------------------------------------------------
# Averaging over shifted patch grids
# ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "patch,want", [(2, [0, 1]), (4, [0, 1, 2, -1]), (8, [0, 1, 2, 3, 4, -3, -2, -1]), (3, [0, 1, -1])]
)
def test_grid_shifts_cover_every_offset_of_the_grid_once_with_the_smallest_rolls(patch, want):
    from moh_dit.sampling.guidance import grid_shifts

    shifts = grid_shifts(patch)
    assert shifts == want
    assert sorted(s % patch for s in shifts) == list(range(patch)) and all(abs(s) <= patch / 2 for s in shifts)


@pytest.mark.parametrize("scale", [1.0, 3.0])
def test_grid_average_is_the_mean_of_the_shifted_predictions_rolled_back(scale):
    # brute force: one forward per shifted copy, each prediction rolled back by hand, then the mean
    pipe = pipe_for(tiny_model(patch_size=2))
    x = torch.randn(3, 1, 8, 8, generator=torch.Generator().manual_seed(0))
    t, labels = torch.tensor(400), torch.tensor([0, 1, 0])
    averaged = evaluate(pipe, x, t, labels, scale, None, True)
    singles = [
        torch.roll(evaluate(pipe, torch.roll(x, (s, s), (2, 3)), t, labels, scale), (-s, -s), (2, 3)) for s in (0, 1)
    ]
    assert averaged.shape == singles[0].shape == (3, 2, 8, 8)  # noise and variance channels
    torch.testing.assert_close(averaged, torch.stack(singles).mean(0), rtol=1e-5, atol=1e-6)
    assert not torch.allclose(averaged, singles[0], atol=1e-4)


def test_grid_average_spreads_a_denoiser_seam_evenly_over_the_image():
    # a stand-in transformer whose prediction is a seam on its own grid's first column: 1 where
    # column % 4 == 0, 0 elsewhere, whatever the input. Averaged over the four shifted grids, every column
    # gets the seam once in four: a flat 1/4, no line left (closed form)
    from types import SimpleNamespace

    pipe = pipe_for(tiny_model(patch_size=4, sample_size=8))
    seam = (torch.arange(8) % 4 == 0).float().expand(8, 8)  # (H, W)

    def seam_only(x, t, y, **kwargs):
        return SimpleNamespace(sample=seam.expand(x.shape[0], 2, 8, 8).clone())

    pipe.transformer.forward = seam_only
    x = torch.randn(2, 1, 8, 8)
    plain = evaluate(pipe, x, torch.tensor(10), torch.tensor([0, 1]), 1.0)
    averaged = evaluate(pipe, x, torch.tensor(10), torch.tensor([0, 1]), 1.0, None, True)
    assert torch.equal(plain[0, 0], seam)
    torch.testing.assert_close(averaged, torch.full_like(averaged, 0.25))


@pytest.mark.parametrize("name", ["ddpm", "dpm-solver"])
def test_grid_averaging_averages_exactly_the_steps_at_or_below_its_timestep(name, monkeypatch):
    pipe = pipe_for(tiny_model(), scheduler=name)
    seen = spy_on_steps(monkeypatch)
    kwargs = dict(guidance_scale=3.0, num_inference_steps=10, output_type="pt")
    gen = lambda: torch.Generator().manual_seed(5)  # noqa: E731
    averaged = pipe([0, 1], grid_averaging=400, generator=gen(), **kwargs).images
    assert any(t <= 400 for t, _, _ in seen) and any(t > 400 for t, _, _ in seen)
    assert all(average == (t <= 400) for t, _, average in seen)
    seen.clear()
    plain = pipe([0, 1], generator=gen(), **kwargs).images
    assert not any(average for _, _, average in seen)  # off by default
    assert pipe([0, 1], grid_averaging=None, generator=gen(), **kwargs).images.equal(plain)
    assert not torch.equal(averaged, plain) and torch.isfinite(averaged).all()


def test_grid_averaging_is_checked():
    from moh_dit.errors import ConfigError
    from moh_dit.sampling.spec import SamplingSpec

    def check_grid_averaging(last):
        return SamplingSpec.create(grid_averaging=last).sampler.grid_averaging

    assert check_grid_averaging(100) == 100 and check_grid_averaging(None) is None and check_grid_averaging(0) == 0
    for bad in (-1, 1000, 1.5, True, "100", [100]):
        with pytest.raises(ConfigError, match="grid_averaging must be a timestep between 0 and 999"):
            check_grid_averaging(bad)
    with pytest.raises(ConfigError, match="grid_averaging"):
        pipe_for(tiny_model())([0], num_inference_steps=2, grid_averaging=1000)


def test_saved_pipelines_record_how_they_are_meant_to_be_sampled(tmp_path):
    from moh_dit.errors import ArtifactError
    from moh_dit.sampling.loading import load_pipeline, recorded_sampling
    from moh_dit.sampling.spec import SamplingSpec

    pipe = pipe_for(tiny_model())
    assert pipe.preview_sampling == SamplingSpec()  # no record: the package's grid defaults
    want = SamplingSpec.create("ddim", 12, 3.0, (100, 600), grid_averaging=100)
    pipe.save(tmp_path / "p", {"note": "test"}, sampling=want)
    recorded = {"guidance_scale": 3.0, "guidance_interval": [100, 600], "scheduler": "ddim", "num_inference_steps": 12}
    recorded["grid_averaging"] = 100  # the manifest's form, as moh-dit 0.2 wrote it
    assert json.loads((tmp_path / "p" / "manifest.json").read_text())["sampling"] == recorded
    assert recorded_sampling(tmp_path / "p") == want
    assert load_pipeline(tmp_path / "p", device="cpu").preview_sampling == want
    with pytest.raises(ArtifactError, match="recorded sampling"):
        pipe.set_preview_sampling({"guidance_scale": 3.0, "guidance_interval": [600, 100]})
    with pytest.raises(ArtifactError, match="recorded sampling"):
        pipe.set_preview_sampling({"guidance_scale": 3.0, "grid_averaging": -5})
    # a record written before grid averaging existed reads as none
    assert SamplingSpec.from_record({"guidance_scale": 3.0}).sampler.grid_averaging is None
    manifest = json.loads((tmp_path / "p" / "manifest.json").read_text())
    manifest["sampling"]["guidance_interval"] = [100]  # a damaged record is refused, not half-used
    (tmp_path / "p" / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match="recorded sampling .* is not valid"):
        recorded_sampling(tmp_path / "p")


def test_a_run_folder_of_moh_dit_0_2_still_gives_its_preview_spec(tmp_path):
    """Before the preview section, a run's config.yaml kept the preview settings as log.sample_*."""
    from moh_dit.sampling.loading import ModelSource, _run_preview_sampling
    from moh_dit.sampling.spec import SamplingSpec

    (tmp_path / "config.yaml").write_text(
        "log:\n  sample_cfg_scale: 2.5\n  sample_guidance_interval: [100, 600]\n  sample_steps: 9\n"
    )
    spec = _run_preview_sampling(ModelSource("checkpoint", tmp_path / "checkpoints" / "step-1", 1, tmp_path))
    assert spec == SamplingSpec.create(num_inference_steps=9, guidance_scale=2.5, guidance_interval=(100, 600))
