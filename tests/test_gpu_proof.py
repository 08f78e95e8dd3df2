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

    assert sum(gpu_proof.PLAN.values()) < 8 * 60
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
