"""Evaluation: image validation, Inception features (randomly initialised, real architecture), reference
statistics, evaluate_fid.py end to end with a tiny registered extractor, and ADM parity when available."""

import hashlib
import json
import os
import pickle
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
import torch
from PIL import Image

import evaluate_fid
from moh_dit.data.fashion_mnist import find_fashion_mnist
from moh_dit.errors import ConfigError, EvaluationError
from moh_dit.evaluation.features import (
    InceptionFeatures,
    extract_features,
    find_inception_weights,
    load_images,
    resolve_extractor,
)
from moh_dit.evaluation.scoring import evaluate
from moh_dit.evaluation.statistics import reference_statistics

from ..helpers.factories import generation_settings
from ..helpers.tiny_extractor import TINY  # importing it registers the tiny extractor

ROOT = Path(__file__).resolve().parents[2]


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


def test_a_truncated_reference_names_itself(tmp_path):
    np.savez(tmp_path / "ref.npz", arr_0=random_images(4, size=8))
    (tmp_path / "cut.npz").write_bytes((tmp_path / "ref.npz").read_bytes()[:300])
    with pytest.raises(EvaluationError, match=r"reference .*cut.npz is not a readable array file .*truncated\?"):
        reference_statistics(tmp_path / "cut.npz", resolve_extractor(TINY, None, "cpu"), cache=False)


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

    with (
        mock.patch.object(FeatureExtractorInceptionV3, "load_state_dict", lambda self, sd: None),
        mock.patch("torch_fidelity.feature_extractor_inceptionv3.load_state_dict_from_url", lambda *a, **k: {}),
    ):
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
    with mock.patch("moh_dit.evaluation.statistics.extract_features", side_effect=AssertionError("recomputed")):
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
    assert set(same) == {"fid", "sfid", "inception_score", "kid", "kid_std", "precision", "recall"}
    assert same["fid"] < shifted["fid"] and same["sfid"] < shifted["sfid"]


def test_cli_end_to_end_from_a_tiny_pipeline(tmp_path):
    from moh_dit.sampling.generation import generate_samples

    from ..helpers.factories import generation_settings, tiny_model
    from ..helpers.factories import tiny_pipeline as pipe_for

    pipe = pipe_for(tiny_model(signal=0.1, in_channels=3))
    npz = generate_samples(
        pipe, tmp_path / "samples", generation_settings(num_samples=12, batch_size=6, num_inference_steps=3)
    )
    (tmp_path / "real").mkdir()
    for i, img in enumerate(random_images(15, size=8)):
        Image.fromarray(img).save(tmp_path / "real" / f"{i}.png")
    out = tmp_path / "metrics.json"
    evaluate_fid.main(
        [
            "--samples",
            str(npz),
            "--reference",
            str(tmp_path / "real"),
            "--extractor",
            TINY,
            "--out",
            str(out),
            "--batch-size",
            "5",
        ]
    )
    result = json.loads(out.read_text())
    assert set(result["metrics"]) == {"fid", "sfid", "inception_score", "kid", "kid_std", "precision", "recall"}
    assert all(np.isfinite(v) for v in result["metrics"].values())
    assert result["num_samples"] == 12 and result["extractor"] == TINY
    assert result["reference"]["num_images"] == 15


def test_cli_from_a_model_records_sampling_settings(tmp_path):
    from ..helpers.factories import tiny_model
    from ..helpers.factories import tiny_pipeline as pipe_for

    pipe_for(tiny_model(signal=0.1, in_channels=3)).save_pretrained(tmp_path / "pipe")
    np.savez(tmp_path / "ref.npz", arr_0=random_images(10, size=8))
    result = evaluate_fid.main(
        [
            "--model",
            str(tmp_path / "pipe"),
            "--reference",
            str(tmp_path / "ref.npz"),
            "--extractor",
            TINY,
            "--num-samples",
            "6",
            "--num-steps",
            "2",
            "--cfg-scale",
            "2.5",
            "--sample-batch-size",
            "4",
            "--out",
            str(tmp_path / "m.json"),
        ]
    )
    assert result["num_samples"] == 6
    saved = json.loads((tmp_path / "m.json").read_text())
    identity = saved["samples"]["manifest"]["identity"]
    assert identity["guidance_scale"] == 2.5 and identity["num_inference_steps"] == 2
    assert identity["scheduler"]["name"] == "DDPMScheduler" and saved["samples"]["manifest"]["count"] == 6
    assert saved["kind"] == "metrics" and "command_line" not in saved


def test_cli_from_a_meanflow_model_samples_its_paper_protocol_unguided_and_with_a_cache(tmp_path):
    from moh_dit.objectives.meanflow import MeanFlow

    from ..helpers.factories import tiny_model
    from ..helpers.factories import tiny_pipeline as pipe_for

    model = tiny_model(signal=0.1, in_channels=3, **MeanFlow(guidance_mix=0.5).model_config())
    pipe_for(model, scheduler="meanflow").save_pretrained(tmp_path / "pipe")
    np.savez(tmp_path / "ref.npz", arr_0=random_images(10, size=8))
    common = ["--model", str(tmp_path / "pipe"), "--reference", str(tmp_path / "ref.npz"), "--extractor", TINY]
    common += ["--num-samples", "4", "--sample-batch-size", "4"]
    evaluate_fid.main([*common, "--out", str(tmp_path / "one.json")])
    identity = json.loads((tmp_path / "one.json").read_text())["samples"]["manifest"]["identity"]
    # the paper's protocol is one step, and the model, guided in training, samples without guidance
    assert (identity["scheduler"]["name"], identity["num_inference_steps"]) == ("MeanFlowScheduler", 1)
    assert identity["guidance_scale"] == 1.0 and identity["objective"]["guidance_mix"] == 0.5
    evaluate_fid.main(
        [*common, "--protocol", "two-step", "--cache", "first-block", "--out", str(tmp_path / "two.json")]
    )
    identity = json.loads((tmp_path / "two.json").read_text())["samples"]["manifest"]["identity"]
    assert identity["num_inference_steps"] == 2 and identity["cache"] == "first-block"
    with pytest.raises(ConfigError, match="samples flow models; this is a meanflow model"):
        evaluate_fid.main([*common, "--scheduler", "euler", "--out", str(tmp_path / "bad.json")])


def run_evaluate_cli(args):
    """``evaluate_fid.py`` as the shell runs it: bad input ends with one line and exit code 2."""
    from moh_dit.cli.common import run_cli

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
        run_evaluate_cli(
            ["--samples", str(tmp_path / "f.npz"), "--reference", str(tmp_path / "s.npz"), "--extractor", TINY]
        )
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
@pytest.mark.skipif(
    not (ADM_REF and ADM_SAMPLES and _have_weights()),
    reason="set MOH_DIT_ADM_REFERENCE, MOH_DIT_ADM_SAMPLES and provide the Inception weights",
)
def test_parity_with_adm_readme_numbers():
    result = evaluate(load_images(ADM_SAMPLES), ADM_REF, InceptionFeatures(), batch_size=250, fp16_distances=True)
    m = result["metrics"]
    assert m["fid"] == pytest.approx(3.94256, abs=0.01)
    assert m["sfid"] == pytest.approx(6.14043, abs=0.01)
    assert m["inception_score"] == pytest.approx(215.837, abs=0.5)
    assert m["precision"] == pytest.approx(0.8265, abs=0.005)
    assert m["recall"] == pytest.approx(0.5309, abs=0.005)


# ----------------------------------------------------------------------------------------------------
# Integrity: safe weights, content-keyed caches, outputs, image trees, what the JSON records
# ----------------------------------------------------------------------------------------------------
class _MakesFile:
    """Unpickling this creates a file: proof that a loader ran code from the weights file."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


@pytest.mark.parametrize("extractor", ["vgg16", TINY])
def test_weights_files_are_checked_before_any_extractor_loads_them(tmp_path, extractor, capsys, monkeypatch):
    monkeypatch.delenv("MOH_DIT_DEBUG", raising=False)
    marker = tmp_path / "code-ran"
    evil = tmp_path / "evil.pth"
    with open(evil, "wb") as f:
        pickle.dump({"weights": _MakesFile(marker)}, f)
    np.savez(tmp_path / "s.npz", arr_0=random_images(4))
    with pytest.raises(SystemExit) as exc:
        run_evaluate_cli(
            [
                "--samples",
                str(tmp_path / "s.npz"),
                "--reference",
                str(tmp_path / "s.npz"),
                "--extractor",
                extractor,
                "--inception-weights",
                str(evil),
            ]
        )
    assert exc.value.code == 2 and not marker.exists()
    assert "refusing to unpickle" in capsys.readouterr().err


def test_a_replaced_reference_is_never_scored_against_stale_statistics(tmp_path):
    ext = resolve_extractor(TINY, None, "cpu")
    samples = random_images(40, seed=5)
    np.savez(tmp_path / "ref.npz", arr_0=random_images(40, seed=1))
    evaluate(samples, tmp_path / "ref.npz", ext)  # caches the statistics of the first reference
    size = (tmp_path / "ref.npz").stat().st_size
    np.savez(tmp_path / "ref.npz", arr_0=random_images(40, seed=2, shift=60))  # other images, same shape and size
    assert (tmp_path / "ref.npz").stat().st_size == size
    cached = evaluate(samples, tmp_path / "ref.npz", ext)["metrics"]["fid"]
    fresh = evaluate(samples, tmp_path / "ref.npz", ext, cache=False)["metrics"]["fid"]
    assert cached == pytest.approx(fresh, rel=1e-9)


def test_a_read_only_reference_folder_caches_elsewhere(tmp_path, monkeypatch):
    import moh_dit.evaluation.statistics as evaluation
    from moh_dit.errors import OutputError

    ref_dir = tmp_path / "readonly"
    ref_dir.mkdir()
    np.savez(ref_dir / "ref.npz", arr_0=random_images(20))
    real = evaluation.ensure_writable_dir

    def refuse(path, what):
        if Path(path) == ref_dir:
            raise OutputError(f"{path} is not writable")
        return real(path, what)

    monkeypatch.setattr(evaluation, "ensure_writable_dir", refuse)
    monkeypatch.setenv("MOH_DIT_CACHE", str(tmp_path / "cache"))
    ext = resolve_extractor(TINY, None, "cpu")
    first = reference_statistics(ref_dir / "ref.npz", ext)
    assert not list(ref_dir.glob("*moh-dit-stats*")) and len(list((tmp_path / "cache").rglob("*.npz"))) == 1
    with mock.patch("moh_dit.evaluation.statistics.extract_features", side_effect=AssertionError("recomputed")):
        second = reference_statistics(ref_dir / "ref.npz", ext)
    np.testing.assert_array_equal(first["mu"], second["mu"])


def test_outputs_are_checked_before_the_work_and_numbers_survive_a_failed_write(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("MOH_DIT_DEBUG", raising=False)
    np.savez(tmp_path / "s.npz", arr_0=random_images(12))
    np.savez(tmp_path / "r.npz", arr_0=random_images(12, seed=3))
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    args = ["--samples", str(tmp_path / "s.npz"), "--reference", str(tmp_path / "r.npz"), "--extractor", TINY]
    with (
        mock.patch(
            "moh_dit.evaluation.statistics.extract_features", side_effect=AssertionError("worked before checking")
        ),
        pytest.raises(SystemExit) as exc,
    ):
        run_evaluate_cli([*args, "--out", str(blocker / "m.json")])
    assert exc.value.code == 2 and "not writable" in capsys.readouterr().err
    with (
        mock.patch("moh_dit.evaluation.scoring.atomic_write_json", side_effect=OSError(28, "No space left on device")),
        pytest.raises(SystemExit),
    ):
        run_evaluate_cli([*args, "--out", str(tmp_path / "m.json")])
    captured = capsys.readouterr()
    assert "FID" in captured.out and "the numbers are above" in captured.err


def _image_tree(root, sizes=((20, 12), (9, 15), (16, 16))):
    rng = np.random.default_rng(0)
    for c, name in enumerate(["cats", "dogs"]):
        for i, (w, h) in enumerate(sizes):
            (root / name / "sub").mkdir(parents=True, exist_ok=True)
            Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(root / name / "sub" / f"{c}{i}.jpg")


def test_a_class_tree_of_mixed_sizes_is_a_reference(tmp_path):
    _image_tree(tmp_path / "tree")
    ext = resolve_extractor(TINY, None, "cpu")
    result = evaluate(random_images(8, size=8), tmp_path / "tree", ext, cache=False)
    assert result["reference"]["num_images"] == 6 and result["reference"]["image_size"] == 8
    assert result["reference"]["center_crop"]


def test_reference_builder_writes_an_adm_style_batch(tmp_path):
    from moh_dit.cli.reference import main
    from moh_dit.data.image_folder import center_crop_arr, list_images
    from moh_dit.evaluation.metrics import feature_statistics
    from moh_dit.evaluation.reference import build_reference

    _image_tree(tmp_path / "tree")
    (tmp_path / "tree" / "dogs" / "sub" / "broken.png").write_bytes(b"not an image")
    ext = resolve_extractor(TINY, None, "cpu")
    out = build_reference(
        tmp_path / "tree", 8, tmp_path / "ref.npz", ext, batch_images=4, batch_size=2, max_bad_fraction=0.5
    )
    with np.load(out) as data:
        manifest = json.loads(str(data["moh_dit_manifest"]))
        assert data["arr_0"].shape == (4, 8, 8, 3) and set(data["arr_1"].tolist()) <= {0, 1}
        mu, sigma = data["mu"], data["sigma"]
    assert manifest["classes"] == ["cats", "dogs"] and manifest["skipped"] == ["dogs/sub/broken.png"]
    assert manifest["num_source_images"] == 6 and manifest["statistics_over"] == 6
    files = [f for f in list_images(tmp_path / "tree") if not f.endswith("broken.png")]
    imgs = np.stack([np.asarray(center_crop_arr(Image.open(f).convert("RGB"), 8)) for f in files])
    mu_ref, sigma_ref = feature_statistics(ext(torch.from_numpy(imgs.transpose(0, 3, 1, 2).copy()))["pool"].numpy())
    np.testing.assert_allclose(mu, mu_ref, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(sigma, sigma_ref, rtol=1e-4, atol=1e-6)
    # the evaluator uses the stored statistics, and the command line writes the same file
    stats = reference_statistics(out, ext, cache=False)
    assert "stored statistics" in stats["info"]["statistics"]
    main([str(tmp_path / "tree"), "--image-size", "8", "--out", str(tmp_path / "cli.npz"), "--batch-images", "4"])
    with np.load(tmp_path / "cli.npz") as data:
        assert data["arr_0"].shape == (4, 8, 8, 3) and "mu" not in data.files
    # an existing file (a downloaded ADM batch, or one built earlier) is replaced only when asked
    from moh_dit.errors import OutputError

    np.savez(tmp_path / "adm.npz", arr_0=random_images(4, size=8))
    for existing, what in (("adm.npz", "a file moh-dit did not build"), ("cli.npz", "a reference built from")):
        before = (tmp_path / existing).read_bytes()
        with pytest.raises(OutputError, match=f"exists \\({what}.*pass --overwrite"):
            main([str(tmp_path / "tree"), "--image-size", "8", "--out", str(tmp_path / existing)])
        assert (tmp_path / existing).read_bytes() == before
    main([str(tmp_path / "tree"), "--image-size", "8", "--out", str(tmp_path / "adm.npz"), "--overwrite"])
    with np.load(tmp_path / "adm.npz") as data:
        assert "moh_dit_manifest" in data.files


def test_metrics_of_existing_samples_record_the_samples_own_manifest(tmp_path):
    from moh_dit.sampling.generation import generate_samples

    from ..helpers.factories import tiny_model
    from ..helpers.factories import tiny_pipeline as pipe_for

    pipe = pipe_for(tiny_model(signal=0.1, in_channels=3))
    settings = generation_settings(num_samples=10, batch_size=4, num_inference_steps=3, guidance_scale=2.0, seed=7)
    npz = generate_samples(pipe, tmp_path / "cfg2.0", settings)
    np.savez(tmp_path / "r.npz", arr_0=random_images(10, size=8))
    for source in (npz, tmp_path / "cfg2.0"):
        result = evaluate_fid.main(
            ["--samples", str(source), "--reference", str(tmp_path / "r.npz"), "--extractor", TINY]
        )
        identity = result["samples"]["manifest"]["identity"]
        assert identity["num_inference_steps"] == 3 and identity["guidance_scale"] == 2.0 and identity["seed"] == 7
        assert result["samples"]["manifest"]["count"] == 10 and "command_line" not in result
    metrics = sorted(p.name for p in tmp_path.glob("*.metrics*.json"))
    assert metrics == [f"cfg2.0.metrics-{TINY}.json"]


def test_samples_changed_or_unfinished_since_sampling_are_not_scored(tmp_path):
    import shutil

    from moh_dit.errors import ArtifactError
    from moh_dit.sampling.generation import generate_samples

    from ..helpers.factories import tiny_model
    from ..helpers.factories import tiny_pipeline as pipe_for

    pipe = pipe_for(tiny_model(signal=0.1, in_channels=3))
    npz = generate_samples(
        pipe, tmp_path / "s", generation_settings(num_samples=10, batch_size=4, num_inference_steps=2)
    )
    np.savez(tmp_path / "r.npz", arr_0=random_images(10, size=8))
    score = ["--reference", str(tmp_path / "r.npz"), "--extractor", TINY, "--samples"]
    evaluate_fid.main([*score, str(npz)])
    with np.load(npz) as data:
        arrays = dict(data)
    edited = dict(arrays, arr_0=arrays["arr_0"].copy())
    edited["arr_0"][3, 0, 0, 0] ^= 1  # one bit of one image
    np.savez(tmp_path / "edited.npz", **edited)
    with pytest.raises(ArtifactError, match="holds other images than sample.py packed into it"):
        evaluate_fid.main([*score, str(tmp_path / "edited.npz")])
    np.savez(tmp_path / "cut.npz", **dict(arrays, arr_0=arrays["arr_0"][:8]))
    with pytest.raises(ArtifactError, match="holds 8 images but its manifest records 10"):
        evaluate_fid.main([*score, str(tmp_path / "cut.npz")])
    shutil.copytree(tmp_path / "s", tmp_path / "unfinished")
    (tmp_path / "unfinished" / "000004.png").unlink()  # as an interrupted sampling leaves it
    with pytest.raises(ArtifactError, match=r"holds 9 of the 10 samples its manifest counts \(missing 000004.png\)"):
        evaluate_fid.main([*score, str(tmp_path / "unfinished")])
    del arrays["moh_dit_manifest"]  # images from elsewhere say nothing, and are taken as they are
    np.savez(tmp_path / "plain.npz", **dict(arrays, arr_0=edited["arr_0"]))
    assert evaluate_fid.main([*score, str(tmp_path / "plain.npz")])["samples"]["manifest"] is None


def test_evaluating_a_run_that_trained_on_samples_the_new_weights(tmp_path):
    from moh_dit.training.config import load_config
    from moh_dit.training.trainer import train

    from ..helpers.factories import make_image_folder, tiny_train_overrides

    make_image_folder(tmp_path / "images")
    run = tmp_path / "run"
    common = ("preview.per_class=0", "log.trackers=[]")
    train(load_config(None, tiny_train_overrides(run, tmp_path / "images", *common)))
    np.savez(tmp_path / "r.npz", arr_0=random_images(10, size=8))
    args = [
        "--model",
        str(run),
        "--reference",
        str(tmp_path / "r.npz"),
        "--extractor",
        TINY,
        "--num-samples",
        "6",
        "--num-steps",
        "2",
        "--sample-batch-size",
        "3",
    ]
    first = evaluate_fid.main(args)
    train(
        load_config(
            None, tiny_train_overrides(run, tmp_path / "images", "train.resume=latest", "train.max_steps=6", *common)
        )
    )
    second = evaluate_fid.main(args)
    assert first["samples"]["manifest"]["model"]["step"] == 4 and second["samples"]["manifest"]["model"]["step"] == 6
    assert first["samples"]["path"] != second["samples"]["path"]
    assert (
        first["samples"]["manifest"]["identity"]["transformer_sha256"]
        != second["samples"]["manifest"]["identity"]["transformer_sha256"]
    )


def test_kid_agrees_with_torch_fidelity_on_the_same_features(tmp_path):
    """torch-fidelity computes KID end to end from the same images and extractor."""
    import torch_fidelity

    samples, reference = random_images(60, seed=4, shift=30), random_images(80, seed=5)
    np.savez(tmp_path / "ref.npz", arr_0=reference)
    ours = evaluate(samples, tmp_path / "ref.npz", resolve_extractor(TINY, None, "cpu"), cache=False)["metrics"]

    class Images(torch.utils.data.Dataset):
        def __init__(self, arr):
            self.arr = arr

        def __len__(self):
            return len(self.arr)

        def __getitem__(self, i):
            return torch.from_numpy(self.arr[i].transpose(2, 0, 1).copy())

    theirs = torch_fidelity.calculate_metrics(
        input1=Images(reference),
        input2=Images(samples),
        kid=True,
        feature_extractor=TINY,
        kid_subset_size=60,
        cuda=False,
        verbose=False,
        save_cpu_ram=True,
    )
    assert ours["kid"] == pytest.approx(theirs["kernel_inception_distance_mean"], rel=1e-5)
    assert ours["kid_std"] == pytest.approx(theirs["kernel_inception_distance_std"], rel=1e-4)


def test_bootstrap_intervals_in_the_cli_json(tmp_path):
    np.savez(tmp_path / "s.npz", arr_0=random_images(30, seed=2))
    np.savez(tmp_path / "r.npz", arr_0=random_images(30, seed=3))
    result = evaluate_fid.main(
        [
            "--samples",
            str(tmp_path / "s.npz"),
            "--reference",
            str(tmp_path / "r.npz"),
            "--extractor",
            TINY,
            "--bootstrap",
            "10",
        ]
    )
    m = result["metrics"]
    assert m["fid_interval"][0] <= m["fid_interval"][1] and m["kid_interval"][0] <= m["kid_interval"][1]
    for key in ("fid", "kid"):  # centred on the reported value (resamples shift both upwards)
        assert sum(m[f"{key}_interval"]) / 2 == pytest.approx(m[key], rel=1e-9)
    assert json.loads((tmp_path / f"s.metrics-{TINY}.json").read_text())["metrics"]["kid"] == m["kid"]


def test_evaluate_can_return_the_features_it_scored(tmp_path):
    samples, reference = random_images(30, seed=6, shift=20), random_images(40, seed=7)
    np.savez(tmp_path / "ref.npz", arr_0=reference)
    extractor = resolve_extractor(TINY, None, "cpu")
    plain = evaluate(samples, tmp_path / "ref.npz", extractor, cache=False)
    with_features = evaluate(samples, tmp_path / "ref.npz", extractor, cache=False, return_features=True)
    features, expected = with_features.pop("features"), extract_features(extractor, samples, 100)
    assert "features" not in plain and with_features == plain  # the same scores; only the features are added
    assert features.keys() == expected.keys()
    assert all(np.array_equal(features[k], expected[k]) for k in expected)


def test_a_missing_array_file_is_said_to_not_exist_and_a_damaged_one_to_be_unreadable(tmp_path):
    """A missing .npz read "is not a readable array file ([Errno 2] ...); truncated?": it does not exist."""
    from moh_dit.errors import EvaluationError
    from moh_dit.evaluation.features import load_images

    with pytest.raises(EvaluationError, match=r"nowhere\.npz does not exist$"):
        load_images(tmp_path / "nowhere.npz")
    (tmp_path / "bad.npz").write_bytes(b"not a zip")
    with pytest.raises(EvaluationError, match="bad.npz is not a readable array file .*truncated"):
        load_images(tmp_path / "bad.npz")


def test_a_missing_reference_is_said_before_the_default_extractors_weights(tmp_path, monkeypatch):
    """With the default extractor (Inception, whose weights this machine lacks) a missing --reference is the user's
    first mistake to hear about, not the weights."""
    from moh_dit.cli.evaluate import main

    monkeypatch.delenv("MOH_DIT_INCEPTION_WEIGHTS", raising=False)
    np.savez(tmp_path / "s.npz", arr_0=random_images(2, size=8))
    with pytest.raises(FileNotFoundError, match=r"--reference .*missing.npz does not exist: give an ADM reference"):
        main(["--samples", str(tmp_path / "s.npz"), "--reference", str(tmp_path / "missing.npz")])


def test_a_distilled_students_objective_is_not_called_meanflow_whatever_its_method():
    from moh_dit.objectives.distill import DMD2Distill
    from moh_dit.objectives.registry import entry

    assert "MeanFlow" not in entry("distill").summary
    assert DMD2Distill(teacher={"sha256": "ab" * 32}).describe().startswith("A DMD2 generator distilled from")


@pytest.mark.skipif(find_fashion_mnist() is None, reason="Fashion-MNIST IDX files not installed")
def test_the_training_split_reference_holds_the_first_thousand_training_images_of_each_class(tmp_path, monkeypatch):
    """``fashion-mnist-train``: 10,000 training images, 1000 a class (the test split's count), the first of each
    class in the split's order, as RGB; made once into the cache, none of them from the test split's files."""
    from moh_dit.data.fashion_mnist import FashionMNIST
    from moh_dit.evaluation.reference import resolve_reference
    from moh_dit.evaluation.statistics import CACHE_ENV

    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    path = resolve_reference("fashion-mnist-train")
    assert path == tmp_path / "references" / "fashion-mnist-train.npz"
    with np.load(path) as stored:
        images = stored["arr_0"]
    train = FashionMNIST(split="train")
    rows = [i for c in range(10) for i in np.flatnonzero(train.labels == c)[:1000]]
    assert images.shape == (10_000, 28, 28, 3) and (images[..., 0] == images[..., 2]).all()
    assert np.array_equal(images[..., 0], train.images[sorted(rows)])
    assert np.bincount(train.labels[sorted(rows)], minlength=10).tolist() == [1000] * 10
