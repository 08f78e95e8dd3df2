"""The errors moh-dit raises for bad input, damaged or mismatched files, and runs that must stop.

Every class derives from :class:`MohDitError`; the command-line entry points print such an error as one
line and exit with code 2 (``MOH_DIT_DEBUG=1`` shows the traceback). Each also derives from the builtin
that describes it best, so ``except ValueError`` keeps working for callers of the Python API.
"""

from __future__ import annotations

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
