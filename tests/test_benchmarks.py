"""Smoke tests: every benchmark script runs end to end on a tiny shape and writes its reports."""
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def test_train_throughput_smoke(tmp_path):
    from benchmarks import train_throughput

    result = train_throughput.main(["--image-size", "16", "--batch-size", "2", "--steps", "1", "--rounds", "1",
                                    "--warmup", "0", "--hidden-size", "48", "--vae", "tiny", "--out", str(tmp_path)])  # fmt: skip
    assert len(result["rows"]) == 8
    base = [r for r in result["rows"] if r["model"] == "DiT-S/2" and r["precision"] == "fp32" and r["input"] == "latents"]
    assert base[0]["ratio_to_baseline"] == 1.0
    assert json.loads((tmp_path / "train_throughput_cpu.json").read_text())["rows"]
    assert "| model |" in (tmp_path / "train_throughput_cpu.md").read_text()


def test_attention_benchmark_smoke_and_calibration(tmp_path):
    from benchmarks import attention

    cal_file = tmp_path / "cal.json"
    result = attention.main(["--quick", "--rounds", "1", "--out", str(tmp_path), "--calibrate", "--calibration-file",
                             str(cal_file), "--rhos", "1.0,0.5"])  # fmt: skip
    rows = result["rows"]
    assert len(rows) == 2 and {"infer", "train"} <= set(rows[0])
    assert rows[0]["infer"]["ratio_to_mha"]["mha"] == 1.0
    assert (tmp_path / "attention_cpu.md").exists() and (tmp_path / "attention_cpu.json").exists()
    assert (tmp_path / "attention_cpu.png").exists()


def test_calibration_fit_recovers_a_known_cost_model():
    from benchmarks import attention
    from moh_dit.perf import FEATURE_NAMES, features, predict_sparse_over_dense

    true = [0.05, 0.9, 0.15, 0.1, 0.2]
    rows = []
    for dim, heads in ((384, 6), (768, 12), (1152, 16)):
        for tokens in (256, 1024):
            for shared, top_k in ((1, 2), (2, 2), (3, 4), (heads // 4, heads // 4)):
                rho, routed = (shared + top_k) / heads, (heads - shared) / heads
                ratio = sum(c * f for c, f in zip(true, features(rho, routed, tokens, dim)))
                rows.append({"rho": rho, "heads": heads, "shared": shared, "tokens": tokens, "dim": dim,
                             "infer": {"sparse_over_dense": ratio}, "train": {"sparse_over_dense": ratio + 0.1}})  # fmt: skip
    cal = attention.fit_calibration(rows, "cpu")
    assert cal["cpu/infer"]["features"] == list(FEATURE_NAMES)
    assert cal["cpu/infer"]["coef"] == pytest.approx(true, abs=1e-6)
    assert cal["cpu/train"]["coef"][0] == pytest.approx(0.15, abs=1e-6) and cal["cpu/train"]["rms_residual"] < 1e-6
    assert predict_sparse_over_dense(cal["cpu/infer"], 0.5, 0.75, 512, 768) == pytest.approx(
        sum(c * f for c, f in zip(true, features(0.5, 0.75, 512, 768))))


def test_model_benchmark_smoke(tmp_path, capsys):
    from benchmarks import model

    result = model.main(["--sizes", "S", "--image-size", "32", "--batch", "1", "--rounds", "1", "--hidden-size", "48",
                         "--no-memory", "--out", str(tmp_path)])  # fmt: skip
    labels = [r["model"] for r in result["rows"]]
    assert labels[0] == "DiT-S/2" and "MoH-DiT-S/2-75 [sparse]" in labels and len(labels) == 7
    assert result["rows"][0]["ratio_to_dit"] == 1.0
    model.main(["--child", "MoH-DiT-S/2-90", "auto", "--image-size", "32", "--batch", "1", "--hidden-size", "48"])
    assert "peak_mb" in capsys.readouterr().out.splitlines()[-1]
