"""What a run logs about the hardware: the gradient norm before clipping, model TFLOP/s, MFU, peak memory."""

import json
import math

import pytest
import torch
from safetensors.torch import load_file

from moh_dit.model.flops import forward_flops
from moh_dit.model.presets import create_model
from moh_dit.training.throughput import PEAK_TFLOPS, measure_matmul_tflops, peak_memory_gb, peak_tflops

from ..helpers.factories import train_tiny


def records(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_every_record_has_the_gradient_norm_tflops_mfu_and_peak_memory(tmp_path, image_dir):
    out = tmp_path / "run"
    train_tiny(out, image_dir, "optim.grad_clip=0", "log.peak_tflops=2", "preview.per_class=0")
    model = create_model("MoH-DiT-Ti/4-75", hidden_size=32, head_dim=8, patch_size=2, sample_size=8, in_channels=3)
    per_image = forward_flops(model, active_heads=True).training_step()
    for r in records(out):
        assert math.isfinite(r["grad_norm"]) and r["grad_norm"] > 0
        assert r["tflops"] == pytest.approx(r["images_per_s"] * per_image / 1e12)
        assert r["mfu"] == pytest.approx(r["tflops"] / 2) and r["peak_memory_gb"] > 0.05


def test_the_logged_norm_is_before_clipping_and_measuring_it_changes_no_weight(tmp_path, image_dir):
    clipped, every, rarely = tmp_path / "clipped", tmp_path / "every", tmp_path / "rarely"
    train_tiny(clipped, image_dir, "optim.grad_clip=1e-6", "preview.per_class=0")
    assert all(r["grad_norm"] > 1e-3 for r in records(clipped))  # the norm before the clip to 1e-6
    # without clipping the norm is measured on logged steps only; logging every step must not move a weight
    train_tiny(every, image_dir, "optim.grad_clip=0", "log.log_every=1", "preview.per_class=0")
    train_tiny(rarely, image_dir, "optim.grad_clip=0", "log.log_every=3", "preview.per_class=0")
    name = "checkpoints/step-00000004/model/diffusion_pytorch_model.safetensors"
    a, b = load_file(every / name), load_file(rarely / name)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_the_peak_comes_from_the_config_the_data_sheet_or_a_measurement():
    assert peak_tflops(torch.device("cpu"), "no", 3.5) == (3.5, "log.peak_tflops")
    measured, source = peak_tflops(torch.device("cpu"), "no")
    assert measured > 0 and "measured on this CPU" in source
    assert 0 < measure_matmul_tflops(size=256, rounds=3) < 1e3
    assert PEAK_TFLOPS["H100"]["bf16"] == 989.0 and peak_memory_gb(torch.device("cpu")) > 0
