"""Smoke tests: every benchmark script runs end to end on a tiny shape and writes its reports."""

import json
import logging
import re
import statistics
from pathlib import Path

import pytest

from moh_dit.data.fashion_mnist import find_fashion_mnist

ROOT = Path(__file__).resolve().parents[1]


def test_train_throughput_reports_ratios_of_its_own_timings(tmp_path):
    from benchmarks import train_throughput

    result = train_throughput.main(
        [
            "--image-size",
            "16",
            "--batch-size",
            "2",
            "--steps",
            "1",
            "--rounds",
            "3",
            "--warmup",
            "0",
            "--hidden-size",
            "48",
            "--vae",
            "tiny",
            "--out",
            str(tmp_path),
        ]
    )
    rows = {(r["model"], r["precision"], r["input"]): r for r in result["rows"]}
    base = rows[("DiT-S/2", "fp32", "latents")]
    for _key, row in rows.items():
        ips = 2 * 1 / statistics.median(row["round_seconds"])  # batch x steps / median round time
        assert row["images_per_s"] == pytest.approx(ips) and len(row["round_seconds"]) == 3
        assert row["ratio_to_baseline"] == pytest.approx(row["images_per_s"] / base["images_per_s"])
    assert {k[0] for k in rows} == set(train_throughput.MODELS) and {k[2] for k in rows} == {"latents", "vae"}
    saved = json.loads((tmp_path / "train_throughput_cpu.json").read_text())
    assert saved["rows"] == json.loads(json.dumps(result["rows"]))
    table = (tmp_path / "train_throughput_cpu.md").read_text()
    assert all(f"| {r['images_per_s']:.2f} | {r['ratio_to_baseline']:.3f} |" in table for r in result["rows"])


def test_attention_benchmark_choices_ratios_and_calibration(tmp_path):
    from benchmarks import attention
    from moh_dit.model.cost_model import FEATURE_NAMES

    cal_file = tmp_path / "cal.json"
    result = attention.main(
        [
            "--quick",
            "--rounds",
            "2",
            "--out",
            str(tmp_path),
            "--calibrate",
            "--calibration-file",
            str(cal_file),
            "--rhos",
            "1.0,0.5",
        ]
    )
    by_rho = {r["rho"]: r for r in result["rows"]}
    assert by_rho[1.0]["infer"]["auto_choice"] == "dense"  # nothing to skip: auto must not pick sparse
    for row in result["rows"]:
        for pass_ in ("infer", "train"):
            seconds, ratios = row[pass_]["seconds"], row[pass_]["ratio_to_mha"]
            assert ratios == pytest.approx({m: seconds[m] / seconds["mha"] for m in seconds})
            assert row[pass_]["sparse_over_dense"] == pytest.approx(seconds["sparse"] / seconds["dense"])
    assert 0.5 <= by_rho[0.5]["padded_rho"] <= 1.0  # padding can only add work
    # too few shapes to fit here, so nothing is written for a pass without enough points, and the file says so
    saved = json.loads(cal_file.read_text())
    assert saved == result["calibration"] and all(v["features"] == list(FEATURE_NAMES) for v in saved.values())
    assert (tmp_path / "attention_cpu.md").read_text().count("| tiny |") == 4
    assert (tmp_path / "attention_cpu.png").stat().st_size > 0


def test_calibration_fit_recovers_a_known_cost_model():
    from benchmarks import attention
    from moh_dit.model.cost_model import FEATURE_NAMES, features, predict_sparse_over_dense

    true = [0.05, 0.9, 0.15, 0.1, 0.2]
    rows = []
    for dim, heads in ((384, 6), (768, 12), (1152, 16)):
        for tokens in (256, 1024):
            for shared, top_k in ((1, 2), (2, 2), (3, 4), (heads // 4, heads // 4)):
                rho, routed = (shared + top_k) / heads, (heads - shared) / heads
                ratio = sum(c * f for c, f in zip(true, features(rho, routed, tokens, dim)))
                rows.append(
                    {
                        "rho": rho,
                        "heads": heads,
                        "shared": shared,
                        "tokens": tokens,
                        "dim": dim,
                        "infer": {"sparse_over_dense": ratio},
                        "train": {"sparse_over_dense": ratio + 0.1},
                    }
                )
    cal = attention.fit_calibration(rows, "cpu")
    assert cal["cpu/infer"]["features"] == list(FEATURE_NAMES)
    assert cal["cpu/infer"]["coef"] == pytest.approx(true, abs=1e-6)
    assert cal["cpu/train"]["coef"][0] == pytest.approx(0.15, abs=1e-6) and cal["cpu/train"]["rms_residual"] < 1e-6
    assert predict_sparse_over_dense(cal["cpu/infer"], 0.5, 0.75, 512, 768) == pytest.approx(
        sum(c * f for c, f in zip(true, features(0.5, 0.75, 512, 768)))
    )


def test_model_benchmark_compares_each_mode_with_its_dit(tmp_path, capsys):
    from benchmarks import model

    result = model.main(
        [
            "--sizes",
            "S",
            "--image-size",
            "32",
            "--batch",
            "1",
            "--rounds",
            "2",
            "--hidden-size",
            "48",
            "--no-memory",
            "--out",
            str(tmp_path),
        ]
    )
    rows = {r["model"]: r for r in result["rows"]}
    base = statistics.median(rows["DiT-S/2"]["round_seconds"])
    for _label, row in rows.items():
        assert row["step_seconds"] == pytest.approx(statistics.median(row["round_seconds"]))
        assert row["ratio_to_dit"] == pytest.approx(row["step_seconds"] / base)
    modes = {(r["preset"], r["mode"]) for r in result["rows"]}
    assert {("MoH-DiT-S/2-75", m) for m in ("dense", "sparse", "auto")} <= modes
    model.main(["--child", "MoH-DiT-S/2-90", "auto", "--image-size", "32", "--batch", "1", "--hidden-size", "48"])
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["peak_mb"] >= 0


@pytest.mark.slow
def test_latents_benchmark_reads_the_manifest_timings(tmp_path):
    from benchmarks import latents

    result = latents.main(
        ["--images", "4", "--image-size", "32", "--batch-size", "2", "--processes", "1", "--out", str(tmp_path)]
    )
    fp32, bf16 = result["rows"]
    assert fp32["ratio_to_first"] == 1.0 and bf16["ratio_to_first"] == pytest.approx(
        bf16["images_per_s"] / fp32["images_per_s"]
    )
    assert fp32["images_per_s"] == pytest.approx(4 / fp32["seconds"]) and "deviation_from_fp32" in bf16
    assert "| 1 | bf16 |" in (tmp_path / "latents_cpu.md").read_text()


def test_cli_startup_benchmark(tmp_path):
    from benchmarks import cli_startup

    result = cli_startup.main(["--rounds", "1", "--out", str(tmp_path)])
    from moh_dit.cli import COMMANDS

    commands = [r["command"] for r in result["rows"]]
    assert all(f"moh-dit {name} --help" in commands for name in COMMANDS) and len(commands) == len(COMMANDS) + 2
    assert all(r["seconds"] == r["rounds"][0] > 0 for r in result["rows"])
    assert "| `moh-dit train --help` |" in (tmp_path / "cli_startup_cpu.md").read_text()


def test_sampler_choice_is_the_cheapest_within_five_percent_of_the_best_fast_setting():
    from benchmarks.samplers import choose

    def row(scheduler, steps, kid, seconds):
        return {"scheduler": scheduler, "steps": steps, "nfe": steps, "kid": kid, "seconds_per_image": seconds}

    rows = [
        row("ddpm", 250, 0.100, 1.0),
        row("ddim", 50, 0.090, 0.2),  # better, but over 25 evaluations
        row("ddim", 25, 0.104, 0.10),
        row("dpm-solver", 20, 0.105, 0.08),  # within 5%, the fastest such
        row("dpm-solver", 10, 0.120, 0.04),  # faster but 20% worse
    ]
    choice = choose(rows)
    assert (choice["scheduler"], choice["steps"], choice["within_5_percent"]) == ("dpm-solver", 20, True)
    assert choice["speedup"] == pytest.approx(1.0 / 0.08)
    rows[3]["kid"] = 0.2
    rows[2]["kid"] = 0.15  # none within 5%: the best KID at <= 25 evaluations, said so
    choice = choose(rows)
    assert (choice["scheduler"], choice["steps"], choice["within_5_percent"]) == ("dpm-solver", 10, False)
    # a fast solver that beats DDPM-250 by far is not traded for a cheaper one that only matches DDPM-250
    rows = [row("ddpm", 250, 0.100, 1.0), row("dpm-solver", 20, 0.080, 0.08), row("dpm-solver", 10, 0.104, 0.04)]
    choice = choose(rows)
    assert (choice["scheduler"], choice["steps"], choice["within_5_percent"]) == ("dpm-solver", 20, True)
    # KID is unbiased and can be negative on few samples: "within 5%" is 5% of its size, not 1.05 times it
    rows = [row("ddpm", 250, -0.010, 1.0), row("dpm-solver", 20, -0.020, 0.08), row("dpm-solver", 10, -0.0195, 0.04)]
    choice = choose(rows)
    assert (choice["scheduler"], choice["steps"], choice["within_5_percent"]) == ("dpm-solver", 10, True)
    rows[2]["kid"] = -0.018  # 10% above the best: not within
    assert (choose(rows)["steps"], choose(rows)["within_5_percent"]) == (20, True)
    # the cost is model evaluations: at equal evaluations the better KID, whatever the (noisy) seconds say
    rows = [row("ddpm", 250, 0.100, 1.0), row("dpm-solver", 25, 0.080, 0.09), row("unipc", 25, 0.083, 0.08)]
    assert (choose(rows)["scheduler"], choose(rows)["steps"]) == ("dpm-solver", 25)
    rows.append(row("dpm-solver", 20, 0.095, 0.10))  # fewer evaluations but 19% worse: not chosen
    assert (choose(rows)["scheduler"], choose(rows)["steps"]) == ("dpm-solver", 25)


@pytest.mark.slow
@pytest.mark.skipif(find_fashion_mnist() is None, reason="Fashion-MNIST IDX files not installed")
def test_sampler_study_scores_every_setting_and_reuses_its_sample_sets(tmp_path):
    from benchmarks import samplers
    from moh_dit.manifests import fingerprint_module
    from moh_dit.sampling.pipeline import MoHDiTPipeline
    from moh_dit.sampling.sample_sets import read_npz_manifest, sample_npz_path

    from .helpers.factories import tiny_model

    model = tiny_model(signal=0.1, sample_size=28, patch_size=4, num_classes=10)
    names = {i: str(i) for i in range(10)}
    MoHDiTPipeline.build(model, None, names).save(tmp_path / "model", {"test": True})
    args = [str(tmp_path / "model"), "--quick", "--samples", "20", "--bootstrap", "3"]  # batch 250 shrinks to 20
    args += ["--reference-count", "300"]
    stopped = samplers.main(
        [*args, "--work", str(tmp_path / "work"), "--out", str(tmp_path / "out"), "--limit-minutes", "1e-9"]
    )
    assert stopped["grid"] == [] and stopped["choice"] is None and len(stopped["pending"]) == 4
    assert "Not measured yet" in (tmp_path / "out" / "samplers_cpu.md").read_text()
    result = samplers.main([*args, "--work", str(tmp_path / "work"), "--out", str(tmp_path / "out")])
    assert result["pending"] == []
    assert result["transformer_sha256"] == [fingerprint_module(model)]  # which weights every row scored
    assert [(r["scheduler"], r["steps"]) for r in result["grid"]] == [("ddpm", 250), ("dpm-solver", 25)]
    assert [r["guidance"] for r in result["sweep"]] == [1.0, 1.5]
    for r in result["grid"] + result["sweep"]:
        assert r["num_samples"] == 20 and r["seconds_per_image"] > 0 and r["kid_interval"][0] <= r["kid_interval"][1]
    assert [r["samples"] for r in result["sample_size_effect"]] == [20]
    assert result["choice"]["ddpm250_kid"] == result["grid"][0]["kid"]
    text = (tmp_path / "out" / "samplers_cpu.md").read_text()
    assert "| ddpm | 250 |" in text and "Chosen fast default" in text
    # the sample sets are reused; scoring what is sampled is never cut off by the time limit
    again = samplers.main(
        [*args, "--work", str(tmp_path / "work"), "--out", str(tmp_path / "out"), "--limit-minutes", "1e-9"]
    )
    assert again["pending"] == [] and again["grid"][1]["kid"] == result["grid"][1]["kid"]

    # every setting sampled as a model's record asks (guidance inside an interval, grids averaged): its own
    # sample sets, recorded, and no sweep when none is asked for
    placed = samplers.main(
        [*args, "--work", str(tmp_path / "work"), "--out", str(tmp_path / "placed"), "--guidance", "3"]
        + ["--guidance-interval", "100", "500", "--grid-averaging", "100", "--sweep-guidance"]
    )
    assert placed["pending"] == [] and placed["sweep"] == [] and placed["guidance_interval"] == (100, 500)
    for r in placed["grid"]:
        assert r["folder"].endswith(f"{r['scheduler']}{r['steps']}-cfg3-t100-500-avg100-n20")
        manifest = read_npz_manifest(sample_npz_path(Path(r["folder"])))
        identity = manifest["identity"]
        assert manifest["batch_size"] == 20  # fewer samples than a batch: blocks of them, not of 250
        assert (identity["guidance_interval"], identity["grid_averaging"], identity["guidance_scale"]) == (
            [100, 500],
            100,
            3.0,
        )
    text = (tmp_path / "placed" / "samplers_cpu.md").read_text()
    assert "## Samplers at guidance 3 at timesteps 100-500, patch grids averaged at timesteps 0-100" in text
    with pytest.raises(SystemExit):
        samplers.main([*args, "--guidance-interval", "500", "100"])


@pytest.mark.skipif(find_fashion_mnist() is None, reason="Fashion-MNIST IDX files not installed")
def test_config_throughput_times_the_trainers_own_steps_of_each_config(tmp_path):
    from benchmarks import config_throughput

    config = tmp_path / "tiny.yaml"
    config.write_text(
        "model: {preset: MoH-DiT-Ti/4-50, overrides: {hidden_size: 32, head_dim: 8, depth: 2}}\n"
        "data: {name: fashion-mnist, image_size: 28, channels: 1, vae: none, num_workers: 0}\n"
        "train: {global_batch_size: 4}\n"
    )
    other = tmp_path / "other.yaml"
    other.write_text(config.read_text().replace("depth: 2", "depth: 1"))
    level = logging.getLogger("moh_dit").level
    result = config_throughput.main(
        [str(config), "--set", "deeper=model.overrides.depth=3;train.global_batch_size=2"]
        + ["--set", f"wider@{other}=model.overrides.hidden_size=48"]  # another config than the first, changed
        + ["--steps", "2", "--rounds", "3", "--warmup", "1", "--out", str(tmp_path), "--tag", "t"]
    )
    assert logging.getLogger("moh_dit").level == level  # quiet while timing, then as it was
    base, deeper, wider = result["rows"]
    assert wider["name"] == "wider" and (
        wider["model_overrides"]["depth"],
        wider["model_overrides"]["hidden_size"],
    ) == (1, 48)
    assert (base["name"], deeper["name"]) == ("tiny", "deeper") and deeper["model_overrides"]["depth"] == 3
    assert base["parameters"] < deeper["parameters"] and (base["batch_size"], deeper["batch_size"]) == (4, 2)
    for row in result["rows"]:
        assert row["optimizer_steps"] == 1 + 3 * 2  # warm-up and timed steps, all taken by the trainer
        ips = row["batch_size"] * 2 / statistics.median(row["round_seconds"])
        assert row["images_per_s"] == pytest.approx(ips) and len(row["round_seconds"]) == 3
        assert row["ratio_to_baseline"] == pytest.approx(row["images_per_s"] / base["images_per_s"])
        assert row["tflops"] == pytest.approx(row["images_per_s"] * row["gflops_per_image"] / 1e3)
        assert row["mfu"] == pytest.approx(row["tflops"] / result["peak_tflops"])  # a matmul peak of this run
    assert base["gflops_per_image"] < deeper["gflops_per_image"]
    assert json.loads((tmp_path / "config_throughput_cpu_t.json").read_text())["baseline"] == "tiny"
    table = (tmp_path / "config_throughput_cpu_t.md").read_text()
    assert all(f"| {r['images_per_s']:.1f} | {r['ratio_to_baseline']:.3f} |" in table for r in result["rows"])
    with pytest.raises(SystemExit, match="NAME\\[@CONFIG\\]=KEY=VALUE"):
        config_throughput.parse_set("deeper")
    # a row may change another config than the first (DiT's with MoH's block options)
    assert config_throughput.parse_set("dit-modern@c/dit.yaml=a=1;b={x: y, z: w}") == (
        "dit-modern",
        "c/dit.yaml",
        ["a=1", "b={x: y, z: w}"],
    )
    assert config_throughput.parse_set("deeper=a=1")[1] is None


def test_main_job_projects_the_whole_run_from_the_commands_own_records(tmp_path):
    import yaml

    from benchmarks import main_job

    from .helpers.factories import make_image_folder, tiny_train_config, train_tiny

    make_image_folder(tmp_path / "images")
    config = tiny_train_config(tmp_path / "unused", tmp_path / "images")
    config["train"]["max_steps"] = 1000  # what the projection is for; each round runs --steps
    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump(config))
    finished = tmp_path / "finished"
    train_tiny(finished, tmp_path / "images")
    args = ["--config", str(tmp_path / "tiny.yaml"), "--steps", "4", "--log-every", "1", "--rounds", "1"]
    result = main_job.main([*args, "--measured", str(finished), "--out", str(tmp_path / "out"), "--tag", "tiny"])
    (run,) = result["rounds"]
    assert len(run["windows"]) == 3 and run["steps_per_s"] == statistics.median(run["windows"])  # window 1 warms up
    assert run["fixed_s"] == pytest.approx(run["wall_s"] - 4 / run["steps_per_s"])
    assert result["projected_minutes"] == pytest.approx((run["fixed_s"] + 1000 / run["steps_per_s"]) / 60)
    low, high = result["projected_range_minutes"]
    assert low <= result["projected_minutes"] <= high
    assert result["measured"]["step"] == 4 and result["measured"]["minutes"] >= 0  # seconds-resolution stamps
    text = (tmp_path / "out" / "main_job_cpu_tiny.md").read_text()
    assert "Projected for 1000 steps" in text and "Measured:" in text and result["machine"]["cores"] >= 1


def test_suite_time_reads_pytest_s_own_summary_and_slowest_tests():
    from benchmarks.suite_time import parse_pytest

    output = (
        "....\n============================= slowest 3 durations =============================\n"
        "38.61s call     tests/test_experiments.py::test_quality\n"
        "9.77s setup    tests/test_distributed.py::test_a[torchrun-0-15]\n"
        "0.01s teardown tests/x.py::test_b\n"
        "FAILED tests/x.py::test_c - AssertionError: no\n"
        "1 failed, 558 passed, 9 deselected, 98 warnings in 479.84s (0:07:59)\n"
    )
    parsed = parse_pytest(output)
    assert parsed["counts"] == {"failed": 1, "passed": 558, "deselected": 9, "warnings": 98}
    assert parsed["failed"] == ["tests/x.py::test_c"]
    assert parsed["pytest_seconds"] == 479.84
    assert [(d["seconds"], d["phase"]) for d in parsed["slowest"]] == [
        (38.61, "call"),
        (9.77, "setup"),
        (0.01, "teardown"),
    ]
    assert parsed["slowest"][1]["test"] == "tests/test_distributed.py::test_a[torchrun-0-15]"
    with pytest.raises(ValueError, match="no pytest summary"):
        parse_pytest("collected 0 items / 1 error")


def test_caches_benchmark_times_each_cache_against_the_uncached_sampler_in_the_same_run(tmp_path):
    from benchmarks.caches import main

    from .helpers.factories import tiny_model, tiny_pipeline

    pipe = tiny_pipeline(tiny_model(signal=0.1, depth=3, num_shared_heads=4, top_k=0), scheduler="dpm-solver")
    pipe.save_pretrained(tmp_path / "pipeline")
    args = ["--model", str(tmp_path / "pipeline"), "--steps", "6", "--images", "2", "--rounds", "2"]
    result = main([*args, "--out", str(tmp_path), "--tag", "tiny"])
    rows = {r["cache"]: r for r in result["rows"]}
    assert set(rows) == {"none", "first-block", "magcache", "taylorseer"}
    assert rows["none"]["speedup"] == 1.0 and rows["none"]["max_abs_difference"] == 0
    # TaylorSeer with its defaults (3 warm-up calls, then every 5th) computes 4 of the 6 calls in full
    assert rows["taylorseer"]["computed_share"] == 4 / 6
    assert all(len(r["rounds"]) == 2 and r["seconds_per_image"] > 0 for r in rows.values())
    assert "| 6 | magcache |" in (tmp_path / "caches_cpu_tiny.md").read_text()


def test_guidance_benchmark_times_each_rule_and_each_guide_against_cfg_in_the_same_run(tmp_path):
    from benchmarks.guidance import main

    from .helpers.factories import tiny_model, tiny_pipeline

    tiny_pipeline(tiny_model(signal=0.1), scheduler="dpm-solver").save_pretrained(tmp_path / "main")
    tiny_pipeline(tiny_model(signal=0.1, hidden_size=16, seed=3), scheduler="dpm-solver").save_pretrained(
        tmp_path / "small"
    )
    args = ["--model", str(tmp_path / "main"), "--guide", f"small={tmp_path / 'small'}", "--steps", "3"]
    result = main([*args, "--images", "2", "--rounds", "2", "--out", str(tmp_path), "--tag", "tiny"])
    rows = {r["method"]: r for r in result["rows"]}
    assert set(rows) == {"cfg", "apg", "cfg-zero-star", "ag-small", "folded"}
    evaluations = {name: row["main_model_evaluations_per_image"] for name, row in rows.items()}
    assert evaluations["folded"] == 3 and evaluations["cfg"] == evaluations["ag-small"] + 3 == 6  # 3 steps
    assert rows["cfg"]["vs_cfg"] == 1.0 and rows["cfg"]["guide_parameters"] is None
    small = sum(p.numel() for p in tiny_model(hidden_size=16).parameters())
    assert rows["ag-small"]["guide_parameters"] == small
    assert all(len(r["rounds"]) == 2 and r["seconds_per_image"] > 0 for r in rows.values())
    assert "| ag-small |" in (tmp_path / "guidance_cpu_tiny.md").read_text()


def test_a_benchmark_given_a_missing_model_or_a_malformed_guide_says_so_in_one_line(tmp_path, capsys):
    from benchmarks.caches import main as caches
    from benchmarks.guidance import main as guidance
    from moh_dit.cli.common import run_cli

    with pytest.raises(SystemExit):
        run_cli(lambda: caches(["--model", str(tmp_path / "missing")]))
    assert re.match(r"^error: .*missing does not exist", capsys.readouterr().err)
    with pytest.raises(SystemExit):
        guidance(["--guide", "nameonly"])
    assert "expected NAME=PATH" in capsys.readouterr().err


def test_no_benchmark_or_script_writes_into_committed_files_by_default():
    """Every benchmark's --out defaults to runs/benchmarks (which git ignores), as does the classifier's training:
    publishing into benchmarks/results or experiments/weights is asked for, not a side effect."""
    import ast

    from benchmarks.timing import DEFAULT_OUT

    root = Path(__file__).resolve().parents[1]
    assert DEFAULT_OUT.startswith("runs/") and "runs/" in (root / ".gitignore").read_text().splitlines()
    for script in [*sorted((root / "benchmarks").glob("*.py")), root / "experiments" / "train_classifier.py"]:
        for node in ast.walk(ast.parse(script.read_text())):
            is_call = isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument"
            if is_call and node.args and isinstance(node.args[0], ast.Constant) and node.args[0].value == "--out":
                options = {k.arg: ast.unparse(k.value) for k in node.keywords}
                if options.get("required") == "True":
                    continue  # the user names the folder every time (the GPU proof)
                text = options["default"]
                assert "DEFAULT_OUT" in text or text.startswith("'runs/"), (script.name, text)


def test_a_report_rewritten_as_a_run_goes_is_never_left_half_written(tmp_path, monkeypatch):
    """write_report replaces each file whole: a write that dies leaves the previous report as it was, no stray file."""
    import json
    from pathlib import Path

    from benchmarks.timing import write_report

    write_report(tmp_path, "r", {"rows": 1}, ["| a |"])
    real = Path.write_text

    def dies(self, text, *args, **kwargs):
        real(self, text[: len(text) // 2])
        raise OSError("disk full")

    monkeypatch.setattr(Path, "write_text", dies)
    with pytest.raises(OSError, match="disk full"):
        write_report(tmp_path, "r", {"rows": 2}, ["| b |"])
    monkeypatch.undo()
    assert json.loads((tmp_path / "r.json").read_text()) == {"rows": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json", "r.md"]
