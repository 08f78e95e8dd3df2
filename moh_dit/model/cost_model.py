"""The cost model behind ``execution="auto"``: dense or sparse MoH attention for a given shape.

Exact head skipping can save at most the ideal ratio of the attention module's multiply-adds

    ideal(rho, r) = (1 + rho + rho r) / (2 + r),   r = tokens / model width, rho = active-head fraction

(queries, attention rows and output rows of inactive (token, head) pairs are skipped; keys and values
stay dense). What a sparse kernel really achieves is an affine function of that ideal, fitted per device
type and per pass (forward only / forward + backward) by ``benchmarks/attention.py --calibrate``,
together with the share of routed heads (the part that pays gather/scatter overhead), the inverse
sequence length and the inverse width (fixed bookkeeping weighs more on short, narrow layers):

    measured sparse / dense  ~=  a + b * ideal + c * (routed heads / heads) + d * 256 / tokens + e * 384 / width

Auto picks ``sparse`` only where the fitted ratio is below ``1 - margin``; with no calibration for a
device (or one fitted on other features) it picks ``dense``, so the default is never slower than the
reference computation.

Where calibrations live: the package ships one file per device type, ``moh_dit/calibrations/<type>.json``
(fitted on this project's machines and committed with the benchmark report they come from). A
calibration of your own hardware (``benchmarks/attention.py --calibrate`` writes
``benchmarks/results/calibration_<device>.json``) is used by pointing ``$MOH_DIT_CALIBRATION`` at it;
its entries replace the shipped ones of the same device type. Calibrations are read once, when an
``auto`` processor is made, never during a forward pass.
"""

from __future__ import annotations

import json
import os
from functools import lru_cache
from pathlib import Path

__all__ = [
    "FEATURE_NAMES",
    "ideal_attention_ratio",
    "ideal_block_ratio",
    "choose_execution",
    "load_calibration",
    "CALIBRATION_DIR",
    "CALIBRATION_ENV",
]

CALIBRATION_DIR = Path(__file__).with_name("calibrations")
CALIBRATION_ENV = "MOH_DIT_CALIBRATION"
DEFAULT_MARGIN = 0.05


def ideal_attention_ratio(active_fraction: float, tokens: int, dim: int) -> float:
    """Ideal attention-module cost of exact skipping relative to dense attention."""
    r = tokens / dim
    return (1 + active_fraction + active_fraction * r) / (2 + r)


def ideal_block_ratio(active_fraction: float, tokens: int, dim: int) -> float:
    """Ideal cost of a whole DiT block (attention + MLP with ratio 4 + adaLN excluded) relative to dense."""
    r = tokens / dim
    return (10 + 2 * active_fraction + 2 * active_fraction * r) / (12 + 2 * r)


def load_calibration(path: str | None = None) -> dict:
    """The cost-model coefficients per ``<device type>/<infer|train>``: the shipped files, updated by
    ``path`` or ``$MOH_DIT_CALIBRATION`` when given."""
    return _load_calibration(path or os.environ.get(CALIBRATION_ENV) or None)


@lru_cache(maxsize=4)
def _load_calibration(extra: str | None) -> dict:
    cal: dict = {}
    for file in sorted(CALIBRATION_DIR.glob("*.json")):
        cal.update(json.loads(file.read_text()))
    if extra:
        file = Path(extra)
        if not file.is_file():
            raise FileNotFoundError(f"calibration file {file} (${CALIBRATION_ENV}) not found")
        cal.update(json.loads(file.read_text()))
    return cal


def choose_execution(
    device_type: str,
    tokens: int,
    dim: int,
    num_heads: int,
    head_dim: int,
    active_fraction: float,
    backward: bool,
    routed_fraction: float = 1.0,
    calibration: dict | None = None,
    margin: float = DEFAULT_MARGIN,
) -> str:
    """``"sparse"`` if the calibrated model predicts it to be faster than dense by more than ``margin``."""
    if active_fraction >= 1.0:
        return "dense"
    cal = (calibration if calibration is not None else load_calibration()).get(
        f"{device_type}/{'train' if backward else 'infer'}"
    )
    if not cal or tuple(cal.get("features", FEATURE_NAMES)) != FEATURE_NAMES or len(cal["coef"]) != len(FEATURE_NAMES):
        return "dense"  # uncalibrated, or fitted on another feature set: stay with the reference computation
    if not cal.get("min_tokens", 0) <= tokens:
        return "dense"
    predicted = predict_sparse_over_dense(cal, active_fraction, routed_fraction, tokens, dim)
    return "sparse" if predicted < 1.0 - margin else "dense"


FEATURE_NAMES = ("1", "ideal", "routed_share", "256/tokens", "384/width")


def features(active_fraction: float, routed_fraction: float, tokens: int, dim: int) -> list[float]:
    """Regressors of the cost model, named in ``FEATURE_NAMES``: constant, ideal ratio, routed share,
    256 / tokens and 384 / width (the fixed bookkeeping of the sparse path weighs more on short
    sequences and narrow layers)."""
    return [1.0, ideal_attention_ratio(active_fraction, tokens, dim), routed_fraction, 256.0 / tokens, 384.0 / dim]


def predict_sparse_over_dense(
    cal: dict, active_fraction: float, routed_fraction: float, tokens: int, dim: int
) -> float:
    return float(sum(c * f for c, f in zip(cal["coef"], features(active_fraction, routed_fraction, tokens, dim))))
