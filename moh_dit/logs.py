"""Logging for every command: one log to follow on any number of processes.

The main process logs at INFO; the others log warnings and errors only, each line marked with its rank, so a
run on 8 GPUs prints one stream instead of eight copies of every line.
"""

from __future__ import annotations

import logging
import os

__all__ = ["launch_rank", "setup_logging"]


def launch_rank() -> tuple[int, int]:
    """``(rank, world size)`` of this process as the launcher (torchrun, accelerate launch) set them, known before
    any process group exists; ``(0, 1)`` for a plain ``python``."""
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def setup_logging(with_time: bool = True) -> None:
    """Configure the root logger for a command (a no-op when the application configured logging already)."""
    rank, world = launch_rank()
    where = f" [rank {rank}]" if world > 1 else ""
    stamp = "%(asctime)s " if with_time else ""
    logging.basicConfig(
        format=f"{stamp}{where.strip()}{' ' if where else ''}%(levelname)s %(name)s: %(message)s",
        level=logging.INFO if rank == 0 else logging.WARNING,
    )
