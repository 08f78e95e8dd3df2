"""Post-hoc EMA snapshots in a run folder (``<run>/posthoc/step-N.safetensors``): writing one, reading its metadata,
and rebuilding the EMA of any width from them (:func:`reconstruct`, the math of :mod:`moh_dit.posthoc_ema`). Below
training and sampling: the trainer writes snapshots, ``moh-dit ema`` and autoguidance's guides rebuild from them."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

import torch

from moh_dit.errors import ArtifactError
from moh_dit.files import atomic_path, read_safetensors
from moh_dit.posthoc_ema import PowerFunctionEMAs, posthoc_coefficients
from moh_dit.run_folder import RunLayout

__all__ = ["SNAPSHOT_DTYPES", "save_snapshot", "read_snapshot_metadata", "snapshots_up_to", "reconstruct"]

SNAPSHOT_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def save_snapshot(path, emas: PowerFunctionEMAs, names: Sequence[str], step: int, images: int, dtype: str) -> None:
    """Every tracked EMA at ``step`` (after ``images`` training images) in one safetensors file, written atomically;
    its metadata says when and how it was taken."""
    from safetensors.torch import save_file

    tensors = {k: v.to(SNAPSHOT_DTYPES[dtype]) for k, v in emas.state_dict(names).items()}
    metadata = {"step": str(step), "images": str(images), "sigma_rels": json.dumps(emas.sigma_rels), "dtype": dtype}
    with atomic_path(path) as tmp:
        save_file(tensors, tmp, metadata=metadata)


def read_snapshot_metadata(path) -> dict:
    """``{"step", "images", "sigma_rels", "dtype"}`` of a snapshot file, without reading its tensors."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
    except Exception as err:  # safetensors raises its own error types for a damaged file
        raise ArtifactError(f"{path} is not a readable post-hoc EMA snapshot ({str(err).splitlines()[0]})") from None
    try:
        return {
            "step": int(meta["step"]),
            "images": int(meta["images"]),
            "sigma_rels": [float(s) for s in json.loads(meta["sigma_rels"])],
            "dtype": meta["dtype"],
        }
    except (KeyError, ValueError) as err:
        raise ArtifactError(f"{path} has no post-hoc EMA snapshot metadata ({err})") from None


def reconstruct(
    snapshots: Sequence, sigma_rel: float, names: Sequence[str]
) -> tuple[dict[str, torch.Tensor], list[dict]]:
    """The EMA of width ``sigma_rel`` at the time of the last of ``snapshots`` (paths, oldest first; every one with
    images <= the last's is used, as EDM2 does): each parameter as the coefficients' combination of the snapshots'
    EMAs, accumulated in float64, returned in float32. Also returns, per snapshot EMA used, its step, images,
    sigma_rel and coefficient (the record of what made it)."""
    metas = [read_snapshot_metadata(p) for p in snapshots]
    target = metas[-1]["images"]
    inputs = [(p, m, s) for p, m in zip(snapshots, metas) for s in m["sigma_rels"] if 0 < m["images"] <= target]
    x = posthoc_coefficients([m["images"] for _, m, _ in inputs], [s for _, _, s in inputs], target, sigma_rel)[:, 0]
    total = {name: None for name in names}
    used, loaded = [], (None, None)
    for (path, meta, s), coefficient in zip(inputs, x):
        if loaded[0] != path:  # each file once: its EMAs are next to each other in ``inputs``
            loaded = (path, read_safetensors(path, "cpu"))
        for name in names:
            value = loaded[1][f"{s:.6g}/{name}"].double() * float(coefficient)
            total[name] = value if total[name] is None else total[name] + value
        used.append(dict(step=meta["step"], images=meta["images"], sigma_rel=s, coefficient=float(coefficient)))
    return {name: t.float() for name, t in total.items()}, used


def snapshots_up_to(run: str | os.PathLike, step: int | None = None) -> list[Path]:
    """The run's snapshots up to ``step`` (default: the newest), oldest first; a step without a snapshot is an
    error that lists the steps there are."""
    layout = RunLayout(run)
    found = layout.list_snapshots()
    if not found:
        raise ArtifactError(
            f"{layout.root} has no post-hoc EMA snapshots ({layout.posthoc.name}/): train it with ema.posthoc_every > 0"
        )
    steps = [s for s, _ in found]
    step = steps[-1] if step is None else step
    if step not in steps:
        shown = ", ".join(map(str, steps[:8])) + (f", ... {steps[-1]}" if len(steps) > 8 else "")
        raise ArtifactError(f"{layout.root} has no snapshot at step {step}; it has steps {shown}")
    return [p for s, p in found if s <= step]
