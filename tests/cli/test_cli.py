"""The command-line entry points: bad input ends with one line (exit code 2), never a traceback; help texts
show their examples as written."""

import ast
import importlib
import os
import pickle
import shutil
from pathlib import Path

import numpy as np
import pytest

import evaluate_fid
import sample
import train as train_script
from moh_dit.cli import COMMANDS
from moh_dit.cli.common import one_line, run_cli
from moh_dit.training.config import load_config
from moh_dit.training.trainer import train

from ..helpers.factories import make_image_folder, tiny_train_overrides, tiny_vae

ROOT = Path(__file__).resolve().parents[2]

UNWRITABLE = "/proc/moh-dit-cannot-write-here"  # not even root can create files in /proc


class NotATensor:
    """Pickled into a checkpoint: anything but tensors must be refused, not unpickled."""


@pytest.fixture(autouse=True)
def no_debug(monkeypatch):
    monkeypatch.delenv("MOH_DIT_DEBUG", raising=False)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    make_image_folder(root / "images")
    train(load_config(None, tiny_train_overrides(root / "run", root / "images", "preview.per_class=0")))
    return root


def fails_in_one_line(main, args, capsys, progress_lines_before: bool = False) -> str:
    """Run a command's main as the shell would; it must exit with 2 and print exactly one line (after
    progress lines of a download attempt, where allowed)."""
    with pytest.raises(SystemExit) as exc:
        run_cli(lambda: main(args))
    err = capsys.readouterr().err
    assert exc.value.code == 2, err
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    if progress_lines_before:
        assert all(ln.startswith("Downloading") for ln in lines[:-1]), err
        lines = lines[-1:]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


def usage_error(main, args, capsys) -> str:
    """An argparse usage error: exit code 2, usage and one error line, no traceback."""
    with pytest.raises(SystemExit) as exc:
        run_cli(lambda: main(args))
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "Traceback" not in err and "error:" in err, err
    return err.strip().splitlines()[-1]


def train_args(world, out, *extra):
    return tiny_train_overrides(world / out, world / "images", "preview.per_class=0", *extra)


# ----------------------------------------------------------------------------------------------------
# train.py
# ----------------------------------------------------------------------------------------------------
def test_data_problems(world, tmp_path, capsys):
    assert "does not exist" in fails_in_one_line(
        train_script.main, train_args(world, "a", "data.path=/nonexistent"), capsys
    )
    (tmp_path / "empty").mkdir()
    assert "no images" in fails_in_one_line(
        train_script.main, train_args(world, "b", f"data.path={tmp_path / 'empty'}"), capsys
    )
    (tmp_path / "noimg" / "cls").mkdir(parents=True)
    (tmp_path / "noimg" / "cls" / "readme.txt").write_text("x")
    assert "no images" in fails_in_one_line(
        train_script.main, train_args(world, "c", f"data.path={tmp_path / 'noimg'}"), capsys
    )
    shutil.copytree(world / "images", tmp_path / "corrupt")
    for f in (tmp_path / "corrupt").rglob("*.png"):
        f.write_bytes(b"broken")
    line = fails_in_one_line(
        train_script.main, train_args(world, "d", f"data.path={tmp_path / 'corrupt'}", "data.num_workers=1"), capsys
    )
    assert "are unreadable" in line and "Original Traceback" not in line


def test_bad_values_and_config_files(world, tmp_path, capsys):
    for override, message in (
        ("log.log_every=0", "log.log_every must be >= 1"),
        ("ema.update_every=0", "ema.update_every must be >= 1"),
        ("train.resume=123", "train.resume must be 'latest'"),
        ("model.overrides=foo", "model.overrides must be a mapping"),
        (f"train.output_dir={UNWRITABLE}", "not writable"),
    ):
        args = (
            train_args(world, "v", override) if "output_dir" not in override else [*train_args(world, "v"), override]
        )
        assert message in fails_in_one_line(train_script.main, args, capsys)
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("train:\n  max_steps: [1, 2\n")
    assert "is not valid YAML" in fails_in_one_line(train_script.main, ["--config", str(bad_yaml)], capsys)


def test_a_non_finite_stop_is_one_line(world, capsys):
    line = fails_in_one_line(
        train_script.main, train_args(world, "nan", "optim.lr=1e30", "train.max_steps=20"), capsys
    )
    assert "exploded" in line or "non-finite loss" in line


# ----------------------------------------------------------------------------------------------------
# sample.py
# ----------------------------------------------------------------------------------------------------
def test_sampling_arguments_and_devices(world, capsys):
    run = str(world / "run")
    for args, message in (
        (["--cfg-scale", "nan"], "finite"),
        (["--cfg-scale", "inf"], "finite"),
        (["--num-steps", "0"], ">= 1"),
        (["--batch-size", "0"], ">= 1"),
        (["--batch-size", "-1"], ">= 1"),
        (["--per-class", "0"], ">= 1"),
        (["--num-samples", "-3"], ">= 1"),
    ):
        assert message in usage_error(sample.main, [run, *args], capsys)
    assert "no CUDA GPU" in fails_in_one_line(sample.main, [run, "--device", "cuda", "--out", "/tmp/x.png"], capsys)
    assert "VAE folder /nonexistent does not exist" in fails_in_one_line(
        sample.main, [run, "--vae", "/nonexistent"], capsys
    )


@pytest.mark.parametrize(
    "args, message",
    [
        (["--num-samples", "0"], "--num-samples: must be >= 1"),
        (["--sample-dir", "s"], "--sample-dir holds --num-samples images: give --num-samples too"),
        (["--num-samples", "4", "--class-labels", "Bag"], "--class-labels draw a grid; --num-samples draws N images"),
        (["--num-samples", "4", "--per-class", "2", "--out", "g.png"], "--per-class, --out draw a grid"),
        (["--out", "grid.txt"], "--out grid.txt: give an image file name"),
    ],
)
def test_sample_options_of_the_other_mode_are_errors_not_ignored(args, message, capsys):
    from moh_dit.cli import sample as sample_command

    with pytest.raises(SystemExit):
        sample_command.main(["no-such-run", *args])  # refused before the model is even looked at
    assert message in capsys.readouterr().err


def test_evaluating_given_samples_refuses_sampling_options(capsys):
    from moh_dit.cli import evaluate

    with pytest.raises(SystemExit):
        evaluate.main(["--samples", "s.npz", "--reference", "r.npz", "--cfg-scale", "2", "--sample-dir", "d"])
    assert "--cfg-scale, --sample-dir choose how --model is sampled; --samples are scored as they are" in (
        capsys.readouterr().err
    )


def test_sampling_protocols_choose_scheduler_and_steps_unless_given(world, tmp_path):
    import json

    from moh_dit.cli import evaluate
    from moh_dit.cli import sample as sample_command
    from moh_dit.sampling.options import spec_from_args
    from moh_dit.sampling.spec import PROTOCOLS

    def chosen(module, *args):
        spec = spec_from_args(module.build_parser().parse_args([*args]))
        return spec.sampler.scheduler, spec.sampler.num_steps

    assert chosen(sample_command, "run") == PROTOCOLS["fast"]  # sample.py: the fast protocol of the sampler study
    assert chosen(evaluate, "--reference", "r.npz", "--model", "m") == ("ddpm", 250)  # DiT's, for paper parity
    assert chosen(sample_command, "run", "--protocol", "dit") == ("ddpm", 250)
    assert chosen(sample_command, "run", "--protocol", "dit", "--num-steps", "50") == ("ddpm", 50)
    assert chosen(sample_command, "run", "--scheduler", "ddim") == ("ddim", PROTOCOLS["fast"][1])
    # and the samples record the scheduler that made them
    for protocol, name in (("fast", "DPMSolverMultistepScheduler"), ("dit", "DDPMScheduler")):
        folder = tmp_path / protocol
        sample.main(
            [
                str(world / "run"),
                "--num-samples",
                "2",
                "--num-steps",
                "2",
                "--protocol",
                protocol,
                "--sample-dir",
                str(folder),
            ]
        )
        manifest = json.loads((folder / "manifest.json").read_text())
        assert manifest["identity"]["scheduler"]["name"] == name


def test_outputs_are_checked_before_sampling(world, capsys, monkeypatch):
    from moh_dit.sampling.pipeline import MoHDiTPipeline

    monkeypatch.setattr(MoHDiTPipeline, "__call__", lambda *a, **k: pytest.fail("sampled before checking the output"))
    run = str(world / "run")
    assert "not writable" in fails_in_one_line(sample.main, [run, "--out", f"{UNWRITABLE}/grid.png"], capsys)
    assert "not writable" in fails_in_one_line(sample.main, [run, "--save-images", UNWRITABLE], capsys)
    line = fails_in_one_line(sample.main, [run, "--num-samples", "2", "--sample-dir", UNWRITABLE], capsys)
    assert "not writable" in line


def test_damaged_model_folders(world, tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(world / "run" / "checkpoints" / "step-00000004", ckpt)
    (ckpt / "model" / "diffusion_pytorch_model.safetensors").write_bytes(os.urandom(4096))
    assert "cannot be loaded" in fails_in_one_line(sample.main, [str(ckpt), "--num-steps", "2"], capsys)
    shutil.rmtree(ckpt)
    shutil.copytree(world / "run" / "checkpoints" / "step-00000004", ckpt)
    (ckpt / "ema.safetensors").write_bytes(os.urandom(4096))
    assert "ema.safetensors is damaged" in fails_in_one_line(sample.main, [str(ckpt), "--num-steps", "2"], capsys)
    pipe = tmp_path / "pipe"
    shutil.copytree(world / "run" / "pipeline", pipe)
    weights = pipe / "transformer" / "diffusion_pytorch_model.safetensors"
    weights.unlink()
    with open(pipe / "transformer" / "diffusion_pytorch_model.bin", "wb") as f:
        pickle.dump({"x": 1}, f)
    assert "cannot be loaded" in fails_in_one_line(sample.main, [str(pipe), "--num-steps", "2"], capsys)


# ----------------------------------------------------------------------------------------------------
# evaluate_fid.py and the module commands
# ----------------------------------------------------------------------------------------------------
def test_evaluation_inputs(world, tmp_path, capsys):
    np.savez(tmp_path / "s.npz", arr_0=np.zeros((4, 8, 8, 3), np.uint8))
    data = (tmp_path / "s.npz").read_bytes()
    (tmp_path / "cut.npz").write_bytes(data[: len(data) // 2])
    line = fails_in_one_line(
        evaluate_fid.main,
        [
            "--samples",
            str(tmp_path / "cut.npz"),
            "--reference",
            str(tmp_path / "s.npz"),
            "--extractor",
            "moh-dit-test-tiny",
            "--extractor-module",
            "tests.helpers.tiny_extractor",
        ],
        capsys,
    )
    assert "not a readable array file" in line
    line = fails_in_one_line(
        evaluate_fid.main,
        [
            "--samples",
            str(tmp_path / "s.npz"),
            "--reference",
            str(tmp_path / "s.npz"),
            "--extractor-module",
            "no_such_mod",
        ],
        capsys,
    )
    assert "cannot import" in line
    line = fails_in_one_line(
        evaluate_fid.main,
        ["--samples", str(tmp_path / "s.npz"), "--reference", str(tmp_path / "s.npz"), "--extractor", "vgg16"],
        capsys,
        progress_lines_before=True,
    )
    assert "could not be downloaded" in line and "--extractor-weights" in line


def test_convert_and_latents_commands(world, tmp_path, capsys):
    from moh_dit.cli import convert, latents

    assert "not writable" in fails_in_one_line(convert.main, [str(world / "run"), f"{UNWRITABLE}/out"], capsys)
    evil = tmp_path / "evil.pt"
    with open(evil, "wb") as f:
        pickle.dump({"model": NotATensor()}, f)
    line = fails_in_one_line(convert.main, [str(evil), str(tmp_path / "out")], capsys)
    assert "refusing to unpickle" in line and "weights_only" not in line
    # junk bytes (an unknown opcode, a KeyError inside the unpickler) and text are damaged files, and moh-dit never
    # repeats torch's advice to retry with weights_only=False
    junk, text = tmp_path / "junk.pt", tmp_path / "notes.pt"
    junk.write_text("hello world this is junk\n")
    text.write_text("# a README\n\nsome words\n")
    for path, reason in ((junk, "unknown pickle opcode 101"), (text, "Unsupported operand 35")):
        line = fails_in_one_line(convert.main, [str(path), str(tmp_path / "out")], capsys)
        assert "is damaged or not a" in line and reason in line and "weights_only" not in line, line
    tiny_vae().save_pretrained(tmp_path / "vae")
    line = fails_in_one_line(
        latents.main,
        [
            "--data-path",
            str(world / "images"),
            "--vae",
            str(tmp_path / "vae"),
            "--out",
            f"{UNWRITABLE}/lat.npy",
            "--image-size",
            "16",
        ],
        capsys,
    )
    assert "not writable" in line


def test_worker_tracebacks_become_their_last_line():
    err = RuntimeError(
        "Caught DataError in DataLoader worker process 0.\nOriginal Traceback (most recent call last):\n"
        '  File "x.py", line 1\nmoh_dit.errors.DataError: 5 of 16 images under /d are unreadable'
    )
    assert one_line(err) == "5 of 16 images under /d are unreadable"


# ----------------------------------------------------------------------------------------------------
# Help texts
# ----------------------------------------------------------------------------------------------------

MODULES = [f"moh_dit.cli.{c}" for c in COMMANDS] + [
    "moh_dit.vae",
    "moh_dit.sampling.loading",
    "moh_dit.training.setup",
]


@pytest.mark.parametrize("target", MODULES)
def test_docstring_examples_keep_their_line_breaks(target):
    """A trailing backslash in a (non-raw) docstring joins two example lines into one."""
    path = Path(importlib.import_module(target).__file__)
    source = path.read_text()
    node = ast.parse(source).body[0]
    assert isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
    assert node.value.value.count("\n") == ast.get_source_segment(source, node).count("\n")


@pytest.mark.parametrize("name", COMMANDS)
def test_help_shows_every_example_line_as_written(name):
    module = importlib.import_module(f"moh_dit.cli.{name}")
    shown = [ln.strip() for ln in module.build_parser(f"moh-dit {name}").format_help().splitlines()]
    written = [ln.strip() for ln in module.__doc__.splitlines() if ln.strip()]
    continued = [ln for ln in written if ln.endswith("\\")]
    assert all(ln in shown for ln in written)
    if name in ("train", "sample", "evaluate", "latents"):
        assert continued, "an example with a line continuation is expected here"


def test_guidance_is_described_and_tagged_the_same_way_everywhere():
    from moh_dit.sampling.spec import SamplingSpec

    def spec(interval=None, averaging=None, scale=4.0):
        return SamplingSpec.create(guidance_scale=scale, guidance_interval=interval, grid_averaging=averaging)

    assert spec().tag() == "" and spec((100, 500)).tag() == "-t100-500"
    assert spec((100, 500), 100).tag() == "-t100-500-avg100" and spec(None, 0).tag() == "-avg0"
    assert spec().placement() == "at every step"
    placed = "at timesteps 100-500, patch grids averaged at timesteps 0-100"
    assert spec([100, 500], 100).placement() == placed
    assert spec((100, 500), 100).describe_guidance() == f"guidance 4 {placed}"
    assert spec(scale=1.5).describe_guidance() == "guidance 1.5 at every step"
    assert spec(scale=1.5).replace(guidance_channels=3).describe_guidance() == (
        "guidance 1.5 on the first 3 channels at every step"
    )
    assert spec((100, 500)).describe() == "dpm-solver, 25 steps, guidance 4 at timesteps 100-500"


def test_flags_and_overrides_mix_in_any_order(tmp_path, capsys):
    """``train.py --config C k=v --init-from P k=v``: every override is taken, wherever the flags stand."""
    import yaml

    from moh_dit import create_model

    create_model("DiT-Ti/4", sample_size=8, in_channels=3, num_classes=2).save_pretrained(tmp_path / "p")
    config = Path(__file__).resolve().parents[2] / "configs" / "fashion_mnist_moh.yaml"
    argv = [
        "--config", str(config), "train.max_steps=2", "--init-from", str(tmp_path / "p"),
        f"train.output_dir={tmp_path / 'd'}", "--print-config",
    ]  # fmt: skip
    train_script.main(argv)
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["train"]["max_steps"] == 2 and printed["train"]["output_dir"] == str(tmp_path / "d")
    assert printed["model"]["init_from"] == str(tmp_path / "p")


def test_sample_writes_under_runs_when_told_no_place_so_that_a_checkout_stays_clean(
    world, tmp_path, monkeypatch, caplog
):
    """Without --out a grid went to samples.png in the working directory (a checkout's, not ignored); it goes to
    runs/samples/, which the repository ignores, and the command says where."""
    from ..helpers.factories import run_in_process

    monkeypatch.chdir(tmp_path)
    run_in_process("sample", [world / "run", "--per-class", "1", "--num-steps", "2"], caplog)
    assert (tmp_path / "runs" / "samples" / "grid.png").is_file() and not (tmp_path / "samples.png").exists()
    ignored = (Path(__file__).resolve().parents[2] / ".gitignore").read_text().splitlines()
    assert "runs/" in ignored


def test_cfg_on_top_of_folded_guidance_is_said_once_and_not_for_a_model_without_it(caplog):
    """--cfg-scale on a student or a model trained with folded guidance stacked on it without a word."""
    import logging

    from moh_dit.cli import sample as sample_command
    from moh_dit.sampling.options import spec_from_args

    args = sample_command.build_parser().parse_args(["run", "--cfg-scale", "2"])
    with caplog.at_level(logging.INFO):
        spec_from_args(args, objective={"name": "meanflow"})
        spec_from_args(args, objective={"name": "flow", "guidance_scale": 4.0})
        spec_from_args(args, objective={"name": "ddpm"})
    said = [r for r in caplog.records if "guidance folded into its training" in r.getMessage()]
    assert len(said) == 2 and "--cfg-scale 2 guides it again" in said[0].getMessage()
