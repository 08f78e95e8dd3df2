"""Sample-quality metrics with the semantics of the ADM evaluator (docs/evaluation.md).

- FID / sFID: Frechet distance between Gaussians fitted to features (covariance with N - 1), with
  ``scipy.linalg.sqrtm``; if the product's square root is not finite, 1e-6 is added to both diagonals;
  the real part is kept.
- Inception Score: softmax of the logits, contiguous splits of 5000 in file order (the last split may be
  partial), mean over splits of ``exp(mean KL(p(y|x) || p(y)))``.
- Precision / recall (k = 3): each point's radius is the squared distance to its k-th nearest neighbour in
  its own set (self excluded); precision is the share of samples inside some reference ball, recall the
  share of reference points inside some sample ball. Distances are computed in blocks so 50K x 10K fits in
  memory, optionally in float16 as ADM does.

Beside them, a diagnostic with no ADM counterpart: the patch-seam ratio, how much sharper the lines of a
transformer's patch grid are than the rest of the image (the 4x4 texture of an undertrained DiT).

torch-fidelity computes FID (by eigenvalues), an IS with equal-count splits and precision/recall with
unsquared distances; those are not the ADM conventions, so the ADM versions are written here and the
tests check that both agree wherever the conventions coincide.
"""

from __future__ import annotations

import collections
import hashlib
import math
import warnings

import numpy as np
import torch
from scipy import linalg

__all__ = [
    "feature_statistics",
    "frechet_distance",
    "inception_score",
    "precision_recall",
    "knn_radii",
    "kernel_inception_distance",
    "bootstrap_interval",
    "patch_seam_ratio",
    "KID_SUBSETS",
    "KID_SUBSET_SIZE",
]

# torch-fidelity's defaults for KID: 100 random subsets of 1000 (fewer when there are fewer images)
KID_SUBSETS, KID_SUBSET_SIZE, KID_SEED = 100, 1000, 2020


def feature_statistics(features: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Mean and covariance (N - 1 normalisation) of (N, D) features, in float64."""
    features = np.asarray(features, dtype=np.float64)
    if features.ndim != 2 or features.shape[0] < 2:
        raise ValueError(f"need (N >= 2, D) features, got shape {features.shape}")
    return features.mean(axis=0), np.cov(features, rowvar=False)


def frechet_distance(mu1, sigma1, mu2, sigma2, eps: float = 1e-6) -> float:
    """``|mu1 - mu2|^2 + Tr(S1) + Tr(S2) - 2 Tr sqrtm(S1 S2)``."""
    mu1, mu2 = np.atleast_1d(np.asarray(mu1, np.float64)), np.atleast_1d(np.asarray(mu2, np.float64))
    sigma1, sigma2 = np.atleast_2d(np.asarray(sigma1, np.float64)), np.atleast_2d(np.asarray(sigma2, np.float64))
    if mu1.shape != mu2.shape or sigma1.shape != sigma2.shape or sigma1.shape != (mu1.size, mu1.size):
        raise ValueError(f"statistics of different shapes: {mu1.shape}/{sigma1.shape} vs {mu2.shape}/{sigma2.shape}")
    diff = mu1 - mu2
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # sqrtm warns on singular products; handled below as ADM does
        covmean = linalg.sqrtm(sigma1.dot(sigma2))
        if not np.isfinite(covmean).all():
            offset = np.eye(sigma1.shape[0]) * eps
            covmean = linalg.sqrtm((sigma1 + offset).dot(sigma2 + offset))
    if np.iscomplexobj(covmean):
        covmean = covmean.real
    return float(diff.dot(diff) + np.trace(sigma1) + np.trace(sigma2) - 2 * np.trace(covmean))


def inception_score(logits: np.ndarray, split_size: int = 5000) -> float:
    """Inception Score from (N, K) logits, with contiguous splits of ``split_size`` in order."""
    logits = torch.as_tensor(np.asarray(logits), dtype=torch.float64)
    if logits.ndim != 2 or len(logits) == 0:
        raise ValueError(f"need (N, K) logits, got shape {tuple(logits.shape)}")
    probs = logits.softmax(dim=1)
    log_probs = logits.log_softmax(dim=1)
    scores = []
    for start in range(0, len(probs), split_size):
        p, log_p = probs[start : start + split_size], log_probs[start : start + split_size]
        marginal = p.mean(dim=0, keepdim=True)
        kl = (p * (log_p - marginal.log())).sum(dim=1).mean()
        scores.append(math.exp(kl.item()))
    return float(np.mean(scores))


def _sq_distances(a: torch.Tensor, b: torch.Tensor, fp16: bool) -> torch.Tensor:
    """Squared Euclidean distances (rows of a) x (rows of b), as ADM: |a|^2 - 2 a.b + |b|^2, clamped at 0.

    ``fp16`` emulates ADM's half-precision distance block: inputs rounded to float16, products accumulated
    in float32 (as fp16 tensor-core kernels do), the result rounded to float16.
    """
    if fp16:
        a, b = a.half().float(), b.half().float()
    d = a.square().sum(1, keepdim=True) - 2 * a @ b.T + b.square().sum(1)[None]
    if fp16:
        d = d.half().float()
    return d.clamp_min(0)


def knn_radii(features: torch.Tensor, k: int = 3, block: int = 10000, fp16: bool = False) -> torch.Tensor:
    """Squared distance from each point to its k-th nearest neighbour within the set (self excluded)."""
    if len(features) <= k:
        raise ValueError(f"need more than k={k} points to compute k-NN radii, got {len(features)}")
    radii = []
    for start in range(0, len(features), block):
        rows = features[start : start + block]
        dists = torch.cat(
            [_sq_distances(rows, features[c : c + block], fp16) for c in range(0, len(features), block)], 1
        )
        radii.append(dists.kthvalue(k + 1, dim=1).values)  # the 0-th neighbour is the point itself
    return torch.cat(radii)


# The reference's k-NN radii, by the reference features' digest: the same reference is scored against again and again
# (every evaluation during training, every model of a study), and its radii are its N x N distances' k-th smallest,
# most of an evaluation's time on a CPU (6 s of a 20-sample evaluation against 10,000 test images). A pure function's
# results, kept for the last few references.
_RADII: collections.OrderedDict[tuple, torch.Tensor] = collections.OrderedDict()
_RADII_KEPT = 4


def _reference_radii(features: torch.Tensor, k: int, block: int, fp16: bool) -> torch.Tensor:
    """:func:`knn_radii` of a reference, computed once per reference features (``_RADII``)."""
    digest = hashlib.sha256(features.detach().cpu().numpy().tobytes()).hexdigest()
    key = (digest, tuple(features.shape), k, fp16, str(features.device))
    if key not in _RADII:
        _RADII[key] = knn_radii(features, k, block, fp16)
        while len(_RADII) > _RADII_KEPT:
            _RADII.popitem(last=False)
    _RADII.move_to_end(key)
    return _RADII[key]


def _coverage(points: torch.Tensor, centres: torch.Tensor, radii: torch.Tensor, block: int, fp16: bool) -> float:
    """Share of ``points`` within ``radii`` of at least one of ``centres``."""
    inside = torch.zeros(len(points), dtype=torch.bool, device=points.device)
    for start in range(0, len(points), block):
        rows = points[start : start + block]
        hit = torch.zeros(len(rows), dtype=torch.bool, device=points.device)
        for c in range(0, len(centres), block):
            d = _sq_distances(rows, centres[c : c + block], fp16)
            hit |= (d <= radii[None, c : c + block]).any(dim=1)
        inside[start : start + block] = hit
    return inside.float().mean().item()


def precision_recall(
    reference: np.ndarray,
    samples: np.ndarray,
    k: int = 3,
    block: int = 10000,
    fp16: bool = False,
    device: str | None = None,
) -> tuple[float, float]:
    """Improved precision and recall (Kynkaanniemi et al.) with ADM's k-NN manifolds."""
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    ref = torch.as_tensor(np.asarray(reference), dtype=torch.float32, device=dev)
    gen = torch.as_tensor(np.asarray(samples), dtype=torch.float32, device=dev)
    if ref.ndim != 2 or gen.ndim != 2 or ref.shape[1] != gen.shape[1]:
        raise ValueError(f"feature sets must be (N, D) with the same D, got {tuple(ref.shape)} and {tuple(gen.shape)}")
    ref_radii = _reference_radii(ref, k, block, fp16)
    gen_radii = knn_radii(gen, k, block, fp16)
    precision = _coverage(gen, ref, ref_radii, block, fp16)
    recall = _coverage(ref, gen, gen_radii, block, fp16)
    return precision, recall


def kernel_inception_distance(
    reference: np.ndarray,
    samples: np.ndarray,
    subsets: int = KID_SUBSETS,
    subset_size: int = KID_SUBSET_SIZE,
    seed: int = KID_SEED,
) -> tuple[float, float, int]:
    """KID (Binkowski et al. 2018): the unbiased estimate of the squared MMD with the kernel
    ``(x.y / d + 1)^3``, averaged over random subsets of both sets. Computed by torch-fidelity's own
    implementation on our features. Returns ``(mean, standard deviation over subsets, subset size)``."""
    from torch_fidelity.metric_kid import KEY_METRIC_KID_MEAN, KEY_METRIC_KID_STD, kid_features_to_metric

    size = min(subset_size, len(reference), len(samples))
    if size < 2:
        raise ValueError(f"KID needs at least 2 images on each side, got {len(reference)} and {len(samples)}")
    out = kid_features_to_metric(
        torch.as_tensor(np.asarray(reference, dtype=np.float64)),
        torch.as_tensor(np.asarray(samples, dtype=np.float64)),
        kid_subsets=subsets,
        kid_subset_size=size,
        rng_seed=seed,
        verbose=False,
        kid_kernel="poly",
        kid_kernel_poly_degree=3,
        kid_kernel_poly_gamma=None,
        kid_kernel_poly_coef0=1,
    )
    return out[KEY_METRIC_KID_MEAN], out[KEY_METRIC_KID_STD], size


def bootstrap_interval(
    samples: np.ndarray,
    statistic,
    rounds: int = 20,
    seed: int = 0,
    level: float = 0.9,
    estimate: float | None = None,
) -> tuple[float, float]:
    """A normal bootstrap interval of ``statistic(samples)``: the estimate +- z times the standard deviation
    of the statistic over resamples of the generated samples (rows drawn with replacement), i.e. how much
    the number moves with the particular images drawn, at this sample count.

    Why not percentiles of the resampled values: a resample repeats about a third of the images, which
    shifts both FID and KID upwards (duplicates look like a less diverse set), so percentile intervals of
    an unbiased KID can miss the estimate altogether. The spread of the resampled values is not shifted.
    ``estimate``: the reported value when ``statistic`` is a cheaper version of it (KID over fewer subsets,
    whose extra subset noise only widens the interval); default ``statistic(samples)``."""
    from statistics import NormalDist

    rng = np.random.default_rng(seed)
    values = [statistic(samples[rng.integers(0, len(samples), len(samples))]) for _ in range(rounds)]
    estimate = float(statistic(samples)) if estimate is None else float(estimate)
    spread = float(np.std(values, ddof=1))
    z = NormalDist().inv_cdf(0.5 + level / 2)
    return estimate - z * spread, estimate + z * spread


def patch_seam_ratio(images, patch: int, offset: int = 0) -> float:
    """How much sharper the patch grid's lines are than the image around them: the mean absolute difference
    between neighbouring pixels on either side of a line of the ``patch``-pixel grid, divided by the mean
    absolute difference between neighbouring pixels inside a patch (rows and columns together; colour
    channels averaged first). A transformer that predicts each patch from its own token draws faint seams
    along the grid when it is undertrained or pushed by strong guidance; those raise the ratio. Real images
    are not invariant to where the grid falls either (centred objects put their outlines in particular
    columns), so compare a set's ratio with that of real images of the same kind; their quotient is the
    seam excess (1 = no more seams than real images).

    ``offset`` moves the grid by that many pixels right and down (0: the model's own grid, whose first line
    lies between pixels ``patch - 1`` and ``patch``); sampling that shifts the grid (grid averaging) is
    checked at every offset, so that seams moved elsewhere are not missed.

    ``images``: (N, H, W) or (N, H, W, C), any real dtype (uint8 as stored). Written here because no library
    we build on measures patch-grid artefacts."""
    x = torch.from_numpy(np.array(images, dtype=np.float64))  # a copy: stored arrays may be read-only
    if x.ndim == 4:
        x = x.mean(dim=3)  # (N, H, W)
    if x.ndim != 3 or patch < 2 or min(x.shape[1:]) <= patch:
        raise ValueError(
            f"patch_seam_ratio wants (N, H, W[, C]) images larger than patch {patch} >= 2, got {tuple(x.shape)}"
        )
    if not 0 <= offset < patch:
        raise ValueError(f"patch_seam_ratio: the offset must be between 0 and {patch - 1}, got {offset}")
    across_columns = (x[:, :, 1:] - x[:, :, :-1]).abs()  # (N, H, W - 1): column j against column j + 1
    across_rows = (x[:, 1:, :] - x[:, :-1, :]).abs()  # (N, H - 1, W)
    on_line_col = (torch.arange(1, x.shape[2]) - offset) % patch == 0  # the pair straddles a vertical grid line
    on_line_row = (torch.arange(1, x.shape[1]) - offset) % patch == 0
    seams = torch.cat([across_columns[:, :, on_line_col].flatten(), across_rows[:, on_line_row, :].flatten()])
    inside = torch.cat([across_columns[:, :, ~on_line_col].flatten(), across_rows[:, ~on_line_row, :].flatten()])
    if inside.mean() == 0:
        raise ValueError("patch_seam_ratio: the images do not change inside any patch (flat images have no ratio)")
    return float(seams.mean() / inside.mean())
