"""What moh-dit 0.3 wrote still loads and gives the same numbers (recorded with 0.3's own code by
tests/reference_outputs/record_moh_dit_0_3.py): its run, stopped at step 2, resumes to the losses and EMA weights of
its uninterrupted twin; its exported pipeline draws the same images, bit for bit, with DDPM and DPM-Solver++ (a
guidance interval and grid averaging included)."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from .helpers.factories import make_image_folder, tiny_train_config

RECORDS = Path(__file__).resolve().parent / "reference_outputs" / "moh_dit_0_3"
MADE = json.loads((RECORDS / "records.json").read_text())


def test_a_run_of_0_3_resumes_to_the_losses_and_weights_it_would_have_had(tmp_path):
    from moh_dit.manifests import fingerprint_module
    from moh_dit.sampling.loading import load_pipeline
    from moh_dit.training.config import load_config
    from moh_dit.training.trainer import train

    make_image_folder(tmp_path / "images")  # the same images (their fingerprint is the run's)
    run = tmp_path / "run"
    shutil.copytree(RECORDS / "cut-run", run)
    config = tiny_train_config(run, tmp_path / "images")
    train(load_config(config, [*MADE["overrides"], "train.max_steps=4", "train.resume=latest"]))
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    losses = [[r["step"], r["diffusion_loss"], r["moh_loss"]] for r in records]
    assert losses == MADE["whole_run_losses"]
    resumed = load_pipeline(run / "pipeline", device="cpu").transformer
    # the weights 0.3's whole run exported: bit for bit on a CPU like the one that recorded them; another CPU's
    # kernels sum in another order (AVX-512 or AVX2), which leaves the losses equal and the weights 1.5e-8 apart (an
    # AMD EPYC), so the fingerprint is checked where it can hold and the values everywhere
    recorded = load_pipeline(RECORDS / "pipeline", device="cpu").transformer
    for key, value in resumed.state_dict().items():
        torch.testing.assert_close(value, recorded.state_dict()[key], rtol=0, atol=1e-6)
    exact = fingerprint_module(resumed) == fingerprint_module(recorded)
    assert exact or not _cpu_of_the_records(), "on the recording CPU the resumed weights must be bit for bit 0.3's"
    assert resumed.config.get("objective") is None  # still DiT's DDPM, recorded as 0.3 recorded it


def _cpu_of_the_records() -> bool:
    """Whether this CPU has AVX-512 as the one that recorded the 0.3 artifacts had (its kernels' order of sums)."""
    try:
        return "avx512f" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


def test_a_pipeline_of_0_3_draws_the_same_images():
    from moh_dit.sampling.grids import sample_grid
    from moh_dit.sampling.loading import load_pipeline
    from moh_dit.sampling.spec import SamplingSpec

    pipe = load_pipeline(RECORDS / "pipeline", device="cpu")
    samples = np.load(RECORDS / "samples.npz")
    for name, record in MADE["sampling"].items():
        images, _ = sample_grid(pipe, [0, 1], 2, 7, SamplingSpec.from_record(record))
        assert np.array_equal(images, samples[name]), name


# ----------------------------------------------------------------------------------------------------
# moh-dit 0.4 (flow matching, DiT's block): recorded by tests/reference_outputs/record_moh_dit_0_4.py
# ----------------------------------------------------------------------------------------------------
RECORDS_0_4 = Path(__file__).resolve().parent / "reference_outputs" / "moh_dit_0_4"
MADE_0_4 = json.loads((RECORDS_0_4 / "records.json").read_text())


def test_a_flow_run_of_0_4_resumes_to_the_losses_it_would_have_had(tmp_path):
    from moh_dit.sampling.loading import load_pipeline
    from moh_dit.training.config import load_config
    from moh_dit.training.tracking import objective_loss
    from moh_dit.training.trainer import train

    make_image_folder(tmp_path / "images")
    run = tmp_path / "run"
    shutil.copytree(RECORDS_0_4 / "cut-run", run)
    config = tiny_train_config(run, tmp_path / "images")
    train(load_config(config, [*MADE_0_4["overrides"], "train.max_steps=4", "train.resume=latest"]))
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    losses = [[r["step"], objective_loss(r)[1], r["moh_loss"]] for r in records]
    # to the rounding of another CPU's kernels: an AMD EPYC (AVX-512) gave MoH's loss at step 3 2e-7 apart, relative
    assert losses == [pytest.approx(row, rel=1e-6, abs=0) for row in MADE_0_4["whole_run_losses"]]
    resumed = load_pipeline(run / "pipeline", device="cpu").transformer
    recorded = load_pipeline(RECORDS_0_4 / "pipeline", device="cpu").transformer
    assert resumed.config.get("block") is None and resumed.config.objective["name"] == "flow"
    for key, value in resumed.state_dict().items():  # to the rounding of another CPU's kernels (see above)
        torch.testing.assert_close(value, recorded.state_dict()[key], rtol=0, atol=1e-6)


def test_a_flow_pipeline_of_0_4_gives_the_same_outputs_and_images():
    from safetensors.torch import load_file

    from moh_dit.sampling.grids import sample_grid
    from moh_dit.sampling.loading import load_pipeline
    from moh_dit.sampling.spec import SamplingSpec

    pipe = load_pipeline(RECORDS_0_4 / "pipeline", device="cpu")
    assert pipe.transformer.block_options.record() is None  # DiT's block, as 0.4 made it
    forward = load_file(RECORDS_0_4 / "forward.safetensors")
    with torch.no_grad():
        out = pipe.transformer(forward["x"], forward["t"], forward["y"]).sample
    # another CPU's kernels sum in another order: 2e-9 apart on an AMD EPYC; the images below stay bit for bit
    torch.testing.assert_close(out, forward["out"], rtol=0, atol=1e-6)
    samples = np.load(RECORDS_0_4 / "samples.npz")
    for name, record in MADE_0_4["sampling"].items():
        images, _ = sample_grid(pipe, [0, 1], 2, 7, SamplingSpec.from_record(record))
        assert np.array_equal(images, samples[name]), name
