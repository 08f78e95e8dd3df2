"""What moh-dit 0.3 wrote still loads and gives the same numbers (recorded with 0.3's own code by
tests/reference_outputs/record_moh_dit_0_3.py): its run, stopped at step 2, resumes to the losses and EMA weights of
its uninterrupted twin; its exported pipeline draws the same images with DDPM and DPM-Solver++ (a guidance interval
and grid averaging included). Recorded on another CPU: compared to float32's rounding (tests/helpers/recorded.py)."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from .helpers.factories import make_image_folder, tiny_train_config
from .helpers.recorded import assert_images_match_recorded, recorded_rows

RECORDS = Path(__file__).resolve().parent / "reference_outputs" / "moh_dit_0_3"
MADE = json.loads((RECORDS / "records.json").read_text())


def test_a_run_of_0_3_resumes_to_the_losses_and_weights_it_would_have_had(tmp_path):
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
    # recorded on another CPU: equal to float32's rounding (an Intel Xeon gave step 3's loss 1.2e-7 apart)
    assert losses == recorded_rows(MADE["whole_run_losses"])
    resumed = load_pipeline(run / "pipeline", device="cpu").transformer
    # the weights 0.3's whole run exported, to the rounding of another CPU's kernels (1.5e-8 apart on an AMD EPYC);
    # bit for bit belongs to a straight run against its resumed twin on one machine (tests/training/test_trainer.py)
    recorded = load_pipeline(RECORDS / "pipeline", device="cpu").transformer
    for key, value in resumed.state_dict().items():
        torch.testing.assert_close(value, recorded.state_dict()[key], rtol=0, atol=1e-6)
    assert resumed.config.get("objective") is None  # still DiT's DDPM, recorded as 0.3 recorded it


def test_a_pipeline_of_0_3_draws_the_same_images():
    from moh_dit.sampling.grids import sample_grid
    from moh_dit.sampling.loading import load_pipeline
    from moh_dit.sampling.spec import SamplingSpec

    pipe = load_pipeline(RECORDS / "pipeline", device="cpu")
    samples = np.load(RECORDS / "samples.npz")
    for name, record in MADE["sampling"].items():
        images, _ = sample_grid(pipe, [0, 1], 2, 7, SamplingSpec.from_record(record))
        assert_images_match_recorded(images, samples[name])


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
    assert losses == recorded_rows(MADE_0_4["whole_run_losses"])
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
    # another CPU's kernels sum in another order: 2e-9 apart on an AMD EPYC; the images to a level on a few pixels
    torch.testing.assert_close(out, forward["out"], rtol=0, atol=1e-6)
    samples = np.load(RECORDS_0_4 / "samples.npz")
    for name, record in MADE_0_4["sampling"].items():
        images, _ = sample_grid(pipe, [0, 1], 2, 7, SamplingSpec.from_record(record))
        assert_images_match_recorded(images, samples[name])


def test_recorded_numbers_are_compared_to_float32s_rounding_and_no_further():
    recorded = MADE["whole_run_losses"]
    # what an Intel Xeon gave at step 3 where the recording CPU gave 1.005635380744934 (another order of sums)
    xeon = [row if row[0] != 3 else [3, 1.0056354999542236, row[2]] for row in recorded]
    assert xeon == recorded_rows(recorded) and xeon != recorded
    assert [[s, loss * (1 + 1e-3), moh] for s, loss, moh in recorded] != recorded_rows(recorded)  # not a real change
    assert [[s + 1, loss, moh] for s, loss, moh in recorded] != recorded_rows(recorded)

    images = np.load(RECORDS / "samples.npz")["ddpm"]
    nudged = images.copy()
    nudged.flat[0] = nudged.flat[0] + 1 if nudged.flat[0] < 255 else 254  # a pixel on a rounding boundary
    assert_images_match_recorded(nudged, images)
    far = images.copy()
    far.flat[0] = 0 if far.flat[0] > 127 else 255
    with pytest.raises(AssertionError, match="levels from the recorded image"):
        assert_images_match_recorded(far, images)
    shifted = np.where(images < 255, images + 1, 254).astype(images.dtype)
    with pytest.raises(AssertionError, match="of the pixels moved a level"):
        assert_images_match_recorded(shifted, images)
