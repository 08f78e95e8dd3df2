"""How long the main job takes here: train a config for a few hundred steps exactly as the README's command does
(``train.py --config ...`` in a new process), and project the whole job from what was measured.

Each round runs the command with ``train.max_steps=--steps`` in a temporary folder and reads the run's own
records: the speed of every logged window of steps (``metrics.jsonl``; the first window, which warms up, is left
out) and the command's wall time. What is not training (start-up, data, the final grid and the export) is the
wall time less the steps' time. The projection for the config's ``train.max_steps`` is

    fixed seconds + max_steps / steps per second

given as the median over rounds, and as a range from the slowest to the fastest window speed of any round
(machines of one kind differ from day to day; the range is what a newcomer may see). ``--measured RUN`` adds the
wall time of a finished main job (its manifest's start and stop events) beside the projection.

    python benchmarks/main_job.py                                   # the embedded default, 3 rounds of 200 steps
    python benchmarks/main_job.py --measured runs/fashion_mnist_moh # and the main job you ran, for comparison
    python benchmarks/main_job.py --config configs/fashion_mnist_moh_flow.yaml --tag flow

Writes ``runs/benchmarks/main_job_<cpu|cuda>[_tag].{json,md}`` (``--out benchmarks/results`` publishes).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

if not __package__:  # run as a file (python benchmarks/x.py): the repository root holds the benchmarks package
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.timing import DEFAULT_OUT, OUT_HELP, write_report

ROOT = Path(__file__).resolve().parents[1]


def machine() -> dict:
    """What the numbers were measured on: CPU model, cores this process may use, Python and torch."""
    model = platform.processor() or "cpu"
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        names = [ln.split(":", 1)[1].strip() for ln in cpuinfo.read_text().splitlines() if ln.startswith("model name")]
        model = names[0] if names else model
    import torch

    return {
        "cpu": model,
        "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }


def run_round(config: str, steps: int, log_every: int, overrides: list[str]) -> dict:
    """One run of the README's command for ``steps`` steps: window speeds, wall time, seconds outside the steps."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run"
        cmd = [sys.executable, str(ROOT / "train.py"), "--config", config, *overrides]
        cmd += [f"train.max_steps={steps}", f"train.output_dir={out}", f"log.log_every={log_every}", "log.trackers=[]"]
        start = time.perf_counter()
        done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
        wall = time.perf_counter() - start
        if done.returncode != 0:
            raise SystemExit(f"the command failed:\n{' '.join(cmd)}\n{done.stderr[-3000:]}")
        records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    windows = [r["steps_per_s"] for r in records if "steps_per_s" in r][1:]  # the first window warms up
    if not windows:
        raise SystemExit(f"--steps {steps} with windows of {log_every} steps leaves no window after the first")
    speed = statistics.median(windows)
    return {"wall_s": wall, "steps_per_s": speed, "windows": windows, "fixed_s": max(0.0, wall - steps / speed)}


def measured_job(run: Path) -> dict:
    """Wall minutes of a finished run, from the first start to the last stop in its manifest."""
    events = json.loads((run / "manifest.json").read_text())["events"]
    times = [datetime.fromisoformat(e["time"]) for e in events if e["event"] in ("start", "resume", "stopped")]
    steps = [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "steps_per_s" in r]
    return {
        "run": str(run),
        "minutes": (max(times) - min(times)).total_seconds() / 60,
        "step": events[-1].get("step"),
        "median_steps_per_s": statistics.median(r["steps_per_s"] for r in steps[1:] or steps),
        "resumed": any(e["event"] == "resume" for e in events),
        "note": "from the run's start event to its stop event: without the interpreter's start-up, data loading "
        "and model set-up (seconds)",
    }


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/fashion_mnist_moh.yaml")
    p.add_argument("--steps", type=int, default=200, help="steps per round")
    p.add_argument("--log-every", type=int, default=25, help="steps per timed window")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="more config overrides")
    p.add_argument("--measured", type=Path, default=None, help="a finished run of the config, to show beside")
    p.add_argument("--out", type=Path, default=Path(DEFAULT_OUT), help=OUT_HELP)
    p.add_argument("--tag", default="", help="suffix of the result files")
    args = p.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from moh_dit.training.config import load_config

    config_path = Path(args.config) if Path(args.config).is_absolute() else ROOT / args.config
    max_steps = load_config(str(config_path), args.set).train.max_steps
    rounds = []
    for i in range(args.rounds):
        rounds.append(run_round(args.config, args.steps, args.log_every, args.set))
        print(
            f"round {i + 1}/{args.rounds}: {rounds[-1]['steps_per_s']:.2f} steps/s, "
            f"{rounds[-1]['fixed_s']:.1f} s outside the steps",
            flush=True,
        )
    windows = [w for r in rounds for w in r["windows"]]
    speed, fixed = statistics.median(r["steps_per_s"] for r in rounds), statistics.median(r["fixed_s"] for r in rounds)
    project = lambda s: (fixed + max_steps / s) / 60  # noqa: E731
    result = {
        "config": args.config,
        "overrides": args.set,
        "max_steps": max_steps,
        "machine": machine(),
        "when": datetime.now().astimezone().isoformat(timespec="seconds"),
        "rounds": rounds,
        "steps_per_s": speed,
        "fixed_s": fixed,
        "projected_minutes": project(speed),
        "projected_range_minutes": [project(max(windows)), project(min(windows))],
        "measured": measured_job(args.measured) if args.measured else None,
    }
    m = result["machine"]
    lo, hi = result["projected_range_minutes"]
    lines = [
        f"# The main job's time ({m['cuda'] or m['cpu']}, {m['cores']} cores, torch {m['torch']})",
        "",
        f"`{args.config}` {' '.join(args.set)} trained by `train.py` for {args.steps} steps, {args.rounds} rounds "
        f"(`python benchmarks/main_job.py`), measured {result['when']}.",
        "",
        "| round | steps/s (median of windows) | slowest window | fastest window | seconds outside the steps |",
        "|---|---|---|---|---|",
        *[
            f"| {i + 1} | {r['steps_per_s']:.2f} | {min(r['windows']):.2f} | {max(r['windows']):.2f} | {r['fixed_s']:.1f} |"
            for i, r in enumerate(rounds)
        ],
        "",
        f"Projected for {max_steps} steps: **{result['projected_minutes']:.1f} minutes** (median), "
        f"{lo:.1f} to {hi:.1f} minutes from the fastest to the slowest window.",
    ]
    if result["measured"]:
        done = result["measured"]
        lines += [
            "",
            f"Measured: `{done['run']}` took {done['minutes']:.1f} minutes to step {done['step']} at a median "
            f"{done['median_steps_per_s']:.2f} steps/s ({done['note']}).",
        ]
    write_report(
        args.out, f"main_job_{'cuda' if m['cuda'] else 'cpu'}{'_' + args.tag if args.tag else ''}", result, lines
    )
    return result


if __name__ == "__main__":
    from moh_dit.cli.common import run_cli

    run_cli(main)  # bad input: one line, as the commands say it
