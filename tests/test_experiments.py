"""The quality experiment end to end on a tiny setting, and the Fashion-MNIST classifier it relies on."""

import json
import os
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from experiments.distill_dmd2_settings import LATER_SCALES, ONE_STEP_ARMS
from experiments.fmnist_classifier import (
    DEFAULT_WEIGHTS,
    accuracy,
    load_classifier,
    predict,
    recognition_rates,
    register,
)
from moh_dit.data.fashion_mnist import find_fashion_mnist
from moh_dit.errors import ConfigError
from moh_dit.evaluation.features import extract_features

from .helpers.factories import generation_settings

needs_data = pytest.mark.skipif(find_fashion_mnist() is None, reason="Fashion-MNIST IDX files not installed")


@needs_data
@pytest.mark.slow  # an asset check: 10,000 test images through the classifier; its loading is tested by every study
def test_shipped_classifier_reaches_its_recorded_test_accuracy():
    from moh_dit.data.fashion_mnist import FashionMNIST

    info = json.loads(DEFAULT_WEIGHTS.with_suffix(".json").read_text())
    assert info["test_accuracy"] >= 0.90
    test = FashionMNIST(split="test")
    acc = accuracy(load_classifier(), test.images, test.labels)
    assert acc == pytest.approx(info["test_accuracy"], abs=1e-4)


def test_classifier_is_registered_and_gives_features():
    from moh_dit.evaluation.features import resolve_extractor

    ext = resolve_extractor(register(), None, "cpu")
    images = torch.randint(0, 256, (5, 3, 28, 28), dtype=torch.uint8)
    feats = ext(images)
    assert feats["pool"].shape == (5, 128) and feats["logits"].shape == (5, 10)


def test_recognition_rates_are_per_class_recall():
    labels = np.array([0, 0, 0, 1, 1, 2, 2, 2, 2])
    predicted = np.array([0, 1, 0, 1, 1, 2, 0, 0, 0])
    rates = recognition_rates(predicted, labels, num_classes=4)
    assert rates == [pytest.approx(2 / 3), 1.0, 0.25, None]  # class 3 has no images: no rate, not 0


def test_predict_takes_grayscale_and_rgb_uint8_alike():
    model = load_classifier()
    gray = torch.randint(0, 256, (7, 28, 28), dtype=torch.uint8).numpy()
    rgb = np.repeat(gray[..., None], 3, axis=3)  # how sample folders store grayscale
    assert np.array_equal(predict(model, gray, batch=3), predict(model, rgb))
    labels = predict(model, gray)
    assert accuracy(model, gray, labels) == 1.0 and accuracy(model, gray, (labels + 1) % 10) == 0.0


@needs_data
def test_fashion_reference_writes_beside_another_process_writing_the_same_file(tmp_path, monkeypatch):
    """Two studies started at once write the same reference: each writes its own temporary file, so neither
    renames the other's away (a shared temporary name failed one of them)."""
    import experiments.common as common
    from experiments.common import fashion_reference

    other = tmp_path / ".reference_fmnist_test_20.npz.tmp-999999999.npz"  # another process, mid-write
    other.write_bytes(b"partial")
    written = []
    savez = np.savez

    def recording_savez(file, **arrays):
        written.append(Path(file).name)
        savez(file, **arrays)

    monkeypatch.setattr(common.np, "savez", recording_savez)
    path = fashion_reference(tmp_path, count=20)
    assert len(written) == 1 and str(os.getpid()) in written[0]  # this process's own temporary name
    assert other.read_bytes() == b"partial"  # untouched
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([other.name, path.name])
    assert np.load(path)["arr_0"].shape == (20, 28, 28, 3)
    assert fashion_reference(tmp_path, count=20) == path  # reused, checked


@needs_data
def test_per_class_scores_compare_each_class_with_the_same_class_of_the_reference(tmp_path):
    from experiments.common import classifier_features, fashion_reference, per_class_scores
    from moh_dit.data.fashion_mnist import FashionMNIST

    train = FashionMNIST(split="train")
    picked = np.concatenate([np.flatnonzero(train.labels == c)[:40] for c in range(10)])
    images, labels = np.repeat(train.images[picked, :, :, None], 3, axis=3), train.labels[picked]
    reference, extractor = fashion_reference(tmp_path, count=3000), classifier_features()  # ~300 per class
    features = extract_features(extractor, images, 100)
    right = per_class_scores(features, labels, reference, extractor)
    wrong = per_class_scores(features, (labels + 1) % 10, reference, extractor)  # each class scored against another
    kid_right, kid_wrong = right["class_kid"], wrong["class_kid"]
    assert max(kid_right) < 20 and min(kid_wrong) > 100  # the right class: noise around 0; a mix-up: hundreds
    # the classifier's own labels for these training images, from the same pass, agree with predict()
    predicted = predict(load_classifier(), images)
    assert right["recognised"] == recognition_rates(predicted, labels) and min(right["recognised"]) > 0.5
    short = per_class_scores({k: v[:41] for k, v in features.items()}, labels[:41], reference, extractor)
    assert short["class_kid"][2:] == [None] * 8 and short["recognised"][2:] == [None] * 8  # < 2 samples: none


@needs_data
def test_seam_excess_is_one_for_real_images_and_grows_with_patchwise_offsets():
    from experiments.common import seam_excess
    from moh_dit.data.fashion_mnist import FashionMNIST

    train = FashionMNIST(split="train")  # other images than the test set the excess is measured against
    picked = np.concatenate([np.flatnonzero(train.labels == c)[:300] for c in range(9)])  # no ankle boots
    images, labels = train.images[picked], train.labels[picked]
    real = seam_excess(np.repeat(images[..., None], 3, axis=3), labels, 4)
    assert real["seam_excess"] == pytest.approx(1.0, abs=0.05)
    assert (
        all(v == pytest.approx(1.0, abs=0.1) for v in real["class_seam_excess"][:9])
        and real["class_seam_excess"][9] is None
    )
    # each 4x4 patch of a bright area shifted by its own small offset: the texture of an undertrained model
    offsets = np.kron(np.random.default_rng(0).normal(0, 20, (len(images), 7, 7)), np.ones((4, 4)))
    textured = np.clip(images + offsets * (images > 60), 0, 255).astype(np.uint8)
    seamy = seam_excess(textured, labels, 4)
    assert seamy["seam_excess"] > real["seam_excess"] + 0.15
    assert seamy["class_seam_excess"][1] > real["class_seam_excess"][1] + 0.15  # trousers too
    assert seam_excess(textured, labels, 7)["seam_excess"] < seamy["seam_excess"]  # a grid that is not the model's


def test_missing_classifier_weights_explain_how_to_make_them(tmp_path):
    with pytest.raises(FileNotFoundError, match="python -m experiments.train_classifier"):
        load_classifier(tmp_path / "none.safetensors")


@pytest.mark.slow
@needs_data
def test_quality_experiment_runs_end_to_end_on_a_tiny_setting(tmp_path):
    from experiments.quality import GUIDANCE, run_experiment

    models = ("DiT-Ti/4", "MoH-DiT-Ti/4-50")
    first = run_experiment("tiny", tmp_path, models=models, seeds=(0,))  # a first stage: seed 0 only
    text = (tmp_path / "RESULTS.md").read_text()
    assert "Status: partial" in text and "--scale tiny --part study --seeds 1" in text
    result = run_experiment("tiny", tmp_path, models=models, seeds=(1,))  # the second stage adds seed 1
    records = result["study"]["records"]
    assert [(r["model"], r["seed"]) for r in records] == [(m, s) for m in models for s in (0, 1)]
    assert [r for r in records if r["seed"] == 0] == json.loads(json.dumps(first["study"]["records"]))
    guided = f"cfg{GUIDANCE:g}"
    for rec in records:
        assert np.isfinite(rec["final_diffusion_loss"]) and rec["train_images_per_s"] > 0
        for setting in ("cfg1", guided):
            scores = rec[setting]
            for key in ("kid", "fid", "precision", "recall", "seconds_per_image"):
                assert np.isfinite(scores[key]), (setting, key)
            lo, hi = scores["kid_interval"]
            assert lo <= hi and scores["num_samples"] == 24
    usage = np.array(result["study"]["head_usage"]["MoH-DiT-Ti/4-50"])
    assert usage.shape == (6, 6, 6) and np.allclose(usage[:, :2], 1.0)  # shared heads always on
    assert "DiT-Ti/4" not in result["study"]["head_usage"]

    cont = result["continue"]
    assert cont["points"] == [0, 1, 2]
    arms = {(r["arm"], r["seed"], r["step"]) for r in cont["records"]}
    assert arms == {(a, s, p) for a in ("DiT", "MoH-75", "MoH-50") for s in (0, 1) for p in (0, 1, 2)}
    # the DiT at step 0 is the study's DiT: the same samples, the same score
    dit0 = next(r for r in cont["records"] if r["arm"] == "DiT" and r["seed"] == 0 and r["step"] == 0)
    study_dit = next(r for r in records if r["model"] == "DiT-Ti/4" and r["seed"] == 0)
    assert dit0["kid"] == pytest.approx(study_dit[guided]["kid"])
    converted = tmp_path / "continue" / "seed0" / "converted-MoH-50"
    assert json.loads((converted / "transformer" / "config.json").read_text())["num_shared_heads"] in (2, [2] * 6)

    text = (tmp_path / "RESULTS.md").read_text()
    assert "| MoH-DiT-Ti/4-50 | 0, 1 |" in text and "Continue-tuning" in text and "Conclusion" in text
    assert "Status: partial" in text and "MoH-DiT-Ti/4-90" in text  # two of the four planned models
    for plot in ("loss_curves.png", "head_usage_MoH-DiT-Ti_4-50.png", "continue_tuning_kid.png"):
        assert (tmp_path / plot).exists(), plot
    again = run_experiment("tiny", tmp_path, models=("DiT-Ti/4",), seeds=(0,), part="study")  # runs are reused
    assert again["study"]["records"][0]["cfg1"]["kid"] == pytest.approx(study_dit["cfg1"]["kid"])
    assert len(again["study"]["records"]) == 4  # the runs this stage did not redo are kept
    assert again["continue"] == json.loads(json.dumps(result["continue"]))  # the other part is kept from results.json

    from experiments.quality import main

    main(["--scale", "tiny", "--out", str(tmp_path), "--note", "seed 0's DiT was copied in"])  # kept by later stages
    assert "Note: seed 0's DiT was copied in" in (tmp_path / "RESULTS.md").read_text()
    kept = run_experiment("tiny", tmp_path, models=("DiT-Ti/4",), seeds=(0,), part="study")
    assert kept["notes"] == ["seed 0's DiT was copied in"]

    # results made with other settings are moved aside, never mixed into a new stage
    saved = json.loads((tmp_path / "results.json").read_text())
    saved["made_by"]["guidance"] = 9.0
    (tmp_path / "results.json").write_text(json.dumps(saved))
    fresh = run_experiment("tiny", tmp_path, models=("DiT-Ti/4",), seeds=(0,), part="study")
    assert len(fresh["study"]["records"]) == 1 and fresh["continue"] is None
    assert (tmp_path / "results.previous.json").exists()


@needs_data
def test_quality_experiment_refuses_a_run_folder_made_by_another_recipe(tmp_path):
    from experiments.quality import train_run
    from moh_dit.errors import MohDitError

    tiny = ["train.max_steps=1", "train.global_batch_size=8", "data.subset_per_class=2", "log.log_every=1"]
    train_run(tmp_path / "run", [*tiny, "model.preset=DiT-Ti/4", "train.seed=0"])
    with pytest.raises(MohDitError):  # the study would otherwise score this DiT as seed 1's run
        train_run(tmp_path / "run", [*tiny, "model.preset=DiT-Ti/4", "train.seed=1"])


@pytest.mark.slow
@needs_data
def test_default_comparison_trains_scores_and_draws_each_recipe_alike(tmp_path):
    from experiments import default_comparison

    short = "train.max_steps=2,train.global_batch_size=8,log.log_every=1,preview.per_class=1"
    short += ",model.overrides.hidden_size=32,model.overrides.head_dim=8"  # the plumbing, not the model, is tested
    recipes = [
        f"old=experiments/configs/fashion_mnist_moh_v1.yaml:{short}",
        f"new=configs/fashion_mnist_moh.yaml:{short}",
    ]
    args = ["--only", "old", "new", "--samples", "20", "--steps", "2", "--bootstrap", "3", "--out", str(tmp_path)]
    args += ["--reference-count", "300"]  # the first 300 test images, about 30 of each class
    result = default_comparison.main([*args, *(f"--recipe={r}" for r in recipes)])
    assert list(result["rows"]) == ["old", "new"]
    for name, row in result["rows"].items():
        assert row["train"]["step"] == 2 and row["train"]["median_images_per_s"] > 0
        assert row["num_samples"] == 20 and row["kid_interval"][0] <= row["kid_interval"][1]
        assert (tmp_path / f"grid_{name}.png").exists()
    text = (tmp_path / "RESULTS.md").read_text()
    assert "| old | 2 |" in text and "| new | 2 |" in text and "![new](grid_new.png)" in text
    assert "first 300 Fashion-MNIST test images" in text  # what the scores are against
    for row in result["rows"].values():  # 20 balanced samples: 2 of each class, so every rate is 0, 0.5 or 1
        assert len(row["recognised"]) == 10 and set(row["recognised"]) <= {0.0, 0.5, 1.0}
        assert len(row["class_kid"]) == 10 and all(np.isfinite(row["class_kid"]))
        assert len(row["class_seam_excess"]) == 10 and np.isfinite(row["seam_excess"])
        assert row["seam_excess_any_offset"] >= row["seam_excess"]  # the largest over every grid offset
    assert min(result["real_recognised"]) > 0.5 and "| real test images |" in text and "| Sandal |" in text
    assert "Patch seams" in text and "| Sandal | Shirt | Sneaker | Bag | Ankle boot | all | any offset |" in text
    again = default_comparison.main([*args, *(f"--recipe={r}" for r in recipes)])  # runs and samples are reused
    assert again["rows"]["new"]["kid"] == result["rows"]["new"]["kid"]
    one = default_comparison.main([*args, "--only", "new", *(f"--recipe={r}" for r in recipes)])
    assert list(one["rows"]) == ["old", "new"]  # a recipe scored alone joins the table, in recipe order

    # the guidance study on the same model: each setting's samples carry their interval, one grid each
    from experiments import guidance_interval

    model = f"new={tmp_path / 'runs' / 'new' / 'pipeline'}"
    settings = ["2", "2@100-600", "2@100-600+avg500"]
    study = ["--models", model, "--settings", *settings, "--samples", "20", "--steps", "2", "--bootstrap", "3"]
    study += ["--reference-count", "300"]
    rows = guidance_interval.main([*study, "--out", str(tmp_path / "gi")])["rows"]
    assert list(rows) == [f"new {s}" for s in settings] and rows["new 2@100-600"]["interval"] == (100, 600)
    banded = np.load(tmp_path / "gi" / "runs" / "new" / "samples-dpm-solver2-cfg2-t100-600-n20.npz")
    assert json.loads(str(banded["moh_dit_manifest"]))["identity"]["guidance_interval"] == [100, 600]
    averaged = np.load(tmp_path / "gi" / "runs" / "new" / "samples-dpm-solver2-cfg2-t100-600-avg500-n20.npz")
    assert json.loads(str(averaged["moh_dit_manifest"]))["identity"]["grid_averaging"] == 500
    assert rows["new 2@100-600+avg500"]["grid_averaging"] == 500 and rows["new 2@100-600"]["grid_averaging"] is None
    text = (tmp_path / "gi" / "RESULTS.md").read_text()
    assert "| new | 2@100-600 |" in text and "| new 2@100-600 |" in text  # the main table and the per-class one
    assert all((tmp_path / "gi" / r["grid"]).exists() for r in rows.values())
    assert guidance_interval.parse_setting("4@100-500+avg100") == (4.0, (100, 500), 100)
    assert guidance_interval.parse_setting("3+avg0") == (3.0, None, 0)
    for bad in ("4@100", "4@100-500+avg1000", "4+avg"):
        with pytest.raises(SystemExit, match=r"GUIDANCE\[@FIRST-LAST\]\[\+avgT\]"):
            guidance_interval.parse_setting(bad)


def test_a_study_keeps_earlier_rows_only_when_they_were_scored_with_the_same_protocol(tmp_path):
    from experiments.common import kept_rows

    protocol = {"samples": 2000, "steps": 25, "interval": (100, 500)}
    assert kept_rows(tmp_path, protocol) == {}
    (tmp_path / "results.json").write_text(json.dumps({"protocol": protocol, "rows": {"v7": {"kid": 3.1}}}))
    assert kept_rows(tmp_path, protocol) == {"v7": {"kid": 3.1}}  # a tuple matches its JSON list
    assert kept_rows(tmp_path, dict(protocol, samples=500)) == {}  # never mixed into a table of 500 samples
    aside = json.loads((tmp_path / "results.previous.json").read_text())
    assert aside["rows"] == {"v7": {"kid": 3.1}} and not (tmp_path / "results.json").exists()


def test_recipe_overrides_split_on_commas_outside_lists():
    from experiments.default_comparison import parse_recipe

    assert parse_recipe("d8=a.yaml:model.overrides.depth=8,model.overrides.top_k=[2,2,0],train.seed=1") == (
        "d8",
        "a.yaml",
        ["model.overrides.depth=8", "model.overrides.top_k=[2,2,0]", "train.seed=1"],
    )
    assert parse_recipe("v=a.yaml") == ("v", "a.yaml", [])
    for bad in ("a.yaml", "d=a.yaml:x=[1,2"):
        with pytest.raises(SystemExit, match="--recipe"):
            parse_recipe(bad)


@pytest.mark.slow
@needs_data
def test_classifier_training_script_reaches_stated_accuracy(tmp_path):
    """The documented command, as a file in a new process from the repository root, nothing on PYTHONPATH."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = tmp_path / "clf.safetensors"
    done = subprocess.run(
        [sys.executable, "-m", "experiments.train_classifier", "--out", str(out)],
        cwd=Path(__file__).resolve().parents[1],
        env=env,
        capture_output=True,
        text=True,
        timeout=3600,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    info = json.loads((tmp_path / "clf.json").read_text())
    assert info["test_accuracy"] >= 0.90 and info["seed"] == 0


@needs_data
def test_sample_and_score_refuses_samples_made_by_another_model(tmp_path):
    from experiments.common import classifier_features, fashion_reference, sample_and_score
    from experiments.quality import train_run
    from moh_dit.errors import ArtifactError

    tiny = ["train.max_steps=1", "train.global_batch_size=8", "data.subset_per_class=2", "model.preset=DiT-Ti/4"]
    first, second = (train_run(tmp_path / f"run{seed}", [*tiny, f"train.seed={seed}"]) for seed in (0, 1))
    reference, extractor = fashion_reference(tmp_path, count=50), classifier_features()
    settings = generation_settings(num_samples=8, seed=1000, batch_size=8, guidance_scale=1.0, num_inference_steps=2)
    folder = tmp_path / "samples"
    scores = sample_and_score(first / "pipeline", folder, settings, "ddim", reference, extractor, bootstrap=2)
    assert scores["num_samples"] == 8 and scores["seconds_per_image"] > 0
    again = sample_and_score(first / "pipeline", folder, settings, "ddim", reference, extractor, bootstrap=2)
    assert again["kid"] == scores["kid"]  # the finished set is reused, not regenerated
    with pytest.raises(ArtifactError, match="other settings"):  # a retrained model is never scored from old samples
        sample_and_score(second / "pipeline", folder, settings, "ddim", reference, extractor, bootstrap=2)


@needs_data
def test_a_reference_file_that_is_not_the_test_set_is_refused(tmp_path):
    from experiments.common import classifier_features, fashion_reference, per_class_scores
    from moh_dit.data.fashion_mnist import FashionMNIST
    from moh_dit.errors import ArtifactError

    path = fashion_reference(tmp_path, count=20)
    assert fashion_reference(tmp_path, count=20) == path  # reused after the check
    with np.load(path) as stored:
        images = stored["arr_0"].copy()
    images[0, 0, 0] ^= 1
    np.savez(path, arr_0=images)
    with pytest.raises(ArtifactError, match="does not hold the first 20 Fashion-MNIST test images"):
        fashion_reference(tmp_path, count=20)
    samples = np.repeat(FashionMNIST(split="test").images[:20, :, :, None], 3, axis=3)
    extractor = classifier_features()
    features = extract_features(extractor, samples, 20)
    with pytest.raises(ArtifactError, match="does not hold the first 20"):  # per-class scores need its labels
        per_class_scores(features, np.arange(20) % 10, path, extractor)
    with pytest.raises(ValueError, match="logits of 19 samples"):  # features of other images than the labels
        per_class_scores(features, np.arange(19) % 10, path, extractor)


def test_paired_differences_report_each_seed_and_whether_they_agree():
    from experiments.quality_report import paired
    from experiments.report import seedwise

    records = [
        {"model": m, "seed": seed, "cfg3": {"kid": kid}}
        for m, seed, kid in [("DiT", 0, 20.0), ("DiT", 1, 21.0), ("MoH", 0, 19.0), ("MoH", 1, 18.5)]
    ]
    d = paired(records, "MoH", "DiT", "cfg3", "kid")
    assert d["values"] == [-1.0, -2.5] and d["mean"] == -1.75
    lo, hi = d["ci"]  # t(0.975, 1) = 12.706; sd of the differences = 1.0607
    assert abs(hi - lo - 2 * 12.7062 * 1.06066 / 2**0.5) < 1e-2
    assert seedwise(d["values"]) == "per seed -1.00, -2.50: same sign in every seed"
    assert seedwise([1.0, -0.5]).endswith("signs differ between seeds")


@needs_data
def test_flip_floor_shows_what_mirrored_shoes_cost_and_symmetric_garments_do_not(tmp_path):
    from experiments import flip_floor

    result = flip_floor.main(["--per-class", "40", "--reference-count", "3000", "--out", str(tmp_path / "default")])
    kid = {name: dict(zip(result["classes"], row["class_kid"])) for name, row in result["rows"].items()}
    assert max(kid["as they are"].values()) < 20  # real images of the right class: noise around 0
    for shoe in ("Sandal", "Ankle boot"):  # every shoe in the catalogue points the same way
        assert kid["all mirrored"][shoe] > 100 and kid["half mirrored"][shoe] > 20
    for garment in ("T-shirt/top", "Pullover", "Coat", "Shirt", "Bag"):  # near mirror-symmetric
        assert kid["all mirrored"][garment] < 20
    table = (tmp_path / "default" / "flip_floor.md").read_text()
    assert all(f"| {name} |" in table for name in flip_floor.VARIANTS)
    assert json.loads((tmp_path / "default" / "flip_floor.json").read_text()) == json.loads(json.dumps(result))
    assert result["extractor"] == "fmnist-classifier" and len(result["weights_sha256"]) == 64  # what scored it
    assert result["reference_count"] == 3000 and "first 3,000 Fashion-MNIST test images" in table
    assert result["code"]["moh_dit"]
    mirrored = flip_floor.mirrored(np.arange(12).reshape(1, 3, 4), 1.0)
    assert np.array_equal(mirrored[0], np.arange(12).reshape(3, 4)[:, ::-1])


def test_recipes_study_refuses_a_second_writer_of_the_same_folder(tmp_path):
    from experiments.recipes import main
    from experiments.report import hold_lock

    held = hold_lock(tmp_path, "recipes")  # what a running part holds
    with pytest.raises(SystemExit, match="another experiments.recipes process is writing"):
        main(["--part", "train", "--scale", "tiny", "--out", str(tmp_path)])
    held.close()
    assert not (tmp_path / "results.json").exists()  # nothing written by the refused one
    hold_lock(tmp_path, "recipes").close()  # free again once the first has ended


@pytest.mark.parametrize("study", ["recipes", "backbone", "guidance", "fewstep", "distill"])
def test_every_study_refuses_records_of_another_protocol_and_a_second_writer(tmp_path, study):
    import importlib

    from experiments.report import hold_lock

    main = importlib.import_module(f"experiments.{study}").main
    records = tmp_path / "results.json"
    records.write_text(json.dumps({"protocol": {"scale": "cpu", "samples": 1}, "training": {}}))
    with pytest.raises(
        SystemExit, match="was written with .*not .*'tiny'.*pass --scale cpu to continue them.*another --out"
    ):
        main(["--report-only", "--scale", "tiny", "--out", str(tmp_path)])
    records.unlink()
    held = hold_lock(tmp_path, study)
    with pytest.raises(SystemExit, match=f"another experiments.{study} process is writing"):
        main(["--part", "train", "--scale", "tiny", "--out", str(tmp_path)])
    held.close()
    assert not records.exists()


def test_a_study_opens_its_records_with_sections_added_and_its_seeds(tmp_path):
    from argparse import Namespace

    from experiments.common import REFERENCE_COUNT
    from experiments.report import hold_lock, open_study

    scale = {"samples": 8, "seeds": (0, 1, 2)}
    args = Namespace(out=str(tmp_path), scale="tiny", seeds=None, report_only=False, reference_count=REFERENCE_COUNT)
    kept = {"protocol": {"scale": "tiny", "samples": 8}, "training": {"flow-seed0": {"steps": 3}}}
    (tmp_path / "results.json").write_text(json.dumps(kept))
    result, seeds, lock = open_study(args, scale, "backbone", {"training": {}, "scores": []})
    assert result == kept | {"scores": []} and seeds == (0, 1, 2)  # a section written later is added, none replaced
    lock.close()
    held = hold_lock(tmp_path, "backbone")  # a report alone writes no records: it takes no lock
    args.report_only, args.seeds, args.reference_count = True, [2], 500
    with pytest.raises(SystemExit, match="reference_count"):  # another reference is another protocol
        open_study(args, scale, "backbone", {})
    args.reference_count = REFERENCE_COUNT
    assert open_study(args, scale, "backbone", {})[1:] == ((2,), None)
    held.close()


def test_recipes_report_pairs_training_curves_and_posthoc_sweeps_by_seed(tmp_path):
    from experiments.recipes_report import plot, posthoc_table
    from experiments.recipes_report import runs_table as curve_table

    training = {
        f"{arm}-seed{seed}": {
            "arm": arm,
            "seed": seed,
            "curve": [{"step": 100, "kid": kid}, {"step": 200, "kid": None}],
        }
        for arm, seed, kid in [("moh-flow", 0, 10.0), ("moh-flow", 1, 12.0), ("moh-flow-repa", 0, 9.0)]
        + [("moh-flow-repa", 1, 12.5)]
    }
    lines = curve_table(training, ["moh-ddpm", "moh-flow", "moh-flow-repa"], [("moh-flow-repa", "moh-flow")])
    assert lines[0] == "| step | moh-flow | moh-flow-repa | moh-flow-repa - moh-flow, paired |"
    assert len(lines) == 3  # the step without a KID is left out
    # means 11.0 and 10.75; differences by seed -1.0 and +0.5: mean -0.25, half-width 12.706 * 1.0607 / sqrt(2)
    assert lines[2].startswith("| 100 | 11.00 [-1.71, 23.71] (n=2) | 10.75 [")
    assert lines[2].endswith("| -0.25 [-9.78, 9.28] |")

    def row(weights, guidance, kid, sigma_rel=None):
        return {"weights": weights, "guidance": guidance, "kid": kid, "sigma_rel": sigma_rel}

    posthoc = {
        "0": {"rows": [row("posthoc-0.05", 1.0, 16.0, 0.05), row("fixed-ema", 1.0, 15.0), row("fixed-ema", 4.0, 3.0)]},
        "1": {"rows": [row("posthoc-0.05", 1.0, 18.0, 0.05), row("fixed-ema", 1.0, 16.0), row("fixed-ema", 4.0, 2.0)]},
    }
    table = posthoc_table(posthoc)
    assert table[0] == "| weights | guidance | seed 0 | seed 1 | mean [95% t] | vs fixed-ema, paired |"
    assert table[2] == "| posthoc-0.05 | 1 | 16.00 | 18.00 | 17.00 [4.29, 29.71] | 1.50 [-4.85, 7.85] |"
    assert table[3].startswith("| fixed-ema | 1 | 15.00 | 16.00 | 15.50 [") and table[3].endswith("|  |")
    assert table[4].startswith("| fixed-ema | 4 | 3.00 | 2.00 |")
    result = {"samplers": {}, "objective": [], "repa": [], "training": training, "posthoc": posthoc}
    plot(result, tmp_path)
    assert (tmp_path / "posthoc_by_seed.png").exists() and (tmp_path / "kid_during_training.png").exists()


@pytest.mark.slow
@needs_data
def test_recipes_study_trains_every_arm_chooses_samplers_by_counted_nfe_and_reports(tmp_path):
    from experiments.recipes import ARMS, NFE_BUDGETS, SCALES, main

    out = tmp_path / "out"
    result = main(["--scale", "tiny", "--reference-count", "200", "--out", str(out)])
    assert set(result["training"]) == {f"{arm}-seed{s}" for arm in ARMS for s in (0, 1)}
    repa = result["training"]["moh-flow-repa-seed0"]
    assert repa["final_repa_loss"] < 0 and result["training"]["moh-flow-seed0"]["final_repa_loss"] is None
    assert all(len(t["curve"]) == 2 for t in result["training"].values())  # evaluated during training at 2 and 4
    counted = {(r["scheduler"], r["steps"]): r["nfe"] for r in result["samplers"]["flow"]}
    assert counted[("heun", 13)] == 25 and counted[("sde", 25)] == 25 and counted[("euler", 50)] == 50
    for objective in ("ddpm", "flow"):
        for budget in NFE_BUDGETS:
            assert 0.9 * budget <= result["choice"][objective][str(budget)]["nfe"] <= budget
    assert {(r["arm"], r["seed"], r["budget"]) for r in result["objective"]} == {
        (a, s, b) for a in ("moh-ddpm", "moh-flow", "dit-flow") for s in (0, 1) for b in NFE_BUDGETS
    }
    assert {r["arm"] for r in result["repa"]} == {"moh-flow", "moh-flow-repa"}
    rows = result["posthoc"]["0"]["rows"]
    guidance = result["choice"]["ddpm"]["25"]["guidance"]
    assert len(rows) == (len(SCALES["tiny"]["sigma_rels"]) + 1) * len({1.0, guidance})
    assert {r["guidance"] for r in rows} == {1.0, guidance}
    text = (out / "RESULTS.md").read_text()
    assert "## DDPM against flow matching" in text and "| dit-flow | 50 |" in text and "## REPA" in text
    for plot in (
        "kid_vs_nfe.png",
        "kid_during_training.png",
        "kid_by_seed.png",
        "grid_moh-flow.png",
        "posthoc-seed0/posthoc_sweep.png",
    ):
        assert (out / plot).exists(), plot
    (out / "RESULTS.md").unlink()
    reread = main(["--scale", "tiny", "--reference-count", "200", "--out", str(out), "--report-only"])
    assert reread == json.loads(json.dumps(result))  # as results.json holds it (intervals as lists)
    assert (out / "RESULTS.md").read_text() == text


def test_backbone_study_reads_the_steps_to_a_target_from_a_curve():
    from experiments.backbone import ARMS, comparisons, steps_to_reach

    # KID 20 at step 1000 and 10 at 2000: 14.14 (the geometric mean) is reached half way, in log KID
    assert steps_to_reach({1000: 20.0, 2000: 10.0}, 20 * 0.5**0.5) == pytest.approx(1500)
    assert steps_to_reach({1000: 20.0, 2000: 16.0}, 14.0) is None  # never reached
    assert steps_to_reach({1000: 12.0, 2000: 10.0}, 14.0) == 1000  # already at the first evaluation
    # every ablation row is paired with the row above it, the side rows with LightningDiT's block
    assert comparisons()[0] == ("+lognorm", "flow") and ("dit-modern", "+rope") in comparisons()
    assert set(ARMS) == {a for pair in comparisons() for a in pair}


@pytest.mark.slow
@needs_data
def test_backbone_study_trains_every_arm_scores_and_reports(tmp_path):
    from experiments.backbone import ARMS, main

    out = tmp_path / "out"
    result = main(["--scale", "tiny", "--reference-count", "200", "--out", str(out)])
    assert set(result["training"]) == {f"{arm}-seed{s}" for arm in ARMS for s in (0, 1)}
    assert {(r["arm"], r["seed"]) for r in result["scores"]} == {(a, s) for a in ARMS for s in (0, 1)}
    text = (out / "RESULTS.md").read_text()
    assert "## Guided at NFE 25" in text and "| +qknorm | KID |" in text and (out / "kid_during_training.png").exists()
    modern = result["training"]["+qknorm-seed0"]
    assert len(modern["curve"]) == 2 and modern["final_loss"] > 0


def test_guidance_study_trains_only_the_chosen_objectives_models(tmp_path, monkeypatch):
    from experiments import guidance

    trained = []
    monkeypatch.setattr(guidance, "train_arm", lambda arm, seed, *rest: trained.append((arm, seed)) or {})
    result = {"training": {}, "protocol": {}, "sweep": [], "seeds": [], "ema": []}
    monkeypatch.setattr(guidance, "save", lambda out, result: None)
    guidance.part_train({}, tmp_path, None, (0, 1), ["flow"], result, tmp_path / "backbone-runs")
    assert trained == [("flow-small", 0), ("flow-small", 1)]  # the flow mains come from the backbone study
    trained.clear()
    guidance.part_train({}, tmp_path, None, (0,), ["ddpm", "flow"], result, None)
    assert trained == [("ddpm", 0), ("flow", 0), ("ddpm-small", 0), ("flow-small", 0)]


def test_guidance_study_scores_only_the_chosen_methods_at_each_seed(tmp_path, monkeypatch, capsys):
    from experiments import guidance

    scored = []
    monkeypatch.setattr(
        guidance, "score", lambda name, o, m, scale, seed, n, ctx: scored.append((m, seed, scale)) or {}
    )
    monkeypatch.setattr(guidance, "_record", lambda result, key, row, out: None)
    sweep = [
        {"objective": "flow", "method": m, "scale": s, "kid": abs(s - 3)} for m in guidance.METHODS for s in (2, 3)
    ]
    done = {"objective": "flow", "method": "cfg", "scale": 3, "seed": 1, "samples": 8}  # in the records already
    result = {"sweep": sweep, "seeds": [done]}
    ctx = {"out": tmp_path, "rescore": False}
    guidance.part_seeds({"samples": 8}, ctx, (0, 1), ["flow"], result, ["ag-quarter", "cfg"])
    assert scored == [("ag-quarter", 0, 3), ("cfg", 0, 3), ("ag-quarter", 1, 3)]  # the recorded one kept
    scored.clear()
    guidance.part_seeds({"samples": 8}, ctx | {"rescore": True}, (1,), ["flow"], result, ["cfg"])
    assert scored == [("cfg", 1, 3)]
    scored.clear()  # the sweep: the chosen methods, their points not yet recorded, and an objective's extra scales
    guidance.part_sweep({"sweep_samples": 8}, ctx, ["ddpm"], result, ["ag-quarter"])
    assert scored == [("ag-quarter", 0, s) for s in (1.5, 2.0, 3.0, 4.0, 6.0)]
    scored.clear()
    sweep.append({"objective": "flow", "method": "ag-quarter", "scale": 1.5, "seed": 0, "samples": 8, "kid": 9})
    guidance.part_sweep({"sweep_samples": 8}, ctx, ["flow"], result, ["ag-quarter"])
    assert scored == [("ag-quarter", 0, 2.0), ("ag-quarter", 0, 3.0)]
    scored.clear()  # a guide rebuilt from post-hoc snapshots: DDPM mains keep them, the flow twin's do not
    guidance.part_sweep({"sweep_samples": 8}, ctx, ["ddpm", "flow"], result, ["ag-quarter-ema"])
    assert scored == [("ag-quarter-ema", 0, s) for s in (2.0, 3.0, 4.0)]
    assert "ag-quarter-ema: only for ddpm, so not run on flow" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        guidance.main(["--methods", "nope", "--report-only"])


def test_guidance_report_says_what_its_records_alone_do_not():
    from experiments import guidance

    result = {"protocol": {"scale": "tiny", "samples": 8}, "sweep": [], "seeds": [], "ema": []}
    assert "Note:" not in guidance.report(result)
    assert "\nNote: retrained mains\n" in guidance.report(result | {"notes": ["retrained mains"]})


def test_guidance_study_rebuilds_the_quarter_guide_from_the_runs_snapshots(tmp_path, monkeypatch):
    from experiments import guidance

    specs = []
    monkeypatch.setattr(guidance, "spec_for", lambda *args, **options: specs.append((args, options)) or (None, "s"))
    monkeypatch.setattr(guidance, "GenerationSettings", lambda *args, **kwargs: None)
    monkeypatch.setattr(guidance, "sample_and_score", lambda *args, **kwargs: {"kid": 1.0})
    ctx = {"out": tmp_path, "flow_runs": None, "quarter": 2000, "reference": None, "extractor": None, "bootstrap": 2}
    guidance.score("x", "ddpm", "ag-quarter-ema", 3.0, 1, 8, ctx)
    guidance.score("y", "ddpm", "ag-quarter", 3.0, 1, 8, ctx)
    (ema_args, ema_options), (fixed_args, fixed_options) = specs
    run = tmp_path / "runs" / "ddpm-seed1"
    assert ema_args[-1] == str(run) and ema_options == {
        "guide_step": 2000,
        "guide_sigma_rel": guidance.GUIDE_SIGMA_REL,
    }
    assert fixed_args[-1] == str(run / "checkpoints" / "step-00002000") and fixed_options == {}


@pytest.mark.slow
@needs_data
def test_guidance_study_trains_sweeps_every_method_and_reports(tmp_path):
    from experiments.guidance import METHODS, ONLY_FOR, main

    out = tmp_path / "out"
    result = main(["--scale", "tiny", "--reference-count", "200", "--out", str(out)])  # as documented
    assert {(r["objective"], r["method"]) for r in result["sweep"]} == {
        (o, m) for o in ("ddpm", "flow") for m in METHODS if o in ONLY_FOR.get(m, (o,))
    }
    assert {(r["method"], r["seed"]) for r in result["seeds"] if r["objective"] == "ddpm"} == {
        (m, s) for m in METHODS for s in (0, 1)
    }
    assert len(result["ema"]) == 2 * (1 + 3)  # two main widths: CFG, and three guide widths
    text = (out / "RESULTS.md").read_text()
    assert "## ddpm: each method at its best scale" in text and "| ag-small |" in text


def test_fewstep_caches_part_times_the_models_whose_runs_are_given(tmp_path, monkeypatch, capsys):
    from experiments import fewstep

    timed = []
    monkeypatch.setattr(
        fewstep, "recorded_sampling", lambda model: SimpleNamespace(guidance=SimpleNamespace(scale=4.0))
    )
    monkeypatch.setattr(fewstep, "score", lambda kind, seed, sched, steps, scale, ctx, cache: {"kind": kind})
    monkeypatch.setattr(fewstep, "_record", lambda result, key, row, out: timed.append(row["kind"]))
    ctx = {"out": tmp_path, "flow_runs": str(tmp_path), "ddpm_runs": None}
    fewstep.part_caches(ctx, {})
    assert timed == ["flow"] * 2 * len(fewstep.CACHES) and "no --ddpm-runs" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="pass --flow-runs, --ddpm-runs or both"):
        fewstep.part_caches(ctx | {"flow_runs": None}, {})


def test_fewstep_score_part_keeps_recorded_points_and_scores_only_the_given_seeds(tmp_path, monkeypatch):
    from experiments import fewstep

    scored = []
    monkeypatch.setattr(
        fewstep,
        "score",
        lambda kind, seed, sched, steps, scale, ctx, cache="none": (
            scored.append((kind, seed, steps))
            or {
                "kind": kind,
                "seed": seed,
                "scheduler": sched,
                "steps": steps,
                "scale": scale,
                "cache": cache,
                "kid": 1.0,
            }
        ),
    )
    monkeypatch.setattr(fewstep, "save", lambda out, result: None)
    sweep = [  # seed 0's sweeps, recorded by an earlier session whose seed-0 runs are gone
        {"kind": "meanflow", "seed": 0, "scheduler": "meanflow", "steps": 1, "scale": s, "cache": "none", "kid": s}
        for s in fewstep.MEANFLOW_SCALES
    ] + [
        {"kind": "flow", "seed": 0, "scheduler": "euler", "steps": 25, "scale": s, "cache": "none", "kid": abs(s - 3)}
        for s in fewstep.FLOW_SCALES
    ]
    result = {"sweep": sweep, "scores": []}
    fewstep.part_score({"out": tmp_path, "rescore": False}, (1, 2), result)
    assert scored == [("meanflow", s, n) for s in (1, 2) for n in (1, 2, 4)] + [
        ("flow", s, n) for s in (1, 2) for n in (25, 50)
    ]
    assert {r["scale"] for r in result["scores"] if r["kind"] == "flow"} == {3.0}  # the recorded sweep's best
    scored.clear()
    fewstep.part_score({"out": tmp_path, "rescore": False}, (1,), result)
    assert scored == []  # everything recorded now
    fewstep.part_score({"out": tmp_path, "rescore": True}, (1,), result)
    assert len(scored) == len(fewstep.MEANFLOW_SCALES) + 3 + len(fewstep.FLOW_SCALES) + 2


def test_fewstep_reads_the_flow_curves_of_its_seeds_and_keeps_the_others(tmp_path):
    from experiments import fewstep

    out, runs = tmp_path / "out", tmp_path / "runs"
    (runs / "flow-seed1").mkdir(parents=True)
    evaluation = {"kind": "evaluation", "step": 10, "kid": 5.0, "fid": 20.0}
    (runs / "flow-seed1" / "metrics.jsonl").write_text(json.dumps(evaluation) + "\n")
    out.mkdir()
    seed0 = {"arm": "flow", "seed": 0, "curve": [{"step": 10, "kid": 9.0, "fid": 30.0}]}  # another session's runs
    records = {"protocol": {"scale": "tiny", "samples": fewstep.SCALES["tiny"]["samples"]}, "flow_curves": [seed0]}
    (out / "results.json").write_text(json.dumps(records))
    result = fewstep.main(
        ["--report-only", "--scale", "tiny", "--seeds", "1", "--flow-runs", str(runs), "--out", str(out)]
    )
    assert result["flow_curves"] == [
        seed0,
        {"arm": "flow", "seed": 1, "curve": [{"step": 10, "kid": 5.0, "fid": 20.0}]},
    ]


def test_fewstep_report_times_each_seed_against_its_own_flow_run_and_prints_the_notes():
    from experiments import fewstep

    def row(kind, seed, steps, seconds):
        return {
            "kind": kind, "seed": seed, "steps": steps, "kid": 1.0, "fid": 10.0, "precision": 0.8, "recall": 0.5,
            "seconds_per_image": seconds, "nfe": steps,
        }  # fmt: skip

    # seed 0 timed on a slower machine than seed 1 (flow 0.9 s against 0.2): the seconds mix machines, the ratios do not
    scores = [
        row("meanflow", 0, 1, 0.03),
        row("flow", 0, 25, 0.9),
        row("meanflow", 1, 1, 0.01),
        row("flow", 1, 25, 0.2),
    ]
    from experiments import fewstep_report

    assert fewstep_report.time_ratios({0: 0.03, 1: 0.01, 2: 0.5}, {0: 0.9, 1: 0.2}) == pytest.approx([1 / 30, 1 / 20])
    result = {
        "protocol": {"scale": "tiny", "samples": 8}, "training": {}, "sweep": [], "scores": scores, "caches": [],
        "notes": ["seed 0 ran elsewhere"],
    }  # fmt: skip
    text = fewstep.report(result)
    meanflow_line = next(line for line in text.splitlines() if line.startswith("| meanflow | 1 | 1 |"))
    assert meanflow_line.endswith(f"| {fewstep_report.fmt_values([1 / 30, 1 / 20], 3)} |")
    assert "Note: seed 0 ran elsewhere" in text


@pytest.mark.slow
@needs_data
def test_fewstep_study_trains_meanflow_scores_it_against_flow_and_caches_and_reports(tmp_path):
    from experiments.arms import train_arm
    from experiments.common import fashion_reference
    from experiments.fewstep import CACHES, MEANFLOW_STEPS, SCALES, main

    others = tmp_path / "others"  # the flow and DDPM runs the other studies train
    arms = {"flow": ("configs/fashion_mnist_moh_flow.yaml", []), "ddpm": ("configs/fashion_mnist_moh.yaml", [])}
    reference = fashion_reference(others, 200)
    for arm, seed in (("flow", 0), ("flow", 1), ("ddpm", 0)):
        train_arm(arm, seed, SCALES["tiny"], others, reference, arms)
    out = tmp_path / "out"
    args = ["--scale", "tiny", "--reference-count", "200", "--out", str(out)]
    result = main([*args, "--flow-runs", str(others / "runs"), "--ddpm-runs", str(others / "runs")])
    assert set(result["training"]) == {"meanflow-seed0", "meanflow-seed1"}  # the flow runs given are not retrained
    assert {(r["kind"], r["steps"], r["seed"]) for r in result["scores"]} == {
        *(("meanflow", s, seed) for s in MEANFLOW_STEPS for seed in (0, 1)),
        *(("flow", s, seed) for s in (25, 50) for seed in (0, 1)),
    }
    one_step = next(r for r in result["scores"] if (r["kind"], r["steps"]) == ("meanflow", 1))
    swept = [r for r in result["sweep"] if r["kind"] == "meanflow"]
    assert one_step["scale"] == min(swept, key=lambda r: r["kid"])["scale"]  # guided as it is best
    assert one_step["nfe"] == (1 if one_step["scale"] == 1.0 else 2)  # CFG on top: two evaluations per step
    assert {(r["kind"], r["steps"], r["cache"]) for r in result["caches"]} == {
        (k, s, c) for k in ("ddpm", "flow") for s in (25, 50) for c in CACHES
    }
    text = (out / "RESULTS.md").read_text()
    assert "## MeanFlow at 1, 2 and 4 steps" in text and "| flow | 25 | taylorseer |" in text
    assert (out / "kid_during_training.png").exists()


def test_distill_report_judges_the_goal_by_seed_from_the_records():
    """Students against their teachers, paired by seed: KID ratios, the recall gap and each distillation's whole cost
    (the student's passes, the teacher's evaluations, the trajectories; a cmt student's trajectory student's too)
    against the teacher's training; a goal met at some seeds says so."""
    from experiments.distill_report import costs, report

    def row(arm, seed, steps, kid, recall):
        return dict(arm=arm, seed=seed, steps=steps, kid=kid, recall=recall, fid=10.0, precision=0.8, nfe=steps,
                    seconds_per_image=0.01, kid_interval=[kid - 1, kid + 1])  # fmt: skip

    scores = [row("flow", s, 25, 2.0, 0.58) for s in (0, 1)]
    scores += [row("trajectory-flow", 0, 2, 2.4, 0.55), row("trajectory-flow", 1, 2, 2.6, 0.50)]  # 1.2x, 1.3x
    scores += [row("trajectory-flow", 0, 1, 3.0, 0.4), row("trajectory-flow", 1, 1, 5.0, 0.4)]  # 1.5x, 2.5x
    teacher = {"steps": 8300, "median_images_per_s": 100.0}  # 132,800 images: 398,400 evaluations, 1328 s
    student = {"steps": 1000, "median_images_per_s": 80.0, "student_images": 16000, "student_forwards": 48000,
               "teacher_evaluations": 10000, "trajectories": 1000, "trajectory_evaluations": 40000,
               "trajectory_seconds": 100.0}  # fmt: skip
    training = {f"flow-seed{s}": {"arm": "flow", "seed": s, **teacher} for s in (0, 1)}
    training |= {f"trajectory-flow-seed{s}": {"arm": "trajectory-flow", "seed": s, **student} for s in (0, 1)}
    training["cmt-flow-seed0"] = {"arm": "cmt-flow", "seed": 0, **student, "trajectories": 0, "trajectory_evaluations": 0,
                                  "trajectory_seconds": 0.0}  # fmt: skip
    result = {"protocol": {"scale": "cpu", "samples": 1000}, "training": training, "scores": scores}
    spent = costs(result, "trajectory", "flow")[0]
    assert spent["forwards"] == pytest.approx(98000 / 398400)
    assert spent["images"] == pytest.approx(17000 / 132800)
    assert spent["seconds"] == pytest.approx((200 + 100) / 1328)
    assert costs(result, "cmt", "flow")[0]["forwards"] == pytest.approx((98000 + 58000) / 398400)  # with its start
    text = report(result)
    assert "- 2 steps: KID 1.25 [" in text and "met at 1 of 2 seeds" in text
    assert "- 1 step: KID 2.00 [" in text
    assert "- 2 steps: recall -0.055 [" in text  # -0.03 and -0.08: within 0.05 at one seed
    assert "- cost: 0.25 [" in text
    assert "(goal <= 1; met at 2 of 2 seeds)" in text


def test_distill_cost_reads_the_teachers_evaluations_from_the_training_records(tmp_path):
    """The run's last record is its final evaluation, which has the images seen but not the teacher's count."""
    from experiments.distill_report import run_cost

    records = [{"step": 10, "samples_seen": 160, "teacher_evaluations": 300},
               {"step": 10, "kind": "evaluation", "kid": 3.0, "samples_seen": 160}]  # fmt: skip
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    cost = run_cost(tmp_path)
    assert cost["student_images"] == 160 and cost["teacher_evaluations"] == 300


@pytest.mark.parametrize(("method", "counted"), [("rcm", True), ("trajectory", True), ("dmd2", False)])
def test_a_runs_own_set_of_trajectories_is_counted_for_every_method_that_records_one(method, counted, tmp_path):
    """rCM records its own set as the trajectory method does: its cost goes into the run's (DMD2 without its
    regression records none)."""
    import yaml

    from experiments.distill_report import run_cost

    config = {"objective": {"name": "distill"}, "distill": {"method": method, "teacher": "runs/x"},
              "train": {"output_dir": str(tmp_path)}}  # fmt: skip
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "samples_seen": 16, "teacher_evaluations": 2}))
    (tmp_path / "trajectories").mkdir()
    manifest = {"cost": {"images": 1024, "evaluations": 51200, "seconds": 60.0}}
    (tmp_path / "trajectories" / "trajectories.json").write_text(json.dumps(manifest))
    assert run_cost(tmp_path).get("trajectory_evaluations") == (51200 if counted else None)


def test_distill_report_judges_dmd2_by_the_one_step_goal_and_sets_its_gan_term_beside_it():
    """DMD2's students are judged at one step (1.5x the teacher's KID, recall within 0.1), with their cost reported but
    not judged; the GAN arm sits beside the same student without it."""
    from experiments.distill_report import report

    def row(arm, steps, kid, recall):
        return dict(arm=arm, seed=0, steps=steps, kid=kid, recall=recall, fid=10.0, precision=0.8, nfe=steps,
                    seconds_per_image=0.01)  # fmt: skip

    scores = [row("flow", 25, 2.0, 0.58), row("dmd2-flow", 1, 2.8, 0.50), row("dmd2-flow", 2, 2.2, 0.55)]
    scores += [row("dmd2-flow-gan", 1, 3.5, 0.40), row("dmd2-flow-gan", 2, 2.4, 0.52)]
    result = {"protocol": {"scale": "cpu", "samples": 1000}, "training": {}, "scores": scores}
    text = report(result)
    assert "**dmd2** (the one step goal):" in text
    assert "- 1 step: KID 1.40 x the teacher's (goal <= 1.5x; met at 1 of 1 seeds)." in text
    assert "- 1 step: recall -0.080 from the teacher's (goal: within 0.1; met at 1 of 1 seeds)." in text
    assert "- 2 steps: KID" not in text  # the few-step goal is not DMD2's
    assert "| dmd2-flow | without | 2.8 | 2.2 | 0.5 | 0.55 |" in text
    assert "| dmd2-flow | with | 3.5 | 2.4 | 0.4 | 0.52 |" in text


def test_distill_one_seed_arms_run_at_other_seeds_when_named_and_report_seed_by_seed(tmp_path):
    """By default 0.5's recipe, the GAN term and the ablations run at seed 0 and every method at every seed; named
    with --arms, an ablation runs at the seeds given (to confirm it), and the report sets its seeds side by side with
    the student it changes."""
    import dataclasses

    from experiments import distill, distill_dmd2
    from experiments.distill_report import report

    arms = distill.student_arms(1, tmp_path, distill.SCALES["tiny"])
    assert {"meanflow-flow-l2-anchor", "meanflow-ddpm-anchor", "v05-ddpm", "dmd2t-flow-gan", "cmt-ddpm"} <= set(arms)
    assert "meanflow-ddpm-l2-grid" not in arms  # the other ablations change the flow twin's student only
    assert {"distill.anchor=1.0", "distill.loss=l2"} <= set(arms["meanflow-flow-l2-anchor"][1])
    assert "distill.teacher=" + str(tmp_path / "runs" / "flow-seed1") in arms["meanflow-flow-l2-anchor"][1]
    assert arms["meanflow-ddpm-anchor"][0] == "configs/fashion_mnist_moh_distill_ddpm.yaml"
    assert "distill.teacher=" + str(tmp_path / "runs" / "ddpm-seed1") in arms["meanflow-ddpm-anchor"][1]
    defaults = {arm for arm in arms if distill.selected(arm, 1, None)}
    methods = {f"{m}-{k}" for m in ("meanflow", "trajectory", "cmt", "dmd2", "dmd2t") for k in distill.KINDS}
    recipes = {f"dmd2f-{k}-g{distill_dmd2.RECIPE_SCALE[k]:g}" for k in distill.KINDS}
    assert "dmd2f-ddpm-g4" in recipes and "dmd2f-ddpm-g2" in arms  # the sampler's scale, and the short sweep's choice
    # the variety lever: the flow twin's full start with its real score below the sampler's scale, without the GAN term
    # (a one-seed arm: the default's r = 2 from the full start is its short sweep's choice, an arm already)
    variety = arms["dmd2f-flow-g2-nogan"][1]
    assert "distill.real_guidance=2.0" in variety and variety[-1] == "distill.gan_weight=0.0"
    assert "distill.student_from=" + str(tmp_path / "runs" / "trajectory-flow-seed1") in variety
    assert not distill.selected("dmd2f-flow-g2-nogan", 1, None) and "dmd2h-flow-g2-nogan" not in arms
    # the rest of the real score's sweep from the same start: none and 1.5 (one seed each)
    for scale in ("1", "1.5"):
        swept = arms[f"dmd2f-ddpm-g{scale}-nogan"][1]
        assert f"distill.real_guidance={float(scale)}" in swept and "distill.gan_weight=0.0" in swept
        assert "distill.student_from=" + str(tmp_path / "runs" / "trajectory-ddpm-seed1") in swept
    assert defaults == methods | recipes | {f"{r}-nogan" for r in recipes}
    assert all(distill.selected(arm, 0, None) for arm in arms)
    # a group at the study's seeds for it, an arm named alone at every seed given
    chosen = f"dmd2f-flow-g{distill_dmd2.RECIPE_SCALE['flow']:g}"  # the recipe's start and scale: at every seed
    named = distill.Named(["dmd2s-flow-g1", chosen])
    named.grouped = frozenset(named)
    assert distill.selected(chosen, 1, named) and not distill.selected("dmd2s-flow-g1", 1, named)
    assert distill.selected("dmd2s-flow-g1", 1, ["dmd2s-flow-g1"])
    assert not distill.selected("rcm-flow", 1, None) and distill.selected("rcm-flow", 0, None)  # the study's, at 0
    # DMD2 from the full trajectory student: the group trains that student first, at every seed (the recipe's stages
    # start from it), and its stage counts the student's cost; the short start at seed 0 only
    full = chosen
    assert distill_dmd2.start_of(full) == "trajectory-flow" and distill_dmd2.start_of("dmd2s-ddpm-g2") == "short-ddpm"
    assert "distill.student_from=" + str(tmp_path / "runs" / "trajectory-flow-seed1") in arms[full][1]
    assert "distill.gan_weight=0.0" in arms[f"{full}-nogan"][1] and distill_dmd2.budget_arm(full)
    group = distill.Named(distill.GROUPS["dmd2-study"](tmp_path, distill.SCALES["tiny"]))
    group.grouped = frozenset(group)
    assert {"trajectory-flow", "trajectory-ddpm", full, "short-flow"} <= set(group) and "cmt-flow" not in group
    assert "meanflow-flow" in group and not distill.selected("meanflow-flow", 1, group)  # dmd2m's start, at seed 0
    assert distill.selected("trajectory-flow", 1, group) and distill.selected(full, 1, group)
    assert not distill.selected("short-flow", 1, group) and not distill.selected("dmd2s-flow-g3", 1, group)
    assert not distill.selected("half-flow", 1, group) and distill.selected("half-flow", 0, group)
    # the dmd2 study's students scored at the goal's step counts, every other at 1, 2 and 4
    assert distill.scored_steps("dmd2s-flow-g2") == distill.scored_steps("short-ddpm") == (1, 2)
    assert distill.scored_steps("rcm-flow") == (1, 2) and distill.scored_steps("dmd2t-flow") == (1, 2, 4)
    # the variety lever's start: the full trajectory stage recorded at a lower guidance, and the recipe from it with the
    # sampler's scale put back by the real score (one seed)
    low = arms["low-flow"][1]
    assert low[:-1] == arms["trajectory-flow"][1] and low[-1] == "distill.guidance_scale=1.5"
    from_low = arms["dmd2l-ddpm-g4-nogan"][1]
    assert "distill.student_from=" + str(tmp_path / "runs" / "low-ddpm-seed1") in from_low
    assert {"distill.real_guidance=4.0", "distill.gan_weight=0.0"} <= set(from_low)
    assert distill_dmd2.start_of("dmd2l-ddpm-g4-nogan") == "low-ddpm" and distill.scored_steps("low-ddpm") == (1, 2)
    # and the start between (the flow twin's half lost KID): recorded at MID_SCALE, the same recipe from it
    assert arms["mid-flow"][1] == [*low[:-1], "distill.guidance_scale=2.0"] and arms["mid-ddpm"][1][-1].endswith("3.0")
    assert distill_dmd2.start_of("dmd2mid-flow-g3-nogan") == "mid-flow" and distill_dmd2.budget_arm(
        "dmd2mid-flow-g3-nogan"
    )
    assert arms["dmd2mid-flow-g3-nogan"][1] == [
        o.replace("low-flow-seed1", "mid-flow-seed1") for o in arms["dmd2l-flow-g3-nogan"][1]
    ]
    assert distill.scored_steps("mid-flow") == (1, 2) and distill.selected("mid-flow", 0, None)
    # the cheaper start: the full stage's steps on a quarter of its recorded set (at this scale's set of 8, 2), and the
    # recipe from it, whose length the budget sets after that start's smaller cost
    full_count = distill_dmd2.load_arm(*arms["trajectory-ddpm"]).distill.trajectory_count
    assert arms["few-ddpm"][1] == [*arms["trajectory-ddpm"][1], f"distill.trajectory_count={full_count // 4}"]
    assert distill_dmd2.start_of("dmd2few-ddpm-g4-nogan") == "few-ddpm" and distill_dmd2.budget_arm(
        "dmd2few-ddpm-g4-nogan"
    )
    assert arms["dmd2few-ddpm-g4-nogan"][1] == [
        o.replace("low-ddpm-seed1", "few-ddpm-seed1") for o in arms["dmd2l-ddpm-g4-nogan"][1]
    ]
    assert not distill_dmd2.budget_arm("few-ddpm") and distill.scored_steps("few-ddpm") == (1, 2)
    # the EMA's hold on the start (it steps once per generator update): the recipe and the cheaper start's recipe with
    # a longer EMA, every other setting theirs, the same length the budget sets (within it: not an -x4 arm)
    for recipe, decay in (("dmd2f-flow-g3-nogan", "0.998"), ("dmd2few-ddpm-g4-nogan", "0.999")):
        anchored = f"{recipe}-ema{decay[2:]}"
        assert arms[anchored] == (arms[recipe][0], [*arms[recipe][1], f"ema.decay={decay}"])
        assert distill_dmd2.load_arm(*arms[recipe]).ema.decay == 0.995  # the recipe's
        assert distill_dmd2.load_arm(*arms[anchored]).ema.decay == float(decay)
        assert (
            distill_dmd2.start_of(anchored) == distill_dmd2.start_of(recipe)
            and distill_dmd2.over_budget(anchored) == 1
        )
        assert distill_dmd2.budget_arm(anchored) and not distill.selected(anchored, 1, None)
    # the two levers together: the cheaper start recorded at the lower (middle) guidance, the recipe from it held by the
    # longer EMA; the recipe's own settings, only the start differs from the cheaper start's held recipe
    for start, scale in (("fewlow", distill_dmd2.LOW_SCALE), ("fewmid", distill_dmd2.MID_SCALE)):
        assert arms[f"{start}-ddpm"][1] == [*arms["few-ddpm"][1], f"distill.guidance_scale={scale['ddpm']}"]
        stage = {"fewlow": "dmd2fewl", "fewmid": "dmd2fewmid"}[start] + "-ddpm-g4-nogan-ema998"
        assert distill_dmd2.start_of(stage) == f"{start}-ddpm" and distill_dmd2.budget_arm(stage)
        assert arms[stage] == (
            arms["dmd2few-ddpm-g4-nogan-ema998"][0],
            [o.replace("few-ddpm-seed1", f"{start}-ddpm-seed1") for o in arms["dmd2few-ddpm-g4-nogan-ema998"][1]],
        )
        assert not distill_dmd2.budget_arm(f"{start}-ddpm") and distill.scored_steps(f"{start}-ddpm") == (1, 2)
        loaded = distill_dmd2.load_arm(*arms[f"{start}-ddpm"]).distill
        assert (loaded.trajectory_count, loaded.guidance_scale) == (full_count // 4, scale["ddpm"])
    # the two-step grid's middle: the recipe with only distill.dmd_midpoint changed, within the budget
    recipe = distill_dmd2.load_arm(*arms["dmd2f-flow-g3-nogan"]).distill
    for middle in distill_dmd2.MIDDLES:
        moved = distill_dmd2.load_arm(*arms[f"dmd2f-flow-g3-nogan-middle{middle:g}"]).distill
        assert recipe.dmd_midpoint == 0.5 and moved.dmd_midpoint == middle and moved != recipe
        assert vars(moved) | {"dmd_midpoint": 0.5} == vars(recipe)
        assert distill_dmd2.over_budget(f"dmd2f-flow-g3-nogan-middle{middle:g}") == 1
    assert "dmd2few-flow-g3-nogan-middle0.3" not in arms
    held = arms["dmd2f-ddpm-g4-nogan-ema99874-x4"]  # past the budget with the recipe's share of the start held
    assert held == (arms["dmd2f-ddpm-g4-nogan"][0], [*arms["dmd2f-ddpm-g4-nogan"][1], "ema.decay=0.99874"])
    assert distill_dmd2.over_budget("dmd2f-ddpm-g4-nogan-ema99874-x4") == 4 and 0.43 < 0.99874**652 < 0.45
    assert "dmd2few-ddpm-g4-nogan-ema99874-x4" not in arms
    # the references' pairing: the real score unguided, the GAN term at DMD2's ImageNet weight switched on late, from
    # the recipe's start; the same run four times as long past the budget
    late = distill_dmd2.load_arm(*arms["dmd2f-flow-g1-ganlate"]).distill
    assert (late.real_guidance, late.gan_weight, late.gan_start) == (1.0, 0.003, 200)
    assert (late.dmd_input, late.fake_updates, late.vsd_weight) == ("generator", 4, 1.0)
    assert distill_dmd2.start_of("dmd2f-flow-g1-ganlate") == "trajectory-flow"
    assert arms["dmd2f-flow-g1-ganlate"][1][:2] == arms["dmd2f-flow-g3-nogan"][1][:2]  # the same teacher and start
    assert arms["dmd2f-ddpm-g1-ganlate-x4"] == arms["dmd2f-ddpm-g1-ganlate"]
    guided = distill_dmd2.load_arm(*arms["dmd2f-ddpm-g4-ganlate"]).distill  # the same term at the recipe's scale
    assert (guided.real_guidance, guided.gan_weight, guided.gan_start) == (4.0, 0.003, 200)
    assert "dmd2f-ddpm-g4-ganlate-x4" not in arms
    low = distill_dmd2.load_arm(*arms["dmd2f-flow-g3-ganlow"]).distill  # its discriminator at low noise
    assert (low.real_guidance, low.gan_weight, low.gan_start, tuple(low.gan_time)) == (3.0, 0.003, 200, (0.02, 0.4))
    assert arms["dmd2f-flow-g1-ganlow"][1][:-2] == arms["dmd2f-flow-g1-ganlate"][1][:-1]  # only the times differ
    assert distill_dmd2.over_budget("dmd2f-ddpm-g1-ganlate-x4") == 4 and distill_dmd2.budget_arm(
        "dmd2f-ddpm-g1-ganlate"
    )
    # ECT from a start whose jumps cover every interval: the full stage on its own set, intervals drawn uniformly
    uni = arms["uni-ddpm"][1]
    assert uni[:-2] == arms["trajectory-ddpm"][1] and uni[-1] == "distill.grid_share=0.0"
    assert uni[-2] == "distill.trajectories=" + str(tmp_path / "runs" / "trajectory-ddpm-seed1" / "trajectories")
    assert "distill.student_from=" + str(tmp_path / "runs" / "uni-ddpm-seed1") in arms["ectu-ddpm"][1]
    assert arms["ectu-ddpm"][0] == arms["ect-ddpm"][0] and distill_dmd2.start_of("ectu-flow") == "uni-flow"
    assert distill_dmd2.budget_arm("ectu-flow") and not distill_dmd2.budget_arm("uni-flow")
    # and from the grid-trained start with ECT's curriculum on its step
    assert arms["ectc-flow"][1][:3] == arms["ect-flow"][1] and distill_dmd2.start_of("ectc-flow") == "trajectory-flow"
    assert arms["ectc-flow"][1][3:] == ["distill.ect_dt_start=0.25", "distill.ect_dt_every=100"]
    # and with its own intervals drawn uniformly (the measured arms name the grid share they were measured with)
    assert arms["ect-flow"][1][-1] == "distill.grid_share=0.9" and distill_dmd2.budget_arm("ect-flow-uniform")
    assert arms["ect-flow-uniform"][1] == [*arms["ect-flow"][1][:2], "distill.grid_share=0.0"]
    assert distill_dmd2.start_of("ect-flow-uniform") == "trajectory-flow"
    assert not distill.selected("dmd2l-flow-g3-nogan", 1, None) and distill.selected("low-flow", 0, None)
    # the recipe from the MeanFlow-distilled student (the start level with its teacher at four steps)
    assert "distill.student_from=" + str(tmp_path / "runs" / "meanflow-flow-seed1") in arms["dmd2m-flow-g3-nogan"][1]
    assert distill_dmd2.start_of("dmd2m-flow-g3-nogan") == "meanflow-flow"
    # CMT's own second stage: the full trajectory student post-trained by ECT, for what the budget leaves after it
    assert arms["ect-ddpm"][0] == "configs/fashion_mnist_moh_ect_ddpm.yaml" and distill_dmd2.budget_arm("ect-ddpm")
    assert "distill.student_from=" + str(tmp_path / "runs" / "trajectory-ddpm-seed1") in arms["ect-ddpm"][1]
    assert distill_dmd2.start_of("ect-ddpm") == "trajectory-ddpm" and not distill.selected("ect-flow", 1, None)
    # ECT from the cheaper start for half of what it leaves, then DMD2 from that student (trained after it)
    assert arms["ectfew-ddpm"][1][1:] == [
        f"distill.student_from={tmp_path / 'runs' / 'few-ddpm-seed1'}",
        "distill.grid_share=0.0",
    ]
    assert (
        distill_dmd2.start_of("dmd2ecf-ddpm-g4-nogan-ema998") == "ectfew-ddpm"
        and distill_dmd2.start_of("ectfew-ddpm") == "few-ddpm"
    )
    assert (
        list(arms).index("ectfew-ddpm")
        < list(arms).index("dmd2ecf-ddpm-g4-nogan")
        < list(arms).index("dmd2ecf-ddpm-g4-nogan-ema998")
    )
    assert (
        arms["dmd2ecf-ddpm-g4-nogan"][1][2:] == arms["dmd2few-ddpm-g4-nogan"][1][2:]
    )  # the recipe the cheaper start had
    # ECT's variants from the cheaper start (a third of the rate, a longer fixed step), each with DMD2 from it: the
    # same stage with one setting changed, the same share of the budget, and DMD2 started from that variant's student
    for tail, change in (("lr", "optim.lr=3e-05"), ("dt", "distill.ect_dt=0.05")):
        assert arms[f"ectfew{tail}-ddpm"] == (arms["ectfew-ddpm"][0], [*arms["ectfew-ddpm"][1], change])
        assert distill_dmd2.start_of(f"ectfew{tail}-ddpm") == "few-ddpm" and distill_dmd2.budget_share(f"ectfew{tail}-ddpm") == 0.5  # fmt: skip
        dmd2 = f"dmd2ecf{tail}-ddpm-g4-nogan-ema998"
        assert distill_dmd2.start_of(dmd2) == f"ectfew{tail}-ddpm" and distill_dmd2.budget_arm(dmd2)
        started = f"distill.student_from={tmp_path / 'runs' / f'ectfew{tail}-ddpm-seed1'}"
        assert arms[dmd2][1] == [arms["dmd2ecf-ddpm-g4-nogan-ema998"][1][0], started, *arms["dmd2ecf-ddpm-g4-nogan-ema998"][1][2:]]  # fmt: skip
        assert list(arms).index(f"ectfew{tail}-ddpm") < list(arms).index(dmd2)
    # the budget's split: the step 0.05's stage with a quarter or three quarters of what the cheaper start leaves
    for tail, share in (("dts25", 0.25), ("dts75", 0.75)):
        assert arms[f"ectfew{tail}-flow"] == arms["ectfewdt-flow"] and distill_dmd2.budget_share(f"ectfew{tail}-flow") == share  # fmt: skip
        dmd2 = f"dmd2ecf{tail}-flow-g3-nogan"
        assert distill_dmd2.start_of(dmd2) == f"ectfew{tail}-flow" and distill_dmd2.budget_share(dmd2) == 1
        assert [o for o in arms[dmd2][1] if "student_from" not in o] == [o for o in arms["dmd2ecfdt-flow-g3-nogan"][1] if "student_from" not in o]  # fmt: skip
    # the cheaper start on every interval (only its draws of intervals differ), ECT at the step 0.05 from it, DMD2 from that
    assert arms["fewuni-ddpm"] == (arms["few-ddpm"][0], [*arms["few-ddpm"][1], "distill.grid_share=0.0"])
    assert distill_dmd2.load_arm(*arms["fewuni-ddpm"]).distill.grid_share == 0 < distill_dmd2.load_arm(*arms["few-ddpm"]).distill.grid_share  # fmt: skip
    assert not distill_dmd2.budget_arm("fewuni-ddpm") and distill_dmd2.start_of("fewuni-ddpm") is None
    started = f"distill.student_from={tmp_path / 'runs' / 'fewuni-ddpm-seed1'}"
    assert arms["ectfewuni-ddpm"][1] == [arms["ectfewdt-ddpm"][1][0], started, *arms["ectfewdt-ddpm"][1][2:]]
    dmd2 = "dmd2ecfuni-ddpm-g4-nogan-ema998"
    assert distill_dmd2.start_of(dmd2) == "ectfewuni-ddpm" and distill_dmd2.start_of("ectfewuni-ddpm") == "fewuni-ddpm"
    order = list(arms)
    assert order.index("fewuni-ddpm") < order.index("ectfewuni-ddpm") < order.index(dmd2)
    assert arms["ectfewuni01-ddpm"][1] == [*arms["ectfewuni-ddpm"][1][:-1], "distill.ect_dt=0.01"]  # ECT's own step
    assert distill_dmd2.load_arm(*arms["ectfewuni01-ddpm"]).distill.ect_dt == 0.01
    # SiD's loss in place of VSD from ECT's start: DMD2's best arm there with the method alone changed, its own stage
    # within the budget; its variants one setting each (`-x4` past the budget)
    for kind, ema in (("flow-g3", ""), ("ddpm-g4", "-ema998")):  # each teacher's chain config's arm
        sid, dmd2 = f"sidecfdt-{kind}-nogan{ema}", f"dmd2ecfdt-{kind}-nogan{ema}"
        assert arms[sid] == (arms[dmd2][0], [*arms[dmd2][1], "distill.method=sid", "distill.sid_alpha=1.2"])
    assert distill_dmd2.load_arm(*arms[sid]).distill.method == "sid"
    assert distill_dmd2.start_of(sid) == "ectfewdt-ddpm" and distill_dmd2.budget_arm(sid)
    assert distill_dmd2.budget_share(sid) == 1 and distill_dmd2.over_budget(sid) == 1
    assert arms[f"{sid}-f1"][1] == [*arms[sid][1], "distill.fake_updates=1"]
    assert arms[f"{sid}-lr3e-4"][1] == [*arms[sid][1], "optim.lr=0.0003"]
    assert arms[f"{sid}-lr3e-4-alpha0.5"][1] == [*arms[sid][1], "optim.lr=0.0003", "distill.sid_alpha=0.5"]
    assert distill_dmd2.load_arm(*arms[f"{sid}-lr3e-4-alpha0.5"]).distill.sid_alpha == 0.5
    below = distill_dmd2.load_arm(*arms[f"{sid}-lr3e-4-alpha1-real1.5"]).distill  # the real score's own scale
    assert (below.real_guidance, below.sid_alpha, below.method) == (1.5, 1.0, "sid")
    assert distill_dmd2.load_arm(*arms[f"{sid}-lr3e-4-alpha1-real5"]).distill.real_guidance == 5.0  # above it
    for past in (6.0, 8.0, 12.0):  # past a third more
        assert distill_dmd2.load_arm(*arms[f"{sid}-lr3e-4-alpha1-real{past:g}"]).distill.real_guidance == past
    assert arms[f"{sid}-alpha1"][1] == [*arms[sid][1], "distill.sid_alpha=1.0"]  # at the recipe's rate
    assert arms[f"{sid}-alpha1-real5"][1] == [*arms[f"{sid}-alpha1"][1], "distill.real_guidance=5.0"]
    for beyond in (16.0, 24.0):  # the default's past 12, at three times the rate
        assert distill_dmd2.load_arm(*arms[f"{sid}-lr3e-4-alpha1-real{beyond:g}"]).distill.real_guidance == beyond
    for above in (6.0, 8.0, 12.0, 16.0):  # the flow twin's past 5, at the recipe's rate
        assert arms[f"{sid}-alpha1-real{above:g}"][1] == [*arms[f"{sid}-alpha1"][1], f"distill.real_guidance={above}"]
    for name in ONE_STEP_ARMS:  # one step alone
        assert arms[f"{sid}-{name}-one"][1] == [*arms[f"{sid}-{name}"][1], "distill.dmd_steps=[1]"]
        alone, both = (distill_dmd2.load_arm(*arms[f"{sid}-{name}{tail}"]).distill for tail in ("-one", ""))
        assert (tuple(alone.dmd_steps), tuple(both.dmd_steps)) == ((1,), (1, 2))
        assert dataclasses.replace(alone, dmd_steps=both.dmd_steps) == both
        assert distill_dmd2.budget_arm(f"{sid}-{name}-one") and distill_dmd2.budget_share(f"{sid}-{name}-one") == 1
    fewer = f"{sid}-lr3e-4-alpha1-real16-one-f3"  # one step alone with three fake-score updates per generator update
    assert arms[fewer][1] == [*arms[f"{sid}-lr3e-4-alpha1-real16-one"][1], "distill.fake_updates=3"]
    assert distill_dmd2.budget_arm(fewer) and distill_dmd2.load_arm(*arms[fewer]).distill.fake_updates == 3
    for name, scale in LATER_SCALES:  # the later step's own real-score scale, the first's kept
        later = distill_dmd2.load_arm(*arms[f"{sid}-{name}-later{scale:g}"]).distill
        assert later.real_guidance_later == scale and tuple(later.dmd_steps) == (1, 2)
        assert (
            dataclasses.replace(later, real_guidance_later=None)
            == distill_dmd2.load_arm(*arms[f"{sid}-{name}"]).distill
        )
        assert distill_dmd2.budget_arm(f"{sid}-{name}-later{scale:g}")
    for name in ("alpha1-real8", "lr3e-4-alpha1-real16"):  # a quarter of the samples at the middle
        shared, both = (distill_dmd2.load_arm(*arms[f"{sid}-{name}{tail}"]) for tail in ("-first75", ""))
        assert (
            shared.distill.dmd_first_share == 0.75
            and dataclasses.replace(shared.distill, dmd_first_share=None) == both.distill
        )
        cheaper, dearer = (distill_dmd2.counted_objective(loaded).step_forwards(0) for loaded in (shared, both))
        assert cheaper == dearer - 0.25  # a quarter less backward simulation: more steps in the same budget
        assert distill_dmd2.budget_arm(f"{sid}-{name}-first75")
    assert distill_dmd2.load_arm(*arms[sid]).distill.real_guidance == 4.0  # the sampler's, as the arm's name says
    few = "sidfew-ddpm-g4-nogan-ema998-lr3e-4-alpha1"  # from the cheaper start, without ECT
    assert arms[few][1] == [*arms["dmd2few-ddpm-g4-nogan-ema998"][1], "distill.method=sid", "distill.sid_alpha=1.2", "optim.lr=0.0003", "distill.sid_alpha=1.0"]  # fmt: skip
    assert distill_dmd2.start_of(few) == "few-ddpm" and distill_dmd2.budget_arm(few)
    quarter = "sidecfdts25-ddpm-g4-nogan-ema998-lr3e-4-alpha1"  # after a quarter to ECT
    assert distill_dmd2.start_of(quarter) == "ectfewdts25-ddpm" and distill_dmd2.budget_share(quarter) == 1
    late = distill_dmd2.load_arm(*arms["sidecfdt-ddpm-g4-ema998-ganlate"]).distill  # SiDA's pairing
    assert (late.method, late.gan_weight, late.gan_start) == (
        "sid",
        0.003,
        200,
    ) and "sidecfdt-ddpm-g4-nogan-ema998-ganlate" not in arms
    assert arms[f"{sid}-x4"] == arms[sid] and distill_dmd2.over_budget(f"{sid}-x4") == 4
    assert list(arms).index("ectfewdt-ddpm") < list(arms).index(sid)
    # DMD2 from ECT's start at a lower real-score scale than the recipe's (the recall ECT adds)
    lower = arms["dmd2ecf-flow-g2-nogan"][1]
    assert "distill.real_guidance=2.0" in lower and "distill.gan_weight=0.0" in lower
    assert [o for o in lower if "real_guidance" not in o] == [
        o for o in arms["dmd2ecf-flow-g3-nogan"][1] if "real_guidance" not in o
    ]
    # the smoke scale: its own few arms, one of each kind of run
    smoke = distill.SCALES["tiny"]
    assert {a for a in arms if distill.selected(a, 0, None, smoke)} == set(smoke["arms"]) and smoke["seeds"] == (0,)
    assert distill.selected("meanflow-flow-l2-anchor", 2, ["meanflow-flow-l2-anchor"])
    assert not distill.selected("meanflow-flow", 2, ["meanflow-flow-l2-anchor"])
    with pytest.raises(SystemExit):
        distill.main(["--scale", "tiny", "--out", str(tmp_path), "--arms", "meanflow-flow-anchr"])
    assert not (tmp_path / "results.json").exists()  # refused before anything is written

    def row(arm, seed, steps, kid):
        return dict(
            arm=arm, seed=seed, steps=steps, kid=kid, recall=0.1 * (seed + 1), fid=1.0, precision=0.5, nfe=steps
        )

    scores = [row(a, s, n, k + s + n / 10) for a, k in (("meanflow-flow", 30), ("meanflow-flow-l2-anchor", 20))
              for s in (0, 1) for n in (1, 2, 4)]  # fmt: skip
    scores += [
        row(a, 2, n, k + n / 10) for a, k in (("meanflow-ddpm", 40), ("meanflow-ddpm-anchor", 50)) for n in (1, 2, 4)
    ]
    training = {f"meanflow-flow-l2-anchor-seed{s}": {"arm": "meanflow-flow-l2-anchor", "seed": s} for s in (0, 1)}
    training["meanflow-ddpm-anchor-seed2"] = {"arm": "meanflow-ddpm-anchor", "seed": 2}
    text = report({"protocol": {"scale": "cpu", "samples": 1000}, "training": training, "scores": scores})
    assert (
        "## Ablations: the meanflow student of the flow twin with one stabiliser changed, seed by seed (0, 1)" in text
    )
    assert "| meanflow-flow | 30.10 / 31.10 | 30.20 / 31.20 | 30.40 / 31.40 | 0.100 / 0.200 |" in text
    assert "| meanflow-flow-l2-anchor | 20.10 / 21.10 | 20.20 / 21.20 | 20.40 / 21.40 | 0.100 / 0.200 |" in text
    assert "the embedded default (DDPM) with one stabiliser changed, seed by seed (2)" in text  # each teacher its own
    assert "| meanflow-ddpm-anchor | 50.10 | 50.20 | 50.40 | 0.300 |" in text
    training["meanflow-flow-no-clamp-seed2"] = {"arm": "meanflow-flow-no-clamp", "seed": 2, "diverged": "loss nan"}
    text = report({"protocol": {"scale": "cpu", "samples": 1000}, "training": training, "scores": scores})
    assert "| meanflow-flow-no-clamp | diverged (seed 2: loss nan) |||||" in text  # a run without scores is shown


def test_distill_score_part_alone_skips_what_is_not_trained_yet(tmp_path, monkeypatch):
    """`--part score` on a folder whose runs are still training (none finished, no teacher of a seed yet) scores
    nothing, draws no grid and still writes the report: the scoring context reaches the parts under the names they
    read."""
    import experiments.common as common
    from experiments import distill

    monkeypatch.setattr(common, "start_scoring", lambda args: (Path(args.out), tmp_path / "reference.npz", None))
    result = distill.main(["--scale", "tiny", "--out", str(tmp_path), "--part", "score", "--seeds", "0", "2"])
    assert result["scores"] == [] and not list(tmp_path.glob("grid_*.png"))
    assert (tmp_path / "RESULTS.md").is_file()


def test_distill_scores_a_two_step_generator_with_its_starts_first_jump_apart_and_pairs_it_in_the_report(
    tmp_path, monkeypatch
):
    """A dmd2 study arm with a start is scored at two steps with the start's pipeline leading (a row of its own in
    ``handoff``, never over the arm's own), once; an arm from the teacher, or whose start is not trained, is not; the
    report pairs the hand-off with the generator alone by seed and reads it against the goal."""
    from experiments import distill
    from experiments.distill_dmd2_report import _handoff_lines

    calls = []
    monkeypatch.setattr(distill, "score_model", lambda model, name, *a, lead=None, **k: calls.append((name, lead)) or {"kid": 2.0, "recall": 0.4})  # fmt: skip
    monkeypatch.setattr(distill, "save", lambda out, result: None)
    ctx, result = {"out": tmp_path, "samples": 5000}, {"training": {}, "scores": []}
    arm = "sidecfdt-flow-g3-nogan-alpha1-real8-b4"
    distill._score_handoff(result, ctx, arm, 0)  # its start is not trained (yet)
    (tmp_path / "runs" / "ectfewdt-flow-seed0" / "pipeline").mkdir(parents=True)
    for name in (arm, arm, "dmd2g-flow", "meanflow-flow"):  # the second time: recorded, not redone
        distill._score_handoff(result, ctx, name, 0)
    assert calls == [(f"{arm}-seed0", tmp_path / "runs" / "ectfewdt-flow-seed0" / "pipeline")]
    assert result["handoff"] == [{"arm": arm, "seed": 0, "steps": 2, "scale": 1.0, "samples": 5000,
                                  "lead": "ectfewdt-flow", "scheduler": "meanflow", "kid": 2.0, "recall": 0.4}]  # fmt: skip
    assert result["scores"] == []
    result = {"protocol": {"samples": 5000}, "scores": [
        *({"arm": arm, "seed": s, "steps": 2, "samples": 5000, "kid": k, "recall": 0.30} for s, k in ((0, 2.6), (1, 3.0))),
        *({"arm": "flow", "seed": s, "steps": 25, "samples": 5000, "kid": k, "recall": 0.50} for s, k in ((0, 2.0), (1, 2.0)))],
        "handoff": [{"arm": arm, "seed": s, "steps": 2, "samples": 5000, "kid": k, "recall": 0.48, "lead": "ectfewdt-flow"}
                    for s, k in ((0, 2.2), (1, 2.8))]}  # fmt: skip
    lines = _handoff_lines(result, "flow")
    assert (
        "| ectfewdt-flow's first jump, then its second | 2.20 | 2.80 | 2.50 [-1.31, 6.31] | -0.30 [-1.57, 0.97] |"
        in lines
    )
    assert (
        "| ectfewdt-flow's first jump, then its second | 0.480 | 0.480 | 0.480 [0.480, 0.480] | 0.180 [0.180, 0.180] |"
        in lines
    )
    # 1.1x and 1.4x the teacher, recall 0.02 below it: met at seed 0 only
    assert any(
        line.startswith("- With the hand-off: 1.25 [") and line.endswith("met at 1 of 2 seeds.") for line in lines
    )
    assert _handoff_lines(result, "ddpm") == []


def test_the_report_sets_a_generator_trained_for_the_hand_off_beside_its_arm_alone_and_in_the_hand_off():
    """A ``-lead`` arm (its middle trained on the start's first jump) and the arm it varies, each alone and in the
    hand-off, by seed, the differences paired against the arm's own hand-off."""
    from experiments.distill_dmd2_report import _trained_for_lead_lines

    arm, lead = "sidecfdt-flow-g3-nogan-alpha1-real8-b4", "sidecfdt-flow-g3-nogan-alpha1-real8-b4-lead"
    rows = [{"arm": a, "seed": s, "steps": 2, "samples": 5000, "kid": k, "recall": 0.3}
            for a, ks in ((arm, (2.6, 3.0)), (lead, (2.5, 2.9))) for s, k in enumerate(ks)]  # fmt: skip
    led = [{"arm": a, "seed": s, "steps": 2, "samples": 5000, "kid": k, "recall": r, "lead": "ectfewdt-flow"}
           for a, ks, r in ((arm, (2.2, 2.8), 0.40), (lead, (2.0, 2.4), 0.45)) for s, k in enumerate(ks)]  # fmt: skip
    lines = _trained_for_lead_lines(rows, led)
    assert lines[0] == f"Trained for the hand-off (`{lead}`) against `{arm}`:"
    assert "| the arm | hand-off | 2.20 | 2.80 | 2.50 [-1.31, 6.31] |  |" in lines
    assert "| trained for it | hand-off | 2.00 | 2.40 | 2.20 [-0.34, 4.74] | -0.30 [-1.57, 0.97] |" in lines
    assert "| trained for it | hand-off | 0.450 | 0.450 | 0.450 [0.450, 0.450] | 0.050 [0.050, 0.050] |" in lines
    assert "| the arm | alone | 2.60 | 3.00 | 2.80 [0.26, 5.34] | 0.30 [-0.97, 1.57] |" in lines
    assert _trained_for_lead_lines(rows, [r for r in led if r["arm"] == lead]) == []  # the arm's hand-off not scored
    middle = [dict(r, arm=r["arm"] + "-middle0.3") for r in led if r["arm"] == lead]  # a variant of the lead arm
    assert f"Trained for the hand-off (`{lead}-middle0.3`) against `{arm}`:" in _trained_for_lead_lines(
        rows, led + middle
    )


def test_a_hand_off_counts_the_leads_network_evaluations_with_the_models(tmp_path):
    from experiments.arms import counted_evaluations
    from moh_dit.sampling.spec import SamplingSpec
    from tests.helpers.factories import tiny_model, tiny_pipeline

    meanflow = {"name": "meanflow", "guidance_scale": 1.0, "guidance_mix": 0.0, "guidance_times": [0.0, 1.0]}
    for name, seed in (("main", 0), ("lead", 1)):
        model = tiny_model(signal=0.1, learn_sigma=False, objective=meanflow, time_inputs=2, seed=seed)
        tiny_pipeline(model, scheduler="meanflow").save(tmp_path / name, {"kind": "test"})
    spec = SamplingSpec.create("meanflow", 3, 1.0)
    assert counted_evaluations(tmp_path / "main", spec, "meanflow") == 3
    led = spec.replace(lead_model=str(tmp_path / "lead"), lead_steps=2)
    assert counted_evaluations(tmp_path / "main", led, "meanflow") == 3  # two by the lead, one by the model


@pytest.mark.slow
@needs_data
def test_distill_study_trains_teachers_and_students_scores_them_and_reports(tmp_path):
    """The whole study at the tiny scale, its smoke run: the teachers, one student of each kind of run (each method, a
    stage started from another, a DMD2 stage as long as its budget, an ablation), every student at 1, 2, 4 steps and
    every teacher at 25; the students' curves hold their 2-step scores, each student its cost; grids drawn."""
    from experiments import distill

    result = distill.main(["--scale", "tiny", "--out", str(tmp_path)])
    arms = {(r["arm"], r["seed"]) for r in result["training"].values()}
    assert arms == {(a, 0) for a in ("flow", "ddpm", *distill.SCALES["tiny"]["arms"])}
    students = [r for r in result["training"].values() if "-" in r["arm"]]
    assert all("kid@2" in p for r in students for p in r["curve"])
    assert all(r["student_images"] > 0 and r["teacher_evaluations"] > 0 for r in students if "diverged" not in r)
    assert all(r["trajectory_evaluations"] > 0 for r in students if r["arm"].startswith(("trajectory", "short")))
    assert result["training"]["dmd2s-flow-g2-seed0"]["generator_updates"] > 0  # counted and kept
    scored = {(r["arm"], r["seed"], r["steps"]) for r in result["scores"]}
    assert {("trajectory-ddpm", 0, n) for n in (1, 2, 4)} | {("flow", 0, 25), ("cmt-ddpm", 0, 4)} <= scored
    manifest = json.loads((tmp_path / "runs" / "trajectory-ddpm-seed0" / "manifest.json").read_text())
    assert manifest["identity"]["frozen"]["teacher"]["sha256"]
    text = (tmp_path / "RESULTS.md").read_text()
    assert "## the flow twin: students at 1, 2 and 4 steps" in text and "Against the goal" in text
    assert "## DMD2 as its references train it" in text and "KID against what the distillation cost" in text
    assert (tmp_path / "grid_meanflow-flow_1step.png").is_file() and (tmp_path / "distill_kid.png").is_file()
    assert (tmp_path / "distill_cost.png").is_file()
    # the DMD2 stage from the short start, also with the start's first jump: a row of its own, both networks counted
    led = next(r for r in result["handoff"] if r["arm"] == "dmd2s-flow-g2")
    assert led["lead"] == "short-flow" and led["nfe"] == 2 and "a hand-off" in text


def test_each_studys_tiny_scale_needs_no_flag_the_docs_do_not_show(tmp_path, monkeypatch):
    """The smoke runs run as written: the guidance study's quarter guide is a checkpoint its tiny runs keep; the
    few-step study's tiny scale trains its own flow twin; at the real scale a missing --flow-runs is said before
    any training."""
    from experiments import fewstep, guidance
    from experiments.common import smoke_run

    tiny = guidance.SCALES["tiny"]
    steps = next(int(o.split("=")[1]) for o in tiny["overrides"] if o.startswith("train.max_steps="))
    every = next(int(o.split("=")[1]) for o in smoke_run() if o.startswith("train.checkpoint_every="))
    assert 0 < tiny["quarter"] <= steps and tiny["quarter"] % every == 0
    assert guidance.SCALES["cpu"]["quarter"] == guidance.QUARTER

    trained = []
    monkeypatch.setattr(fewstep, "train_arm", lambda arm, seed, *rest: trained.append((arm, seed)) or {})
    monkeypatch.setattr(fewstep, "save", lambda out, result: None)
    fewstep.part_train(fewstep.SCALES["tiny"], tmp_path, None, (0,), {"training": {}})
    assert trained == [("meanflow", 0), ("flow", 0)]
    trained.clear()
    fewstep.part_train(fewstep.SCALES["cpu"], tmp_path, None, (0,), {"training": {}})
    assert trained == [("meanflow", 0)]  # the backbone study's flow arm is passed, not retrained
    with pytest.raises(SystemExit):
        fewstep.main(["--part", "score", "--scale", "cpu", "--out", str(tmp_path / "x")])
    assert not (tmp_path / "x").exists()  # refused before anything was written


def test_a_report_only_run_leaves_the_committed_records_as_they_are(tmp_path):
    """Every committed results.json is byte for byte what a study writes, and unchanged records are not rewritten:
    ``--report-only`` does not dirty a checkout."""
    import time

    from experiments.report import save_results
    from moh_dit.files import json_text

    for path in (Path(__file__).resolve().parents[1] / "experiments" / "results").glob("*/results.json"):
        assert json_text(json.loads(path.read_text())) == path.read_text(), path
    save_results(tmp_path, {"a": 1}, "# report\n")
    before = {p.name: p.stat().st_mtime_ns for p in tmp_path.iterdir()}
    time.sleep(0.01)
    save_results(tmp_path, {"a": 1}, "# report\n")
    assert {p.name: p.stat().st_mtime_ns for p in tmp_path.iterdir()} == before
    save_results(tmp_path, {"a": 2}, "# report\n")
    assert json.loads((tmp_path / "results.json").read_text()) == {"a": 2}


def test_the_efficiency_study_reports_each_arm_against_its_full_budget_run():
    from experiments import efficiency

    result = {
        "training": {
            "tread-short-seed0": {"arm": "tread-short", "seed": 0, "steps": 2490, "median_images_per_s": 83.0,
                                  "curve": [{"step": 830, "kid": 30.0}, {"step": 2490, "kid": 12.5}]},
        },
        "scores": [{"arm": "tread-short", "seed": 0, "kid": 11.0, "nfe": 25}],
        "full_budget": {
            "training": {"flow-seed0": {"arm": "flow", "seed": 0, "curve": [{"step": 8300, "kid": 9.0}]}},
            "scores": [{"arm": "flow", "seed": 0, "kid": 1.8, "nfe": 50}],
        },
    }  # fmt: skip
    row = next(line for line in efficiency.report(result).splitlines() if line.startswith("| tread-short"))
    assert row == (
        "| tread-short | 0 | 2490 | 83.0 | 8.0 | 830: 30.0, 2490: 12.5 | 11.00 (25) | flow: 9.00 at 8300, 1.80 (50) |"
    )
    tables = set(efficiency.BASELINES) | set(efficiency.SAMPLERS)
    full_budget = {"ddpm", "flow"}  # the distillation study's runs
    assert tables | set(efficiency.FOLDED) | set(efficiency.FOLDED.values()) <= set(efficiency.ARMS) | full_budget
    assert efficiency.SAMPLERS.get("xpred-p7-short", "euler") == "euler"


def test_the_efficiency_study_sets_folded_guidance_against_cfg_on_the_same_budget():
    from experiments import efficiency

    def row(arm, scale, nfe, kid):
        return {"arm": arm, "seed": 1, "scale": scale, "nfe": nfe, "kid": kid, "fid": 50.0, "precision": 0.7,
                "recall": 0.3, "seconds_per_image": 0.1}  # fmt: skip

    rows = [row("flow-short", 1.0, 43, 30.0), row("flow-short", 4.0, 59, 12.0), row("mg-flow-short", 1.0, 43, 20.0)]
    table = efficiency.guidance_table({"scores": rows})
    assert table[-2:] == [
        "| mg-flow-short | 1 | folded | 43 | 20.00 | 50.0 | 0.70 | 0.30 | 0.100 |",
        "| flow-short | 1 | CFG 4 | 59 | 12.00 | 50.0 | 0.70 | 0.30 | 0.100 |",
    ]  # the plain arm's unguided row is not its CFG baseline
    full = {"scores": [row("mg-full", 1.0, 31, 5.0)], "full_budget": {"scores": [row("ddpm", 4.0, 41, 3.0)]}}
    assert efficiency.guidance_table(full)[-1] == "| ddpm | 1 | CFG 4 | 41 | 3.00 | 50.0 | 0.70 | 0.30 | 0.100 |"


def test_the_efficiency_study_trains_and_scores_only_the_arms_asked_for(tmp_path, monkeypatch):
    from experiments import efficiency

    trained = []
    monkeypatch.setattr(efficiency, "train_arm", lambda arm, seed, *rest: trained.append((arm, seed)) or {})
    monkeypatch.setattr(efficiency, "save", lambda out, result: None)
    efficiency.part_train(efficiency.SCALES["tiny"], tmp_path, None, (1, 2), {"training": {}}, ["tread-short"])
    assert trained == [("tread-short", 1), ("tread-short", 2)]
    with pytest.raises(SystemExit):
        efficiency.main(["--arms", "no-such-arm", "--out", str(tmp_path / "x")])


def test_a_full_budget_arm_trains_on_the_configs_own_steps_and_the_full_budget_evaluations():
    from experiments import efficiency
    from experiments.arms import STUDY_SCALES

    cpu = efficiency.SCALES["cpu"]
    assert f"train.max_steps={efficiency.SHORT}" in efficiency.arm_scale(cpu, "mg-short")["overrides"]
    full = efficiency.arm_scale(cpu, "mg-full")
    assert full["overrides"] == [] and full["eval"] == STUDY_SCALES["cpu"]["eval"]
    assert full["samples"] == cpu["samples"] and full["bootstrap"] == cpu["bootstrap"]
    tiny = efficiency.SCALES["tiny"]
    assert efficiency.arm_scale(tiny, "mg-full") == tiny == efficiency.arm_scale(tiny, "mg-short")


def test_an_equal_time_arm_trains_the_plain_recipe_for_its_routed_runs_time_and_is_paired_with_it():
    from experiments import efficiency

    cpu, tiny = efficiency.SCALES["cpu"], efficiency.SCALES["tiny"]
    for arm, (routed, steps) in efficiency.EQUAL_TIME.items():
        assert efficiency.ARMS[arm] == efficiency.ARMS[routed.replace("-tread", "")]  # the plain recipe
        assert efficiency.arm_scale(cpu, arm)["overrides"] == [f"train.max_steps={steps}"]
        assert efficiency.arm_scale(tiny, arm) == tiny  # the tiny scale keeps its own budget
    # the routed run's 2490 steps over the routed/plain images/s of the committed idle benchmark, as its table shows them
    bench = json.loads(
        (
            Path(__file__).parents[1] / "benchmarks/results/config_throughput_cpu_efficiency_modern_idle.json"
        ).read_text()
    )
    speed = {row["name"]: row["images_per_s"] for row in bench["rows"]}
    for arm, plain, routed in (
        ("modern-time", "fashion_mnist_moh_modern", "modern_tread"),
        ("dit-modern-time", "dit_modern", "dit_modern_tread"),
    ):
        assert efficiency.EQUAL_TIME[arm][1] == round(
            efficiency.SHORT / (round(speed[routed], 1) / round(speed[plain], 1))
        )

    def run(arm, seed, steps, kid):
        return {"arm": arm, "seed": seed, "steps": steps, "curve": [{"step": steps, "kid": kid}]}

    result = {
        "training": {
            "a": run("modern-tread-short", 0, 2490, 20.0),
            "b": run("modern-time", 0, 1905, 23.0),
            "c": run("modern-tread-short", 1, 2490, 22.0),
            "d": run("modern-time", 1, 1905, 24.0),
            "e": run("dit-modern-tread-short", 0, 2490, 19.0),  # its plain arm not run: no row
        }
    }
    table = efficiency.equal_time_table(result)
    assert table[-1] == "| modern-tread-short (2490) | modern-time (1905) | 0, 1 | 20.0 / 22.0 | 23.0 / 24.0 | -2.5 |"
    assert "| dit-modern-tread-short" not in "\n".join(table)


def test_the_efficiency_study_finds_the_step_each_seed_reaches_the_defaults_final_kid():
    from experiments import efficiency

    def run(arm, seed, kids):
        return {"arm": arm, "seed": seed, "curve": [{"step": 830 * (i + 1), "kid": k} for i, k in enumerate(kids)]}

    result = {
        "training": {"a": run("modern-short", 0, [40.0, 14.0, 12.0]), "b": run("modern-short", 1, [40.0, 20.0, 16.0])},
        "full_budget": {"training": {"d0": run("ddpm", 0, [50.0, 14.0]), "d1": run("ddpm", 1, [50.0, 15.0])}},
    }
    table = efficiency.goal_table(result)
    assert "seed 0: 14.0, seed 1: 15.0" in table[1]
    assert table[-1] == "| modern-short | 0, 1 | 830: 40.0, 1660: 17.0, 2490: 14.0 | 1660, - |"


def test_the_efficiency_study_scores_a_plain_arm_also_at_its_recorded_cfg(tmp_path, monkeypatch):
    from experiments import efficiency
    from moh_dit.sampling.spec import SamplingSpec

    scored = []
    monkeypatch.setattr(efficiency, "recorded_sampling", lambda model: SamplingSpec.create(guidance_scale=4.0))
    monkeypatch.setattr(efficiency, "score_model", lambda *a: scored.append((a[1], a[4])) or {"kid": 1.0, "nfe": 9})
    monkeypatch.setattr(efficiency, "save", lambda out, result: None)
    result = {"scores": [{"arm": "flow-short", "seed": 0, "scale": 1.0, "kid": 2.0}]}
    efficiency.part_score({"out": tmp_path}, (0,), result, ["flow-short", "mg-flow-short"])
    assert scored == [("flow-short-seed0", 4.0), ("mg-flow-short-seed0", 1.0)]  # the unguided row was kept
    assert {(r["arm"], r["scale"]) for r in result["scores"]} == {
        ("flow-short", 1.0), ("flow-short", 4.0), ("mg-flow-short", 1.0)
    }  # fmt: skip
    scored.clear()
    efficiency.part_score({"out": tmp_path, "guided_only": True}, (1,), result, ["flow-short", "mg-flow-short"])
    assert scored == [("flow-short-seed1", 4.0), ("mg-flow-short-seed1", 1.0)]  # a folded arm's own row is guided


def test_the_fewstep_score_part_names_a_missing_runs_folder_before_it_samples(tmp_path, monkeypatch):
    """--flow-runs pointing where no flow twin was trained is said at once (it was said after 30 s of sampling)."""
    from experiments import fewstep

    monkeypatch.setattr(fewstep, "scoring_context", lambda *a, **k: pytest.fail("sampled before checking its inputs"))
    with pytest.raises(SystemExit):
        fewstep.main(["--part", "score", "--flow-runs", str(tmp_path / "nowhere"), "--out", str(tmp_path / "o")])


def test_the_experiments_weights_scripts_leave_the_shipped_weights_alone_by_default():
    """`python -m experiments.fmnist_encoder` wrote over the committed experiments/weights/fmnist_ae.safetensors; now
    both scripts write under runs/ unless told the shipped path."""
    import argparse

    from experiments import fmnist_encoder

    seen = {}
    real_parse = argparse.ArgumentParser.parse_args

    def spy(self, args=None, namespace=None):
        parsed = real_parse(self, args, namespace)
        seen["out"] = parsed.out
        raise SystemExit(0)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(argparse.ArgumentParser, "parse_args", spy)
        with pytest.raises(SystemExit):
            fmnist_encoder.main([])
    assert "experiments/weights" not in str(seen["out"]) and str(seen["out"]).startswith("runs")


def test_a_study_keeps_its_reference_in_the_shared_folder_not_beside_the_out_it_was_given(tmp_path, monkeypatch):
    """A study with --out DIR wrote its 23 MB Fashion-MNIST reference into DIR's parent; now every study keeps one copy
    in experiments/results (ignored by git)."""
    from argparse import Namespace

    from experiments import common

    monkeypatch.setattr(common, "classifier_features", lambda: None)
    monkeypatch.setattr(common, "fashion_reference", lambda folder, count: Path(folder) / f"ref_{count}.npz")
    out, reference, _ = common.start_scoring(Namespace(out=str(tmp_path / "mine" / "study"), reference_count=50))
    assert reference.parent == common.REFERENCE_DIR and not (tmp_path / "mine" / "ref_50.npz").exists()
    assert out == tmp_path / "mine" / "study"


def test_the_distillation_diagnosis_measures_what_it_says():
    """The diagnosis's pieces on known inputs: the one-step share of two logit-normal draws against its closed form,
    a class's spread, the grain of an image, and its report's tables."""
    import torch

    from experiments import distill_diagnosis as diagnosis

    t, r = torch.tensor([0.95, 0.95, 0.5, 0.9]), torch.tensor([0.05, 0.5, 0.0, 0.2])
    assert diagnosis.near(t, r, (1.0, 0.0)).tolist() == [True, False, False, False]
    assert diagnosis.logit_normal_closed_form(-0.4, 1.0) == pytest.approx(3.4e-4, rel=0.02)
    flat, striped = torch.zeros(2, 1, 4, 4), torch.tensor([[1.0, -1.0] * 2] * 4).expand(2, 1, 4, 4)
    assert diagnosis.roughness(flat) == 0 and diagnosis.roughness(striped) == pytest.approx(1.0)
    images, labels = torch.stack([flat[0], -flat[0] + 1, flat[0], flat[0]]), torch.tensor([0, 0, 1, 1])
    assert diagnosis.spread(images, labels) == pytest.approx((0.7071 + 0) / 2, rel=1e-3)
    from experiments.distill_diagnosis_gan import roc_area

    assert roc_area(torch.tensor([2.0, 3.0]), torch.tensor([0.0, 1.0])) == 1.0  # every real image ranked above
    assert roc_area(torch.tensor([0.0, 1.0]), torch.tensor([2.0, 3.0])) == 0.0
    assert roc_area(torch.tensor([1.0, 3.0]), torch.tensor([2.0, 1.0])) == pytest.approx(
        (0.5 + 1 + 0 + 1) / 4
    )  # a tie: half
    text = diagnosis.report({"ema": {"run": "r", "decay": 0.99, "teacher_share": {830: 0.99**830}}})
    assert "Decay 0.99: the teacher's share of the EMA weights at step 830: 0.000238" in text  # an earlier record
    counted = {"run": "r", "decay": 0.995, "steps": 815, "updates": 163, "start_share": {163: 0.995**163}}
    assert "163 EMA updates in 815 steps: the start's share of the EMA weights at update 163: 0.442" in (
        diagnosis.report({"ema": counted})
    )


def test_the_consistency_diagnosis_measures_ects_target_image_for_the_one_step_jump():
    """The target image of the jump 1 -> 0 at a fixed step dt is one teacher step to s = 1 - dt and the student's jump
    from there, z - dt v - s u(z_s, s, 0): with a student whose average velocity is a known function, each distance is
    the closed form's."""
    from types import SimpleNamespace

    from experiments.distill_diagnosis_ect import STEPS, consistency_row

    def average_velocity(model, z, t, r, y):  # u(z, t, r) = 2 z t: the jump from t lands at z (1 - 2 t^2)
        return SimpleNamespace(sample=2 * z * t.reshape(-1, 1, 1, 1))

    z = torch.randn(4, 1, 3, 3, generator=torch.Generator().manual_seed(0))
    y = torch.zeros(4, dtype=torch.long)
    teacher_end = torch.zeros_like(z)
    row = consistency_row(SimpleNamespace(average_velocity=average_velocity), None, lambda z, t, y: 0.5 * z, z, y, teacher_end)  # fmt: skip
    rms = lambda a: float((a**2).mean().sqrt())  # noqa: E731
    direct = -z  # z - 2 z
    assert row["direct to the teacher"] == pytest.approx(rms(direct))
    for dt in STEPS:
        s = 1 - dt
        z_s = z - dt * 0.5 * z
        target = z_s * (1 - 2 * s * s)
        assert row[f"target dt={dt:g} to the teacher"] == pytest.approx(rms(target))
        assert row[f"target dt={dt:g} to direct"] == pytest.approx(rms(target - direct))


def test_the_variety_diagnosis_composes_jumps_and_scores_each_class_against_its_own_images():
    """A flow map's jump from t to r is x - (t - r) u(x, t, r); the teacher's half is Euler over its own times (exact for
    a constant velocity); a sample set equal to the reference has recall and precision 1 overall and in each class,
    and one that covers a class with a single repeated point has that class's recall lower and a higher KID."""
    from types import SimpleNamespace

    import numpy as np

    from experiments.distill_diagnosis_variety import HALF_STEPS, flow_map_jump, teacher_half, variety_scores

    def average_velocity(model, z, t, r, y):  # u(z, t, r) = z (t + r): the jump lands at z (1 - (t - r)(t + r))
        return SimpleNamespace(sample=z * (t + r).reshape(-1, 1, 1, 1))

    z = torch.randn(3, 1, 2, 2, generator=torch.Generator().manual_seed(0))
    y = torch.zeros(3, dtype=torch.long)
    jumped = flow_map_jump(SimpleNamespace(average_velocity=average_velocity), None, z, 1.0, 0.5, y)
    assert torch.allclose(jumped, z * (1 - 0.5 * 1.5))
    # the sampler's own step: a renoising generator predicts the data from t (x_0 = z (1 - t^2): u = z t at r = 0)
    # and noises it to r; a flow map jumps; the last step (r = 0) is the data either way
    from experiments.distill_diagnosis_variety import renoises, sampler_jump
    from moh_dit.objectives.flow_schedulers import MeanFlowScheduler

    def objective(renoise: bool) -> SimpleNamespace:
        return SimpleNamespace(
            average_velocity=average_velocity, make_scheduler=lambda name: MeanFlowScheduler(renoise=renoise)
        )

    assert renoises(objective(True)) and not renoises(objective(False))
    noise = torch.randn(z.shape, generator=torch.Generator().manual_seed(1))
    assert torch.allclose(
        sampler_jump(objective(True), None, z, 1.0, 0.5, y, True, noise), 0.5 * z * (1 - 1.0) + 0.5 * noise
    )
    assert torch.allclose(sampler_jump(objective(False), None, z, 1.0, 0.5, y, False, noise), jumped)
    assert torch.allclose(sampler_jump(objective(True), None, z, 0.5, 0.0, y, True, noise), z * (1 - 0.25))
    # a restart: the jump down to `low`, then noised forward to r; from a point on the path at `low` ((1 - low) x_0 +
    # low eps; here a jump of no length, t = low) it lands on the path's marginal at r: mean (1 - r) x_0, spread r
    from experiments.distill_diagnosis_variety import restart_jump

    g = torch.Generator().manual_seed(3)
    at_low = 0.8 * 2.0 + 0.2 * torch.randn(200_000, 1, 1, 1, generator=g)  # x_0 = 2, low = 0.2
    landed = restart_jump(objective(False), None, at_low, 0.2, 0.2, 0.5, y[:1].expand(200_000), torch.randn(at_low.shape, generator=g))  # fmt: skip
    assert float(landed.mean()) == pytest.approx(1.0, abs=3e-3) and float(landed.std()) == pytest.approx(0.5, abs=3e-3)
    assert torch.allclose(restart_jump(objective(False), None, z, 1.0, 0.0, 0.5, y, noise), 0.5 * noise)
    calls = []

    def constant(x, t, labels):  # dx/dt = c, so the ODE from t to r moves x by (r - t) c in any number of steps
        calls.append(float(t.flatten()[0]))
        return torch.full_like(x, 2.0)

    assert torch.allclose(teacher_half(constant, z, 1.0, 0.5, y), z - 1.0, atol=1e-6)
    assert len(calls) == HALF_STEPS and calls[0] == pytest.approx(1.0) and calls[-1] > 0.5
    g = np.random.default_rng(0)
    reference, labels = g.normal(size=(400, 8)), np.repeat(np.arange(4), 100)
    reference[:, 0] += 10 * labels  # four well-apart classes
    same = variety_scores(reference.copy(), labels, reference, labels)
    assert same["recall"] == 1.0 and same["precision"] == 1.0
    assert same["class_recall"] == [1.0] * 4
    collapsed = reference.copy()
    collapsed[labels == 2] = reference[labels == 2][:1] + 1e-3 * g.normal(size=(100, 8))  # class 2 on one point
    scores = variety_scores(collapsed, labels, reference, labels)
    assert scores["class_recall"][2] < 0.2 and scores["class_recall"][:2] == [1.0, 1.0] and scores["recall"] < 0.9
    assert scores["kid"] > same["kid"] + 100  # x 1000: the collapsed class moves the whole set's KID
    from experiments.distill_diagnosis_report import report

    text = report({"variety": {"r": {"run": "r", "start": "s", "steps": {"student": 4, "start": 2}, "samples": 400, "middle": 0.5, "teacher_steps": 24,
                                     "rows": {"student, 2 steps": scores}}}})  # fmt: skip
    assert "## Where the two-step student's variety goes (r)" in text and "| student, 2 steps |" in text


def test_the_variety_report_reads_an_arm_across_seeds_paired_with_its_student():
    """Records of one arm at several seeds (``ARM-seedN``) are set side by side: per seed, the mean, and the paired
    difference from the student's own two steps with the seeds on which a composition is ahead; an arm at one seed
    gets no such table."""
    from experiments.distill_diagnosis_report import across_seeds

    def record(student: float, composite: float, recall: float) -> dict:
        row = {"precision": 0.5, "class_recall": [0.5]}
        return {"rows": {"student, 2 steps": {"kid": student, "recall": 0.30, **row},
                         "start's first jump": {"kid": composite, "recall": recall, **row}}}  # fmt: skip

    lines = across_seeds({"a-seed2": record(3.0, 2.5, 0.40), "a-seed0": record(2.0, 2.2, 0.33),
                          "a-seed1": record(4.0, 3.1, 0.36), "b-seed0": record(1.0, 1.0, 0.3)})  # fmt: skip
    text = "\n".join(lines)
    assert "(a)" in text and "(b)" not in text and "Seeds 0, 1, 2" in text
    # KID differences +0.2, -0.9, -0.5: mean -0.40, ahead on two; recall +0.03, +0.06, +0.10: +0.063, ahead on three
    assert (
        "| start's first jump | 2.20 / 3.10 / 2.50 | 2.60 | -0.40 | 2 of 3 | 0.330 / 0.360 / 0.400 | 0.363 | +0.063 | 3 of 3 |"
        in lines
    )
    assert "| student, 2 steps | 2.00 / 4.00 / 3.00 | 3.00 | - | - | 0.300 / 0.300 / 0.300 | 0.300 | - | - |" in lines


@needs_data
def test_the_diagnosis_of_a_short_run_on_a_subset_writes_under_its_out_and_refuses_a_part_of_another_method(
    tmp_path, monkeypatch
):
    """A run trained on data.subset_per_class (40 images: fewer than the 2000 real images the collapse part reads) is
    diagnosed without an IndexError; the diagnosis goes to --out (or runs/distill_diagnosis/RUN), never over the
    committed study's; a part the run's method has not (a dmd2 student's interval derivative) is one line."""
    from experiments import distill_diagnosis as diagnosis
    from experiments.common import ROOT, smoke_run
    from moh_dit.training.config import load_config
    from moh_dit.training.trainer import train

    committed = (diagnosis.OUT / "results.json").read_bytes()
    teacher, student = tmp_path / "teacher", tmp_path / "student"
    small = [*smoke_run(2), "preview.per_class=0", "log.trackers=[]"]
    train(load_config(ROOT / "configs" / "fashion_mnist_moh_flow.yaml", [*small, f"train.output_dir={teacher}"]))
    distill = ["distill.derivative=finite-difference", f"distill.teacher={teacher}", f"train.output_dir={student}"]
    train(load_config(ROOT / "configs" / "fashion_mnist_moh_distill.yaml", [*small, *distill]))
    result = diagnosis.main(
        ["--part", "collapse", "derivative", "ema", "--run", str(student), "--out", str(tmp_path / "d")]
    )
    assert {"collapse", "derivative", "ema"} <= set(result) and (tmp_path / "d" / "RESULTS.md").is_file()
    assert (diagnosis.OUT / "results.json").read_bytes() == committed
    monkeypatch.chdir(tmp_path)
    diagnosis.main(["--part", "ema", "--run", str(student)])
    assert (tmp_path / "runs" / "distill_diagnosis" / "student" / "results.json").is_file()
    # where ECT's target points: an ECT run from that student, against its start; a run from no student is one line
    ect = tmp_path / "ect"
    train(load_config(ROOT / "configs" / "fashion_mnist_moh_ect.yaml", [*small, f"distill.teacher={teacher}",
                                                                       f"distill.student_from={student}", f"train.output_dir={ect}"]))  # fmt: skip
    rows = diagnosis.main(["--part", "consistency", "--run", str(ect), "--out", str(tmp_path / "c")])["consistency"]
    assert set(rows["ect"]["rows"]) == {"the start (student)", "the run's end"} and rows["ect"]["ect_dt"] == 0.01
    assert "Where ECT's target points (ect)" in (tmp_path / "c" / "RESULTS.md").read_text()
    with pytest.raises(SystemExit, match="started from none"):
        diagnosis.main(["--part", "consistency", "--run", str(student), "--out", str(tmp_path / "c")])
    dmd2 = tmp_path / "dmd2"
    train(load_config(ROOT / "configs" / "fashion_mnist_moh_dmd2.yaml", [*small, f"distill.teacher={teacher}",
                                                                        f"train.output_dir={dmd2}"]))  # fmt: skip
    with pytest.raises(
        SystemExit,
        match="--part derivative does not apply to .* a dmd2 student \\(for it: collapse, ema, weights, discriminator, variety\\)",
    ):
        diagnosis.main(["--part", "derivative", "--run", str(dmd2)])
    # its EMA stepped with the generator's updates only: 1 of the run's 2 steps (4 fake-score updates per generator's)
    ema = diagnosis.main(["--part", "ema", "--run", str(dmd2), "--out", str(tmp_path / "e")])["ema"]
    assert (ema["steps"], ema["updates"]) == (2, 1) and ema["start_share"] == {1: pytest.approx(0.995)}
    # the variety part: a run from the teacher has no start to compare with (one line); a DMD2 run from the ECT student
    # is scored at each composition, every class's recall with it
    with pytest.raises(SystemExit, match="started from the teacher"):
        diagnosis.main(["--part", "variety", "--run", str(dmd2), "--out", str(tmp_path / "v")])
    from experiments import common
    from experiments.distill_diagnosis_variety import COMPOSITIONS

    monkeypatch.setattr(common, "REFERENCE_COUNT", 200)  # a small reference: about 20 test images per class
    from_ect = tmp_path / "dmd2-from-ect"
    train(load_config(ROOT / "configs" / "fashion_mnist_moh_dmd2.yaml", [*small, f"distill.teacher={teacher}",
                                                                        f"distill.student_from={ect}", f"train.output_dir={from_ect}"]))  # fmt: skip
    variety = diagnosis.main(["--part", "variety", "--run", str(from_ect), "--samples", "40", "--out", str(tmp_path / "v")])["variety"][from_ect.name]  # fmt: skip
    assert list(variety["rows"]) == list(COMPOSITIONS) and variety["start"] == str(ect)
    only = diagnosis.main(["--part", "variety", "--run", str(from_ect), "--samples", "40", "--generators-only",
                           "--out", str(tmp_path / "g")])["variety"][from_ect.name]["rows"]  # fmt: skip
    assert list(only) == [t for t in COMPOSITIONS if "teacher" not in t]  # no teacher ODE
    assert (
        only["start's first jump, then the student's second"]
        == variety["rows"]["start's first jump, then the student's second"]
    )
    assert variety["steps"] == {"student": 2, "start": 2}  # the checkpoints whose EMA weights were read
    ect.rename(tmp_path / "ect-moved")  # a run whose start is gone: one line naming it
    with pytest.raises(SystemExit, match="started from .*ect, which holds no checkpoint here"):
        diagnosis.main(["--part", "variety", "--run", str(from_ect), "--out", str(tmp_path / "v")])
    (tmp_path / "ect-moved").rename(ect)
    assert all(len(r["class_recall"]) == 10 and 0 <= r["recall"] <= 1 for r in variety["rows"].values())
    # the weights part's raw pipeline: the last checkpoint's raw weights, sampled as the EMA's pipeline is, named so
    from experiments.distill_diagnosis_ema import raw_pipeline
    from moh_dit.run_folder import RunLayout
    from moh_dit.sampling.loading import load_pipeline
    from moh_dit.sampling.sources import checkpoint_model

    raw = load_pipeline(raw_pipeline(dmd2, tmp_path / "raw"), device="cpu")
    model, _ = checkpoint_model(RunLayout(dmd2).latest_checkpoint(), prefer_ema=False)
    exported = load_pipeline(dmd2 / "pipeline", device="cpu").transformer.state_dict()
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in raw.transformer.state_dict().items())
    assert any(not torch.equal(v, exported[k]) for k, v in raw.transformer.state_dict().items())  # not the EMA's
    assert json.loads((tmp_path / "raw" / "manifest.json").read_text())["source"]["weights"] == "model"
    assert raw.preview_sampling == load_pipeline(dmd2 / "pipeline", device="cpu").preview_sampling
    assert raw_pipeline(dmd2, tmp_path / "raw") == tmp_path / "raw"  # this run's, at its step: reused
    with pytest.raises(SystemExit, match="holds model weights of .* not .*student's raw weights at step 2"):
        raw_pipeline(student, tmp_path / "raw")  # another run's: refused, never scored as this one's
    # the discriminator part: a run without one is refused in one line; with one, its checkpoint's head is scored at
    # each noise time and trained alone from it (a few steps here), each probe recorded
    with pytest.raises(SystemExit, match="trained no discriminator"):
        diagnosis.main(["--part", "discriminator", "--run", str(dmd2), "--out", str(tmp_path / "g")])
    from experiments.distill_diagnosis_gan import PROBE_TIMES, PROBES, part_discriminator

    gan = tmp_path / "gan"
    train(load_config(ROOT / "configs" / "fashion_mnist_moh_dmd2.yaml", [*small, f"distill.teacher={teacher}",
                                                                        "distill.gan_weight=0.01", f"train.output_dir={gan}"]))  # fmt: skip
    found: dict = {}
    part_discriminator(found, gan, count=6, steps=3)
    probes = found["discriminator"]["probes"]
    assert found["discriminator"]["step"] == 2 and list(probes) == [
        "checkpoint",
        *(f"{w}, {f:g}x the rate" for w, f in PROBES),
    ]
    assert all(list(p["area"]) == [f"{t:g}" for t in PROBE_TIMES] for p in probes.values())
    assert all(0.0 <= a <= 1.0 for p in probes.values() for a in p["area"].values())
    assert all(p["loss"]["first fifth"] > 0 for name, p in probes.items() if name != "checkpoint")
    assert "## The discriminator" in diagnosis.report(found)


def test_dmd2_report_counts_each_stage_with_its_start_and_sets_the_configs_recipe_beside_the_arms():
    """The dmd2 study's seed-0 table: a stage's cost is its own spending plus the whole of the student it started from
    (the full trajectory student for dmd2f, the short one for dmd2s), the configs' earlier recipe (dmd2t) sits beside
    the arms where the protocol scored it, and the cost curve starts where the start's spending ends."""
    from experiments.distill_dmd2 import BUDGET
    from experiments.distill_dmd2_report import cost_curve, dmd2_lines, whole_cost

    def record(arm, steps, own, trajectories=0.0, curve=(), updates=None):
        found = {"arm": arm, "seed": 0, "steps": steps, "student_forwards": own, "teacher_evaluations": 0.0}
        found |= {"trajectory_evaluations": trajectories} if trajectories else {}
        found |= {"generator_updates": updates} if updates else {}
        return found | {"curve": [dict(step=s, kid=k, **{"kid@2": k / 2}) for s, k in curve]}

    training = {
        "trajectory-flow-seed0": record("trajectory-flow", 100, 0.4 * BUDGET, 0.4 * BUDGET, [(100, 16.0)]),
        "dmd2f-flow-g3-nogan-seed0": record(
            "dmd2f-flow-g3-nogan", 10, 0.2 * BUDGET, curve=[(5, 12.0), (10, 10.0)], updates=2
        ),  # fmt: skip
        "dmd2t-flow-seed0": record("dmd2t-flow", 10, 0.1 * BUDGET, curve=[(10, 11.0)], updates=2),
        "short-flow-seed0": record("short-flow", 10, 0.1 * BUDGET, 0.1 * BUDGET),
        "dmd2s-flow-g3-seed0": record("dmd2s-flow-g3", 10, 0.7 * BUDGET, curve=[(10, 15.0)], updates=5),
    }
    assert whole_cost(training, "dmd2f-flow-g3-nogan", 0) == pytest.approx(BUDGET)
    assert whole_cost(training, "dmd2t-flow", 0) == pytest.approx(0.9 * BUDGET)  # the earlier arm's start, by method
    assert [c for c, _ in cost_curve(training, "dmd2f-flow-g3-nogan", 0)] == pytest.approx([0.9, 1.0])
    assert cost_curve(training, "dmd2s-flow-g3", 0, "kid@2") == [(pytest.approx(0.9), 7.5)]

    def row(arm, steps, kid, samples=5000):
        return dict(arm=arm, seed=0, steps=steps, kid=kid, recall=0.3, samples=samples)

    scores = [row("flow", 25, 2.0), row("dmd2t-flow", 1, 9.9, samples=1000)]  # before the protocol: not in its table
    scores += [row(a, s, k * s) for a, k in (("dmd2f-flow-g3-nogan", 5.0), ("dmd2s-flow-g3", 7.0)) for s in (1, 2)]
    result = {"protocol": {"scale": "cpu", "samples": 5000}, "training": training, "scores": scores}
    text = "\n".join(dmd2_lines(result))
    assert "| dmd2f-flow-g3-nogan | 5.00 | 10.00 | 0.300 | 0.300 | 2 | 1.00 | 12.0 / 10.0 |" in text
    assert "| dmd2s-flow-g3 | 7.00 | 14.00 | 0.300 | 0.300 | 5 | 0.90 | 15.0 |" in text
    assert "| dmd2t-flow |" not in text.split("each setting at seed 0")[1].split("###")[0]
    scores += [row("dmd2t-flow", 1, 10.2), row("dmd2t-flow", 2, 4.5)]
    text = "\n".join(dmd2_lines(result | {"scores": scores}))
    assert "| dmd2t-flow | 10.20 | 4.50 | 0.300 | 0.300 | 2 | 0.90 | 11.0 |" in text
    # the three-seed table: the recipe from the full start and the configs' earlier recipe beside it, against the goal
    final = text.split("5000 samples, seed 0 of three")[1].split("each setting at seed 0")[0]
    assert "| dmd2f-flow-g3-nogan | 1 | 2.50 |" in final and "| dmd2t-flow | 2 | 2.25 |" in final
    assert "| dmd2s-flow-g3 |" not in final  # the short start's recipe: seed 0's measurement only
    assert "- **2 steps**: the best, dmd2t-flow, is at 2.25 x the teacher's KID" in final
    assert "The teacher's own KID: 2.00 (one seed: its spread between seeds is not measured yet)." in final
    # a setting measured at another seed (where its start was trained): its own table at that seed, beside the recipe
    # there and against that seed's teacher; a seed with the three-seed arms alone has none
    for seed, arm in ((1, "dmd2f-flow-g3-nogan"), (1, "dmd2f-flow-g3-nogan-x4"), (2, "dmd2f-flow-g3-nogan")):
        training[f"{arm}-seed{seed}"] = record(arm, 40 if arm.endswith("x4") else 10, 0.2 * BUDGET, updates=2)
        training[f"trajectory-flow-seed{seed}"] = training["trajectory-flow-seed0"] | {"seed": seed}
        scores += [row(arm, s, 4.0 * s) | {"seed": seed} for s in (1, 2)]
    scores += [row("flow", 25, 2.5) | {"seed": seed} for seed in (1, 2)]
    text = "\n".join(dmd2_lines(result | {"scores": scores}))
    assert "each setting at seed 1 (5000 samples; the teacher at 25 steps: 2.50)" in text
    assert "each setting at seed 2" not in text
    assert "Scored with 5000 class-balanced samples" in text  # the protocol's count, not a placeholder
    # the goal's best among the arms scored at the most seeds (a one-seed mean is not set against a two-seed one)
    final = text.split("5000 samples, three seeds")[1].split("each setting at seed 0")[0]
    assert "- **2 steps**: the best, dmd2f-flow-g3-nogan, is at" in final and "met at 0 of 3 seeds" in final
    at_one = text.split("each setting at seed 1")[1].split("###")[0]
    assert "| dmd2f-flow-g3-nogan | 4.00 | 8.00 |" in at_one and "| dmd2f-flow-g3-nogan-x4 | 4.00 | 8.00 |" in at_one
    assert "| dmd2s-flow-g3 |" not in at_one  # seed 0's measurement


def test_a_dmd2_stage_spends_what_the_budget_leaves_in_whole_cycles_and_an_over_budget_arm_runs_on_past_it():
    """fill_budget: the stage's steps, counted step by step at its objective's own count per image and rounded down
    to whole cycles of generator and fake-score updates, spend no more than what its start left of the teacher's
    training, and one more cycle would spend more; ``-x4`` trains four times those steps, evaluated at the same
    steps; a start that leaves too little is refused."""
    from experiments import distill
    from experiments.distill_dmd2 import budget_share, over_budget
    from experiments.distill_dmd2_budget import counted_objective, fill_budget, load_arm
    from experiments.distill_dmd2_settings import BATCH, BUDGET

    arms = distill.student_arms(1, Path("/nonexistent"), distill.SCALES["cpu"])
    config, overrides = arms["dmd2f-flow-g3-nogan"]
    spent = 0.84 * BUDGET
    (length, checkpoints), evals = fill_budget(config, overrides, spent, distill.SCALES["cpu"])
    steps = int(length.split("=")[1])
    loaded = load_arm(config, overrides)
    objective = counted_objective(loaded)
    assert objective.teacher_forwards_at(0) > 0  # the teacher's evaluations are counted
    cycle = loaded.distill.fake_updates + 1

    def cost(n: int) -> float:
        return sum(BATCH * (objective.step_forwards(i) + objective.teacher_forwards_at(i)) for i in range(n))

    assert steps % cycle == 0 and spent + cost(steps) <= BUDGET < spent + cost(steps + cycle)
    assert evals == [checkpoints.replace("train.checkpoint_every", "log.eval_every"), "log.eval_samples=500"]
    assert over_budget("dmd2f-flow-g3-nogan-x4") == 4 and over_budget("dmd2f-flow-g3-nogan") == 1
    config4, overrides4 = arms["dmd2f-flow-g3-nogan-x4"]
    assert overrides4 == overrides and arms["dmd2f-flow-g3-nogan-f1"][1][-1] == "distill.fake_updates=1"
    assert arms["dmd2f-ddpm-g4-nogan-f8"][1][-1] == "distill.fake_updates=8"
    (length8, _), _ = fill_budget(*arms["dmd2f-flow-g3-nogan-f8"], spent, distill.SCALES["cpu"])
    assert int(length8.split("=")[1]) % 9 == 0  # whole cycles of one generator and eight fake-score updates
    (length4, checkpoints4), evals4 = fill_budget(config4, overrides4, spent, distill.SCALES["cpu"], 4)
    assert length4 == f"train.max_steps={4 * steps}" and (checkpoints4, evals4) == (checkpoints, evals)
    for longer in ("ect-flow-uniform-x4", "dmd2l-ddpm-g4-nogan-x4"):  # the two still falling at the budget's end
        assert over_budget(longer) == 4 and arms[longer] == arms[longer.removesuffix("-x4")]
    # the flow twin's config run on past the budget, as a user might: twice the steps the budget leaves
    twice = "sidecfdt-flow-g3-nogan-alpha1-real8-b4-x2"
    assert over_budget(twice) == 2 and arms[twice] == arms[twice.removesuffix("-x2")]
    (once, _), _ = fill_budget(*arms[twice], spent, distill.SCALES["cpu"])
    (longer, _), _ = fill_budget(*arms[twice], spent, distill.SCALES["cpu"], over_budget(twice))
    assert int(longer.split("=")[1]) == 2 * int(once.split("=")[1])
    with pytest.raises(SystemExit, match="too few to train"):
        fill_budget(config, overrides, BUDGET - 10 * BATCH, distill.SCALES["cpu"])
    # ECT's stage: four student passes and the teacher's guided step per image, at every step alike
    (ect_length, _), _ = fill_budget(*arms["ect-flow"], spent, distill.SCALES["cpu"])
    assert ect_length == f"train.max_steps={int((BUDGET - spent) // (BATCH * (4 + 2)))}"
    # a stage with a share of what its start leaves spends that share, and the stage after it the rest
    assert budget_share("ectfew-flow") == 0.5 and budget_share("dmd2ecf-flow-g3-nogan") == 1
    (half, _), _ = fill_budget(*arms["ectfew-flow"], spent, distill.SCALES["cpu"], 1, 0.5)
    assert half == f"train.max_steps={int((BUDGET - spent) / 2 // (BATCH * (4 + 2)))}"
    quarter, share = arms["ectfewdts25-flow"], budget_share("ectfewdts25-flow")  # the budget's split measured
    (length, _), _ = fill_budget(*quarter, spent, distill.SCALES["cpu"], 1, share)
    assert length == f"train.max_steps={int((BUDGET - spent) / 4 // (BATCH * (4 + 2)))}"
    # SiD's generator step differentiates both scores (three passes each): fewer steps than DMD2's in the same budget
    sid_arm, dmd_arm = arms["sidecfdt-flow-g3-nogan-ema998"], arms["dmd2ecfdt-flow-g3-nogan-ema998"]
    sid, dmd = (counted_objective(load_arm(*a)) for a in (sid_arm, dmd_arm))
    assert sid.step_forwards(0) - dmd.step_forwards(0) == 2.0 and sid.step_forwards(1) == dmd.step_forwards(1)
    assert (
        sid.teacher_forwards_at(0) == 3 * dmd.teacher_forwards_at(0) == 6.0
    )  # guided: two evaluations, each 3 passes
    (sid_length, _), _ = fill_budget(*sid_arm, spent, distill.SCALES["cpu"])
    (dmd_length, _), _ = fill_budget(*dmd_arm, spent, distill.SCALES["cpu"])
    sid_steps = int(sid_length.split("=")[1])
    assert sid_steps < int(dmd_length.split("=")[1]) and sid_steps % 5 == 0
    # a GAN term switched on late: the steps before it cost what a stage without it costs, those after it more
    late_config, late_overrides = arms["dmd2f-flow-g1-ganlate"]
    late = counted_objective(load_arm(late_config, late_overrides))
    start = late.gan_start
    assert late.step_forwards(start - cycle) < late.step_forwards(start) and late.gan_on(start)
    (late_length, _), _ = fill_budget(late_config, late_overrides, spent, distill.SCALES["cpu"])
    late_steps = int(late_length.split("=")[1])
    late_cost = sum(BATCH * (late.step_forwards(i) + late.teacher_forwards_at(i)) for i in range(late_steps))
    assert late_steps > start and spent + late_cost <= BUDGET
    # a ramp of the real score's scale down to the sampler's: over the stage's own steps within the budget, which are
    # the unramped arm's (a scale above 1 costs the same at every step); to 1 without a ramp of its own, refused
    base = arms["sidecfdt-flow-g3-nogan-alpha1-real8"]
    ramp_config, ramp_overrides = arms["sidecfdt-flow-g3-nogan-alpha1-real8-to3"]
    assert ramp_overrides == [*base[1], "distill.real_guidance_end=3.0"]
    ramped, ramp_evals = fill_budget(ramp_config, ramp_overrides, spent, distill.SCALES["cpu"])
    plain, plain_evals = fill_budget(*base, spent, distill.SCALES["cpu"])
    ramp_steps = int(plain[0].split("=")[1])
    assert ramped == [*plain, f"distill.real_guidance_ramp={ramp_steps}"] and ramp_evals == plain_evals
    section = load_arm(ramp_config, [*ramp_overrides, *ramped]).distill
    assert (section.real_guidance, section.real_guidance_end, section.real_guidance_ramp) == (8.0, 3.0, ramp_steps)
    with pytest.raises(SystemExit, match="give distill.real_guidance_ramp"):
        fill_budget(ramp_config, [*base[1], "distill.real_guidance_end=1"], spent, distill.SCALES["cpu"])

    # the fake score's own guidance at each two-step config: trained and read at the real score's scale, or read at 2;
    # each guided pass of the fake score costs two, so the stage is shorter within the same budget, still whole cycles
    for sid, scale in (("sidecfdt-flow-g3-nogan-alpha1-real8", 8.0), ("sidecfdt-ddpm-g4-nogan-ema998-lr3e-4-alpha1-real16", 16.0)):  # fmt: skip
        lengths = {}
        for tail, key in (("", None), ("-lsg", f"distill.fake_guidance={scale}"), ("-fakeread2", "distill.fake_guidance_eval=2.0")):  # fmt: skip
            arm_config, arm_overrides = arms[sid + tail]
            assert arm_overrides == [*arms[sid][1], *([key] if key else [])]
            (length, _), _ = fill_budget(arm_config, arm_overrides, spent, distill.SCALES["cpu"])
            lengths[tail] = int(length.split("=")[1])
            guided = counted_objective(load_arm(arm_config, arm_overrides))
            cost = sum(BATCH * (guided.step_forwards(i) + guided.teacher_forwards_at(i)) for i in range(lengths[tail]))
            assert lengths[tail] % (guided.fake_updates + 1) == 0 and spent + cost <= BUDGET
        assert lengths["-lsg"] < lengths["-fakeread2"] < lengths[""]
        # half the batch: the same evaluations in twice the steps (whole cycles), the EMA's decay its square root
        half_config, half_overrides = arms[sid + "-b8"]
        loaded = load_arm(half_config, half_overrides)
        assert loaded.train.global_batch_size == 8 and loaded.ema.decay == pytest.approx(
            load_arm(*arms[sid]).ema.decay ** 0.5, abs=1e-6
        )
        (length, _), _ = fill_budget(half_config, half_overrides, spent, distill.SCALES["cpu"])
        halved = counted_objective(loaded)
        cost = sum(
            8 * (halved.step_forwards(i) + halved.teacher_forwards_at(i)) for i in range(int(length.split("=")[1]))
        )
        assert 2 * lengths[""] <= int(length.split("=")[1]) < 2 * lengths[""] + 2 * (halved.fake_updates + 1)
        assert spent + cost <= BUDGET
        assert load_arm(*arms[sid + "-b2"]).ema.decay == pytest.approx(load_arm(*arms[sid]).ema.decay ** (1 / 8), abs=1e-6)  # fmt: skip
        # the late GAN term at a quarter of the batch switches on after four times the steps (the same share of the
        # images), and its discriminator's passes stay within the budget
        late = sid.replace("-nogan", "") + "-ganlate"
        late_config, late_overrides = arms[late + "-b4"]
        quartered, whole = load_arm(late_config, late_overrides).distill, load_arm(*arms[late]).distill
        assert whole.gan_weight == quartered.gan_weight == 0.003 and quartered.gan_start == 4 * whole.gan_start == 800
        (length, _), _ = fill_budget(late_config, late_overrides, spent, distill.SCALES["cpu"])
        gan = counted_objective(load_arm(late_config, late_overrides))
        steps = int(length.split("=")[1])
        assert not gan.gan_on(799) and gan.gan_on(800)
        cost = sum(4 * (gan.step_forwards(i) + gan.teacher_forwards_at(i)) for i in range(steps))
        assert spent + cost <= BUDGET and steps < 4 * lengths[""]
    # the fake score at a multiple of the generator's rate: only distill.fake_lr changes, and the stage's length not
    for sid, tail, multiple in (("sidecfdt-flow-g3-nogan-alpha1-real8", "-fake3x-b4", 3), ("sidecfdt-ddpm-g4-nogan-ema998-lr3e-4-alpha1-real16", "-fake2x", 2)):  # fmt: skip
        faster, beside = arms[sid + tail], arms[sid + tail.removeprefix(f"-fake{multiple}x")]
        assert [o for o in faster[1] if o not in beside[1]] == [f"distill.fake_lr={multiple * load_arm(*beside).optim.lr:g}"]  # fmt: skip
        assert fill_budget(*faster, spent, distill.SCALES["cpu"]) == fill_budget(*beside, spent, distill.SCALES["cpu"])


def test_the_beta0_karras_and_rerun_arms_change_one_setting_of_the_configs_arms_and_a_rerun_sets_its_own_seed(
    tmp_path, monkeypatch
):
    """`-beta0` changes Adam's betas alone, `-karras` the VSD loss's time law alone, and `-rerun` the stage's seed alone
    (the study's seed + RERUN_SEED), which wins over the seed train_arm gives every arm."""
    import dataclasses

    from experiments import arms as arm_runs
    from experiments import distill
    from experiments.distill_dmd2 import RERUN_SEED, load_arm, over_budget

    study = distill.student_arms(2, tmp_path, distill.SCALES["cpu"])
    flow, ddpm = "sidecfdt-flow-g3-nogan-alpha1-real8", "sidecfdt-ddpm-g4-nogan-ema998-lr3e-4-alpha1-real16"
    for beside, tail, batch in ((flow, "-b4", 4), (ddpm, "", 16)):
        base = load_arm(*study[beside + tail])
        for change, key, value in (("-beta0", "optim", "betas"), ("-karras", "distill", "dmd_time_sampling")):
            arm = load_arm(*study[beside + change + tail])
            assert arm.train.global_batch_size == batch and arm.ema.decay == base.ema.decay
            assert dataclasses.replace(getattr(arm, key), **{value: getattr(getattr(base, key), value)}) == getattr(base, key)  # fmt: skip
        assert load_arm(*study[beside + "-beta0" + tail]).optim.betas == (0.0, 0.999)
        assert load_arm(*study[beside + "-karras" + tail]).distill.dmd_time_sampling == "karras"
        rerun = study[beside + tail + "-rerun"]
        assert rerun[1] == [*study[beside + tail][1], f"train.seed={2 + RERUN_SEED}"]
    seen = []
    monkeypatch.setattr(arm_runs, "train_recipe", lambda name, config, overrides, out: seen.append(overrides) or {"median_images_per_s": 1})  # fmt: skip
    monkeypatch.setattr(arm_runs, "read_records", lambda *a: [])
    sc = {"overrides": [], "eval": []}
    arm_runs.train_arm(flow + "-b4-rerun", 2, sc, tmp_path, tmp_path / "ref.npz", study)
    arm_runs.train_arm(flow + "-b4", 2, sc, tmp_path, tmp_path / "ref.npz", study)
    assert [load_arm(study[flow][0], o).train.seed for o in seen] == [2 + RERUN_SEED, 2]
    # past the budget with its best two-step evaluation kept: chosen against the training images (the arm's own
    # reference wins over the study's test reference), and the kept model is the one scored
    best = flow + "-b4-best-x2"
    assert over_budget(best) == 2 and study[best][1] == [*study[flow + "-b4"][1], "log.eval_reference=fashion-mnist-train", "log.eval_keep_best=kid@2"]  # fmt: skip
    arm_runs.train_arm(
        best, 2, {"overrides": [], "eval": ["log.eval_every=10"]}, tmp_path, tmp_path / "test.npz", study
    )
    chosen = load_arm(study[flow][0], seen[-1]).log
    assert (chosen.eval_reference, chosen.eval_keep_best) == ("fashion-mnist-train", "kid@2")
    assert distill.model_of(best, 2, tmp_path) == tmp_path / "runs" / f"{best}-seed2" / "best"
    assert distill.model_of(flow + "-b4-x2", 2, tmp_path).name == "pipeline"


def test_the_last_jump_arms_and_the_hand_off_arms_change_one_setting_of_the_arms_they_vary(tmp_path):
    """`-last` puts every sample on the last jump (distill.dmd_first_share 0) and changes nothing else of its lead arm;
    the flow twin's config arm gets the hand-off's arms at both ECT splits, led by the start it trains from, and its
    ramped arm none (dropped unrun) and no rerun; the default's `-lead-last-gan` adds the late GAN term to its
    `-lead-last`, and its chain from the lower-guidance start (ECT from it, SiD led by that ECT) is wired start to
    start."""
    import dataclasses

    from experiments import distill
    from experiments.distill_dmd2 import load_arm

    study = distill.student_arms(1, tmp_path, distill.SCALES["cpu"])
    flow, ddpm = "sidecfdt-flow-g3-nogan-alpha1-real8-b4", "sidecfdt-ddpm-g4-nogan-ema998-lr3e-4-alpha1-real16"
    for lead in (f"{flow}-lead-middle0.2", f"{flow}-lead", f"{ddpm}-lead"):
        config, overrides = study[lead + "-last"]
        assert config == study[lead][0] and sorted(overrides) == sorted(
            [*study[lead][1], "distill.dmd_first_share=0.0"]
        )
        last, base = load_arm(*study[lead + "-last"]), load_arm(*study[lead])
        assert last.distill.dmd_first_share == 0.0 and base.distill.dmd_first_share is None
        assert dataclasses.replace(last.distill, dmd_first_share=None) == base.distill
    for prefix, start in (("sidecfdt", "ectfewdt"), ("sidecfdts25", "ectfewdts25")):
        arm = f"{prefix}-flow-g3-nogan-alpha1-real8-b4"
        lead = next(o for o in study[arm][1] if o.startswith("distill.student_from="))
        assert lead.endswith(f"{start}-flow-seed1")  # the start it trains from leads it
        assert study[f"{arm}-lead-middle0.2"] == (
            study[arm][0],
            [*study[arm][1], "distill.dmd_input=lead", "distill.dmd_midpoint=0.2",
             lead.replace("distill.student_from=", "distill.lead_model=")],
        )  # fmt: skip
    assert f"{flow}-rerun" in study and "sidecfdt-flow-g3-nogan-alpha1-real8-to3-b4-rerun" not in study
    assert "sidecfdts25-flow-g3-nogan-alpha1-real8-to3-b4-lead-middle0.2" not in study  # dropped unrun
    # the default's late GAN term on the last jump alone: its name without "-nogan", the term's weight and start added
    gan = load_arm(*study["sidecfdt-ddpm-g4-ema998-lr3e-4-alpha1-real16-lead-last-gan"])
    last = load_arm(*study[f"{ddpm}-lead-last"])
    assert (gan.distill.gan_weight, gan.distill.gan_start, last.distill.gan_weight) == (0.003, 200, 0.0)
    assert dataclasses.replace(gan.distill, gan_weight=0.0, gan_start=0) == last.distill
    assert not [arm for arm in study if arm.endswith("-lead-last-gan") and "-flow-" in arm]  # batch 4: not set there
    # the default's chain from the lower-guidance start: ECT from it, SiD's hand-off arm from that ECT, led by it
    from experiments.distill_dmd2 import budget_share, start_of

    low = "sidecfldt-ddpm-g4-nogan-ema998-lr3e-4-alpha1-real16-lead-last"
    assert (start_of(low), start_of("ectfewldt-ddpm"), budget_share("ectfewldt-ddpm")) == ("ectfewldt-ddpm", "fewlow-ddpm", 0.5)  # fmt: skip
    assert study["ectfewldt-ddpm"][1][1:] == [f"distill.student_from={tmp_path / 'runs' / 'fewlow-ddpm-seed1'}", *study["ectfewdt-ddpm"][1][2:]]  # fmt: skip
    assert f"distill.lead_model={tmp_path / 'runs' / 'ectfewldt-ddpm-seed1'}" in study[low][1]
    # the default's last jump with its real score at 8, and ramped from 16 to the sampler's 4: the scale alone changed
    # (the ramp's length is the stage's, set when the budget fills it)
    for tail, changed in (("real8", ["distill.real_guidance=8.0"]), ("real16-to4", ["distill.real_guidance_end=4.0"])):
        config, overrides = study[f"sidecfdt-ddpm-g4-nogan-ema998-lr3e-4-alpha1-{tail}-lead-last"]
        assert config == study[f"{ddpm}-lead-last"][0]
        assert set(overrides) ^ set(study[f"{ddpm}-lead-last"][1]) <= {*changed, "distill.real_guidance=16.0"}
        assert set(changed) <= set(overrides)


def test_the_dmd2_configs_arms_noised_afresh_change_the_backward_simulations_noise_alone(tmp_path):
    """`dmd2{ecfdt,few,fewl}-*-fresh` (each EMA) is its arm with distill.dmd_input generator_fresh, nothing else: the
    DMD2 configs' arms measured with the noise SiD's configs took."""
    import dataclasses

    from experiments import distill
    from experiments.distill_dmd2 import load_arm

    study = distill.student_arms(0, tmp_path, distill.SCALES["cpu"])
    arms = ("dmd2ecfdt-flow-g3-nogan", "dmd2ecfdt-ddpm-g4-nogan-ema998", "dmd2ecfdt-ddpm-g4-nogan",
            "dmd2few-flow-g3-nogan-ema998", "dmd2few-ddpm-g4-nogan-ema998", "dmd2fewl-ddpm-g4-nogan-ema998")  # fmt: skip
    for arm in arms:
        base, fresh = load_arm(*study[arm]), load_arm(*study[f"{arm}-fresh"])
        assert (base.distill.dmd_input, fresh.distill.dmd_input) == ("generator", "generator_fresh")
        assert dataclasses.replace(fresh, distill=dataclasses.replace(fresh.distill, dmd_input="generator")) == base


def test_the_divergence_arms_add_the_late_gan_to_the_fresh_config_arm_and_pair_on_the_divergence_alone(tmp_path):
    """`dmd2ecfdt-*-fresh-ganlate` is the DMD2 config's fresh arm with the late GAN term (its name without `-nogan`), and
    `-ganlate-js`, `-ganlate-fkl` that arm with distill.vsd_divergence changed, nothing else: the pair measures the
    weighting; each starts from ECT's start and fills the budget left after it."""
    import dataclasses

    from experiments import distill
    from experiments.distill_dmd2 import budget_arm, load_arm, start_of

    study = distill.student_arms(0, tmp_path, distill.SCALES["cpu"])
    for base in ("dmd2ecfdt-flow-g3-nogan-fresh", "dmd2ecfdt-ddpm-g4-nogan-ema998-fresh"):
        gan_name = base.replace("-nogan", "") + "-ganlate"
        fresh, gan = load_arm(*study[base]), load_arm(*study[gan_name])
        assert (gan.distill.gan_weight, gan.distill.gan_start, gan.distill.vsd_divergence) == (
            0.003,
            200,
            "reverse_kl",
        )
        assert dataclasses.replace(gan, distill=dataclasses.replace(gan.distill, gan_weight=0.0, gan_start=0)) == fresh
        for suffix, divergence in (("js", "js"), ("fkl", "forward_kl")):
            weighted = load_arm(*study[f"{gan_name}-{suffix}"])
            assert weighted.distill.vsd_divergence == divergence
            assert dataclasses.replace(weighted, distill=dataclasses.replace(weighted.distill, vsd_divergence="reverse_kl")) == gan  # fmt: skip
            assert budget_arm(f"{gan_name}-{suffix}") and start_of(f"{gan_name}-{suffix}") == start_of(base)


# the twin recipes' configs: (config, the study's arm it is, the arm its DMD2 stage starts from)
TWINS = [
    ("fashion_mnist_moh_distill_trajectory_few.yaml", "few-flow", None),
    ("fashion_mnist_moh_distill_trajectory_few_ddpm.yaml", "few-ddpm", None),
    ("fashion_mnist_moh_distill_trajectory_fewlow_ddpm.yaml", "fewlow-ddpm", None),
    ("fashion_mnist_moh_ect_few.yaml", "ectfewdt-flow", "few-flow"),
    ("fashion_mnist_moh_ect_few_ddpm.yaml", "ectfewdt-ddpm", "few-ddpm"),
    # backward simulation noised afresh (the fresh chains' record, experiments/results/distill_variety)
    ("fashion_mnist_moh_dmd2_few.yaml", "dmd2few-flow-g3-nogan-ema998-fresh", "few-flow"),
    ("fashion_mnist_moh_dmd2_few_ddpm.yaml", "dmd2few-ddpm-g4-nogan-ema998-fresh", "few-ddpm"),
    ("fashion_mnist_moh_dmd2_fewlow_ddpm.yaml", "dmd2fewl-ddpm-g4-nogan-ema998-fresh", "fewlow-ddpm"),
    ("fashion_mnist_moh_dmd2_ect.yaml", "dmd2ecfdt-flow-g3-nogan-fresh", "ectfewdt-flow"),
    ("fashion_mnist_moh_dmd2_ect_ddpm.yaml", "dmd2ecfdt-ddpm-g4-nogan-ema998-fresh", "ectfewdt-ddpm"),
    ("fashion_mnist_moh_sid_ect.yaml", "sidecfdt-flow-g3-nogan-alpha1-real8-fresh-b4", "ectfewdt-flow"),
    (
        "fashion_mnist_moh_sid_ect_ddpm.yaml",
        "sidecfdt-ddpm-g4-nogan-ema998-lr3e-4-alpha1-real16-fresh",
        "ectfewdt-ddpm",
    ),
    (
        "fashion_mnist_moh_sid_ect_one_ddpm.yaml",
        "sidecfdt-ddpm-g4-nogan-ema998-lr3e-4-alpha1-real16-one-f3",
        "ectfewdt-ddpm",
    ),
    # trained for the hand-off (the fresh chains' record, experiments/results/distill_variety)
    (
        "fashion_mnist_moh_sid_ect_lead.yaml",
        "sidecfdt-flow-g3-nogan-alpha1-real8-b4-lead-middle0.2-last",
        "ectfewdt-flow",
    ),
    (
        "fashion_mnist_moh_sid_ect_lead_ddpm.yaml",
        "sidecfdt-ddpm-g4-nogan-ema998-lr3e-4-alpha1-real16-lead",
        "ectfewdt-ddpm",
    ),
]


@pytest.mark.parametrize("config, arm, start", TWINS)
def test_the_twin_recipes_configs_are_the_study_arms_they_cite(config, arm, start, tmp_path):
    """The cheaper start's and the variety start's configs train what the distillation study measured: every key of
    the arm's config with its overrides (the paths aside), and the budget-filled length the study's records give."""
    import dataclasses

    from experiments import distill
    from experiments.common import ROOT
    from moh_dit.training.config import load_config

    config_path = ROOT / "configs" / config
    arms = distill.student_arms(0, tmp_path, distill.SCALES["cpu"])
    base, overrides = arms[arm]
    studied = load_config(ROOT / base, overrides)
    twin = load_config(config_path)
    paths = {"teacher", "student_from", "trajectories", "lead_model"}
    if list(twin.distill.dmd_steps) == [1]:  # a one-step generator has no later grid time, and reads no input there
        paths.add("dmd_input")
    ours = {k: v for k, v in dataclasses.asdict(twin.distill).items() if k not in paths}
    theirs = {k: v for k, v in dataclasses.asdict(studied.distill).items() if k not in paths}
    assert ours == theirs
    for section in ("objective", "optim", "ema", "model"):
        assert getattr(twin, section) == getattr(studied, section), section
    assert twin.train.global_batch_size == studied.train.global_batch_size  # the batch sets the updates (-b4)
    assert str(twin.distill.teacher) == ("runs/fashion_mnist_moh_flow" if "flow" in arm else "runs/fashion_mnist_moh")
    records = {}
    for study in ("distill", "distill_variety"):  # the study's record, and the fresh chains' (the hand-off's arms)
        records |= json.loads((ROOT / f"experiments/results/{study}/results.json").read_text())["training"]
    steps = [r["steps"] for name, r in records.items() if name.startswith(f"{arm}-seed")]
    # the seeds' starts cost a little apart: a cycle or so at the study's batch, as many images at a smaller one
    slack = 5 * 16 // twin.train.global_batch_size
    assert steps and twin.train.max_steps <= min(steps) and max(steps) - twin.train.max_steps <= slack
    if start is not None:  # the DMD2 stage starts from the twin start's config's output
        start_config = next(c for c, a, _ in TWINS if a == start)
        assert str(twin.distill.student_from) == str(load_config(ROOT / "configs" / start_config).train.output_dir)
    if twin.distill.dmd_input == "lead":  # its lead is the start it trains from, as the arm's is
        assert twin.distill.lead_model == twin.distill.student_from
    assert f"--config configs/{config}" in config_path.read_text()  # its header says how to run it


def test_dmd2_with_dmds_regression_trains_on_its_starts_own_set_and_does_not_pay_for_it_twice(tmp_path):
    """The study's `-reg{w}` arms: DMD2 from a trajectory student with DMD's regression on that student's own recorded
    set. It trains (the regression logged beside the VSD loss), and its counted cost leaves the set to the start, which
    recorded it (the same set recorded by a run itself, or read from elsewhere, is that run's to count)."""
    from experiments.common import ROOT, smoke_run
    from experiments.distill_report import run_cost
    from moh_dit.training.config import load_config
    from moh_dit.training.trainer import train

    teacher, start, dmd2 = tmp_path / "teacher", tmp_path / "start", tmp_path / "dmd2"
    small = [*smoke_run(2), "preview.per_class=0", "log.trackers=[]"]
    train(load_config(ROOT / "configs" / "fashion_mnist_moh_flow.yaml", [*small, f"train.output_dir={teacher}"]))
    recorded = [f"distill.teacher={teacher}", "distill.trajectory_count=4", "distill.trajectory_shard_size=2"]
    train(load_config(ROOT / "configs" / "fashion_mnist_moh_distill_trajectory.yaml",
                      [*small, *recorded, f"train.output_dir={start}"]))  # fmt: skip
    from experiments import distill

    arms = distill.student_arms(0, tmp_path / "study", distill.SCALES["cpu"])  # the arm's overrides, on these folders
    _, overrides = arms["dmd2f-flow-g3-nogan-reg0.25"]
    moved = [o.replace(str(tmp_path / "study" / "runs" / "trajectory-flow-seed0"), str(start))
             .replace(str(tmp_path / "study" / "runs" / "flow-seed0"), str(teacher)) for o in overrides]  # fmt: skip
    assert f"distill.trajectories={start / 'trajectories'}" in moved and "distill.regression=0.25" in moved
    train(load_config(ROOT / "configs" / "fashion_mnist_moh_dmd2_trajectory.yaml",
                      [*small, *moved, f"train.output_dir={dmd2}"]))  # fmt: skip
    logged = [json.loads(line) for line in (dmd2 / "metrics.jsonl").read_text().splitlines()]
    assert any("regression" in str(record) for record in logged)
    assert run_cost(start)["trajectory_evaluations"] > 0  # the start recorded the set and counts it
    assert "trajectory_evaluations" not in run_cost(dmd2)  # read from the start's folder: not counted again


def test_a_stage_after_two_others_counts_what_both_spent_before_it():
    """ECT from the cheaper start, then DMD2 from it: the DMD2 stage's budget is what the cheaper start and the ECT stage
    left together (each run's passes, the teacher's evaluations and its own set of trajectories)."""
    from experiments import distill

    def record(forwards, teacher, trajectories=0.0):
        return {"student_images": 1, "student_forwards": forwards, "teacher_evaluations": teacher,
                "trajectory_evaluations": trajectories}  # fmt: skip

    result = {"training": {"few-ddpm-seed0": record(100.0, 0.0, 50.0), "ectfew-ddpm-seed0": record(30.0, 10.0)}}
    assert distill._spent_before("ectfew-ddpm", 0, result) == 150.0
    assert distill._spent_before("dmd2ecf-ddpm-g4-nogan", 0, result) == 190.0
    assert distill._spent_before("dmd2g-ddpm-g2", 0, result) == 0.0  # from the teacher
    with pytest.raises(SystemExit, match="no counted cost yet"):
        distill._spent_before("dmd2ecf-flow-g3-nogan", 0, result)


def test_the_handoff_curve_reads_where_the_hand_off_stands_at_the_recipes_length():
    """Still falling, flat or turning up over the last quarter before the length, and the best point anywhere."""
    from experiments.handoff_curve import reading

    def curve(values):
        return {"length": 400, "handoff": [{"step": 100 * (i + 1), "kid@2": v, "recall@2": 0.5} for i, v in enumerate(values)]}  # fmt: skip

    falling = reading(curve([4.0, 3.0, 2.0, 1.0, 0.9, 0.8]))
    assert (
        "is 1 (recall 0.500), still falling over the last quarter (-1)" in falling
        and "best 0.8 at step 600; its end (600) 0.8" in falling
    )
    assert "flat over the last quarter" in reading(curve([4.0, 3.0, 1.0, 1.01]))
    assert "turning up over the last quarter (+0.5)" in reading(curve([4.0, 3.0, 1.0, 1.5, 2.0]))


def test_the_handoff_curve_continues_a_lead_arms_run_and_checks_it_is_the_same_run(tmp_path):
    """A tiny generator trained for a lead, its run continued to twice its length with the hand-off scored: the shared
    evaluation repeats to the digit, the record and report hold both curves; an arm's record that the new run does not
    repeat is refused, and so is a run not trained for a lead."""
    from experiments import handoff_curve
    from moh_dit.training.config import load_config
    from moh_dit.training.trainer import train

    from .helpers.factories import make_image_folder, tiny_train_config, train_tiny
    from .helpers.tiny_extractor import TINY
    from .training.distill.test_companions import dmd2
    from .training.distill.test_lead import FLOW_MAP, LEAD

    image_dir = tmp_path / "images"
    make_image_folder(image_dir)
    train_tiny(tmp_path / "teacher", image_dir, "objective.name=flow", "train.max_steps=4", "preview.per_class=0")
    lead = tmp_path / "lead"
    train(load_config(tiny_train_config(lead, image_dir), [f"distill.teacher={tmp_path / 'teacher'}", *FLOW_MAP, "train.max_steps=2"]))  # fmt: skip
    evals = ["log.eval_every=2", "log.eval_samples=6", "log.eval_batch_size=4", f"log.eval_reference={image_dir}",
             f"log.eval_extractor={TINY}", "log.eval_extractor_module=tests.helpers.tiny_extractor",
             "log.eval_sampling.num_steps=1", "log.eval_also_steps=[2]"]  # fmt: skip
    arm = tmp_path / "arm"
    train(dmd2(arm, image_dir, tmp_path / "teacher", *LEAD, f"distill.lead_model={lead}", "train.max_steps=2", *evals))
    args = ["--arm-run", str(arm), "--times", "2", "--name", "tiny", "--runs", str(tmp_path / "runs")]
    result = handoff_curve.main([*args, "--out", str(tmp_path / "out")])["tiny"]
    assert [p["step"] for p in result["handoff"]] == [2, 4] and [p["step"] for p in result["alone"]] == [2]
    assert result["lead"] == {"model": str(lead), "steps": 1, "at_steps": [2]}
    report = (tmp_path / "out" / "RESULTS.md").read_text()
    assert "## tiny" in report and "Reading: at its last evaluation within the recipe's length (step 2 of 2)" in report
    records = arm / "metrics.jsonl"
    lines = [json.loads(line) for line in records.read_text().splitlines()]
    records.write_text("".join(json.dumps(dict(r, kid=r["kid"] + 1) if r.get("kind") else r) + "\n" for r in lines))
    with pytest.raises(SystemExit, match="the new run differs from the arm's at step 2"):
        handoff_curve.main([*args, "--out", str(tmp_path / "out")])
    with pytest.raises(ConfigError, match="is not a run trained for a lead"):
        handoff_curve.main(["--arm-run", str(lead), "--name", "x", "--runs", str(tmp_path / "runs")])
