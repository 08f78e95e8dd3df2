"""Loading models from runs, checkpoints and folders; reproducible, resumable N-sample generation; sample.py."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from moh_dit.errors import ArtifactError
from moh_dit.sampling.generation import generate_samples
from moh_dit.sampling.loading import load_pipeline
from moh_dit.sampling.sample_sets import sample_npz_path
from moh_dit.sampling.spec import PROTOCOLS
from moh_dit.seeding import label_for_index
from moh_dit.training.config import load_config
from moh_dit.training.trainer import train

from ..helpers.factories import generation_settings, make_image_folder, run_command, tiny_train_overrides, torchrun

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    base = tmp_path_factory.mktemp("gen")
    make_image_folder(base / "images")
    out = base / "run"
    train(load_config(None, tiny_train_overrides(out, base / "images", "preview.per_class=0")))
    return out


def settings(**kw):
    base = dict(num_samples=6, seed=3, batch_size=4, guidance_scale=2.0, num_inference_steps=4)
    base.update(kw)
    return generation_settings(**base)


def test_load_from_run_checkpoint_pipeline_and_transformer_folders(run_dir):
    from_run = load_pipeline(run_dir, device="cpu")
    from_pipe = load_pipeline(run_dir / "pipeline", device="cpu")
    ckpt = run_dir / "checkpoints" / "step-00000004"
    from_ckpt = load_pipeline(ckpt, device="cpu")
    from_transformer = load_pipeline(run_dir / "pipeline" / "transformer", device="cpu")
    assert from_ckpt.id2label == from_run.id2label == {0: "bright", 1: "dark"}
    # the exported pipeline and the last checkpoint both hold the EMA weights
    for (name, a), b in zip(from_run.transformer.state_dict().items(), from_ckpt.transformer.state_dict().values()):
        assert torch.equal(a, b), name
    strip = lambda cfg: {k: v for k, v in cfg.items() if k != "_name_or_path"}  # noqa: E731
    assert strip(from_pipe.transformer.config) == strip(from_transformer.transformer.config)
    # without the exported pipeline, a run folder falls back to its latest checkpoint
    (run_dir / "pipeline").rename(run_dir / "pipeline.bak")
    try:
        fallback = load_pipeline(run_dir, device="cpu")
    finally:
        (run_dir / "pipeline.bak").rename(run_dir / "pipeline")
    assert torch.equal(
        next(iter(fallback.transformer.state_dict().values())), next(iter(from_ckpt.transformer.state_dict().values()))
    )


def test_load_errors(tmp_path):
    with pytest.raises(ArtifactError, match="does not exist"):
        load_pipeline(tmp_path / "nope")
    with pytest.raises(ArtifactError, match="not a moh-dit"):
        load_pipeline(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"_class_name": "UNet2DModel"}))
    with pytest.raises(ArtifactError, match="not a MoHDiT"):
        load_pipeline(tmp_path)


def test_same_images_for_any_batch_size_and_resume_fills_only_missing(run_dir, tmp_path, monkeypatch):
    """Each image from its own generator: the same bits at any batch size or count (on CPU), and only the images
    asked for (or missing) are drawn, never the rest of a block."""
    pipe = load_pipeline(run_dir, device="cpu")
    drawn, call = [], type(pipe).__call__
    monkeypatch.setattr(
        type(pipe), "__call__", lambda self, **kw: drawn.append(len(kw["generator"])) or call(self, **kw)
    )
    a = np.load(generate_samples(pipe, tmp_path / "a", settings(batch_size=4)))
    assert drawn == [4, 2]
    b = np.load(generate_samples(pipe, tmp_path / "b", settings(batch_size=1)))
    assert a["arr_0"].shape == (6, 8, 8, 3) and a["arr_0"].dtype == np.uint8
    assert np.array_equal(a["arr_0"], b["arr_0"])  # batch-size independent
    drawn.clear()
    few = np.load(generate_samples(pipe, tmp_path / "few", settings(batch_size=64, num_samples=3)))
    assert drawn == [3] and np.array_equal(few["arr_0"], a["arr_0"][:3])  # 3 drawn, not a block of 64
    drawn.clear()
    assert a["arr_1"].tolist() == [label_for_index(3, i, 2, "uniform") for i in range(6)]

    keep = {i: os.stat(tmp_path / "a" / f"{i:06d}.png").st_mtime_ns for i in range(6)}
    for i in (1, 4):
        (tmp_path / "a" / f"{i:06d}.png").unlink()
    c = np.load(generate_samples(pipe, tmp_path / "a", settings(batch_size=4)))
    assert drawn == [1, 1] and np.array_equal(c["arr_0"], a["arr_0"])  # only the two missing ones
    # a cache decides for its whole batch: blocks are drawn whole, so that an image's batch-mates are fixed
    drawn.clear()
    cached = settings(num_samples=3)
    cached.sampling = cached.sampling.replace(cache="first-block")
    generate_samples(pipe, tmp_path / "cached", cached)
    assert drawn == [4]
    for i in range(6):
        changed = os.stat(tmp_path / "a" / f"{i:06d}.png").st_mtime_ns != keep[i]
        assert changed == (i in (1, 4))


def test_balanced_labels():
    assert [label_for_index(0, i, 3, "balanced") for i in range(6)] == [0, 1, 2, 0, 1, 2]
    with pytest.raises(ValueError, match="label mode"):
        label_for_index(0, 0, 3, "zipf")


def test_sample_cli_grid_with_names_and_single_images(run_dir, tmp_path, caplog):
    from ..helpers.factories import run_in_process

    env = dict(os.environ, PYTHONPATH=str(ROOT))
    cmd = [sys.executable, str(ROOT / "sample.py"), str(run_dir)]
    grid = ["--class-labels", "dark", "0", "--per-class", "3", "--num-steps", "3", "--out", tmp_path / "grid.png"]
    grid += ["--save-images", tmp_path / "single", "--scheduler", "ddim"]
    logged = run_in_process("sample", [run_dir, *grid], caplog)  # the command; its exit codes are tested below
    assert "guidance 4 at every step (the model's recorded preview guidance)" in logged
    assert (tmp_path / "grid.png").exists()
    assert len(list((tmp_path / "single").glob("*_dark.png"))) == 3
    bad = subprocess.run(
        cmd[:3] + ["--class-labels", "purple", "--num-steps", "2", "--out", str(tmp_path / "x.png")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert bad.returncode != 0 and "unknown class name 'purple'" in bad.stderr


# ----------------------------------------------------------------------------------------------------
# Integrity: sample folders say what made them
# ----------------------------------------------------------------------------------------------------
def test_a_sample_folder_is_resumed_only_with_the_same_model_and_settings(run_dir, tmp_path):
    pipe = load_pipeline(run_dir, device="cpu")
    npz = generate_samples(pipe, tmp_path / "s", settings())
    first = np.load(npz)
    with pytest.raises(ArtifactError, match=r"other settings \(seed: 3 -> 4\).*--overwrite"):
        generate_samples(pipe, tmp_path / "s", settings(seed=4))
    other = load_pipeline(run_dir / "pipeline", device="cpu")
    with torch.no_grad():
        next(other.transformer.parameters()).add_(0.01)  # another model
    with pytest.raises(ArtifactError, match="transformer_sha256"):
        generate_samples(other, tmp_path / "s", settings())
    # overwrite: every image and label belongs to the new settings
    again = np.load(generate_samples(pipe, tmp_path / "s", settings(seed=4), overwrite=True))
    fresh = np.load(generate_samples(pipe, tmp_path / "fresh", settings(seed=4)))
    assert np.array_equal(again["arr_0"], fresh["arr_0"]) and again["arr_1"].tolist() == fresh["arr_1"].tolist()
    assert not np.array_equal(again["arr_0"], first["arr_0"])
    manifest = json.loads(str(again["moh_dit_manifest"]))
    assert manifest["identity"]["seed"] == 4 and manifest["count"] == 6 and manifest["model"]["step"] == 4


def test_a_sample_set_whose_settings_the_model_cannot_sample_is_redrawn_by_the_corrected_command(
    run_dir, tmp_path, caplog
):
    from moh_dit.errors import ConfigError

    from ..helpers.factories import run_in_process

    folder = tmp_path / "d"
    args = [run_dir, "--num-samples", "4", "--sample-dir", folder, "--num-steps", "2", "--batch-size", "4"]
    with pytest.raises(ConfigError, match=r"guidance_channels=9: this model has \d channel"):
        run_in_process("sample", [*args, "--guidance-channels", "9"], caplog)
    assert not folder.exists()  # checked before anything is written
    folder.mkdir()  # a folder left by a version that wrote its manifest first
    (folder / "manifest.json").write_text(json.dumps({"kind": "samples", "identity": {"guidance_channels": 9}}))
    run_in_process("sample", args, caplog)
    assert len(list(folder.glob("*.png"))) == 4 and sample_npz_path(folder).is_file()


def test_sample_py_draws_an_autoguided_grid_and_guided_by_itself_the_unguided_one(run_dir, tmp_path, caplog):
    from PIL import Image

    from moh_dit.errors import ConfigError

    from ..helpers.factories import run_in_process

    def grid(name, *extra):
        args = [run_dir, "--num-steps", "3", "--per-class", "2", "--out", tmp_path / f"{name}.png", *extra]
        return run_in_process("sample", [*args, "--save-images", tmp_path / name], caplog)

    logged = grid("guided", "--cfg-scale", "3", "--guide-model", run_dir / "checkpoints" / "step-00000002")
    assert "autoguidance 3 by" in logged and (tmp_path / "guided.png").is_file()
    grid("self", "--cfg-scale", "3", "--guide-model", run_dir, "--guide-step", "4")  # the newest weights: itself
    grid("plain", "--cfg-scale", "1")
    pixels = {
        n: [np.asarray(Image.open(p)) for p in sorted((tmp_path / n).glob("*.png"))]
        for n in ("self", "plain", "guided")
    }
    assert all(np.array_equal(a, b) for a, b in zip(pixels["self"], pixels["plain"])) and len(pixels["self"]) == 4
    assert not all(np.array_equal(a, b) for a, b in zip(pixels["guided"], pixels["plain"]))
    with pytest.raises(ConfigError, match="has no checkpoint at step 3"):
        grid("bad", "--guide-model", run_dir, "--guide-step", "3")


def test_a_sample_sets_identity_names_the_sampler_that_draws_it(run_dir, tmp_path):
    # the sampler a spec names is swapped in before the manifest is written: a pipeline that has not sampled yet
    # records it too (it once recorded its own DDPM, and only the calls after its first sampled set were right)
    pipe = load_pipeline(run_dir, device="cpu")
    assert type(pipe.scheduler).__name__ == "DDPMScheduler"
    npz = generate_samples(pipe, tmp_path / "solver", settings(scheduler="dpm-solver"))
    identity = json.loads(str(np.load(npz)["moh_dit_manifest"]))["identity"]
    assert identity["scheduler"]["name"] == "DPMSolverMultistepScheduler"
    fresh = load_pipeline(run_dir, device="cpu")  # resumed by a pipeline that still holds its DDPM
    assert generate_samples(fresh, tmp_path / "solver", settings(scheduler="dpm-solver")) == npz
    loaded = load_pipeline(run_dir, device="cpu", scheduler="dpm-solver")  # the same images as the solver's own
    same = np.load(generate_samples(loaded, tmp_path / "loaded", settings()))
    assert np.array_equal(same["arr_0"], np.load(npz)["arr_0"])
    with pytest.raises(ArtifactError, match=r"other settings \(scheduler\.algorithm_type"):  # another sampler
        generate_samples(load_pipeline(run_dir, device="cpu"), tmp_path / "solver", settings())


def test_a_guidance_interval_is_part_of_what_made_the_samples(run_dir, tmp_path, monkeypatch):
    from moh_dit.sampling.spec import GuidanceSpec

    seen, guided_at = [], GuidanceSpec.guided_at
    monkeypatch.setattr(GuidanceSpec, "guided_at", lambda self, *a: seen.append(self.interval) or guided_at(self, *a))
    pipe = load_pipeline(run_dir, device="cpu")
    plain = generate_samples(pipe, tmp_path / "plain", settings())
    assert "guidance_interval" not in json.loads(str(np.load(plain)["moh_dit_manifest"]))["identity"]
    with pytest.raises(ArtifactError, match=r"guidance_interval: '<absent>' -> \[100, 600\]"):
        generate_samples(pipe, tmp_path / "plain", settings(guidance_interval=(100, 600)))
    banded = np.load(generate_samples(pipe, tmp_path / "banded", settings(guidance_interval=[100, 600])))
    assert json.loads(str(banded["moh_dit_manifest"]))["identity"]["guidance_interval"] == [100, 600]
    assert set(seen) == {None, (100, 600)}  # each folder sampled with its own setting (pixels: test_pipeline)
    # an interval holding every timestep is plain guidance: the same record, so the folder is reused
    assert generate_samples(pipe, tmp_path / "plain", settings(guidance_interval=(0, 999))) == plain


def test_grid_averaging_is_part_of_what_made_the_samples(run_dir, tmp_path, monkeypatch):
    import moh_dit.sampling.guidance as guidance
    from moh_dit.sampling.generation import describe_samples

    averaged, shifts = [], guidance.grid_shifts
    monkeypatch.setattr(guidance, "grid_shifts", lambda patch: averaged.append(patch) or shifts(patch))
    pipe = load_pipeline(run_dir, device="cpu")
    plain = generate_samples(pipe, tmp_path / "plain", settings())
    assert "grid_averaging" not in json.loads(str(np.load(plain)["moh_dit_manifest"]))["identity"] and not averaged
    with pytest.raises(ArtifactError, match=r"grid_averaging: '<absent>' -> 500"):
        generate_samples(pipe, tmp_path / "plain", settings(grid_averaging=500))
    made = np.load(generate_samples(pipe, tmp_path / "averaged", settings(grid_averaging=500)))
    manifest = json.loads(str(made["moh_dit_manifest"]))
    assert manifest["identity"]["grid_averaging"] == 500 and averaged  # each folder made with its own setting
    assert describe_samples(manifest).endswith("at every step, patch grids averaged at timesteps 0-500")
    assert not np.array_equal(made["arr_0"], np.load(plain)["arr_0"])
    with pytest.raises(ValueError, match="grid_averaging must be a timestep"):
        generate_samples(pipe, tmp_path / "bad", settings(grid_averaging=-3))


def test_sample_py_takes_the_models_recorded_guidance_unless_told(run_dir):
    from argparse import Namespace

    from moh_dit.sampling.options import spec_from_args
    from moh_dit.sampling.spec import SamplingSpec

    record = SamplingSpec.create(guidance_scale=2.5, guidance_interval=[100, 600], grid_averaging=100)
    cases = [
        (dict(cfg_scale=None, guidance_interval=None), record, (2.5, (100, 600), 100)),
        (dict(cfg_scale=None, guidance_interval=[0, 999]), record, (2.5, None, 100)),  # the interval flag wins
        (dict(cfg_scale=None, grid_averaging=50), record, (2.5, (100, 600), 50)),  # and the averaging flag
        (dict(cfg_scale=None, grid_averaging="off"), record, (2.5, (100, 600), None)),  # off included
        # a flag overrides its own field only: a scale alone keeps the recorded interval and grid averaging
        (dict(cfg_scale=1.5, guidance_interval=None), record, (1.5, (100, 600), 100)),
        (dict(cfg_scale=1.5, grid_averaging=200), record, (1.5, (100, 600), 200)),
        (dict(cfg_scale=1.5, guidance_interval=[0, 999], grid_averaging="off"), record, (1.5, None, None)),  # DiT's
        (dict(cfg_scale=None, guidance_interval=None), None, (4.0, None, None)),  # no record: the grid default
    ]
    for given, rec, want in cases:
        options = dict(protocol="fast", scheduler=None, num_steps=None, guidance_channels=None)
        args = Namespace(**(options | dict(guidance_interval=None, grid_averaging=None) | given))
        spec = spec_from_args(args, rec)
        assert (spec.guidance.scale, spec.guidance.interval, spec.sampler.grid_averaging) == want
    bad = dict(protocol="fast", scheduler=None, num_steps=None, guidance_channels=None, grid_averaging=None)
    with pytest.raises(ValueError, match=r"guidance_interval must be .* got \[600, 100\]"):
        spec_from_args(Namespace(cfg_scale=None, guidance_interval=[600, 100], **bad), record)


def test_the_grid_averaging_flag_takes_a_timestep_or_off(capsys):
    from moh_dit.cli.sample import build_parser

    parse = build_parser().parse_args
    assert parse(["run", "--grid-averaging", "100"]).grid_averaging == 100
    assert parse(["run", "--grid-averaging", "OFF"]).grid_averaging == "off"
    assert parse(["run"]).grid_averaging is None  # the model's own
    for bad in ("1000", "-1", "soon"):
        with pytest.raises(SystemExit):
            parse(["run", "--grid-averaging", bad])
        assert "--grid-averaging" in capsys.readouterr().err


def test_images_from_elsewhere_are_not_repacked(run_dir, tmp_path):
    from PIL import Image

    folder = tmp_path / "foreign"
    folder.mkdir()
    for i in range(6):
        Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(folder / f"{i:06d}.png")
    with pytest.raises(ArtifactError, match="6 images without a moh-dit manifest"):
        generate_samples(load_pipeline(run_dir, device="cpu"), folder, settings())


def test_sample_folders_whose_names_differ_after_a_dot_keep_separate_npz(run_dir, tmp_path):
    pipe = load_pipeline(run_dir, device="cpu")
    a = generate_samples(pipe, tmp_path / "cfg1.5", settings(guidance_scale=1.5))
    b = generate_samples(pipe, tmp_path / "cfg1.0", settings(guidance_scale=1.0))
    assert a == tmp_path / "cfg1.5.npz" and b == tmp_path / "cfg1.0.npz" and a.exists() and b.exists()
    assert json.loads(str(np.load(a)["moh_dit_manifest"]))["identity"]["guidance_scale"] == 1.5


def test_non_finite_settings_and_weights_stop_sampling(run_dir, tmp_path):
    from moh_dit.errors import ConfigError, NonFiniteSampleError

    pipe = load_pipeline(run_dir, device="cpu")
    for bad in (dict(guidance_scale=float("nan")), dict(guidance_scale=float("inf")), dict(num_inference_steps=0)):
        with pytest.raises(ConfigError):
            generate_samples(pipe, tmp_path / "bad", settings(**bad))
        with pytest.raises(ConfigError):
            pipe([0], progress=False, **bad)
    with torch.no_grad():
        pipe.transformer.final_layer.linear.bias.fill_(3e38)  # finite weights whose outputs overflow
    with pytest.raises(NonFiniteSampleError, match="NaN or infinite"):
        pipe([0, 1], num_inference_steps=2, progress=False)
    broken = tmp_path / "nan-pipe"
    pipe.transformer.final_layer.linear.bias.data.fill_(float("nan"))
    pipe.save_pretrained(broken)
    with pytest.raises(ArtifactError, match="not finite or have exploded"):
        load_pipeline(broken, device="cpu")


def test_a_run_loads_its_newest_weights_and_says_which(run_dir, tmp_path, caplog):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    old_pipeline = tmp_path / "pipeline-step4"
    shutil.copytree(run / "pipeline", old_pipeline)
    cfg = tiny_train_overrides(
        run, run_dir.parent / "images", "train.resume=latest", "train.max_steps=6", "preview.per_class=0"
    )
    train(load_config(None, cfg))
    shutil.rmtree(run / "pipeline")
    shutil.copytree(old_pipeline, run / "pipeline")  # an export older than the newest checkpoint
    with caplog.at_level("INFO"):
        pipe = load_pipeline(run, device="cpu")
    assert "step-00000006 (step 6); newer than the exported pipeline (step 4)" in caplog.text
    assert pipe.provenance["step"] == 6 and pipe.provenance["kind"] == "checkpoint"
    newest = load_pipeline(run / "checkpoints" / "step-00000006", device="cpu")
    for a, b in zip(pipe.transformer.state_dict().values(), newest.transformer.state_dict().values()):
        assert torch.equal(a, b)


def test_two_processes_give_bit_identical_samples_and_log_the_world_size(run_dir, tmp_path):
    # sample.py's default (the fast protocol's solver) against the same solver in this process, autoguided by the
    # run's step-2 checkpoint: each process loads the guide, and the images are the one process's
    guide = run_dir / "checkpoints" / "step-00000002"
    pipe = load_pipeline(run_dir, device="cpu", scheduler=PROTOCOLS["fast"][0])
    guided = settings(num_samples=7)
    guided.sampling = guided.sampling.replace(guide=str(guide))
    single = np.load(generate_samples(pipe, tmp_path / "one", guided))
    args = ["--num-samples", "7", "--seed", "3", "--batch-size", "4", "--cfg-scale", "2.0", "--num-steps", "4"]
    args += ["--guide-model", str(guide)]
    result = run_command(torchrun(ROOT / "sample.py", run_dir, "--sample-dir", tmp_path / "two", *args))
    assert "2 process(es)" in result.stderr
    two = np.load(tmp_path / "two.npz")
    assert np.array_equal(single["arr_0"], two["arr_0"]) and single["arr_1"].tolist() == two["arr_1"].tolist()
    assert json.loads(str(two["moh_dit_manifest"]))["identity"]["guide"]["transformer_sha256"]


# ----------------------------------------------------------------------------------------------------
# The VAE of a latent-space pipeline: its own is checked, a replacement must share its latent space
# ----------------------------------------------------------------------------------------------------
@pytest.fixture
def latent_pipeline(tmp_path):
    from moh_dit.sampling.pipeline import MoHDiTPipeline

    from ..helpers.factories import tiny_model, tiny_vae

    MoHDiTPipeline.build(tiny_model(in_channels=4, signal=0.1), tiny_vae(), {0: "a", 1: "b", 2: "c"}).save(
        tmp_path / "pipe", {"test": True}
    )
    return tmp_path / "pipe"


def _a_vae(tmp_path, name, **config):
    """A tiny VAE saved as ``name``: ``config`` changes its architecture numbers, none changes its weights."""
    from diffusers import AutoencoderKL

    from ..helpers.factories import tiny_vae

    vae = tiny_vae()
    if config:
        vae = AutoencoderKL.from_config(vae.config, **config)
    else:
        with torch.no_grad():
            vae.decoder.conv_out.bias.add_(0.1)  # the same latent space, another decoder (ft-EMA vs ft-MSE)
    vae.save_pretrained(tmp_path / name)
    return str(tmp_path / name)


def test_a_pipeline_whose_vae_was_swapped_is_refused(latent_pipeline, tmp_path):
    import shutil

    load_pipeline(latent_pipeline, device="cpu")
    other = _a_vae(tmp_path, "other")
    shutil.rmtree(latent_pipeline / "vae")
    shutil.copytree(other, latent_pipeline / "vae")
    with pytest.raises(ArtifactError, match="VAE in .* is not the one its manifest records"):
        load_pipeline(latent_pipeline, device="cpu")
    assert load_pipeline(latent_pipeline, device="cpu", vae=other).vae is not None  # chosen on purpose


def test_a_replacement_vae_must_share_the_models_latent_space(latent_pipeline, tmp_path, caplog):
    import logging

    with pytest.raises(ArtifactError, match="makes 8-channel latents but this model works on 4-channel"):
        load_pipeline(latent_pipeline, device="cpu", vae=_a_vae(tmp_path, "c8", latent_channels=8))
    with pytest.raises(ArtifactError, match=r"not in the latent space .* \(scaling_factor: 0.18215 -> 0.5\)"):
        load_pipeline(latent_pipeline, device="cpu", vae=_a_vae(tmp_path, "s05", scaling_factor=0.5))
    with pytest.raises(ArtifactError, match=r"downsample_factor: 2 -> 4"):
        load_pipeline(
            latent_pipeline,
            device="cpu",
            vae=_a_vae(
                tmp_path,
                "d4",
                block_out_channels=[8, 16, 16],
                down_block_types=["DownEncoderBlock2D"] * 3,
                up_block_types=["UpDecoderBlock2D"] * 3,
            ),
        )
    with caplog.at_level(logging.INFO, logger="moh_dit"):
        pipe = load_pipeline(
            latent_pipeline,
            device="cpu",
            vae=_a_vae(
                tmp_path,
                "ft",
            ),
        )
    assert "decoding with VAE" in caplog.text and "instead of the one the model was trained with" in caplog.text
    assert pipe(class_labels=[0], num_inference_steps=2, output_type="np").images.shape == (1, 16, 16, 3)


def test_a_pixel_space_model_takes_no_vae(run_dir, tmp_path):
    from moh_dit.errors import ConfigError

    with pytest.raises(ConfigError, match="pixel space .* does not apply"):
        load_pipeline(run_dir, device="cpu", vae=_a_vae(tmp_path, "v"))
