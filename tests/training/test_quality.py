"""Evaluation during training (``log.eval_every``): the score logged at step N is what ``moh-dit evaluate`` gives
offline for the checkpoint of step N, and a resumed run's curve has every point once."""

import json

import pytest

from moh_dit.data.fashion_mnist import find_fashion_mnist
from moh_dit.errors import ConfigError, EvaluationError
from moh_dit.training.config import load_config
from moh_dit.training.quality import EVALUATION, read_records
from moh_dit.training.trainer import Trainer, train

from ..helpers.factories import tiny_train_overrides
from ..helpers.tiny_extractor import TINY

TINY_EVAL = [
    "log.eval_every=2",
    "log.eval_samples=6",
    "log.eval_batch_size=4",
    f"log.eval_extractor={TINY}",
    "log.eval_extractor_module=tests.helpers.tiny_extractor",
    "log.eval_sampling.num_steps=3",
    "preview.per_class=0",
]


def evaluations(run):
    return read_records(run / "metrics.jsonl", EVALUATION)


def scores(records):
    """What must repeat exactly: the step and every score (not the time it took or where the file is)."""
    return [{k: v for k, v in r.items() if k not in ("seconds",)} for r in records]


@pytest.mark.skipif(find_fashion_mnist() is None, reason="Fashion-MNIST IDX files not installed")
def test_the_score_at_step_n_equals_the_offline_evaluation_of_checkpoint_n(tmp_path):
    """On the embedded default's data and features (Fashion-MNIST, the project's classifier), with guidance."""
    from experiments.common import fashion_reference
    from moh_dit.cli import evaluate as evaluate_cli

    reference, run = fashion_reference(tmp_path, count=60), tmp_path / "run"
    extractor = ["log.eval_extractor=fmnist-classifier", "log.eval_extractor_module=experiments.fmnist_classifier"]
    config = {
        "model": {"preset": "MoH-DiT-Ti/4-75", "overrides": {"hidden_size": 32, "head_dim": 8}},
        "data": {"name": "fashion-mnist", "subset_per_class": 2, "random_flip": False},
        "train": {"output_dir": str(run), "global_batch_size": 8, "max_steps": 3, "checkpoint_every": 2},
        "optim": {"lr": 1e-3},
        "ema": {"decay": 0.9},
        "log": {"log_every": 1, "trackers": []},
        "preview": {"per_class": 0},
    }
    eval_settings = [
        "log.eval_every=2",
        "log.eval_samples=20",
        "log.eval_batch_size=8",
        f"log.eval_reference={reference}",
        "log.eval_sampling.num_steps=4",
        "log.eval_sampling.guidance_scale=1.5",
        *extractor,
    ]
    train(load_config(config, eval_settings))
    records = evaluations(run)
    assert [r["step"] for r in records] == [2, 3]  # every 2 steps, and at the end
    logged = records[0]
    assert logged["num_samples"] == 20 and logged["samples_seen"] == 16

    offline = evaluate_cli.main(
        [
            "--model",
            str(run / "checkpoints" / "step-00000002"),
            "--reference",
            str(reference),
            "--extractor",
            "fmnist-classifier",
            "--extractor-module",
            "experiments.fmnist_classifier",
            "--num-samples",
            "20",
            "--label-mode",
            "balanced",
            "--sample-batch-size",
            "8",
            "--scheduler",
            "dpm-solver",
            "--num-steps",
            "4",
            "--cfg-scale",
            "1.5",
            "--device",
            "cpu",
            "--sample-dir",
            str(tmp_path / "offline"),
        ]
    )
    for key, value in offline["metrics"].items():
        if key in logged:
            assert logged[key] == value, key  # to the last digit
    assert {"kid", "fid", "precision", "recall", "inception_score"} <= set(logged)
    # the same images: the same weights, sampler, seed and labels
    kept = json.loads((run / logged["file"]).read_text())
    assert kept["samples"]["manifest"]["identity"] == offline["samples"]["manifest"]["identity"]
    assert kept["samples"]["manifest"]["images_sha256"] == offline["samples"]["manifest"]["images_sha256"]
    assert not (run / "eval" / "step-00000002").exists()  # the images go once scored; the scores stay

    manifest = json.loads((run / "manifest.json").read_text())
    assert [e["step"] for e in manifest["events"] if e["event"] == "evaluation"] == [2, 3]
    card = (run / "pipeline" / "README.md").read_text()
    assert "## Quality during training" in card and "quality_curve.png" in card
    assert (run / "pipeline" / "quality_curve.png").is_file()


def tiny_run(tmp_path, image_dir, name, *extra):
    """A tiny run (8x8 images) with evaluations every 2 steps on the tiny extractor, against its own images."""
    run = tmp_path / name
    overrides = [*TINY_EVAL, f"log.eval_reference={image_dir}", "train.checkpoint_every=2", *extra]
    return run, load_config(None, tiny_train_overrides(run, image_dir, *overrides))


def test_a_resumed_run_has_every_point_of_its_curve_once(tmp_path, image_dir, monkeypatch):
    whole, config = tiny_run(tmp_path, image_dir, "whole", "train.max_steps=6")
    Trainer(config).run()
    expected = scores(evaluations(whole))
    assert [r["step"] for r in expected] == [2, 4, 6]

    # killed during the evaluation at step 4, after its checkpoint: the resumed run makes it up first
    cut, config = tiny_run(tmp_path, image_dir, "cut", "train.max_steps=6")
    trainer = Trainer(config)
    evaluate = trainer.quality.evaluate

    def killed_at_4(pipe, step, samples_seen):
        if step == 4:
            raise KeyboardInterrupt
        return evaluate(pipe, step, samples_seen)

    monkeypatch.setattr(trainer.quality, "evaluate", killed_at_4)
    with pytest.raises(KeyboardInterrupt):
        trainer.run()
    assert [r["step"] for r in evaluations(cut)] == [2]
    _, config = tiny_run(tmp_path, image_dir, "cut", "train.max_steps=6", "train.resume=latest")
    Trainer(config).run()
    assert scores(evaluations(cut)) == expected

    # resumed from an older checkpoint: the later points are dropped and made again, once
    _, config = tiny_run(
        tmp_path, image_dir, "whole", "train.max_steps=6", f"train.resume={whole / 'checkpoints' / 'step-00000002'}"
    )
    Trainer(config).run()
    assert scores(evaluations(whole)) == expected
    aside = list((whole / "eval").glob("set-aside-after-step-00000002-*"))
    assert len(aside) == 1 and sorted(p.name for p in aside[0].iterdir()) == [
        f"step-00000004.metrics-{TINY}.json",
        f"step-00000006.metrics-{TINY}.json",
    ]

    # a finished run run again: nothing is evaluated twice
    _, config = tiny_run(tmp_path, image_dir, "whole", "train.max_steps=6", "train.resume=latest")
    Trainer(config).run()
    assert scores(evaluations(whole)) == expected


def test_a_meanflow_run_evaluates_itself_in_one_step_without_guidance(tmp_path, image_dir):
    meanflow = ["objective.name=meanflow", "objective.guidance_mix=0.5", "train.snr_gamma=null"]
    run, config = tiny_run(tmp_path, image_dir, "meanflow", *meanflow, "log.eval_sampling.num_steps=1")
    Trainer(config).run()
    records = evaluations(run)
    assert [r["step"] for r in records] == [2, 4] and all(r["kid"] == r["kid"] for r in records)
    identity = json.loads((run / records[0]["file"]).read_text())["samples"]["manifest"]["identity"]
    assert (identity["scheduler"]["name"], identity["num_inference_steps"]) == ("MeanFlowScheduler", 1)
    assert identity["guidance_scale"] == 1.0


def test_more_step_counts_are_scored_beside_the_first_as_their_own_evaluation_would(tmp_path, image_dir):
    """``log.eval_also_steps=[2]`` beside a 1-step MeanFlow evaluation: the records hold kid@2 (and the rest @2),
    each the score a run evaluating at 2 steps logs for the same weights; a repeated count is refused."""
    meanflow = ["objective.name=meanflow", "objective.guidance_mix=0.5", "train.snr_gamma=null", "train.max_steps=2"]
    one = ["log.eval_sampling.num_steps=1", "log.eval_also_steps=[2]"]
    run, config = tiny_run(tmp_path, image_dir, "both", *meanflow, *one)
    Trainer(config).run()
    alone, config = tiny_run(tmp_path, image_dir, "two", *meanflow, "log.eval_sampling.num_steps=2")
    Trainer(config).run()
    (both,), (two,) = evaluations(run), evaluations(alone)
    assert both["kid@2"] != both["kid"]
    for key in ("kid", "fid", "precision", "recall"):
        assert both[f"{key}@2"] == two[key], key
    with pytest.raises(ConfigError, match="log.eval_also_steps must be distinct step counts"):
        load_config(None, ["log.eval_also_steps=[2, 2]"])


def test_evaluation_settings_are_checked_before_a_run_starts(tmp_path, image_dir):
    with pytest.raises(ConfigError, match="log.eval_reference, which is not set"):
        load_config(None, tiny_train_overrides(tmp_path / "a", image_dir, "log.eval_every=10"))
    with pytest.raises(ConfigError, match="log.eval_sampling.num_steps"):
        load_config(None, ["log.eval_sampling.num_steps=0"])
    with pytest.raises(ConfigError, match="unknown config keys.*log.eval_sampling.steps"):
        load_config(None, ["log.eval_sampling.steps=10"])
    with pytest.raises(ConfigError, match="log.eval_samples must be >= 1"):
        load_config(None, ["log.eval_samples=0"])
    missing = tiny_train_overrides(
        tmp_path / "b", image_dir, *TINY_EVAL, f"log.eval_reference={tmp_path / 'nope.npz'}"
    )
    with pytest.raises(ConfigError, match="nope.npz does not exist"):
        Trainer(load_config(None, missing))
    assert not (tmp_path / "b" / "manifest.json").exists()  # stopped before the run began
    (tmp_path / "broken.npz").write_bytes(b"not an array file")
    broken = tiny_train_overrides(
        tmp_path / "c", image_dir, *TINY_EVAL, f"log.eval_reference={tmp_path / 'broken.npz'}"
    )
    with pytest.raises(EvaluationError, match="broken.npz is not a readable array file"):
        Trainer(load_config(None, broken))


def test_the_trackers_get_the_scores_at_their_steps(tmp_path, image_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run, config = tiny_run(tmp_path, image_dir, "run", "train.max_steps=4", "log.trackers=[tensorboard]")
    Trainer(config).run()
    acc = EventAccumulator(str(run / "tensorboard" / "moh-dit"), size_guidance={"scalars": 0})
    acc.Reload()
    records = evaluations(run)
    for key in ("kid", "fid", "precision", "recall"):
        logged = [(e.step, e.value) for e in acc.Scalars(f"eval/{key}")]
        assert logged == [(r["step"], pytest.approx(r[key], rel=1e-6)) for r in records], key


def test_an_evaluation_that_would_not_fit_on_the_disk_stops_before_sampling(tmp_path, image_dir, monkeypatch):
    from moh_dit.evaluation import model_scores
    from moh_dit.files import DiskFullError
    from moh_dit.training.quality import samples_bytes

    run, config = tiny_run(tmp_path, image_dir, "full", "train.max_steps=2")
    monkeypatch.setattr("moh_dit.files.free_bytes", lambda path: 100)  # bytes; the 6 samples of 8 x 8 x 3 need 768
    sampled = []
    monkeypatch.setattr(model_scores, "generate_samples", lambda *args, **kwargs: sampled.append(args))
    with pytest.raises(
        DiskFullError, match=r"not enough space for the evaluation samples of step 2 in .*eval: it needs"
    ):
        Trainer(config).run()
    assert not sampled and (run / "checkpoints" / "step-00000002").is_dir()  # the checkpoint before it is kept
    from ..helpers.factories import tiny_pipeline

    tiny = tiny_pipeline()  # pixel space: the PNGs and the .npz of N images of its size
    side, channels = tiny.transformer.config.sample_size, tiny.transformer.config.in_channels
    assert samples_bytes(tiny, 10) == 2 * 10 * side * side * channels


def weights(path):
    from moh_dit.sampling.loading import load_pipeline

    return load_pipeline(path, device="cpu").transformer.state_dict()


def test_the_best_evaluation_keeps_its_ema_model_and_a_rewound_run_sets_a_later_best_aside(tmp_path, image_dir):
    """``log.eval_keep_best``: ``<run>/best`` holds the EMA weights of the checkpoint whose evaluation scored best
    (KID: the lowest, the earlier of a tie), its manifest says which score and step, the run's manifest has a
    ``best`` event at each improvement; a run resumed from before that step moves it aside and keeps its own."""
    import shutil

    import torch

    from moh_dit.manifests import read_manifest
    from moh_dit.training.quality import improves

    run, config = tiny_run(tmp_path, image_dir, "best", "train.max_steps=6", "log.eval_keep_best=kid")
    Trainer(config).run()
    records = evaluations(run)
    best, improved = None, []
    for r in records:  # the brute-force choice, in the records' order
        if best is None or r["kid"] < best["kid"]:
            best = r
            improved.append(r["step"])
    source = read_manifest(run / "best", "pipeline")["source"]
    assert source["step"] == best["step"] and source["best"]["score"] == "kid"
    assert source["best"]["value"] == best["kid"]
    kept, chosen = weights(run / "best"), weights(run / "checkpoints" / f"step-{best['step']:08d}")
    assert kept.keys() == chosen.keys() and all(torch.equal(kept[k], chosen[k]) for k in kept)
    manifest = json.loads((run / "manifest.json").read_text())
    assert [e["step"] for e in manifest["events"] if e["event"] == "best"] == improved
    assert improves("recall", 0.5, 0.4) and not improves("kid", 0.5, 0.4) and not improves("kid", float("nan"), None)

    # rewound to step 2 with a best of step 6 (the run's final pipeline in its place): that one belongs to a past the
    # run no longer has, so it is set aside; then step 4 is kept (nothing to beat), and step 6 where it beats it
    shutil.rmtree(run / "best")
    shutil.copytree(run / "pipeline", run / "best")
    resumed = ["train.max_steps=6", "log.eval_keep_best=kid", f"train.resume={run / 'checkpoints' / 'step-00000002'}"]
    _, config = tiny_run(tmp_path, image_dir, "best", *resumed)
    Trainer(config).run()
    (aside,) = run.glob("set-aside-after-step-00000002-*")
    assert read_manifest(aside / "best", "pipeline")["source"]["step"] == 6
    by_step = {r["step"]: r["kid"] for r in evaluations(run)}
    expected = 6 if by_step[6] < by_step[4] else 4
    assert read_manifest(run / "best", "pipeline")["source"]["step"] == expected


def test_the_score_a_run_keeps_its_best_by_is_checked_before_it_starts(tmp_path, image_dir):
    with pytest.raises(ConfigError, match=r"log.eval_keep_best must be a score the evaluations record .* got 'lpips'"):
        load_config(None, ["log.eval_keep_best=lpips"])
    with pytest.raises(ConfigError, match=r"log.eval_keep_best=kid@2 selects by a score at 2 steps, which log.eval_also_steps=\[\] does not score"):  # fmt: skip
        load_config(None, ["log.eval_keep_best=kid@2"])
    with pytest.raises(ConfigError, match="log.eval_keep_best=kid selects among the evaluations during training"):
        load_config(None, ["log.eval_keep_best=kid"])
    ok = load_config(None, tiny_train_overrides(tmp_path / "a", image_dir, *TINY_EVAL, f"log.eval_reference={image_dir}", "log.eval_also_steps=[2]", "log.eval_keep_best=kid@2"))  # fmt: skip
    assert ok.log.eval_keep_best == "kid@2"
