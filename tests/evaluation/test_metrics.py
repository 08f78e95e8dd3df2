"""FID, IS and precision/recall against closed forms, brute force and torch-fidelity."""

import math

import numpy as np
import pytest
import torch
from torch_fidelity.metric_fid import fid_features_to_statistics, fid_statistics_to_metric
from torch_fidelity.metric_isc import isc_features_to_metric
from torch_fidelity.metric_prc import calculate_precision_recall_full

from moh_dit.evaluation.metrics import (
    feature_statistics,
    frechet_distance,
    inception_score,
    knn_radii,
    patch_seam_ratio,
    precision_recall,
)


# ----------------------------------------------------------------------------------------------------
# FID
# ----------------------------------------------------------------------------------------------------
def test_fid_isotropic_closed_form():
    d = 16
    m1, m2 = np.zeros(d), np.full(d, 0.5)
    s1, s2 = 2.0, 0.5
    fid = frechet_distance(m1, s1**2 * np.eye(d), m2, s2**2 * np.eye(d))
    assert fid == pytest.approx(d * 0.25 + d * (s1 - s2) ** 2, rel=1e-9)


def test_fid_commuting_covariances_closed_form():
    rng = np.random.default_rng(0)
    d = 12
    q, _ = np.linalg.qr(rng.normal(size=(d, d)))  # shared eigenvectors: the covariances commute
    a, b = rng.uniform(0.1, 3, d), rng.uniform(0.1, 3, d)
    s1, s2 = q @ np.diag(a) @ q.T, q @ np.diag(b) @ q.T
    m1, m2 = rng.normal(size=d), rng.normal(size=d)
    expected = np.sum((m1 - m2) ** 2) + np.sum((np.sqrt(a) - np.sqrt(b)) ** 2)
    assert frechet_distance(m1, s1, m2, s2) == pytest.approx(expected, rel=1e-8)
    diag = frechet_distance(m1, np.diag(a), m2, np.diag(b))
    assert diag == pytest.approx(expected, rel=1e-8)


def test_fid_zero_on_itself_symmetric_and_matches_torch_fidelity():
    rng = np.random.default_rng(1)
    x, y = rng.normal(size=(500, 20)), rng.normal(0.3, 1.2, size=(400, 20))
    mx, sx = feature_statistics(x)
    my, sy = feature_statistics(y)
    assert abs(frechet_distance(mx, sx, mx, sx)) < 1e-8
    assert frechet_distance(mx, sx, my, sy) == pytest.approx(frechet_distance(my, sy, mx, sx), rel=1e-9)
    tf = fid_statistics_to_metric(
        fid_features_to_statistics(torch.from_numpy(x)), fid_features_to_statistics(torch.from_numpy(y)), False
    )
    assert frechet_distance(mx, sx, my, sy) == pytest.approx(tf["frechet_inception_distance"], rel=1e-6)


def test_fid_covariance_uses_n_minus_1():
    x = np.array([[0.0], [2.0]])
    _, sigma = feature_statistics(x)
    assert sigma == pytest.approx(2.0)  # sample variance of {0, 2}


def test_fid_singular_covariances_stay_finite():
    rng = np.random.default_rng(2)
    x = rng.normal(size=(10, 50))  # fewer samples than dimensions: rank-deficient covariance
    y = rng.normal(size=(10, 50))
    fid = frechet_distance(*feature_statistics(x), *feature_statistics(y))
    assert np.isfinite(fid) and fid > 0


def test_fid_shape_mismatch_is_an_error():
    with pytest.raises(ValueError, match="different shapes"):
        frechet_distance(np.zeros(3), np.eye(3), np.zeros(4), np.eye(4))


# ----------------------------------------------------------------------------------------------------
# Inception Score
# ----------------------------------------------------------------------------------------------------
def test_is_one_hot_predictions_give_the_number_of_classes():
    k = 10
    logits = np.full((1000, k), -1e4)
    logits[np.arange(1000), np.arange(1000) % k] = 1e4
    assert inception_score(logits) == pytest.approx(k, rel=1e-9)


def test_is_identical_predictions_give_one():
    logits = np.tile(np.random.default_rng(0).normal(size=(1, 8)), (300, 1))
    assert inception_score(logits) == pytest.approx(1.0, abs=1e-12)


def test_is_partial_last_split_and_file_order():
    rng = np.random.default_rng(3)
    logits = rng.normal(size=(7, 5)) * 3

    def brute(block):
        p = np.exp(block) / np.exp(block).sum(1, keepdims=True)
        py = p.mean(0)
        return math.exp(np.mean(np.sum(p * (np.log(p) - np.log(py)), axis=1)))

    assert inception_score(logits, split_size=5) == pytest.approx(
        (brute(logits[:5]) + brute(logits[5:])) / 2, rel=1e-10
    )
    assert inception_score(logits, split_size=5) != pytest.approx(inception_score(logits[::-1].copy(), split_size=5))


def test_is_matches_torch_fidelity_when_splits_coincide():
    logits = np.random.default_rng(4).normal(size=(10000, 20)) * 2
    ours = inception_score(logits, split_size=5000)
    theirs = isc_features_to_metric(torch.from_numpy(logits), splits=2, shuffle=False)["inception_score_mean"]
    assert ours == pytest.approx(theirs, rel=1e-9)


# ----------------------------------------------------------------------------------------------------
# Precision / recall
# ----------------------------------------------------------------------------------------------------
def brute_force_pr(ref, gen, k=3):
    def sq(a, b):
        return ((a[:, None, :].astype(np.float64) - b[None, :, :]) ** 2).sum(-1)

    r_ref = np.sort(sq(ref, ref), axis=1)[:, k]
    r_gen = np.sort(sq(gen, gen), axis=1)[:, k]
    precision = np.mean([(sq(g[None], ref)[0] <= r_ref).any() for g in gen])
    recall = np.mean([(sq(r[None], gen)[0] <= r_gen).any() for r in ref])
    return precision, recall


@pytest.mark.parametrize("block", [7, 10, 10000])
def test_precision_recall_matches_brute_force(block):
    rng = np.random.default_rng(5)
    ref = rng.normal(size=(31, 6)).astype(np.float32)
    gen = (rng.normal(size=(23, 6)) * 1.3 + 0.4).astype(np.float32)
    gen[5] = gen[4]  # duplicates
    ref[7] = ref[8] = ref[9]
    ours = precision_recall(ref, gen, k=3, block=block, device="cpu")
    assert ours == pytest.approx(brute_force_pr(ref, gen), abs=1e-6)  # same counts (float32 mean)


def test_precision_recall_ties_count_as_inside():
    ref = np.array([[0.0], [1.0], [2.0], [3.0], [4.0]], dtype=np.float32)
    gen = np.array([[7.0], [10.0], [11.0], [12.0], [13.0]], dtype=np.float32)  # ref radius of x=4 is 3^2
    p, _ = precision_recall(ref, gen, k=3, device="cpu")
    assert p == pytest.approx(1 / 5)  # 7 is exactly on the boundary of the ball around 4


def test_precision_recall_identical_and_far_apart_sets():
    x = np.random.default_rng(6).normal(size=(40, 5)).astype(np.float32)
    assert precision_recall(x, x, device="cpu") == (1.0, 1.0)
    assert precision_recall(x, x + 1000, device="cpu") == (0.0, 0.0)


def test_precision_recall_matches_torch_fidelity_and_fp16_is_close():
    rng = np.random.default_rng(7)
    ref = rng.normal(size=(300, 32)).astype(np.float32)
    gen = (rng.normal(size=(200, 32)) * 1.2).astype(np.float32)
    ours = precision_recall(ref, gen, block=64, device="cpu")
    theirs = calculate_precision_recall_full(
        torch.from_numpy(gen), torch.from_numpy(ref), neighborhood=3, batch_size=64
    )
    assert ours == pytest.approx(theirs, abs=1e-6)
    half = precision_recall(ref, gen, block=64, fp16=True, device="cpu")
    assert half == pytest.approx(ours, abs=0.02)


def test_knn_radii_exclude_self_and_need_enough_points():
    x = torch.tensor([[0.0], [1.0], [3.0], [6.0]])
    assert knn_radii(x, k=1).tolist() == [1.0, 1.0, 4.0, 9.0]
    with pytest.raises(ValueError, match="more than k"):
        knn_radii(x, k=4)


# ----------------------------------------------------------------------------------------------------
# KID and bootstrap intervals
# ----------------------------------------------------------------------------------------------------
def _mmd2_unbiased(x: np.ndarray, y: np.ndarray) -> float:
    """The unbiased squared MMD with the cubic polynomial kernel, written out."""
    d = x.shape[1]
    k = lambda a, b: (a @ b.T / d + 1) ** 3  # noqa: E731
    m = len(x)
    kxx, kyy, kxy = k(x, x), k(y, y), k(x, y)
    return (kxx.sum() - np.trace(kxx)) / (m * (m - 1)) + (kyy.sum() - np.trace(kyy)) / (m * (m - 1)) - 2 * kxy.mean()


def test_kid_is_the_unbiased_polynomial_mmd():
    from moh_dit.evaluation.metrics import kernel_inception_distance

    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(50, 8)), rng.normal(0.3, 1.2, size=(50, 8))
    # one subset of every row: the subsets are permutations, the estimate is the full-sample one
    kid, std, size = kernel_inception_distance(x, y, subsets=1, subset_size=50)
    assert size == 50 and std == 0.0
    assert kid == pytest.approx(_mmd2_unbiased(x, y), rel=1e-10)
    same, _, _ = kernel_inception_distance(x, rng.normal(size=(50, 8)), subsets=20, subset_size=25)
    far, _, _ = kernel_inception_distance(x, y, subsets=20, subset_size=25)
    assert abs(same) < far  # unbiased: about 0 for the same distribution, positive for another


def test_bootstrap_interval_brackets_the_statistic_and_narrows_with_more_samples():
    from moh_dit.evaluation.metrics import bootstrap_interval

    rng = np.random.default_rng(1)
    small, large = rng.normal(size=40), rng.normal(size=4000)
    lo_s, hi_s = bootstrap_interval(small, np.mean, rounds=200)
    lo_l, hi_l = bootstrap_interval(large, np.mean, rounds=200)
    assert lo_s < small.mean() < hi_s and lo_l < large.mean() < hi_l
    assert (hi_l - lo_l) < (hi_s - lo_s) / 5  # ~ 1 / sqrt(n)
    assert (hi_s - lo_s) == pytest.approx(2 * 1.645 * small.std() / np.sqrt(40), rel=0.35)


def test_kid_bootstrap_interval_is_centred_on_the_estimate_and_as_wide_as_the_spread_over_fresh_draws():
    from moh_dit.evaluation.metrics import bootstrap_interval, kernel_inception_distance

    rng = np.random.default_rng(0)
    reference = rng.normal(size=(1500, 16))

    def draw():
        return rng.normal(size=(300, 16)) * 1.1 + 0.1

    def kid(f):
        return kernel_inception_distance(reference, f, subsets=10)[0]

    samples = draw()
    low, high = bootstrap_interval(samples, kid, rounds=40)
    # resamples repeat images, which shifts KID up; the interval must still hold the (unbiased) estimate
    assert (low + high) / 2 == pytest.approx(kid(samples), rel=1e-9)
    fresh = np.std([kid(draw()) for _ in range(30)], ddof=1)  # the true spread of KID at 300 samples
    assert (high - low) / (2 * 1.645) == pytest.approx(fresh, rel=0.5)


# ----------------------------------------------------------------------------------------------------
# Patch seams
# ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("patch,size", [(4, 28), (2, 9), (8, 32)])
def test_patch_seam_ratio_closed_form_ramp_with_steps_at_the_grid(patch, size):
    # a ramp of slope a in both directions plus a step s at every grid line: neighbours inside a patch
    # differ by a, neighbours across a line by a + s, so the ratio is (a + s) / a exactly
    a, s = 2.0, 3.0
    i, j = np.meshgrid(np.arange(size), np.arange(size), indexing="ij")
    image = a * (i + j) + s * (i // patch + j // patch)
    assert patch_seam_ratio(image[None], patch) == pytest.approx((a + s) / a, rel=1e-12)
    smooth = a * (i + j)
    assert patch_seam_ratio(np.stack([smooth, smooth]), patch) == pytest.approx(1.0, rel=1e-12)


def brute_force_seam_ratio(images: np.ndarray, patch: int, offset: int = 0) -> float:
    """Every pair of 4-neighbours, one at a time; grid lines ``offset`` pixels right of and below the model's."""
    gray = images.astype(np.float64).mean(axis=3)
    seams, inside = [], []
    for img in gray:
        h, w = img.shape
        for r in range(h):
            for c in range(w):
                for dr, dc in ((0, 1), (1, 0)):
                    if r + dr < h and c + dc < w:
                        on_line = (c + 1 - offset) % patch == 0 if dc else (r + 1 - offset) % patch == 0
                        (seams if on_line else inside).append(abs(img[r + dr, c + dc] - img[r, c]))
    return float(np.mean(seams) / np.mean(inside))


def test_patch_seam_ratio_matches_brute_force_on_uint8_colour_images():
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, size=(3, 10, 7, 3), dtype=np.uint8)  # not square, not a multiple of 4
    for offset in range(4):
        expected = brute_force_seam_ratio(images, 4, offset)
        assert patch_seam_ratio(images, 4, offset) == pytest.approx(expected, rel=1e-12)


def test_patch_seam_ratio_sees_the_seams_of_patchwise_noise_and_not_a_shifted_grid():
    # images whose 4x4 patches each get their own brightness offset: seams on the 4-grid, none on a grid
    # that does not line up with it
    rng = np.random.default_rng(1)
    base = rng.normal(size=(64, 32, 32))
    offsets = np.kron(rng.normal(size=(64, 8, 8)), np.ones((4, 4)))
    ratio = patch_seam_ratio(base + offsets, 4)
    assert ratio > 1.3 and patch_seam_ratio(base, 4) == pytest.approx(1.0, abs=0.05)
    assert patch_seam_ratio(base + offsets, 3) < ratio
    # the same seams moved by one pixel: seen at offset 1, not at the model's grid
    moved = np.roll(base + offsets, (1, 1), axis=(1, 2))
    assert patch_seam_ratio(moved, 4, offset=1) == pytest.approx(ratio, rel=0.05)
    assert patch_seam_ratio(moved, 4) < 1.1


def test_patch_seam_ratio_rejects_what_it_cannot_measure():
    with pytest.raises(ValueError, match="larger than patch"):
        patch_seam_ratio(np.zeros((2, 4, 4)), 4)
    with pytest.raises(ValueError, match=">= 2"):
        patch_seam_ratio(np.zeros((2, 8, 8)), 1)
    with pytest.raises(ValueError, match="flat"):
        patch_seam_ratio(np.ones((2, 8, 8)), 4)
    with pytest.raises(ValueError, match="offset must be between 0 and 3"):
        patch_seam_ratio(np.zeros((2, 8, 8)), 4, offset=4)


def test_the_references_knn_radii_are_computed_once_per_reference_and_change_nothing(monkeypatch):
    """Scoring against the same reference again reuses its k-NN radii (most of a small evaluation's time); another
    reference, or the same one changed, gets its own; the numbers equal a fresh computation."""
    from moh_dit.evaluation import metrics

    g = np.random.default_rng(0)
    ref, gen = g.normal(size=(300, 8)).astype(np.float32), g.normal(size=(40, 8)).astype(np.float32)
    metrics._RADII.clear()
    fresh = metrics.precision_recall(ref, gen, device="cpu")
    calls = []
    real = metrics.knn_radii
    monkeypatch.setattr(metrics, "knn_radii", lambda f, *a: calls.append(len(f)) or real(f, *a))
    assert metrics.precision_recall(ref, gen, device="cpu") == fresh and calls == [40]  # the samples' only
    changed = ref.copy()
    changed[0, 0] += 1
    metrics.precision_recall(changed, gen, device="cpu")
    assert calls == [40, 300, 40]
