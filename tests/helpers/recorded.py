"""Comparisons against numbers recorded on another machine.

A value recorded by another CPU (or another build of torch) went through kernels that may sum in another order
(AVX-512 against AVX2, another thread split), so float32 results agree to float32's rounding, not bit for bit:
an Intel Xeon and an AMD EPYC gave 0.3's training loss at step 3 1.2e-7 apart, relative. Bit-for-bit equality
is asserted only between two results made on one machine in one test (a straight run against its resumed twin).
"""

from collections.abc import Sequence

import numpy as np
import pytest

# float32 keeps about 7 digits; a few training steps or a sampling loop compound a few ulps
FLOAT32_REL = 1e-5


def recorded_rows(rows: Sequence[Sequence[float]], rel: float = FLOAT32_REL) -> list:
    """Rows of recorded numbers as ``pytest.approx`` rows: integers (steps) exact, floats to float32's rounding."""
    return [pytest.approx(list(row), rel=rel, abs=0) for row in rows]


def assert_images_match_recorded(images: np.ndarray, recorded: np.ndarray, *, share: float = 0.01) -> None:
    """uint8 images drawn here equal recorded ones but for rounding: a pixel whose float value sat on a rounding
    boundary may land one level away on another CPU; at most ``share`` of the pixels may, and none further."""
    assert images.shape == recorded.shape and images.dtype == recorded.dtype
    difference = np.abs(images.astype(np.int16) - recorded.astype(np.int16))
    assert difference.max() <= 1, f"a pixel is {difference.max()} levels from the recorded image"
    assert (difference > 0).mean() <= share, f"{(difference > 0).mean():.2%} of the pixels moved a level"
