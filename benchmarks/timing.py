"""What the throughput benchmarks share: interleaved timing rounds and the JSON + markdown report."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Hashable
from pathlib import Path

import torch

# where a benchmark writes unless told: a folder git ignores, so that a user's run leaves the checkout clean;
# benchmarks/results/ holds the published measurements (pass --out benchmarks/results to add to them)
DEFAULT_OUT = "runs/benchmarks"
OUT_HELP = f"folder of the JSON and markdown results (default {DEFAULT_OUT}; benchmarks/results publishes them)"


def sync(device: torch.device) -> None:
    """Wait for queued GPU work, so that a timer measures it (a no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize()


def interleaved_rounds(
    steps: dict[Hashable, Callable[[], None]], device: torch.device, warmup: int, rounds: int, per_round: int
) -> dict[Hashable, list[float]]:
    """Seconds of ``per_round`` calls of each step function, in ``rounds`` rounds that visit every key in
    turn, so that every configuration sees the same machine state in each round (clock drift, other load)."""
    for step in steps.values():
        for _ in range(warmup):
            step()
    seconds: dict[Hashable, list[float]] = {key: [] for key in steps}
    for _ in range(rounds):
        for key, step in steps.items():
            sync(device)
            start = time.perf_counter()
            for _ in range(per_round):
                step()
            sync(device)
            seconds[key].append(time.perf_counter() - start)
    return seconds


def write_report(out: Path, stem: str, result: dict, lines: list[str], echo: bool = True) -> None:
    """``<stem>.json`` (the result) and ``<stem>.md`` (the lines) under ``out``, each written atomically (a report
    rewritten as a run goes, as the GPU proof's, is never left half-written by a kill); the table is printed too
    unless ``echo`` is false."""
    from moh_dit.files import atomic_write_text

    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / f"{stem}.json", json.dumps(result, indent=2, default=str))
    atomic_write_text(out / f"{stem}.md", "\n".join(lines) + "\n")
    if echo:
        print("\n".join(lines))
