"""How long ``moh-dit <command> --help`` takes, next to a bare Python start and a start that imports torch
and diffusers (what every ``--help`` cost before the commands imported them only after parsing).

    python benchmarks/cli_startup.py            # writes runs/benchmarks/cli_startup_<device>.{json,md}

Each command is started as a fresh process; the median of several rounds is reported.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

if not __package__:  # run as a file (python benchmarks/x.py): the repository root holds the benchmarks package
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.timing import DEFAULT_OUT, OUT_HELP
from moh_dit.cli import COMMANDS

BASELINES = {
    "python (bare interpreter)": [sys.executable, "-c", "pass"],
    "python -c 'import torch, diffusers'": [sys.executable, "-c", "import torch, diffusers"],
}


def timed(cmd: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(cmd, check=True, capture_output=True)
    return time.perf_counter() - start


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", default=DEFAULT_OUT, help=OUT_HELP)
    args = p.parse_args(argv)
    runs = dict(BASELINES)
    runs |= {f"moh-dit {name} --help": [sys.executable, "-m", "moh_dit", name, "--help"] for name in COMMANDS}
    rows = []
    for label, cmd in runs.items():
        times = [timed(cmd) for _ in range(args.rounds)]
        rows.append({"command": label, "seconds": statistics.median(times), "rounds": times})
        print(f"{label:<40} {rows[-1]['seconds']:.3f} s", flush=True)
    result = {"machine": platform.processor() or platform.machine(), "python": sys.version.split()[0], "rows": rows}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "cli_startup_cpu.json").write_text(json.dumps(result, indent=2))
    lines = [
        "# Command start-up (`--help`)",
        "",
        f"Median of {args.rounds} fresh processes on {result['machine']}, Python {result['python']}.",
        "",
        "| command | seconds |",
        "|---|---|",
    ]
    lines += [f"| `{r['command']}` | {r['seconds']:.3f} |" for r in rows]
    (out / "cli_startup_cpu.md").write_text("\n".join(lines) + "\n")
    return result


if __name__ == "__main__":
    from moh_dit.cli.common import run_cli

    run_cli(main)  # bad input: one line, as the commands say it
