"""Images: the model's value range, and grids with class-name captions for previews and ``sample.py``."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFont

__all__ = ["heatmap", "make_grid", "to_model_range"]


def make_grid(
    images: np.ndarray,
    ncols: int,
    row_labels: Sequence[str] | None = None,
    scale: int | None = None,
    padding: int = 2,
) -> Image.Image:
    """Tile uint8 images (N, H, W, C) into rows of ``ncols``; ``row_labels`` are written left of each row.

    Small images (e.g. 28 px) are enlarged ``scale`` times with nearest-neighbour so they stay crisp; by
    default to about 96 px per tile.
    """
    if images.ndim != 4 or images.dtype != np.uint8:
        raise ValueError(f"images must be uint8 (N, H, W, C), got {images.dtype} {images.shape}")
    n, h, w, c = images.shape
    scale = scale if scale is not None else max(1, 96 // h)
    if c == 1:
        images = np.repeat(images, 3, axis=3)
    h, w = h * scale, w * scale
    nrows = -(-n // ncols)
    font = ImageFont.load_default()
    label_w = 0
    if row_labels:
        label_w = (
            max(int(ImageDraw.Draw(Image.new("RGB", (1, 1))).textlength(str(t), font=font)) for t in row_labels) + 8
        )
    grid = Image.new("RGB", (label_w + ncols * (w + padding) + padding, nrows * (h + padding) + padding), "white")
    draw = ImageDraw.Draw(grid)
    for i in range(n):
        r, col = divmod(i, ncols)
        tile = Image.fromarray(images[i])
        if scale != 1:
            tile = tile.resize((w, h), Image.NEAREST)
        grid.paste(tile, (label_w + padding + col * (w + padding), padding + r * (h + padding)))
    for r, text in enumerate(row_labels or []):
        if r < nrows:
            draw.text((4, padding + r * (h + padding) + h // 2 - 5), str(text), fill="black", font=font)
    return grid


def to_model_range(arr: np.ndarray) -> torch.Tensor:
    """uint8 (H, W) or (H, W, C) -> float32 (C, H, W) in [-1, 1]."""
    if arr.ndim == 2:
        arr = arr[:, :, None]
    return torch.from_numpy(np.array(arr.transpose(2, 0, 1), dtype=np.float32)).div_(127.5).sub_(1.0)


# viridis at five points, interpolated: perceptually ordered, readable in grey
_VIRIDIS = np.array([[68, 1, 84], [59, 82, 139], [33, 145, 140], [94, 201, 98], [253, 231, 37]], dtype=np.float64)


def _viridis(value: float) -> tuple[int, int, int]:
    pos = float(np.clip(value, 0, 1)) * (len(_VIRIDIS) - 1)
    lo = int(min(pos, len(_VIRIDIS) - 2))
    return tuple(int(x) for x in _VIRIDIS[lo] + (pos - lo) * (_VIRIDIS[lo + 1] - _VIRIDIS[lo]))


def heatmap(
    values: np.ndarray, row_labels: Sequence[str], col_labels: Sequence[str], title: str = "", cell: int = 22
) -> Image.Image:
    """A labelled heatmap of ``values`` (rows x columns) in [0, 1]; NaN cells (e.g. heads a layer does not
    have) are drawn light grey. Drawn with PIL alone, so no plotting library is needed."""
    values = np.asarray(values, dtype=np.float64)
    rows, cols = values.shape
    font = ImageFont.load_default()
    measure = ImageDraw.Draw(Image.new("RGB", (1, 1)))
    left = max(int(measure.textlength(str(t), font=font)) for t in row_labels) + 8
    top = 20 if title else 4
    width, height = max(left + cols * cell + 4, left + 5 * 48), top + rows * cell + 18
    image = Image.new("RGB", (width, height + 16), "white")
    draw = ImageDraw.Draw(image)
    if title:
        draw.text((4, 4), title, fill="black", font=font)
    for r in range(rows):
        draw.text((4, top + r * cell + cell // 2 - 5), str(row_labels[r]), fill="black", font=font)
        for c in range(cols):
            v = values[r, c]
            color = (230, 230, 230) if np.isnan(v) else _viridis(v)
            x0, y0 = left + c * cell, top + r * cell
            draw.rectangle([x0, y0, x0 + cell - 2, y0 + cell - 2], fill=color)
    for c in range(cols):
        draw.text((left + c * cell + 4, top + rows * cell + 2), str(col_labels[c]), fill="black", font=font)
    for i, v in enumerate(np.linspace(0, 1, 5)):
        x0 = left + i * 48
        draw.rectangle([x0, height, x0 + 10, height + 10], fill=_viridis(v))
        draw.text((x0 + 13, height), f"{v:.2g}", fill="black", font=font)
    return image


def plot_curves(
    points: Sequence[dict], keys: Sequence[tuple[str, str]], path, title: str = "", x_key: str = "step"
) -> bool:
    """Line plots of ``points`` (dicts with ``x_key`` and some of ``keys``, given as ``(key, label)``), one panel
    per key present, saved as a PNG at ``path``. Needs matplotlib (the ``plot`` extra); returns whether it drew."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    shown = [(k, label) for k, label in keys if any(k in p for p in points)]
    if not shown:
        return False
    fig, axes = plt.subplots(1, len(shown), figsize=(3.2 * len(shown), 2.8), squeeze=False)
    for ax, (key, label) in zip(axes[0], shown):
        xy = [(p[x_key], p[key]) for p in points if key in p]
        ax.plot([x for x, _ in xy], [y for _, y in xy], marker="o", markersize=3)
        ax.set_xlabel(x_key)
        ax.set_title(label, fontsize=10)
        ax.grid(alpha=0.3)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
