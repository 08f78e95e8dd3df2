"""A guard against loss spikes and non-finite losses (``train.spike_guard``).

A step whose loss (the mean over its micro-batches and processes, so every process decides alike) exceeds
``train.spike_guard`` times the median loss of the last ``train.spike_window`` accepted steps is a spike:
its update is skipped (the step, its data and the learning rate schedule still advance). After
``train.spike_patience`` spikes in a row, or a non-finite loss, the weights, EMA and optimizer state are
rolled back to the newest checkpoint and training continues with the next data; after
``train.max_rollbacks`` rollbacks the run stops with one line that says what happened.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field

__all__ = ["SpikeGuard", "Verdict"]

# accepted steps needed before the median is trusted to call a spike
MIN_HISTORY = 10


@dataclass(frozen=True)
class Verdict:
    """What to do with one step: ``update``, ``skip`` (a spike) or ``rollback``; ``why`` in words."""

    action: str
    why: str = ""


@dataclass
class SpikeGuard:
    """The guard's state: recent accepted losses, spikes in a row, and how often it acted."""

    factor: float
    window: int = 50
    patience: int = 3
    max_rollbacks: int = 3
    history: deque = field(default_factory=deque)
    in_a_row: int = 0
    skipped: int = 0
    rollbacks: int = 0

    @property
    def enabled(self) -> bool:
        return self.factor > 0

    def judge(self, loss: float) -> Verdict:
        """The verdict on a step with mean loss ``loss`` (and the guard's state updated for it)."""
        if not math.isfinite(loss):
            return self._roll_back(f"non-finite loss {loss}")
        if len(self.history) >= MIN_HISTORY:
            median = statistics.median(self.history)
            if loss > self.factor * median:
                self.in_a_row += 1
                why = f"loss {loss:.4g} > {self.factor:g} x median {median:.4g} of the last {len(self.history)} steps"
                if self.in_a_row >= self.patience:
                    return self._roll_back(f"{self.in_a_row} spikes in a row ({why})")
                self.skipped += 1
                return Verdict("skip", why)
        self.in_a_row = 0
        self.history.append(loss)
        while len(self.history) > self.window:
            self.history.popleft()
        return Verdict("update")

    def _roll_back(self, why: str) -> Verdict:
        self.in_a_row = 0
        self.rollbacks += 1
        self.skipped += 1
        return Verdict("rollback", why)

    @property
    def exhausted(self) -> bool:
        """More rollbacks than allowed: the run must stop."""
        return self.rollbacks > self.max_rollbacks

    def state(self) -> dict:
        """What a checkpoint keeps, so that a resumed run judges as an uninterrupted one would."""
        return {
            "history": list(self.history),
            "in_a_row": self.in_a_row,
            "skipped": self.skipped,
            "rollbacks": self.rollbacks,
        }

    def load(self, state: dict | None) -> None:
        if state:
            self.history = deque(state["history"])
            self.in_a_row, self.skipped, self.rollbacks = state["in_a_row"], state["skipped"], state["rollbacks"]
