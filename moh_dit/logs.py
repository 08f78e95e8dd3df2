"""Logging for every command: one log to follow on any number of processes.

The main process logs at INFO; the others log errors, and the warnings that are their own (``extra=PER_RANK``: an
unreadable image in their share of the data), each line marked with its rank. A warning about the run (changed
settings on resume, checkpoints set aside) is logged once, by the main process, so a run on 8 GPUs prints one
stream instead of eight copies of every line.
"""

from __future__ import annotations

import logging
import os

__all__ = ["PER_RANK", "launch_rank", "setup_logging"]

# ``logger.warning(..., extra=PER_RANK)``: a problem of this process alone, logged by every process that has it
PER_RANK = {"per_rank": True}


def _own_problems(record: logging.LogRecord) -> bool:
    """What a process other than the main one logs: errors, and the warnings marked as its own."""
    return record.levelno >= logging.ERROR or getattr(record, "per_rank", False)


def launch_rank() -> tuple[int, int]:
    """``(rank, world size)`` of this process as the launcher (torchrun, accelerate launch) set them, known before
    any process group exists; ``(0, 1)`` for a plain ``python``."""
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def setup_logging(with_time: bool = True) -> None:
    """Configure the root logger for a command (a no-op when the application configured logging already)."""
    rank, world = launch_rank()
    where = f" [rank {rank}]" if world > 1 else ""
    stamp = "%(asctime)s " if with_time else ""
    root = logging.getLogger()
    configured = bool(root.handlers)
    logging.basicConfig(
        format=f"{stamp}{where.strip()}{' ' if where else ''}%(levelname)s %(name)s: %(message)s",
        level=logging.INFO if rank == 0 else logging.WARNING,
    )
    if rank != 0 and not configured:
        for handler in root.handlers:
            handler.addFilter(_own_problems)


def plural(count: int | None, noun: str) -> str:
    """``1 step``, ``25 steps``: a count with its noun as a sentence says it."""
    return f"{count} {noun}{'' if count == 1 else 's'}"
