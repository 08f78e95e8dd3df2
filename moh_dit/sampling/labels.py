"""Class ids from what a user types: ids, names in any case, with suggestions for close misspellings."""

from __future__ import annotations

import difflib
from collections.abc import Sequence

import numpy as np
import torch

__all__ = ["resolve_class_labels"]


def resolve_class_labels(
    labels: int | str | Sequence[int | str], num_classes: int, id2label: dict[int, str] | None = None
) -> list[int]:
    """Class ids or names (case-insensitive; a single one too) -> ids, with clear errors."""
    if isinstance(labels, (int, str, np.integer)):
        labels = [labels]
    if isinstance(labels, torch.Tensor):
        labels = labels.tolist()
    id2label = id2label or {}
    exact = {v: k for k, v in id2label.items()}
    folded: dict[str, list[int]] = {}
    for k, v in id2label.items():
        folded.setdefault(v.lower(), []).append(k)
    ids = []
    for label in labels:
        if isinstance(label, str) and not label.strip().lstrip("-").isdigit():
            key = label.strip()
            if key in exact:
                ids.append(exact[key])
                continue
            matches = folded.get(key.lower(), [])
            if len(matches) > 1:  # e.g. ImageNet's "Cardigan" (a dog) and "cardigan" (a sweater)
                options = ", ".join(f"{id2label[i]!r} = {i}" for i in matches)
                raise ValueError(f"class name {label!r} is ambiguous ({options}): use the exact name or the id")
            if not matches:
                close = difflib.get_close_matches(key.lower(), list(folded), n=3, cutoff=0.6)
                hint = f"; did you mean {', '.join(repr(id2label[folded[c][0]]) for c in close)}?" if close else ""
                shown = ", ".join(repr(v) for v in list(id2label.values())[:12])
                more = f" ... ({len(id2label)} in all)" if len(id2label) > 12 else ""
                known = f"known classes: {shown}{more}" if id2label else "this model has no class names"
                raise ValueError(f"unknown class name {label!r}{hint} ({known})")
            ids.append(matches[0])
            continue
        idx = int(label)
        if not 0 <= idx < num_classes:
            raise ValueError(f"class id {idx} is out of range: this model has classes 0..{num_classes - 1}")
        ids.append(idx)
    return ids
