"""The errors moh-dit raises for bad input, damaged or mismatched files, and runs that must stop.

Every class derives from :class:`MohDitError`; the command-line entry points print such an error as one
line and exit with code 2 (``MOH_DIT_DEBUG=1`` shows the traceback). Each also derives from the builtin
that describes it best, so ``except ValueError`` keeps working for callers of the Python API.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator

__all__ = [
    "MohDitError",
    "ConfigError",
    "DataError",
    "ArtifactError",
    "OutputError",
    "NonFiniteError",
    "NonFiniteLossError",
    "NonFiniteSampleError",
    "EvaluationError",
    "ConversionError",
    "raised_by_the_file",
    "blame_the_file",
    "one_line",
]


class MohDitError(Exception):
    """Base class: an error caused by the user's input, files or environment, explained in one line."""


class ConfigError(MohDitError, ValueError):
    """A config file, override or command-line value that is malformed or out of range."""


class DataError(MohDitError, RuntimeError):
    """A data set cannot be read: missing files, nothing usable, or too many corrupt images."""


class ArtifactError(MohDitError, ValueError):
    """A run, checkpoint, pipeline, sample folder, cache or latent file that is missing, damaged, or was
    made by something other than what is asked for now (its manifest does not match)."""


class OutputError(MohDitError, OSError):
    """An output location that cannot be created or written."""


class NonFiniteError(MohDitError, RuntimeError):
    """Numbers became NaN or infinite (or exploded) where that must stop the work."""


class NonFiniteLossError(NonFiniteError):
    """Training stopped because the loss became NaN or infinite, or the weights exploded."""


class NonFiniteSampleError(NonFiniteError):
    """Sampling produced NaN or infinite values."""


class EvaluationError(MohDitError, ValueError):
    """Inputs that cannot be evaluated: wrong dtype, shape or range, missing files or weights."""


class ConversionError(MohDitError, ValueError):
    """A checkpoint that cannot be mapped onto MoHDiT as asked, with what differs."""


# Exceptions that never come from a file's content: a bug in the code, or the machine running out of memory.
# A wrapper that turns a loader's failure into "the file is damaged" must let these pass untouched.
_NOT_THE_FILE = (
    TypeError,
    AttributeError,
    NameError,
    AssertionError,
    NotImplementedError,
    RecursionError,
    MemoryError,
)


def raised_by_the_file(err: BaseException) -> bool:
    """Whether a loader's exception ``err`` can have been caused by the file it read (a header or format
    error, a short read, wrong shapes) rather than by a bug or the machine (a wrong argument, out of memory).

    Libraries often wrap the original exception (diffusers turns every failure of ``from_pretrained`` into an
    ``OSError``), so the whole chain of causes is checked; one bug or resource error anywhere in it means the
    file is not to blame.
    """
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, _NOT_THE_FILE) or type(err).__name__ == "OutOfMemoryError":
            return False
        if isinstance(err, RuntimeError) and "allocate" in str(err):  # torch's CPU allocator: a plain RuntimeError
            return False
        err = err.__cause__ or err.__context__
    return True


@contextlib.contextmanager
def blame_the_file(
    make_error: Callable[[BaseException], MohDitError], kinds: tuple[type[BaseException], ...]
) -> Iterator[None]:
    """Turn a loader's exception of one of ``kinds`` into ``make_error(err)`` (a one-line error that blames the
    file), but only when the file can have caused it (:func:`raised_by_the_file`); bugs and resource errors
    propagate untouched, with their traceback."""
    try:
        yield
    except kinds as err:
        if not raised_by_the_file(err):
            raise
        raise make_error(err) from err


def one_line(err: BaseException) -> str:
    """The message of ``err`` as one line. Errors re-raised by DataLoader workers carry the worker's whole
    traceback in their message; the original error's last line is what the user needs."""
    message = err.args[0] if isinstance(err, KeyError) and err.args else str(err)
    message = str(message)
    if "Original Traceback" in message:
        last = [ln for ln in message.strip().splitlines() if ln.strip()][-1]
        message = re.sub(r"^[\w.]+(Error|Exception): ", "", last.strip())
    lines = [ln.strip() for ln in message.strip().splitlines() if ln.strip()]
    return lines[0] if lines else type(err).__name__


def unreadable_array(path: object, err: BaseException) -> str:
    """What went wrong reading an array file (``.npz``, ``.npy``): that it does not exist, or that it is not one."""
    import os

    if isinstance(err, FileNotFoundError) or not os.path.exists(path):
        return f"{path} does not exist"
    return f"{path} is not a readable array file ({str(err).splitlines()[0] if str(err) else type(err).__name__}); truncated?"
