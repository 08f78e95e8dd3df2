"""Argument types for command lines: a bad value is a usage error before any work starts. Light (no torch), so
that ``--help`` answers at once; the command line (``moh_dit.cli``) and :class:`~moh_dit.sampling.spec.SamplingSpec`
use them. And the two predicates a value read from a config or a spec is checked with (``True`` is no number there)."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

__all__ = ["int_at_least", "positive_int", "non_negative_int", "finite_float", "is_number", "is_whole"]


def is_number(value: object) -> bool:
    """Whether ``value`` is an int or a float, a bool not counted (YAML's ``true`` is no step size)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def is_whole(value: object) -> bool:
    """Whether ``value`` is an int, a bool not counted."""
    return isinstance(value, int) and not isinstance(value, bool)


def int_at_least(low: int) -> Callable[[str], int]:
    """An argparse type: an integer >= ``low``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value

    return parse


positive_int = int_at_least(1)
non_negative_int = int_at_least(0)


def finite_float(text: str) -> float:
    """An argparse type: a finite number."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return value
