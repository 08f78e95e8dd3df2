"""How long the default test suite takes: the README's test command (its pytest part), timed, with the slowest
tests, for this checkout and optionally for an earlier commit in the same sitting (a machine of one kind differs
from day to day, so a before/after comparison is only fair when both run back to back on one machine).

    python benchmarks/suite_time.py                          # this checkout
    python benchmarks/suite_time.py --baseline v0.3          # an earlier commit first, then this checkout
    python benchmarks/suite_time.py --pytest-args -m slow    # the slow set instead

The earlier commit is checked out with ``git worktree`` into a temporary folder and run with this checkout's
Python environment (pytest's ``pythonpath`` puts that folder's package first). Writes
``runs/benchmarks/suite_time_<cpu|cuda>[_tag].{json,md}`` (``--out benchmarks/results`` publishes).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

if not __package__:  # run as a file (python benchmarks/x.py): the repository root holds the benchmarks package
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.main_job import machine
from benchmarks.timing import DEFAULT_OUT, OUT_HELP, write_report

ROOT = Path(__file__).resolve().parents[1]
SUMMARY = re.compile(r"=* ?(?P<counts>(\d+ \w+(, )?)+) in (?P<seconds>[\d.]+)s")
DURATION = re.compile(r"^(?P<seconds>[\d.]+)s (?P<phase>call|setup|teardown)\s+(?P<test>\S+)", re.M)


def parse_pytest(output: str) -> dict:
    """pytest's own numbers from its output: the counts of its last summary line (passed, failed, deselected,
    ...), the seconds it reports, and the ``--durations`` lines (slowest first)."""
    found = list(SUMMARY.finditer(output))
    if not found:
        raise ValueError("no pytest summary line (`N passed ... in S s`) in the output")
    last = found[-1]
    counts = {word: int(n) for n, word in re.findall(r"(\d+) (\w+)", last["counts"])}
    durations = [
        {"seconds": float(m["seconds"]), "phase": m["phase"], "test": m["test"]} for m in DURATION.finditer(output)
    ]
    failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", output, re.M)  # pytest's short summary of failures
    return {"counts": counts, "pytest_seconds": float(last["seconds"]), "slowest": durations, "failed": failed}


def run_suite(checkout: Path, pytest_args: list[str]) -> dict:
    """The suite of ``checkout``, run as the README runs it: its wall time and pytest's numbers."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--durations=30", *pytest_args]
    start = time.perf_counter()
    done = subprocess.run(cmd, cwd=checkout, capture_output=True, text=True)
    wall = time.perf_counter() - start
    result = parse_pytest(done.stdout)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=checkout, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain"], cwd=checkout, capture_output=True, text=True).stdout
    return {
        "commit": commit.stdout.strip() + ("+changes" if dirty.strip() else ""),
        "exit_code": done.returncode,
        "wall_seconds": wall,
        **result,
    }


def run_at_commit(commit: str, pytest_args: list[str]) -> dict:
    """The suite of an earlier commit, in a temporary worktree."""
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp) / "tree"
        subprocess.run(["git", "worktree", "add", "--detach", str(tree), commit], cwd=ROOT, check=True)
        try:
            return run_suite(tree, pytest_args)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT, check=False)


def report(result: dict) -> list[str]:
    m = result["machine"]
    lines = [
        f"# The default test suite's time ({m['cuda'] or m['cpu']}, {m['cores']} cores, torch {m['torch']})",
        "",
        f"`python -m pytest -q {' '.join(result['pytest_args'])}` (the README's test command without ruff), "
        f"measured {result['when']} by `python benchmarks/suite_time.py`; runs in the order shown, back to back.",
        "",
        "| commit | tests | wall time | ratio to the first |",
        "|---|---|---|---|",
    ]
    first = result["runs"][0]["wall_seconds"]
    for run in result["runs"]:
        counts = ", ".join(f"{n} {w}" for w, n in run["counts"].items())
        minutes, seconds = divmod(round(run["wall_seconds"]), 60)
        lines.append(f"| {run['commit']} | {counts} | {minutes}:{seconds:02d} | {run['wall_seconds'] / first:.2f} |")
    for run in result["runs"]:
        if run["failed"]:
            lines += ["", f"Failed in {run['commit']}: " + ", ".join(f"`{t}`" for t in run["failed"])]
    last = result["runs"][-1]
    lines += ["", f"Slowest tests of {last['commit']}:", "", "| seconds | phase | test |", "|---|---|---|"]
    lines += [f"| {d['seconds']:.1f} | {d['phase']} | `{d['test']}` |" for d in last["slowest"][:15]]
    return lines


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--baseline", default=None, metavar="COMMIT", help="also run this commit's suite, first")
    p.add_argument("--pytest-args", nargs=argparse.REMAINDER, default=[], help="passed on to pytest")
    p.add_argument("--out", type=Path, default=Path(DEFAULT_OUT), help=OUT_HELP)
    p.add_argument("--tag", default="", help="suffix of the result files")
    args = p.parse_args(argv)
    runs = []
    if args.baseline:
        runs.append(run_at_commit(args.baseline, args.pytest_args))
        print(f"{args.baseline}: {runs[-1]['wall_seconds']:.0f} s", flush=True)
    runs.append(run_suite(ROOT, args.pytest_args))
    print(f"this checkout: {runs[-1]['wall_seconds']:.0f} s", flush=True)
    result = {
        "machine": machine(),
        "when": datetime.now().astimezone().isoformat(timespec="seconds"),
        "pytest_args": args.pytest_args,
        "runs": runs,
    }
    kind = "cuda" if result["machine"]["cuda"] else "cpu"
    write_report(args.out, f"suite_time_{kind}{'_' + args.tag if args.tag else ''}", result, report(result))
    return result


if __name__ == "__main__":
    from moh_dit.cli.common import run_cli

    run_cli(main)  # bad input: one line, as the commands say it
