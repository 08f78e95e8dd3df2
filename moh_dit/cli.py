"""Shared behaviour of the command-line entry points."""
from __future__ import annotations

import os
import sys
from typing import Callable, TypeVar

T = TypeVar("T")

# Errors that describe bad input (a missing file, an unknown preset, class or key, a wrong shape): shown as a
# one-line message instead of a traceback. MOH_DIT_DEBUG=1 shows the traceback too.
USER_ERRORS = (ValueError, FileNotFoundError, KeyError, TypeError)


def run_cli(main: Callable[[], T]) -> T:
    try:
        return main()
    except USER_ERRORS as err:
        if os.environ.get("MOH_DIT_DEBUG"):
            raise
        message = err.args[0] if isinstance(err, KeyError) and err.args else str(err)
        print(f"error: {message}", file=sys.stderr)
        raise SystemExit(2) from None
