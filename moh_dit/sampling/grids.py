"""Labelled image grids of a pipeline's samples: ``per_class`` images of each class, one row per class, each image
drawn from its own seed ``(seed, index)`` (``sample.py``'s grid, the trainer's previews, the demo)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from moh_dit.sampling.guides import Guide
from moh_dit.sampling.pipeline import MoHDiTPipeline
from moh_dit.sampling.spec import SamplingSpec
from moh_dit.seeding import index_generator

__all__ = ["sample_grid", "save_grid"]


def sample_grid(
    pipe: MoHDiTPipeline,
    class_labels: Sequence[int | str],
    per_class: int,
    seed: int,
    sampling: SamplingSpec,
    batch_size: int = 64,
    guide: Guide | None = None,
) -> tuple[np.ndarray, list[str] | None]:
    """``per_class`` uint8 images of every requested class, one row per class; image ``i`` draws its noise from
    ``(seed, i)``. Returns the images and the row names (``None`` for an unconditional model)."""
    conditional = pipe.transformer.config.num_classes > 0
    ids = pipe.get_label_ids(class_labels) if conditional else [None]
    labels = [c for c in ids for _ in range(per_class)]
    out = []
    for b in range(0, len(labels), batch_size):
        chunk = labels[b : b + batch_size]
        gens = [index_generator(seed, b + j) for j in range(len(chunk))]
        kwargs = dict(class_labels=chunk) if conditional else dict(num_images=len(chunk))
        drawn = pipe(**kwargs, sampling=sampling, guide=guide, generator=gens, output_type="uint8", progress=False)
        out.append(drawn.images)
    names = [pipe.id2label.get(c, str(c)) for c in ids] if conditional else None
    return np.concatenate(out), names


def save_grid(
    pipe: MoHDiTPipeline,
    path: str | os.PathLike,
    per_class: int,
    seed: int,
    sampling: SamplingSpec,
    max_classes: int | None = None,
) -> Path:
    """A labelled PNG grid of the first ``max_classes`` classes (training previews)."""
    from moh_dit.images import make_grid

    num_classes = pipe.transformer.config.num_classes
    classes = list(range(min(num_classes, max_classes or num_classes)))
    images, names = sample_grid(pipe, classes, per_class, seed, sampling)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    make_grid(images, ncols=per_class, row_labels=names).save(path)
    return path
