"""A run's EMA of any width, rebuilt from its post-hoc snapshots (:mod:`moh_dit.snapshots`) into a transformer: what a
guide of autoguidance with ``guide_sigma_rel`` is, and what ``moh-dit ema`` exports (``moh_dit.training.posthoc_export``).
The architecture comes from the run's newest checkpoint; the weights from the snapshots."""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from moh_dit.errors import ArtifactError
from moh_dit.model.network import MoHDiT
from moh_dit.posthoc_ema import profile_error
from moh_dit.run_folder import RunLayout
from moh_dit.sampling.sources import ModelSource, load_transformer
from moh_dit.snapshots import read_snapshot_metadata, reconstruct, snapshots_up_to

__all__ = ["rebuild_weights", "rebuild_transformer", "newest_checkpoint"]

logger = logging.getLogger(__name__)


def newest_checkpoint(run: str | os.PathLike):
    """The run's newest checkpoint (the architecture, VAE and class names of what is rebuilt)."""
    latest = RunLayout(run).latest_checkpoint()
    if latest is None:
        raise ArtifactError(
            f"{RunLayout(run).root} has no checkpoint to read the architecture, VAE and class names from"
        )
    return latest


def rebuild_weights(
    model: MoHDiT, run: str | os.PathLike, sigma_rel: float, step: int | None, where: str
) -> dict[str, Any]:
    """Replace ``model``'s weights by the EMA of ``sigma_rel`` rebuilt from the run's snapshots up to ``step``; returns
    the record of what made it (its step, images, the snapshots' coefficients and how well they fit the profile)."""
    snapshots = snapshots_up_to(run, step)
    names = [n for n, _ in model.named_parameters()]  # the network only: REPA's projector is not sampled
    weights, used = reconstruct(snapshots, sigma_rel, names)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(weights[name])
    last = read_snapshot_metadata(snapshots[-1])
    logger.info(
        "rebuilt the EMA of sigma_rel %g at step %d from %d snapshots (the architecture of %s)",
        sigma_rel,
        last["step"],
        len(used),
        where,
    )
    error = profile_error(
        [u["images"] for u in used],
        [u["sigma_rel"] for u in used],
        [u["coefficient"] for u in used],
        last["images"],
        sigma_rel,
    )
    if error > 0.1:
        logger.warning(
            "the snapshots fit the profile of sigma_rel %g only to %.0f%% (relative L2): it lies far from the "
            "tracked widths; track it (ema.posthoc_sigma_rels) for a faithful EMA",
            sigma_rel,
            100 * error,
        )
    return {
        "sigma_rel": sigma_rel,
        "step": last["step"],
        "images": last["images"],
        "profile_error": error,
        "snapshots": used,
    }


def rebuild_transformer(
    run: str | os.PathLike, sigma_rel: float, step: int | None = None
) -> tuple[MoHDiT, ModelSource, dict[str, Any]]:
    """The run's transformer with the EMA of ``sigma_rel`` rebuilt at ``step`` (the newest snapshot by default), the
    checkpoint whose architecture it has, and the record of how it was made."""
    model, source = load_transformer(newest_checkpoint(run))
    record = rebuild_weights(model, run, sigma_rel, step, source.path.name)
    return model, source, record
