"""Smoke tests: every benchmark script runs end to end on a tiny shape and writes its reports."""
import json
import sys
from pathlib import Path

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
