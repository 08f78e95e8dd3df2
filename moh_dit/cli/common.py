"""Shared behaviour of the command-line entry points.

Kept free of heavy imports (torch, diffusers) at module level, so that ``--help`` answers at once."""

from __future__ import annotations

import argparse
import logging
import math
import os
import re
import sys
from typing import Callable, Optional, TypeVar

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


def run_cli(main: Callable[[], T]) -> T:
    """Run a command's ``main``: bad input ends with ``error: <one line>`` and exit code 2, Ctrl-C with one
    line and 130. ``MOH_DIT_DEBUG=1`` re-raises with the full traceback."""
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


# ----------------------------------------------------------------------------------------------------
# Argument types: bad values are usage errors before any work starts
# ----------------------------------------------------------------------------------------------------
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


def grid_averaging_arg(text: str):
    """An argparse type: a training timestep for ``--grid-averaging`` (checked as the pipeline checks it),
    or ``off``."""
    from moh_dit.sampling.options import GRID_AVERAGING_OFF, check_grid_averaging

    if text.strip().lower() in (GRID_AVERAGING_OFF, "none"):
        return GRID_AVERAGING_OFF
    try:
        return check_grid_averaging(int(text))
    except ValueError:  # ConfigError is one too
        raise argparse.ArgumentTypeError(
            f"expected a training timestep between 0 and 999 (e.g. 100), or off; got {text!r}"
        ) from None


def finite_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return value


def apply_model_guidance(args, record: Optional[dict]) -> None:
    """Guidance the user left open (``--cfg-scale`` unset): the model's recorded preview guidance, scale
    and interval, and its grid averaging (``MoHDiTPipeline.preview_sampling``), else the package's grid
    guidance at every step without averaging. A ``--cfg-scale`` given alone guides every step (as DiT, without
    averaging); ``--guidance-interval`` and ``--grid-averaging`` (``off`` included) always win. Logs the choice."""
    from moh_dit.sampling.options import GRID_AVERAGING_OFF, GRID_GUIDANCE, check_guidance_interval, describe_guidance

    check_guidance_interval(args.guidance_interval)  # before any model is loaded
    if args.cfg_scale is not None:
        why = "--cfg-scale"
    elif record:
        args.cfg_scale, why = record["guidance_scale"], "the model's recorded preview guidance"
        if args.guidance_interval is None:
            args.guidance_interval = record.get("guidance_interval")
        if args.grid_averaging is None:
            args.grid_averaging = record.get("grid_averaging")
    else:
        args.cfg_scale, why = GRID_GUIDANCE, "no recorded guidance: the package's grid default"
    if args.grid_averaging == GRID_AVERAGING_OFF:
        args.grid_averaging = None
    described = describe_guidance(args.cfg_scale, args.guidance_interval, args.grid_averaging)
    logging.getLogger("moh_dit").info("%s (%s)", described, why)


def add_sampling_arguments(parser, guidance: Optional[float], protocol: str, num_samples: Optional[int]) -> None:
    """The sampling options ``sample.py`` and ``evaluate_fid.py`` share (names, types, choices). Call
    ``apply_protocol`` on the parsed arguments: it fills the scheduler and steps the user left open."""
    from moh_dit.sampling.options import DTYPES, LABEL_MODES, PROTOCOLS, SCHEDULERS

    described = ", ".join(f"{name} = {sched} {steps} steps" for name, (sched, steps) in PROTOCOLS.items())
    parser.add_argument(
        "--protocol",
        choices=list(PROTOCOLS),
        default=protocol,
        help=f"scheduler and steps unless --scheduler/--num-steps say otherwise ({described})",
    )

    parser.add_argument(
        "--num-samples",
        type=positive_int,
        default=num_samples,
        help="how many images to generate for evaluation (PNGs + an ADM .npz)",
    )
    parser.add_argument(
        "--cfg-scale",
        type=finite_float,
        default=guidance,
        help="classifier-free guidance scale (1 = off); default: "
        + (f"{guidance:g}" if guidance is not None else "the model's own (see apply_model_guidance)"),
    )
    parser.add_argument(
        "--guidance-channels",
        type=positive_int,
        default=None,
        help="guide only the first N channels (3 reproduces the DiT/MoH-DiT papers' FIDs)",
    )
    add_guidance_placement_arguments(
        parser,
        "guide only the steps at training timesteps FIRST..LAST (e.g. 100 600; 0 999 = every step, as DiT); "
        "see docs/sampling.md",
        "at the steps with training timestep <= LAST, average the prediction over the patch grid's shifts "
        "(fainter patch seams; e.g. 100); off for none"
        + ("; default: the model's own" if guidance is None else "; default: off")
        + " (docs/sampling.md)",
    )
    parser.add_argument(
        "--num-steps", type=positive_int, default=None, help="sampling steps (default: the protocol's)"
    )
    parser.add_argument("--scheduler", choices=SCHEDULERS, default=None, help="default: the protocol's")
    parser.add_argument("--label-mode", choices=LABEL_MODES, default="uniform")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=DTYPES, default="fp32", help="transformer dtype (the VAE stays fp32)")
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace samples in the sample folder that were made with other settings",
    )


def add_guidance_placement_arguments(parser, interval_help: str, averaging_help: str) -> None:
    """``--guidance-interval FIRST LAST`` and ``--grid-averaging LAST|off`` (both default ``None``), with the
    caller's help texts."""
    parser.add_argument(
        "--guidance-interval",
        type=non_negative_int,
        nargs=2,
        metavar=("FIRST", "LAST"),
        default=None,
        help=interval_help,
    )
    parser.add_argument("--grid-averaging", type=grid_averaging_arg, default=None, metavar="LAST", help=averaging_help)


def apply_protocol(args) -> None:
    """Fill ``args.scheduler`` and ``args.num_steps`` from ``args.protocol`` where the user gave none."""
    from moh_dit.sampling.options import PROTOCOLS

    scheduler, steps = PROTOCOLS[args.protocol]
    args.scheduler = args.scheduler or scheduler
    args.num_steps = args.num_steps or steps
