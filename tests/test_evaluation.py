"""Evaluation: image validation, Inception features (randomly initialised, real architecture), reference
statistics, evaluate_fid.py end to end with a tiny registered extractor, and ADM parity when available."""
import hashlib
import json
import os
import pickle
import sys
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from torch_fidelity.feature_extractor_base import FeatureExtractorBase
from torch_fidelity.registry import FEATURE_EXTRACTORS_REGISTRY, register_feature_extractor

from moh_dit.evaluation import (
    EvaluationError,
    InceptionFeatures,
    evaluate,
    find_inception_weights,
    load_images,
    reference_statistics,
    resolve_extractor,
)

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import evaluate_fid  # noqa: E402


# ----------------------------------------------------------------------------------------------------
# A tiny extractor registered with torch-fidelity
# ----------------------------------------------------------------------------------------------------
class TinyExtractor(FeatureExtractorBase):
    """Fixed random projections of 8x8 downsampled images: 'pool' (24), 'logits_unbiased' (5), 'spatial' (12)."""

    def __init__(self, name, features_list, **kwargs):
        super().__init__(name, features_list)
        g = torch.Generator().manual_seed(0)
        self.register_buffer("w_pool", torch.randn(192, 24, generator=g))
        self.register_buffer("w_logits", torch.randn(24, 5, generator=g))
        self.register_buffer("w_spatial", torch.randn(192, 12, generator=g))

    def forward(self, x):
        x = F.adaptive_avg_pool2d(x.float() / 255, 8).flatten(1)
        pool = torch.tanh(x @ self.w_pool)
        out = {"pool": pool, "logits_unbiased": pool @ self.w_logits, "spatial": x @ self.w_spatial}
        return tuple(out[f] for f in self.features_list)

    @staticmethod
    def get_provided_features_list():
        return "pool", "logits_unbiased", "spatial"

    @staticmethod
    def get_default_feature_layer_for_metric(metric):
        return "pool"

    @staticmethod
    def can_be_compiled():
        return False

    @staticmethod
    def get_dummy_input_for_compile():
        return torch.zeros(1, 3, 8, 8, dtype=torch.uint8)


TINY = "moh-dit-test-tiny"
if TINY not in FEATURE_EXTRACTORS_REGISTRY:
    register_feature_extractor(TINY, TinyExtractor)


def random_images(n, size=16, seed=0, shift=0):
    rng = np.random.default_rng(seed)
    return np.clip(rng.integers(0, 200, (n, size, size, 3)) + shift, 0, 255).astype(np.uint8)


# ----------------------------------------------------------------------------------------------------
# Images
# ----------------------------------------------------------------------------------------------------
def test_load_images_from_npz_folder_and_grayscale(tmp_path):
    imgs = random_images(4)
    np.savez(tmp_path / "s.npz", arr_0=imgs)
    np.testing.assert_array_equal(load_images(tmp_path / "s.npz"), imgs)
    (tmp_path / "pngs").mkdir()
    for i, img in enumerate(imgs):
        Image.fromarray(img[:, :, 0]).save(tmp_path / "pngs" / f"{i:03d}.png")  # grayscale files
    gray = load_images(tmp_path / "pngs")
    assert gray.shape == (4, 16, 16, 3) and np.array_equal(gray[..., 0], gray[..., 2])
    np.save(tmp_path / "g.npy", imgs[..., :1])
    assert load_images(tmp_path / "g.npy").shape == (4, 16, 16, 3)


@pytest.mark.parametrize(
    "array,message",
    [
        (np.random.rand(2, 8, 8, 3), "must be uint8"),
        (np.zeros((2, 3, 8, 8), np.uint8), "channels-first"),
        (np.zeros((2, 8, 8, 4), np.uint8), "1 or 3 channels"),
        (np.zeros((8, 8), np.uint8), r"\(N, H, W, C\)"),
    ],
)
def test_bad_sample_arrays_are_rejected(tmp_path, array, message):
    np.savez(tmp_path / "bad.npz", arr_0=array)
    with pytest.raises(EvaluationError, match=message):
        load_images(tmp_path / "bad.npz")


def test_npz_without_arr_0(tmp_path):
    np.savez(tmp_path / "x.npz", images=random_images(2))
    with pytest.raises(EvaluationError, match="arr_0"):
        load_images(tmp_path / "x.npz")


# ----------------------------------------------------------------------------------------------------
# Inception
# ----------------------------------------------------------------------------------------------------
def test_sfid_spatial_layout_is_h_w_c():
    n, c, h, w = 2, 192, 17, 17
    idx = torch.arange(n * c * h * w, dtype=torch.float64).reshape(n, c, h, w)
    flat = InceptionFeatures.spatial_features(idx)
    assert flat.shape == (2, 2023)
    for cc in range(7):
        for hh in (0, 5, 16):
            for ww in (0, 9, 16):
                assert flat[1, (hh * 17 + ww) * 7 + cc] == idx[1, cc, hh, ww]


@pytest.fixture(scope="module")
def random_inception_weights(tmp_path_factory):
    """A state dict for torch-fidelity's Inception with random weights (no download)."""
    from torch_fidelity.feature_extractor_inceptionv3 import FeatureExtractorInceptionV3

    with mock.patch.object(FeatureExtractorInceptionV3, "load_state_dict", lambda self, sd: None), \
            mock.patch("torch_fidelity.feature_extractor_inceptionv3.load_state_dict_from_url", lambda *a, **k: {}):
        torch.manual_seed(0)
        net = FeatureExtractorInceptionV3("inception-v3-compat", ["2048"])
    path = tmp_path_factory.mktemp("inception") / "weights-inception-2015-12-05-6726825d.pth"
    torch.save(net.state_dict(), path)
    return path


def test_inception_features_with_random_real_architecture(random_inception_weights):
    ext = InceptionFeatures(str(random_inception_weights), device="cpu")
    captured = []
    ext.net.Mixed_6d.register_forward_hook(lambda m, a, out: captured.append(out))
    imgs = torch.from_numpy(random_images(2, size=32).transpose(0, 3, 1, 2).copy())
    feats = ext(imgs)
    assert feats["pool"].shape == (2, 2048) and feats["logits"].shape == (2, 1008)
    assert feats["spatial"].shape == (2, 2023)
    # Mixed_6d concatenates [branch1x1, ...] on channels: the first 7 channels are branch1x1's
    expected = captured[0][:, :7].permute(0, 2, 3, 1).reshape(2, -1)
    torch.testing.assert_close(feats["spatial"], expected)
    assert len(ext.weights_sha256) == 64


class _Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def test_inception_refuses_pickled_code(tmp_path):
    bad = tmp_path / "evil.pth"
    with open(bad, "wb") as f:
        pickle.dump({"x": _Evil()}, f)
    with pytest.raises(EvaluationError, match="refusing"):
        InceptionFeatures(str(bad), device="cpu")


def test_missing_inception_weights_say_where_to_get_them(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.hub, "get_dir", lambda: str(tmp_path / "hub"))
    monkeypatch.delenv("MOH_DIT_INCEPTION_WEIGHTS", raising=False)
    with pytest.raises(EvaluationError, match=r"Download https://.*weights-inception-2015-12-05-6726825d\.pth"):
        find_inception_weights()
    with pytest.raises(EvaluationError, match="not found: /no/such/file"):
        find_inception_weights("/no/such/file")
    monkeypatch.setenv("MOH_DIT_INCEPTION_WEIGHTS", str(tmp_path / "w.pth"))
    (tmp_path / "w.pth").write_bytes(b"")
    assert find_inception_weights() == tmp_path / "w.pth"


# ----------------------------------------------------------------------------------------------------
# Reference statistics and evaluation
# ----------------------------------------------------------------------------------------------------
def test_reference_statistics_are_cached_with_a_record(tmp_path):
    np.savez(tmp_path / "ref.npz", arr_0=random_images(30))
    ext = resolve_extractor(TINY, None, "cpu")
    first = reference_statistics(tmp_path / "ref.npz", ext)
    caches = list(tmp_path.glob(f"ref.npz.moh-dit-stats.{TINY}.*.npz"))
    assert len(caches) == 1
    assert first["info"]["num_images"] == 30 and first["info"]["extractor"] == TINY
    assert first["info"]["content_sha256"] == hashlib.sha256((tmp_path / "ref.npz").read_bytes()).hexdigest()
    with mock.patch("moh_dit.evaluation.extract_features", side_effect=AssertionError("recomputed")):
        second = reference_statistics(tmp_path / "ref.npz", ext)
    np.testing.assert_array_equal(first["sigma"], second["sigma"])


def test_adm_reference_batch_uses_its_stored_statistics(tmp_path):
    mu, sigma = np.arange(24.0), np.eye(24) * 2
    np.savez(tmp_path / "adm.npz", arr_0=random_images(12), mu=mu, sigma=sigma, mu_s=np.zeros(12), sigma_s=np.eye(12))
    stats = reference_statistics(tmp_path / "adm.npz", resolve_extractor(TINY, None, "cpu"), cache=False)
    np.testing.assert_array_equal(stats["mu"], mu)
    np.testing.assert_array_equal(stats["sigma"], sigma)
    assert stats["pool"].shape == (12, 24) and "stored statistics" in stats["info"]["statistics"]


def test_evaluate_same_distribution_scores_better(tmp_path):
    np.savez(tmp_path / "ref.npz", arr_0=random_images(60, seed=1))
    ext = resolve_extractor(TINY, None, "cpu")
    same = evaluate(random_images(60, seed=2), tmp_path / "ref.npz", ext)["metrics"]
    shifted = evaluate(random_images(60, seed=2, shift=80), tmp_path / "ref.npz", ext)["metrics"]
    assert set(same) == {"fid", "sfid", "inception_score", "precision", "recall"}
    assert same["fid"] < shifted["fid"] and same["sfid"] < shifted["sfid"]


def test_cli_end_to_end_from_a_tiny_pipeline(tmp_path):
    from moh_dit.generate import GenerationSettings, generate_samples
    from tests.test_pipeline import pipe_for, tiny_model

    pipe = pipe_for(tiny_model(in_channels=3, sample_size=8, num_classes=3))
    npz = generate_samples(pipe, tmp_path / "samples", GenerationSettings(num_samples=12, batch_size=6, num_inference_steps=3))
    (tmp_path / "real").mkdir()
    for i, img in enumerate(random_images(15, size=8)):
        Image.fromarray(img).save(tmp_path / "real" / f"{i}.png")
    out = tmp_path / "metrics.json"
    evaluate_fid.main(["--samples", str(npz), "--reference", str(tmp_path / "real"), "--extractor", TINY,
                       "--out", str(out), "--batch-size", "5"])  # fmt: skip
    result = json.loads(out.read_text())
    assert set(result["metrics"]) == {"fid", "sfid", "inception_score", "precision", "recall"}
    assert all(np.isfinite(v) for v in result["metrics"].values())
    assert result["num_samples"] == 12 and result["extractor"] == TINY
    assert result["reference"]["num_images"] == 15


def test_cli_from_a_model_records_sampling_settings(tmp_path):
    from tests.test_pipeline import pipe_for, tiny_model

    pipe_for(tiny_model(in_channels=3, sample_size=8, num_classes=3)).save_pretrained(tmp_path / "pipe")
    np.savez(tmp_path / "ref.npz", arr_0=random_images(10, size=8))
    result = evaluate_fid.main(["--model", str(tmp_path / "pipe"), "--reference", str(tmp_path / "ref.npz"),
                                "--extractor", TINY, "--num-samples", "6", "--num-steps", "2", "--cfg-scale", "2.5",
                                "--sample-batch-size", "4", "--out", str(tmp_path / "m.json")])  # fmt: skip
    assert result["num_samples"] == 6
    saved = json.loads((tmp_path / "m.json").read_text())
    identity = saved["samples"]["manifest"]["identity"]
    assert identity["guidance_scale"] == 2.5 and identity["num_inference_steps"] == 2
    assert identity["scheduler"]["name"] == "DDPMScheduler" and saved["samples"]["manifest"]["count"] == 6
    assert saved["kind"] == "metrics" and "command_line" not in saved


def run_evaluate_cli(args):
    """``evaluate_fid.py`` as the shell runs it: bad input ends with one line and exit code 2."""
    from moh_dit.cli import run_cli

    return run_cli(lambda: evaluate_fid.main(args))


def test_cli_missing_weights_and_float_samples_fail_clearly(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(torch.hub, "get_dir", lambda: str(tmp_path / "hub"))
    monkeypatch.delenv("MOH_DIT_INCEPTION_WEIGHTS", raising=False)
    monkeypatch.delenv("MOH_DIT_DEBUG", raising=False)
    np.savez(tmp_path / "s.npz", arr_0=random_images(4))
    with pytest.raises(SystemExit) as exc:
        run_evaluate_cli(["--samples", str(tmp_path / "s.npz"), "--reference", str(tmp_path / "s.npz")])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "weights-inception-2015-12-05" in err and len(err.strip().splitlines()) == 1
    np.savez(tmp_path / "f.npz", arr_0=np.random.rand(4, 8, 8, 3))
    with pytest.raises(SystemExit):
        run_evaluate_cli(["--samples", str(tmp_path / "f.npz"), "--reference", str(tmp_path / "s.npz"), "--extractor", TINY])
    assert "must be uint8" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------------
# Parity with the ADM evaluator (needs the real files; skipped otherwise)
# ----------------------------------------------------------------------------------------------------
ADM_REF = os.environ.get("MOH_DIT_ADM_REFERENCE")  # VIRTUAL_imagenet256_labeled.npz
ADM_SAMPLES = os.environ.get("MOH_DIT_ADM_SAMPLES")  # admnet_guided_upsampled_imagenet256.npz


def _have_weights():
    try:
        find_inception_weights()
        return True
    except EvaluationError:
        return False


@pytest.mark.slow
@pytest.mark.skipif(not (ADM_REF and ADM_SAMPLES and _have_weights()),
                    reason="set MOH_DIT_ADM_REFERENCE, MOH_DIT_ADM_SAMPLES and provide the Inception weights")
def test_parity_with_adm_readme_numbers():
    result = evaluate(load_images(ADM_SAMPLES), ADM_REF, InceptionFeatures(), batch_size=250, fp16_distances=True)
    m = result["metrics"]
    assert m["fid"] == pytest.approx(3.94256, abs=0.01)
    assert m["sfid"] == pytest.approx(6.14043, abs=0.01)
    assert m["inception_score"] == pytest.approx(215.837, abs=0.5)
    assert m["precision"] == pytest.approx(0.8265, abs=0.005)
    assert m["recall"] == pytest.approx(0.5309, abs=0.005)
