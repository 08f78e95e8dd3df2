"""The two checks every config section makes of a value: a number at least so large, one of a few names."""

from __future__ import annotations

from typing import Any

from moh_dit.errors import ConfigError

__all__ = ["at_least", "one_of"]


def at_least(key: str, value: Any, low: int) -> None:
    """``value`` (of ``key``) is at least ``low``."""
    if value < low:
        raise ConfigError(f"{key} must be >= {low}, got {value}")


def one_of(key: str, value: Any, choices: tuple) -> None:
    """``value`` (of ``key``) is one of ``choices``."""
    if value not in choices:
        raise ConfigError(f"{key} must be one of {', '.join(map(str, choices))}; got {value!r}")
