"""Images: the model's value range, and grids with class-name captions for previews and ``sample.py``."""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFont

__all__ = ["make_grid", "to_model_range"]


def make_grid(
    images: np.ndarray,
    ncols: int,
    row_labels: Optional[Sequence[str]] = None,
    scale: Optional[int] = None,
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
