"""The times a few-step student samples at: the intervals of its sampler's grids, and DMD2's generator grids shifted so
that the two-step grid's middle is where it was asked. Pure Python (no torch), so that the configs and the method
table read them before torch loads."""

from __future__ import annotations

__all__ = ["linspace", "sampler_intervals", "generator_grids", "MIDPOINT"]

MIDPOINT = 0.5  # the unshifted two-step grid's middle time (FastGen's [0.999, 0.5, 0])


def linspace(start: float, end: float, count: int) -> list[float]:
    """``count`` evenly spaced values from ``start`` to ``end`` as torch's float64 ``linspace`` computes them (the
    first half counted from the start, the second from the end), so that a grid is the same float either way."""
    if count == 1:
        return [start]
    step = (end - start) / (count - 1)
    return [start + i * step if i < count / 2 else end - (count - 1 - i) * step for i in range(count)]


def sampler_intervals(steps: tuple[int, ...]) -> list[tuple[float, float]]:
    """The intervals ``(start, end)`` the few-step sampler evaluates with each count of ``steps`` (the unshifted grid
    ``1, 1 - 1/n, ..., 0`` of :meth:`moh_dit.objectives.meanflow.MeanFlow.set_timesteps`), each once."""
    found: dict[tuple[float, float], None] = {}
    for n in steps:
        grid = linspace(1.0, 0.0, n + 1)
        found.update({(grid[i], grid[i + 1]): None for i in range(n)})
    return list(found)


def generator_grids(steps: tuple[int, ...], midpoint: float = MIDPOINT) -> dict[int, list[float]]:
    """Each step count's grid of start times (1 first, 0 left out), shifted so that the two-step grid's middle time is
    ``midpoint`` (SD3's shift ``s t / (1 + (s - 1) t)`` with ``s = midpoint / (1 - midpoint)``)."""
    shift = midpoint / (1 - midpoint)
    return {n: [round(shift * a / (1 + (shift - 1) * a), 12) for a, _ in sampler_intervals((n,))] for n in steps}
