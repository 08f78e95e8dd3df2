"""Post-hoc EMA against the official routines of NVlabs/edm2 (recorded by tests/reference_outputs/record_phema.py):
the width <-> exponent conversions, the decay, the profiles' inner products, the reconstruction coefficients
(to 1e-10) and the tracking recursion (to 1e-6); a reconstruction at a tracked width returns that EMA; and the run:
snapshots in training images, an exact resume, `moh-dit ema` rebuilding and sweeping."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from moh_dit.posthoc_ema import (
    PowerFunctionEMAs,
    gamma_to_sigma_rel,
    posthoc_coefficients,
    power_function_beta,
    power_function_correlation,
    profile_error,
    sigma_rel_to_gamma,
)
from moh_dit.snapshots import read_snapshot_metadata, reconstruct, save_snapshot

from .helpers.factories import make_image_folder

HERE = Path(__file__).resolve().parent / "reference_outputs"
OFFICIAL = json.loads((HERE / "phema_official.json").read_text())
TENSORS = load_file(HERE / "phema_official.safetensors")


@pytest.fixture(scope="module")
def image_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("images")
    make_image_folder(root)
    return root


def test_width_and_exponent_conversions_match_edm2():
    np.testing.assert_allclose(sigma_rel_to_gamma(OFFICIAL["sigma_rel"]), OFFICIAL["gamma"], rtol=1e-12)
    np.testing.assert_allclose(
        gamma_to_sigma_rel([0.5, 2.0, 6.9372, 16.97, 60.0]), OFFICIAL["sigma_of_gamma"], rtol=1e-12
    )
    np.testing.assert_allclose(gamma_to_sigma_rel(sigma_rel_to_gamma(0.07)), 0.07, rtol=1e-12)
    with pytest.raises(ValueError, match="sigma_rel must be in"):
        sigma_rel_to_gamma(0.3)


def test_beta_and_profile_correlations_match_edm2():
    for std, t_next, t_delta, beta in OFFICIAL["beta"]:
        assert power_function_beta(std, t_next, t_delta) == pytest.approx(beta, rel=1e-12)
    for a_t, a_s, b_t, b_s, value in OFFICIAL["correlation"]:
        assert float(power_function_correlation(a_t, a_s, b_t, b_s)) == pytest.approx(value, rel=1e-12)


@pytest.mark.parametrize("case", ["regular", "irregular"])
def test_reconstruction_coefficients_match_edm2_to_1e_10(case):
    c = OFFICIAL["coefficients"][case]
    x = posthoc_coefficients(c["in_t"], c["in_sigma"], c["out_t"], c["out_sigma"])
    np.testing.assert_allclose(x, np.array(c["x"]), rtol=0, atol=1e-10)
    np.testing.assert_allclose(x.sum(axis=0), 1.0, atol=1e-12)


def test_profile_error_is_the_l2_distance_of_the_rebuilt_profile_by_brute_force_integration():
    # snapshots every 500 steps of 16 images of EDM2's two widths; the profile of width s ending at T is
    # (g + 1) tau^g / T^(g + 1) on [0, T]; integrate the squared difference on a fine grid
    t = np.repeat(np.arange(500, 8001, 500) * 16.0, 2)
    s = np.tile([0.05, 0.10], len(t) // 2)
    tau = np.linspace(0, t[-1], 400_001)[1:]

    def profile(end, width):
        g = float(sigma_rel_to_gamma(width))
        return np.where(tau <= end, (g + 1) * (tau / end) ** g / end, 0.0)

    basis = np.stack([profile(a, b) for a, b in zip(t, s)])
    for width in (0.02, 0.03, 0.07, 0.2):
        x = posthoc_coefficients(t, s, t[-1], width)[:, 0]
        want = profile(t[-1], width)
        brute = np.sqrt(np.trapezoid((x @ basis - want) ** 2, tau) / np.trapezoid(want**2, tau))
        assert profile_error(t, s, x, t[-1], width) == pytest.approx(brute, rel=2e-3, abs=1e-4), width
    x = posthoc_coefficients(t, s, t[-1], 0.05)[:, 0]
    assert profile_error(t, s, x, t[-1], 0.05) < 1e-6  # a tracked width at a snapshot's time is exact
    assert profile_error(t, s, posthoc_coefficients(t, s, t[-1], 0.02)[:, 0], t[-1], 0.02) > 0.1  # far outside


def test_the_tracking_recursion_matches_edm2s_power_function_ema():
    torch.manual_seed(0)
    net = torch.nn.Linear(3, 2)
    net.load_state_dict({k.removeprefix("start."): v for k, v in TENSORS.items() if k.startswith("start.")})
    ours = PowerFunctionEMAs(net.parameters(), [0.05, 0.10])
    spec, g = OFFICIAL["recursion"], torch.Generator().manual_seed(OFFICIAL["recursion"]["generator_seed"])
    with torch.no_grad():
        for step in range(1, spec["steps"] + 1):
            for p in net.parameters():
                p.add_(torch.randn(p.shape, generator=g) * spec["step_std"])
            ours.update(step * spec["batch"], spec["batch"])
    names = [n for n, _ in net.named_parameters()]
    for i, std in enumerate((0.05, 0.10)):
        for name, tensor in zip(names, ours.tensors(i)):
            torch.testing.assert_close(tensor, TENSORS[f"ema{std:.2f}.{name}"], rtol=1e-6, atol=1e-7)


def tracked_snapshots(net: torch.nn.Module, folder: Path, dtypes=("float32",)):
    """40 steps of random updates of ``net`` (8 images each) with its EMAs at sigma_rel 0.05 and 0.10, saved every
    10 steps in each of ``dtypes``: the EMAs, the parameter names and the snapshot paths per dtype (oldest first)."""
    emas, names = PowerFunctionEMAs(net.parameters(), [0.05, 0.10]), [n for n, _ in net.named_parameters()]
    paths = {dtype: [] for dtype in dtypes}
    with torch.no_grad():
        for step in range(1, 41):
            for p in net.parameters():
                p.add_(torch.randn(p.shape) * 0.1)
            emas.update(step * 8, 8)
            if step % 10 == 0:
                for dtype, files in paths.items():
                    files.append(folder / f"{dtype}-step-{step:08d}.safetensors")
                    save_snapshot(files[-1], emas, names, step, step * 8, dtype)
    return emas, names, paths


def test_a_reconstruction_at_a_tracked_width_returns_that_ema(tmp_path):
    torch.manual_seed(1)
    emas, names, snapshots = tracked_snapshots(torch.nn.Linear(4, 3), tmp_path)
    paths = snapshots["float32"]
    assert read_snapshot_metadata(paths[-1]) == {
        "step": 40,
        "images": 320,
        "sigma_rels": [0.05, 0.1],
        "dtype": "float32",
    }
    for i, sigma_rel in enumerate((0.05, 0.10)):
        rebuilt, used = reconstruct(paths, sigma_rel, names)
        for name, tensor in zip(names, emas.tensors(i)):
            torch.testing.assert_close(rebuilt[name], tensor, rtol=1e-5, atol=1e-6)
        assert len(used) == 8 and sum(u["coefficient"] for u in used) == pytest.approx(1.0)
    between, _ = reconstruct(paths, 0.07, names)  # another width: something in between, not either EMA
    assert not torch.allclose(between["weight"], emas.tensors(0)[0]) and not torch.allclose(
        between["weight"], emas.tensors(1)[0]
    )
    half, used = reconstruct(paths[:2], 0.05, names)  # at an earlier snapshot: only snapshots up to it
    assert {u["step"] for u in used} == {10, 20}


def test_float16_snapshots_halve_the_files_and_cost_the_reconstruction_their_rounding(tmp_path):
    """What the docs state for ``ema.posthoc_dtype=float16``: half the bytes, and the reconstruction off by the
    snapshots' rounding (float16's unit roundoff 2^-11 ~ 4.9e-4, times the coefficients' absolute sum)."""
    torch.manual_seed(1)
    net = torch.nn.Linear(16, 8)
    _, names, paths = tracked_snapshots(net, tmp_path, ("float32", "float16"))
    tensor_bytes = {
        d: sum(4 * n.numel() if d == "float32" else 2 * n.numel() for n in net.parameters()) * 2 for d in paths
    }
    for dtype, files in paths.items():  # the tensors' bytes plus the same small header
        overhead = files[-1].stat().st_size - tensor_bytes[dtype]
        assert 0 < overhead < 2000, dtype
    for sigma_rel in (0.05, 0.07, 0.10):
        exact, used = reconstruct(paths["float32"], sigma_rel, names)
        rounded, _ = reconstruct(paths["float16"], sigma_rel, names)
        bound = 2**-11 * sum(abs(u["coefficient"]) for u in used)
        for name in names:
            relative = ((rounded[name] - exact[name]).norm() / exact[name].norm()).item()
            assert 1e-5 < relative < bound, (sigma_rel, name, relative)


# ----------------------------------------------------------------------------------------------------
# A run with post-hoc EMA, and `moh-dit ema`
# ----------------------------------------------------------------------------------------------------
def test_a_run_snapshots_in_images_resumes_exactly_and_moh_dit_ema_rebuilds_and_sweeps(tmp_path, image_dir, caplog):
    from moh_dit.run_folder import RunLayout
    from moh_dit.sampling.loading import load_pipeline

    from .helpers.factories import run_in_process, train_tiny
    from .helpers.tiny_extractor import TINY

    common = ("ema.posthoc_every=8", "train.checkpoint_every=3", "preview.per_class=0")  # batch 4: every 2 steps
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    train_tiny(whole, image_dir, *common, "train.max_steps=6")
    train_tiny(cut, image_dir, *common, "train.max_steps=3")
    train_tiny(cut, image_dir, *common, "train.max_steps=6", "train.resume=latest")
    snapshots = RunLayout(whole).list_snapshots()
    assert [s for s, _ in snapshots] == [2, 4, 6]
    assert [read_snapshot_metadata(p)["images"] for _, p in snapshots] == [8, 16, 24]
    for (_, a), (_, b) in zip(snapshots, RunLayout(cut).list_snapshots()):
        x, y = load_file(a), load_file(b)
        assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)  # the resume changed nothing

    out = tmp_path / "ema"
    run_in_process("ema", [whole, "--sigma-rel", "0.07", "--out", out], caplog)
    record = json.loads((out / "manifest.json").read_text())["source"]["posthoc_ema"]
    assert record["sigma_rel"] == 0.07 and record["step"] == 6 and len(record["snapshots"]) == 6
    assert 0 < record["profile_error"] < 0.1  # between the tracked widths: close, not exact
    assert sum(s["coefficient"] for s in record["snapshots"]) == pytest.approx(1.0)
    pipe = load_pipeline(out, device="cpu")
    assert pipe([0], num_inference_steps=2, output_type="np", progress=False).images.shape == (1, 8, 8, 3)
    logged = run_in_process("ema", [whole, "--sigma-rel", "0.07", "--step", "4", "--out", tmp_path / "e4"], caplog)
    assert "rebuilt the EMA of sigma_rel 0.07 at step 4 from 4 snapshots" in logged  # what was made, not loaded
    assert (
        "loaded" not in logged and json.loads((tmp_path / "e4" / "manifest.json").read_text())["source"]["step"] == 4
    )
    with pytest.raises(Exception, match="no snapshot at step 5; it has steps 2, 4, 6"):
        run_in_process("ema", [whole, "--sigma-rel", "0.07", "--step", "5", "--out", tmp_path / "x"], caplog)

    sweep = tmp_path / "sweep"
    scoring = ["--reference", image_dir, "--extractor", TINY, "--extractor-module", "tests.helpers.tiny_extractor"]
    args = [whole, "--sweep", "0.05", "0.1", "--sweep-cfg", "1", "2", *scoring, "--num-samples", "6"]
    run_in_process("ema", [*args, "--num-steps", "2", "--sample-batch-size", "3", "--out", sweep], caplog)
    result = json.loads((sweep / "posthoc_sweep.json").read_text())
    assert [(r["weights"], r["guidance"]) for r in result["rows"]] == [
        (w, g) for w in ("posthoc-0.05", "posthoc-0.1", "fixed-ema") for g in (1.0, 2.0)
    ]
    assert "| posthoc-0.05 | 0.05 | 0.000 | 1 |" in (sweep / "posthoc_sweep.md").read_text()  # a tracked width
    assert [r["profile_error"] for r in result["rows"]][-2:] == [None, None]  # the fixed EMA is not rebuilt
    # a width added later joins the earlier rows (the same run, step and scoring); the fixed EMA is scored again
    args[2:4] = ["0.07"]
    run_in_process("ema", [*args, "--num-steps", "2", "--sample-batch-size", "3", "--out", sweep], caplog)
    added = json.loads((sweep / "posthoc_sweep.json").read_text())
    assert [(r["weights"], r["guidance"]) for r in added["rows"]] == [
        (w, g) for w in ("posthoc-0.05", "posthoc-0.07", "posthoc-0.1", "fixed-ema") for g in (1.0, 2.0)
    ]
    assert [r for r in added["rows"] if r["weights"] != "posthoc-0.07"] == result["rows"]  # reused samples
    run_in_process("ema", [*args, "--num-steps", "3", "--sample-batch-size", "3", "--out", sweep], caplog)
    assert {r["weights"] for r in json.loads((sweep / "posthoc_sweep.json").read_text())["rows"]} == {
        "posthoc-0.07",
        "fixed-ema",
    }  # another sampler: the earlier rows are not mixed in
    (sweep / "posthoc_sweep.json").write_text("{ cut short")  # a damaged table is replaced, not a crash
    run_in_process("ema", [*args, "--num-steps", "3", "--sample-batch-size", "3", "--out", sweep], caplog)
    assert "unreadable or from another sweep" in caplog.text
    assert len(json.loads((sweep / "posthoc_sweep.json").read_text())["rows"]) == 4


@pytest.mark.parametrize(
    "override,message",
    [
        ("ema.posthoc_every=6", "multiple of train.global_batch_size=4"),
        ("ema.posthoc_sigma_rels=[0.05, 0.3]", "between 0 and 0.2887"),
        ("ema.posthoc_dtype=int8", "ema.posthoc_dtype must be one of"),
    ],
)
def test_post_hoc_ema_keys_are_checked(override, message):
    from moh_dit.errors import ConfigError
    from moh_dit.training.config import load_config

    with pytest.raises(ConfigError, match=message):
        load_config(None, ["train.global_batch_size=4", override])
