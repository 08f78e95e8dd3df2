"""Scoring samples the way the DiT and MoH-DiT papers do: FID, sFID, IS, precision and recall against an
ADM reference batch (docs/evaluation.md). :func:`evaluate` returns every number plus the settings that
produced it; :func:`score_sample_set` scores a sample set on disk after checking it is complete and unchanged.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from moh_dit.evaluation.features import FeatureExtractor, extract_features, load_images, validate_images
from moh_dit.evaluation.metrics import (
    KID_SUBSETS,
    bootstrap_interval,
    feature_statistics,
    frechet_distance,
    inception_score,
    kernel_inception_distance,
    precision_recall,
)
from moh_dit.evaluation.statistics import reference_statistics
from moh_dit.files import atomic_write_json

logger = logging.getLogger(__name__)


# ----------------------------------------------------------------------------------------------------
# Putting it together
# ----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ScoringOptions:
    """How a sample set is scored, apart from the reference and the features: the feature batch size, ADM's
    float16 distances, the reference-statistics cache, the crop size of an image-folder reference, the
    bootstrap rounds and whether the samples' features come back too (for scores of one's own, such as the
    experiments' per-class KID; see :func:`evaluate`). ``moh-dit evaluate`` and the trainer's evaluations share
    it."""

    batch_size: int = 100
    fp16_distances: bool = False
    cache: bool = True
    reference_size: int | None = None
    bootstrap: int = 0
    return_features: bool = False


def score_sample_set(
    path: str | os.PathLike,
    reference: str | os.PathLike,
    extractor: FeatureExtractor,
    options: ScoringOptions | None = None,
) -> dict:
    """Score the samples at ``path`` (a moh-dit sample folder or ``.npz``, or images from elsewhere): a set
    whose manifest counts more images than it holds, or whose ``.npz`` was changed after packing, is refused
    before its features are computed. The result is :func:`evaluate`'s, with ``samples`` (path and manifest)."""
    from moh_dit.manifests import read_manifest
    from moh_dit.sampling.generation import check_samples
    from moh_dit.sampling.sample_sets import read_npz_manifest

    path, options = Path(path), options or ScoringOptions()
    if path.is_dir():
        manifest = read_manifest(path, "samples")
    else:
        manifest = read_npz_manifest(path) if path.suffix == ".npz" else None
    check_samples(path, manifest)  # a folder: before its images are read
    samples = load_images(path, limit=(manifest or {}).get("count"))
    check_samples(path, manifest, samples)
    result = evaluate(
        samples,
        reference,
        extractor,
        options.batch_size,
        options.fp16_distances,
        cache=options.cache,
        reference_size=options.reference_size,
        bootstrap=options.bootstrap,
        return_features=options.return_features,
    )
    result["samples"] = {"path": str(path.resolve()), "manifest": manifest}
    return result


def evaluate(
    samples: np.ndarray,
    reference: str | os.PathLike,
    extractor: FeatureExtractor,
    batch_size: int = 100,
    fp16_distances: bool = False,
    pr_k: int = 3,
    pr_block: int = 10000,
    is_split_size: int = 5000,
    cache: bool = True,
    reference_size: int | None = None,
    bootstrap: int = 0,
    return_features: bool = False,
) -> dict:
    """FID, sFID, IS, KID, precision and recall of uint8 NHWC ``samples`` against ``reference``. An
    image-folder reference is center-cropped to ``reference_size`` (default: the samples' size). KID is
    computed against the reference's precision/recall images (torch-fidelity's subsets of up to 1000).
    With ``bootstrap`` > 0, 90% percentile intervals of FID and KID over that many resamples of the
    samples are added (``fid_interval``, ``kid_interval``). With ``return_features``, the samples' features
    (``extract_features``'s dict) come back under ``features``, for further scores without a second pass;
    drop them before :func:`write_metrics`."""
    samples = validate_images(samples, "samples")
    ref = reference_statistics(reference, extractor, batch_size, cache, image_size=reference_size or samples.shape[1])
    if (
        ref["info"].get("image_size") not in (None, samples.shape[1])
        and "stored statistics" not in ref["info"]["statistics"]
    ):
        logger.warning("reference images are %d px, samples %d px", ref["info"]["image_size"], samples.shape[1])
    feats = extract_features(extractor, samples, batch_size, "sample features")
    results: dict = {}
    mu, sigma = feature_statistics(feats["pool"])
    results["fid"] = frechet_distance(mu, sigma, ref["mu"], ref["sigma"])
    if "spatial" in feats and "mu_s" in ref:
        mu_s, sigma_s = feature_statistics(feats["spatial"])
        results["sfid"] = frechet_distance(mu_s, sigma_s, ref["mu_s"], ref["sigma_s"])
    if "logits" in feats:
        results["inception_score"] = inception_score(feats["logits"], is_split_size)
    results["precision"], results["recall"] = precision_recall(
        ref["pool"], feats["pool"], k=pr_k, block=pr_block, fp16=fp16_distances
    )
    results["kid"], results["kid_std"], kid_size = kernel_inception_distance(ref["pool"], feats["pool"])
    if bootstrap:
        pool = feats["pool"]
        results["fid_interval"] = bootstrap_interval(
            pool,
            lambda f: frechet_distance(*feature_statistics(f), ref["mu"], ref["sigma"]),
            bootstrap,
            estimate=results["fid"],
        )
        results["kid_interval"] = bootstrap_interval(
            pool,
            lambda f: kernel_inception_distance(ref["pool"], f, subsets=10)[0],
            bootstrap,
            estimate=results["kid"],
        )
    result = {
        "metrics": results,
        "reference": ref["info"],
        "num_samples": int(len(samples)),
        "extractor": extractor.name,
        "weights_sha256": extractor.weights_sha256,
        "settings": {
            "fp16_distances": fp16_distances,
            "kid": {"subsets": KID_SUBSETS, "subset_size": kid_size, "kernel": "(x.y / d + 1)^3"},
            "bootstrap_rounds": bootstrap,
            "pr_k": pr_k,
            "is_split_size": is_split_size,
            "batch_size": batch_size,
        },
    }
    return dict(result, features=feats) if return_features else result


def write_metrics(path: str | os.PathLike, result: dict) -> Path:
    """The metrics JSON (kind ``metrics``), written atomically."""
    from moh_dit.manifests import code_version, utc_now

    return atomic_write_json(path, {"kind": "metrics", "created": utc_now(), "code": code_version(), **result})


def format_table(metrics: dict) -> str:
    names = {
        "fid": "FID",
        "sfid": "sFID",
        "inception_score": "Inception Score",
        "kid": "KID",
        "precision": "Precision",
        "recall": "Recall",
    }
    width = max(len(v) for v in names.values())
    rows = []
    for key, name in names.items():
        if key not in metrics:
            continue
        extra = f"  (std over subsets {metrics['kid_std']:.5f})" if key == "kid" else ""
        if f"{key}_interval" in metrics:
            low, high = metrics[f"{key}_interval"]
            extra += f"  (90% bootstrap {low:.5g} .. {high:.5g})"
        rows.append(f"{name:<{width}}  {metrics[key]:.{5 if key == 'kid' else 4}f}{extra}")
    rule = "-" * (width + 12)
    return "\n".join([rule, *rows, rule])
