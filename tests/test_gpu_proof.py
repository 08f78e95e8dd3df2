"""scripts/gpu_proof.sh: its dry run runs every step at toy size here (installing a carried wheel into a temporary
target, the CUDA-marked tests, every measurement) and writes its report; its plan fits the GPU's time."""

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def a_wheel(folder: Path) -> Path:
    """A minimal wheel of a package ``proof_probe`` (what pip needs: the module, METADATA, WHEEL, RECORD)."""
    folder.mkdir(parents=True)
    wheel = folder / "proof_probe-1.0-py3-none-any.whl"
    info = "proof_probe-1.0.dist-info"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("proof_probe.py", "CARRIED = True\n")
        z.writestr(f"{info}/METADATA", "Metadata-Version: 2.1\nName: proof-probe\nVersion: 1.0\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "")
    return wheel


def test_the_dry_run_runs_every_step_and_reports(tmp_path):
    a_wheel(tmp_path / "wheels")
    out = tmp_path / "proof"
    env = dict(os.environ, MOH_DIT_WHEELS=str(tmp_path / "wheels"), PYTHON=sys.executable, OMP_NUM_THREADS="1")
    run = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_proof.sh"), "--dry-run", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    steps = (out / "steps.log").read_text()
    for name in ("install the carried wheels", "versions", "CUDA-marked tests", "measurements"):
        assert f"{name}" in steps and "FAILED" not in steps
    assert "no " not in run.stdout.split("== versions")[0]  # the carried wheel was installed, not skipped
    result = json.loads((out / "gpu_proof_dry_run.json").read_text())
    assert result["dry_run"] and len(result["training"]) == 6 and len(result["sampling"]) == 2
    assert len(result["memory"]) == 4
    assert result["training"][0]["vs_baseline"] == 1.0 and all(r["images_per_s"] > 0 for r in result["training"])
    assert "| diffusers DiT-XL/2, plain loop |" in (out / "gpu_proof_dry_run.md").read_text()
    assert "total" in run.stdout and "on an H200" in run.stdout


def test_the_plan_fits_the_gpus_time_and_the_real_run_needs_a_gpu(monkeypatch):
    from benchmarks import gpu_proof

    assert sum(gpu_proof.plan_steps(gpu_proof.DEFAULT_SECTIONS).values()) < 8 * 60
    assert {f"train: {row}" for row, *_ in gpu_proof.TRAIN_ARMS} <= set(gpu_proof.PLAN)
    monkeypatch.setattr(gpu_proof.torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="no CUDA device"):
        gpu_proof.main(["--out", "unused"])


def test_the_script_says_what_it_needs(tmp_path):
    run = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_proof.sh"), "--help"], capture_output=True, text=True)
    assert run.returncode == 0 and "--budget" in run.stdout and run.stdout.splitlines()[-1].startswith("# A failing")
    run = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_proof.sh")], capture_output=True, text=True)
    assert run.returncode == 2 and "give the folder" in run.stderr
    env = dict(os.environ, MOH_DIT_WHEELS=str(tmp_path / "none"), PYTHON=sys.executable)
    run = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_proof.sh"), str(tmp_path / "o")], env=env,
                         capture_output=True, text=True, cwd=ROOT)  # fmt: skip
    assert run.returncode != 0 and "run scripts/gpu_wheels.sh" in run.stderr


def test_a_budget_records_what_it_did_not_start_as_skipped(tmp_path):
    """A lent machine's time limit: past --budget no measurement starts; the rest is recorded, the report written."""
    from benchmarks import gpu_proof

    result = gpu_proof.main(["--out", str(tmp_path), "--dry-run", "--budget", "1e-9"])
    rows = result["training"] + result["sampling"] + result["memory"]
    assert result["complete"] and len(rows) == 12
    assert all(r["skipped"] == "past the time budget" and r["vs_baseline"] is None for r in rows)
    assert [r["arm"] for r in result["training"]] == [a[0] for a in gpu_proof.TRAIN_ARMS]  # the table's order
    assert (
        "| moh-dit DiT-XL/2, compiled | past the time budget | n/a |"
        in (tmp_path / "gpu_proof_dry_run.md").read_text()
    )
    with pytest.raises(SystemExit, match="--budget must be a positive"):
        gpu_proof.main(["--out", str(tmp_path), "--dry-run", "--budget", "0"])
    run = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_proof.sh"), "--budget", "soon", str(tmp_path)],
                         capture_output=True, text=True)  # fmt: skip
    assert run.returncode == 2 and "--budget takes a whole number of seconds" in run.stderr


def test_sections_choose_what_runs_and_the_diagnosis_profiles_and_calibrates(tmp_path):
    """--sections: the profile of a training step (by kind, both arms) and the attention calibration run in the
    proof's process and land in its report; the sections not chosen are not run; an unknown one is refused."""
    from benchmarks import gpu_proof

    result = gpu_proof.main(["--out", str(tmp_path), "--dry-run", "--sections", "profile,calibrate"])
    assert result["sections"] == ["profile", "calibrate"] and "training" not in result and "sampling" not in result
    profiled = result["profile"]
    assert [r["arm"] for r in profiled] == [f"profile: {arm}" for arm in ("diffusers DiT-XL/2, plain loop",
                                                                         "moh-dit DiT-XL/2")]  # fmt: skip
    for row in profiled:  # the kinds partition the step's time; the top names are the largest, in order
        assert row["ms_per_step"] > 0
        assert sum(row["by_kind_ms"].values()) == pytest.approx(row["ms_per_step"])
        assert [t["ms"] for t in row["top"]] == sorted((t["ms"] for t in row["top"]), reverse=True)
    assert result["calibration"]["shapes"] == 2 and (tmp_path / "attention_cpu.json").exists()
    md = (tmp_path / "gpu_proof_dry_run.md").read_text()
    assert "| matrix products |" in md and "Calibration of `auto`" in md and "too few with routed heads" in md
    with pytest.raises(SystemExit, match="unknown section.*bogus"):
        gpu_proof.main(["--out", str(tmp_path), "--dry-run", "--sections", "training,bogus"])
    assert set(gpu_proof.plan_steps(("calibrate",))) == {
        "install the carried wheels", "CUDA-marked tests and a short selection of the suite",
        "calibrate: benchmarks/attention.py --calibrate, bf16",
    }  # fmt: skip


def test_a_kernel_is_named_by_its_kind():
    from benchmarks.gpu_diagnosis import kind_of

    assert kind_of("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64") == "matrix products"
    assert kind_of("aten::_scaled_dot_product_flash_attention") == "attention"
    assert kind_of("void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<float>") == "normalisation"
    assert kind_of("void at::native::multi_tensor_apply_kernel<FusedAdam>") == "optimizer"
    assert kind_of("aten::copy_") == "copies and casts"
    assert kind_of("void at::native::elementwise_kernel<128, 2, at::native::gpu_kernel_impl_nocast<x>>") != (
        "copies and casts"
    )  # "nocast" names the kernel template, which any operator uses
    assert kind_of("void at::native::vectorized_elementwise_kernel<4, GeluCUDAKernel>") == "element-wise"
    assert kind_of("ncclDevKernel") == "other"


def test_a_profile_counts_each_kernel_once():
    """On a GPU an operator's device time is its kernels', and the kernels are listed too: only theirs count."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    from benchmarks.gpu_diagnosis import profile_rows

    cpu, gpu = DeviceType.CPU, DeviceType.CUDA
    events = [
        SimpleNamespace(key="aten::mm", device_type=cpu, self_device_time_total=300.0, self_cpu_time_total=50.0, count=2),
        SimpleNamespace(key="sm90_xmma_gemm_bf16", device_type=gpu, self_device_time_total=300.0, self_cpu_time_total=0.0, count=2),
        SimpleNamespace(key="flash_fwd_kernel", device_type=gpu, self_device_time_total=100.0, self_cpu_time_total=0.0, count=2),
    ]  # fmt: skip
    on_device = profile_rows(events, steps=2, on_device=True)
    assert on_device["ms_per_step"] == pytest.approx(0.2)  # (300 + 100) us over 2 steps
    assert on_device["calls_per_step"] == 2  # two kernels a step
    assert on_device["by_kind_ms"] == pytest.approx({"matrix products": 0.15, "attention": 0.05})
    assert on_device["top"][0] == dict(name="sm90_xmma_gemm_bf16", kind="matrix products", ms=0.15, calls=1)
    assert profile_rows(events, steps=2, on_device=False)["ms_per_step"] == pytest.approx(0.025)  # CPU: 50 us / 2
