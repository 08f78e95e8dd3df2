"""Progress a user can follow: a tqdm bar in a terminal, periodic one-line reports in a log file."""

from __future__ import annotations

import sys
import time
from typing import Any


class Progress:
    """A progress bar in a terminal; in a log file (a scheduler job's output) a plain line every
    ``every_s`` seconds instead of tqdm's carriage-return redraws, which flood such files."""

    def __init__(
        self,
        total: int,
        initial: int = 0,
        desc: str = "",
        unit: str = "it",
        enabled: bool = True,
        every_s: float = 30.0,
    ) -> None:
        self.total, self.count, self.desc, self.unit = total, initial, desc, unit
        self.enabled, self.every_s = enabled, every_s
        self.start = self.last = time.time()
        self.start_count = initial
        self.postfix = ""
        self.bar = None
        if enabled and sys.stderr.isatty():
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, initial=initial, desc=desc, unit=unit, dynamic_ncols=True)

    def update(self, n: int = 1, **postfix: Any) -> None:
        """``n`` more units done. Counts past ``total`` are cut: several processes report each other's work as
        their own pace's estimate, which overshoots in the last blocks (256/200 images, eta 23:59:59)."""
        n = max(0, min(n, self.total - self.count))
        self.count += n
        if postfix:
            self.postfix = ", ".join(f"{k}={v}" for k, v in postfix.items())
        if self.bar is not None:
            self.bar.update(n)
            if postfix:
                self.bar.set_postfix_str(self.postfix)
        elif self.enabled and (time.time() - self.last >= self.every_s or self.count >= self.total):
            self.last = time.time()
            rate = (self.count - self.start_count) / max(self.last - self.start, 1e-9)
            left = (self.total - self.count) / rate if rate > 0 else float("inf")
            eta = time.strftime("%H:%M:%S", time.gmtime(left)) if left != float("inf") else "?"
            extra = f" | {self.postfix}" if self.postfix else ""
            print(
                f"{self.desc}: {self.count}/{self.total} {self.unit} ({100 * self.count / max(self.total, 1):.0f}%) "
                f"| {rate:.2f} {self.unit}/s | eta {eta}{extra}",
                file=sys.stderr,
                flush=True,
            )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def progress(items, desc: str, unit: str = "it", total: int | None = None, every_s: float = 30.0):
    """Iterate over ``items`` with a ``Progress`` (a bar in a terminal, periodic lines in a log file)."""
    items = list(items) if total is None and not hasattr(items, "__len__") else items
    bar = Progress(len(items) if total is None else total, desc=desc, unit=unit, every_s=every_s)
    try:
        for item in items:
            yield item
            bar.update()
    finally:
        bar.close()
