"""Shared behaviour of the command-line entry points.

Kept free of heavy imports (torch, diffusers) at module level, so that ``--help`` answers at once."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import TypeVar

from moh_dit.argtypes import finite_float, int_at_least, non_negative_int, positive_int
from moh_dit.errors import one_line

__all__ = [
    "run_cli",
    "one_line",
    "add_sampling_arguments",
    "EXIT_USER_ERROR",
    "finite_float",
    "int_at_least",
    "non_negative_int",
    "positive_int",
]

T = TypeVar("T")

# Exit codes: 2 for bad input (as argparse uses), 128 + signal number for a clean stop on a signal.
EXIT_USER_ERROR = 2


def _user_error_types() -> tuple[type[BaseException], ...]:
    """Errors that describe bad input, files or environment: shown as one line instead of a traceback.
    Errors from our own modules derive from MohDitError; library errors of these kinds mean the same."""
    import pickle
    import zipfile

    from moh_dit.errors import MohDitError

    types: list[type[BaseException]] = [
        MohDitError,
        ValueError,
        KeyError,
        OSError,
        EOFError,
        zipfile.BadZipFile,
        pickle.UnpicklingError,
        ImportError,
    ]
    try:
        import yaml

        types.append(yaml.YAMLError)
    except ImportError:  # pragma: no cover - yaml is a dependency
        pass
    try:
        from safetensors import SafetensorError

        types.append(SafetensorError)
    except ImportError:  # pragma: no cover
        pass
    return tuple(types)


def run_cli(main: Callable[[], T]) -> T:
    """Run a command's ``main``: bad input ends with ``error: <one line>`` and exit code 2, Ctrl-C with one
    line and 130. ``MOH_DIT_DEBUG=1`` re-raises with the full traceback. Modules the user names (extractors,
    encoders) import from the working folder, as under ``python -m``, whichever way the command was started."""
    from moh_dit.user_modules import working_folder_on_path

    working_folder_on_path()
    try:
        return main()
    except KeyboardInterrupt:
        if os.environ.get("MOH_DIT_DEBUG"):
            raise
        print("interrupted", file=sys.stderr)
        raise SystemExit(130) from None
    except _user_error_types() as err:
        if os.environ.get("MOH_DIT_DEBUG"):
            raise
        print(f"error: {one_line(err)}", file=sys.stderr)
        raise SystemExit(EXIT_USER_ERROR) from None
    finally:
        close_process_group()


def close_process_group() -> None:
    """Close a launched job's process group before the interpreter exits (local, no collective): gloo's threads
    outliving it abort a rank at exit ("terminate called without an active exception") after a run that succeeded."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def add_sampling_arguments(parser, guidance: float | None, protocol: str, num_samples: int | None) -> None:
    """The options ``sample.py`` and ``evaluate_fid.py`` share: how to sample (``add_sampling_options``; build the
    spec with ``moh_dit.sampling.options.spec_from_args``) and what to generate (count, labels, seed, dtype)."""
    from moh_dit.sampling.options import add_sampling_options
    from moh_dit.sampling.spec import DTYPES, LABEL_MODES

    add_sampling_options(parser, guidance, protocol)
    parser.add_argument(
        "--num-samples",
        type=positive_int,
        default=num_samples,
        help="how many images to generate for evaluation (PNGs + an ADM .npz)",
    )
    parser.add_argument("--label-mode", choices=LABEL_MODES, default="uniform")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=DTYPES, default="fp32", help="transformer dtype (the VAE stays fp32)")
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace samples in the sample folder that were made with other settings",
    )
