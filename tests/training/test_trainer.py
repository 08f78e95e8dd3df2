"""The training loop on CPU: tiny runs in pixel and latent space, exact resume after SIGKILL, two
processes, EMA semantics, bad input, non-finite loss."""

import itertools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from moh_dit.errors import ConfigError, DataError, NonFiniteLossError
from moh_dit.run_folder import find_checkpoint
from moh_dit.sampling.pipeline import MoHDiTPipeline
from moh_dit.training.config import EMASection, load_config
from moh_dit.training.setup import make_ema
from moh_dit.training.trainer import Trainer, train

from ..helpers.factories import (
    as_overrides,
    generation_settings,
    run_command,
    tiny_train_overrides,
    tiny_vae,
    torchrun,
    train_tiny,
)

ROOT = Path(__file__).resolve().parents[2]


tiny_overrides = tiny_train_overrides


def read_metrics(out_dir):
    return [json.loads(line) for line in (Path(out_dir) / "metrics.jsonl").read_text().splitlines()]


# ----------------------------------------------------------------------------------------------------
def test_pixel_space_run_logs_checkpoints_and_exports(tmp_path, image_dir):
    out = tmp_path / "run"
    summary = train_tiny(out, image_dir)
    assert summary["step"] == 4 and summary["stop_reason"] == "max_steps"
    metrics = read_metrics(out)
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    assert all(np.isfinite(m["diffusion_loss"]) and m["moh_loss"] > 0 for m in metrics)
    usage = metrics[0]["head_usage"]
    assert len(usage) == 6 and len(usage[0]) == 6 and usage[0][0] == 1.0  # shared head always used
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-00000002", "step-00000004"]
    assert (out / "config.yaml").exists() and (out / "samples" / "final.png").exists()
    pipe = MoHDiTPipeline.from_pretrained(out / "pipeline")
    assert pipe.id2label == {0: "bright", 1: "dark"} and pipe.vae is None
    images = pipe(["dark", 0], num_inference_steps=2, output_type="np", progress=False).images
    assert images.shape == (2, 8, 8, 3)


def test_loss_decreases_on_a_memorisation_task(tmp_path, image_dir):
    out = tmp_path / "mem"
    train_tiny(
        out,
        image_dir,
        "train.max_steps=80",
        "train.global_batch_size=8",
        "train.checkpoint_every=1000",
        "preview.per_class=0",
        "optim.lr=2e-3",
        "log.head_usage=false",
    )
    losses = [m["diffusion_loss"] for m in read_metrics(out)]
    assert np.mean(losses[-15:]) < 0.6 * np.mean(losses[:15])


def test_training_with_a_tiny_vae_and_with_pre_extracted_latents(tmp_path, image_dir):
    from moh_dit.data.image_folder import ImageFolderDataset
    from moh_dit.data.latents import extract_latents
    from moh_dit.vae import load_vae

    tiny_vae().save_pretrained(tmp_path / "vae")
    out = tmp_path / "latent-run"
    train_tiny(out, image_dir, f"data.vae={tmp_path / 'vae'}", "train.max_steps=2", image_size=16)
    assert np.isfinite(read_metrics(out)[-1]["diffusion_loss"])
    pipe = MoHDiTPipeline.from_pretrained(out / "pipeline")
    assert pipe.vae is not None and pipe.transformer.config.in_channels == 4
    assert pipe([1], num_inference_steps=2, output_type="np", progress=False).images.shape == (1, 16, 16, 3)

    ds = ImageFolderDataset(image_dir, 16)
    lat = extract_latents(
        ds, load_vae(str(tmp_path / "vae")), tmp_path / "lat.npy", vae_name=str(tmp_path / "vae"), id2label=ds.id2label
    )
    out2 = tmp_path / "packed-run"
    train_tiny(out2, lat, "data.name=latents", "train.max_steps=2", image_size=16)
    assert np.isfinite(read_metrics(out2)[-1]["diffusion_loss"])
    assert MoHDiTPipeline.from_pretrained(out2 / "pipeline").vae is not None


def test_the_first_log_record_projects_the_time_of_the_remaining_steps(tmp_path, image_dir, caplog):
    import logging

    with caplog.at_level(logging.INFO, logger="moh_dit.train"):
        train_tiny(tmp_path / "run", image_dir, "train.max_steps=6", "log.log_every=2")
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("projected:")]
    first = read_metrics(tmp_path / "run")[0]  # the speed of steps 1-2; 4 steps are left after it
    speed = first["steps_per_s"]
    assert said == [
        f"projected: {4 / speed / 60:.3g} more minutes to step 6 at {speed:.2f} steps/s (the speed of the first 2 "
        "steps; previews, evaluations and the export come on top)"
    ]


def _train_cmd(overrides):
    return [sys.executable, str(ROOT / "train.py"), *overrides]


def _train_here(overrides) -> dict:
    """``train.py`` with these overrides, in this process (the process under test is the stopped one)."""
    from moh_dit.training.trainer import train

    return train(load_config(None, overrides))


def test_sigkill_and_resume_reproduce_per_step_losses(tmp_path, image_dir):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    ref = tmp_path / "ref"
    common = ("train.checkpoint_every=5", "preview.per_class=0")
    _train_here(tiny_overrides(ref, image_dir, "train.max_steps=24", *common))

    killed = tmp_path / "killed"
    proc = subprocess.Popen(
        _train_cmd(tiny_overrides(killed, image_dir, "train.max_steps=100000", *common)),
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.time() + 120
    while find_checkpoint(killed) is None and time.time() < deadline:
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    at_kill = find_checkpoint(killed)
    assert at_kill is not None and int(at_kill.name.split("-")[1]) < 24
    _train_here(tiny_overrides(killed, image_dir, "train.max_steps=24", "train.resume=latest", *common))

    a, b = read_metrics(ref), read_metrics(killed)
    assert [m["step"] for m in b] == list(range(1, 25))
    assert [(m["diffusion_loss"], m["moh_loss"]) for m in a] == [(m["diffusion_loss"], m["moh_loss"]) for m in b]
    from safetensors.torch import load_file

    wa = load_file(ref / "pipeline" / "transformer" / "diffusion_pytorch_model.safetensors")
    wb = load_file(killed / "pipeline" / "transformer" / "diffusion_pytorch_model.safetensors")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_two_process_cpu_run(tmp_path, image_dir):
    out = tmp_path / "ddp"
    out.mkdir()
    probe = ROOT / "tests" / "helpers" / "ddp_probe.py"
    run_command(
        torchrun(probe, out, *tiny_overrides(out / "run", image_dir, "train.max_steps=3", "preview.per_class=0"))
    )
    r0, r1 = (json.loads((out / f"rank{r}.json").read_text()) for r in range(2))
    assert r0["world"] == r1["world"] == 2
    assert all(a != b for a, b in zip(r0["seen"], r1["seen"]))  # different data on each rank
    assert r0["weights_sha"] == r1["weights_sha"] and r0["ema_sha"] == r1["ema_sha"]  # grads were averaged
    logged = read_metrics(out / "run")
    for step, m in enumerate(logged):
        mean_d = (r0["local_losses"][step][0] + r1["local_losses"][step][0]) / 2
        mean_m = (r0["local_losses"][step][1] + r1["local_losses"][step][1]) / 2
        assert m["diffusion_loss"] == pytest.approx(mean_d, rel=1e-6)
        assert m["moh_loss"] == pytest.approx(mean_m, rel=1e-6)


# ----------------------------------------------------------------------------------------------------
def test_ema_is_dit_constant_decay_from_a_copy():
    model = torch.nn.Linear(3, 2)
    p0 = [p.detach().clone() for p in model.parameters()]
    ema = make_ema(model, EMASection(decay=0.9))
    expected = p0
    for _ in range(3):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p))
        ema.step(model.parameters())
        expected = [0.9 * e + 0.1 * p.detach() for e, p in zip(expected, model.parameters())]
        for s, e in zip(ema.shadow_params, expected):
            torch.testing.assert_close(s, e)


def test_gradient_accumulation_splits_the_global_batch(tmp_path, image_dir):
    out = tmp_path / "accum"
    trainer = Trainer(
        load_config(
            None,
            tiny_overrides(
                out,
                image_dir,
                "train.grad_accum_steps=2",
                "train.global_batch_size=8",
                "train.max_steps=2",
                "preview.per_class=0",
            ),
        )
    )
    assert trainer.micro_batch == 4
    summary = trainer.run()
    assert summary["step"] == 2 and trainer.samples_seen == 16


def test_non_finite_loss_stops_cleanly_and_saves(tmp_path, image_dir, monkeypatch):
    out = tmp_path / "nan"
    trainer = Trainer(
        load_config(
            None,
            tiny_overrides(out, image_dir, "train.max_steps=10", "train.checkpoint_every=100", "preview.per_class=0"),
        )
    )
    original = trainer._micro_step

    def poisoned(x, y, micro, want_heads):
        loss, losses, h = original(x, y, micro, want_heads)
        return (loss * float("nan") if trainer.step == 3 else loss), losses, h

    monkeypatch.setattr(trainer, "_micro_step", poisoned)
    with pytest.raises(NonFiniteLossError, match="non-finite loss at step 4"):
        trainer.run()
    assert find_checkpoint(out).name == "step-00000003"


@pytest.mark.parametrize(
    "override,error,message",
    [
        ("model.preset=MoH-DiT-Huge/2", ConfigError, "unknown preset"),
        ("data.path=/nonexistent/folder", DataError, "does not exist"),
        ("model.overrides.num_classes=5", ValueError, "num_classes=5"),
    ],
)
def test_bad_input_is_rejected_clearly(tmp_path, image_dir, override, error, message):
    with pytest.raises(error, match=message):
        Trainer(load_config(None, tiny_overrides(tmp_path / "bad", image_dir, override)))


def test_resume_from_a_missing_path_fails(tmp_path, image_dir):
    with pytest.raises(ConfigError, match="not a complete checkpoint"):
        load_config(None, tiny_overrides(tmp_path / "r", image_dir, f"train.resume={tmp_path / 'nope'}"))


def test_a_resume_past_max_steps_says_so_and_changes_nothing(tmp_path, image_dir):
    run = tmp_path / "done"
    train_tiny(run, image_dir, "train.max_steps=4", "train.checkpoint_every=2", "preview.per_class=0")
    before = {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(run.rglob("*")) if p.is_file()}
    overrides = tiny_overrides(run, image_dir, "train.max_steps=3", "train.resume=latest", "preview.per_class=0")
    with pytest.raises(
        ConfigError, match=r"step-00000004 is at step 4, already past train.max_steps=3: there is nothing "
    ):
        Trainer(load_config(None, overrides))
    assert {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(run.rglob("*")) if p.is_file()} == before


# ----------------------------------------------------------------------------------------------------
# Integrity: what a run folder may never lose or mix
# ----------------------------------------------------------------------------------------------------
def _state(ckpt):
    from safetensors.torch import load_file

    return load_file(Path(ckpt) / "model" / "diffusion_pytorch_model.safetensors")


def test_exploding_weights_never_replace_the_last_good_checkpoint(tmp_path, image_dir):
    out = tmp_path / "boom"
    train_tiny(out, image_dir, "train.keep_last=1", "preview.per_class=0")
    good = find_checkpoint(out)
    assert good.name == "step-00000004"
    before = _state(good)
    # the same run continued with an absurd learning rate: the weights explode at once
    with pytest.raises(NonFiniteLossError, match="not saved; the newest good checkpoint is .*step-00000004"):
        train_tiny(
            out,
            image_dir,
            "train.keep_last=1",
            "train.resume=latest",
            "optim.lr=1e30",
            "train.max_steps=12",
            "preview.per_class=0",
        )
    assert [p.name for p in (out / "checkpoints").iterdir() if not p.name.startswith(".")] == ["step-00000004"]
    after = _state(find_checkpoint(out))
    assert all(torch.equal(before[k], after[k]) for k in before)
    # and the run resumes from it
    summary = train_tiny(
        out, image_dir, "train.keep_last=1", "train.resume=latest", "train.max_steps=6", "preview.per_class=0"
    )
    assert summary["step"] == 6 and find_checkpoint(out).name == "step-00000006"


def test_non_finite_loss_right_after_a_resume_rewrites_its_own_checkpoint(tmp_path, image_dir, monkeypatch):
    out = tmp_path / "again"
    train_tiny(out, image_dir, "preview.per_class=0")
    trainer = Trainer(
        load_config(
            None, tiny_overrides(out, image_dir, "train.resume=latest", "train.max_steps=8", "preview.per_class=0")
        )
    )
    original = trainer._micro_step

    def poisoned(x, y, micro, want_heads):
        loss, losses, h = original(x, y, micro, want_heads)
        return loss * float("nan"), losses, h

    monkeypatch.setattr(trainer, "_micro_step", poisoned)
    with pytest.raises(NonFiniteLossError, match="state before this step is saved in .*step-00000004"):
        trainer.run()
    assert find_checkpoint(out).name == "step-00000004"
    assert not [p for p in (out / "checkpoints").iterdir() if p.name.startswith(".")]  # no temp folders left
    assert train_tiny(out, image_dir, "train.resume=latest", "train.max_steps=6", "preview.per_class=0")["step"] == 6


def test_an_existing_run_folder_is_refused_without_resume_or_overwrite(tmp_path, image_dir):
    from moh_dit.errors import ArtifactError

    out = tmp_path / "taken"
    train_tiny(out, image_dir, "preview.per_class=0")
    metrics_before = (out / "metrics.jsonl").read_text()
    with pytest.raises(ArtifactError, match=r"already holds a run with checkpoints up to step 4.*train.resume=latest"):
        Trainer(load_config(None, tiny_overrides(out, image_dir, "train.max_steps=2", "preview.per_class=0")))
    assert (out / "metrics.jsonl").read_text() == metrics_before
    # explicit overwrite: a fresh run, nothing of the old one mixed in
    train_tiny(out, image_dir, "train.max_steps=2", "train.overwrite=true", "preview.per_class=0")
    assert [m["step"] for m in read_metrics(out)] == [1, 2]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-00000002"]


def test_resume_with_another_set_up_is_refused_and_changed_settings_are_recorded(tmp_path, image_dir):
    from moh_dit.errors import ArtifactError

    out = tmp_path / "ident"
    train_tiny(out, image_dir, "preview.per_class=0")
    with pytest.raises(ArtifactError, match=r"another set-up \(train.seed: 0 -> 1"):
        Trainer(load_config(None, tiny_overrides(out, image_dir, "train.resume=latest", "train.seed=1"))).run()
    train_tiny(out, image_dir, "train.resume=latest", "train.max_steps=6", "optim.lr=5e-4", "preview.per_class=0")
    manifest = json.loads((out / "manifest.json").read_text())
    resume = [e for e in manifest["events"] if e["event"] == "resume"][0]
    assert resume["step"] == 4 and resume["changed"]["optim.lr"] == [1e-3, 5e-4]
    ckpt_manifest = json.loads((find_checkpoint(out) / "manifest.json").read_text())
    assert ckpt_manifest["run_id"] == manifest["run_id"] and ckpt_manifest["step"] == 6
    pipe_manifest = json.loads((out / "pipeline" / "manifest.json").read_text())
    assert pipe_manifest["source"]["step"] == 6 and pipe_manifest["source"]["run_id"] == manifest["run_id"]


def test_a_resume_from_an_older_checkpoint_sets_the_newer_ones_aside(tmp_path, image_dir):
    """Rewinding a run (train.resume=PATH of an older checkpoint) must not leave checkpoints of the abandoned
    past where train.resume=latest, or the run's own final checkpoint, would take them for this run's."""
    out = tmp_path / "rewind"
    train_tiny(out, image_dir, "train.max_steps=6", "preview.per_class=0")
    stale = _state(out / "checkpoints" / "step-00000006")
    rewind = (f"train.resume={out / 'checkpoints' / 'step-00000002'}", "train.max_steps=6", "optim.lr=5e-4")
    train_tiny(out, image_dir, *rewind, "preview.per_class=0")
    found = sorted(p.name for p in (out / "checkpoints").iterdir() if p.name.startswith("step-"))
    assert found == ["step-00000002", "step-00000004", "step-00000006"]
    (aside,) = (out / "checkpoints").glob("set-aside-after-step-00000002-*")
    assert sorted(p.name for p in aside.iterdir()) == ["step-00000004", "step-00000006"]
    assert torch.equal(next(iter(_state(aside / "step-00000006").values())), next(iter(stale.values())))
    new = _state(out / "checkpoints" / "step-00000006")  # this run's step 6, not the abandoned one
    assert any(not torch.equal(new[k], stale[k]) for k in new)
    resume = [e for e in json.loads((out / "manifest.json").read_text())["events"] if e["event"] == "resume"][-1]
    assert resume["step"] == 2 and resume["set_aside"] == str(aside)


def test_class_weights_set_what_an_epoch_draws_and_belong_to_the_run(tmp_path, image_dir):
    from moh_dit.errors import ArtifactError

    out = tmp_path / "weighted"
    weighted = tiny_overrides(out, image_dir, "data.class_weights={dark: 3}", "preview.per_class=0")
    trainer = Trainer(load_config(None, weighted))
    assert trainer.batches_per_epoch == 32 // 4  # 8 bright once, 8 dark three times
    labels = torch.cat([y for _, _, y in itertools.islice(trainer._batches(), 2 * trainer.batches_per_epoch)])
    assert torch.bincount(labels).tolist() == [16, 48]
    trainer.run()
    identity = json.loads((out / "manifest.json").read_text())["identity"]["data"]
    assert identity["class_weights"] == {"0": 1.0, "1": 3.0}
    assert "| class weights | dark x3 per epoch" in (out / "pipeline" / "README.md").read_text()
    # the same weights by id resume; without them the run is another one
    train_tiny(
        out,
        image_dir,
        "data.class_weights={1: 3}",
        "train.resume=latest",
        "train.max_steps=6",
        "preview.per_class=0",
    )
    with pytest.raises(ArtifactError, match=r"another set-up \(data.class_weights"):
        Trainer(load_config(None, tiny_overrides(out, image_dir, "train.resume=latest", "train.max_steps=8")))
    # unweighted runs record no weights (runs from before the setting resume as they were)
    plain = tmp_path / "plain"
    train_tiny(plain, image_dir, "train.max_steps=1", "preview.per_class=0")
    assert "class_weights" not in json.loads((plain / "manifest.json").read_text())["identity"]["data"]


def test_rerunning_a_finished_run_keeps_its_grid_and_pipeline_unless_settings_changed(tmp_path, image_dir):
    out = tmp_path / "done"
    train_tiny(out, image_dir)
    grid, weights = out / "samples" / "final.png", out / "pipeline" / "manifest.json"
    stamps = grid.stat().st_mtime_ns, weights.stat().st_mtime_ns
    again = train_tiny(out, image_dir, "train.resume=latest")  # finished: nothing to train, nothing to redraw
    assert again["step"] == 4 and Path(again["pipeline"]) == out / "pipeline" and Path(again["sample_grid"]) == grid
    assert (grid.stat().st_mtime_ns, weights.stat().st_mtime_ns) == stamps
    # a run recorded before a setting existed (here: snr_gamma) behaved as its default: no change
    record = json.loads((out / "manifest.json").read_text())
    del record["settings"]["train"]["snr_gamma"]
    (out / "manifest.json").write_text(json.dumps(record))
    train_tiny(out, image_dir, "train.resume=latest")
    assert (grid.stat().st_mtime_ns, weights.stat().st_mtime_ns) == stamps
    events = json.loads((out / "manifest.json").read_text())["events"]
    assert not [e for e in events if e["event"] == "resume"][-1]["changed"]
    train_tiny(out, image_dir, "train.resume=latest", "preview.guidance_scale=2.0")  # a changed setting: drawn anew
    assert grid.stat().st_mtime_ns != stamps[0] and weights.stat().st_mtime_ns != stamps[1]
    train_tiny(out, image_dir, "train.resume=latest", "train.max_steps=6")  # trained on: exported anew
    assert json.loads(weights.read_text())["source"]["step"] == 6


def test_first_record_after_a_resume_averages_the_same_steps(tmp_path, image_dir):
    """log_every=4 with checkpoints every 5 steps: the window 5..8 straddles the resume at step 5."""
    common = ("log.log_every=4", "train.checkpoint_every=5", "preview.per_class=0", "log.head_usage=false")
    ref = tmp_path / "ref"
    train_tiny(ref, image_dir, "train.max_steps=12", *common)
    split = tmp_path / "split"
    train_tiny(split, image_dir, "train.max_steps=5", *common)
    train_tiny(split, image_dir, "train.max_steps=12", "train.resume=latest", *common)
    a = {m["step"]: m["diffusion_loss"] for m in read_metrics(ref)}
    b = {m["step"]: m["diffusion_loss"] for m in read_metrics(split)}
    assert [a[s] for s in (4, 8, 12)] == [b[s] for s in (4, 8, 12)]


def test_sigterm_and_sigint_save_a_checkpoint_and_resume_exactly(tmp_path, image_dir):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    common = ("train.checkpoint_every=1000", "preview.per_class=0", "log.log_every=3", "log.head_usage=false")
    ref = tmp_path / "ref"
    _train_here(tiny_overrides(ref, image_dir, "train.max_steps=30", *common))
    for sig, code in ((signal.SIGTERM, 143), (signal.SIGINT, 130)):
        run = tmp_path / sig.name
        proc = subprocess.Popen(
            _train_cmd(tiny_overrides(run, image_dir, "train.max_steps=100000", *common)),
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        deadline = time.time() + 120
        while not ((run / "metrics.jsonl").exists() and (run / "metrics.jsonl").read_text().count("\n") >= 2):
            assert time.time() < deadline and proc.poll() is None
            time.sleep(0.05)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == code, err[-2000:]
        assert "Traceback" not in err and "continue with train.resume=latest" in err
        step = int(find_checkpoint(run).name.split("-")[1])
        assert 6 <= step < 100000 and not (run / "pipeline").exists()
        _train_here(tiny_overrides(run, image_dir, "train.max_steps=30", "train.resume=latest", *common))
        assert [(m["step"], m["diffusion_loss"]) for m in read_metrics(ref)] == [
            (m["step"], m["diffusion_loss"]) for m in read_metrics(run) if m["step"] % 3 == 0
        ]


# ----------------------------------------------------------------------------------------------------
# Any class count
# ----------------------------------------------------------------------------------------------------
def test_unconditional_training_from_a_flat_folder_and_from_labelled_data(tmp_path, image_dir):
    import shutil

    from moh_dit.sampling.generation import generate_samples
    from moh_dit.sampling.loading import load_pipeline

    flat = tmp_path / "flat"
    flat.mkdir()
    for i, f in enumerate(sorted(image_dir.rglob("*.png"))):
        shutil.copy(f, flat / f"{i}.png")
    out = tmp_path / "uncond"
    train_tiny(out, flat, "model.overrides.num_classes=0", "preview.per_class=2")
    pipe = load_pipeline(out, device="cpu")
    assert pipe.transformer.config.num_classes == 0 and pipe.transformer.y_embedder is None and pipe.id2label == {}
    assert (out / "samples" / "final.png").exists()
    npz = np.load(generate_samples(pipe, tmp_path / "s", generation_settings(num_samples=3, num_inference_steps=2)))
    assert npz["arr_0"].shape == (3, 8, 8, 3) and npz["arr_1"].tolist() == [-1, -1, -1]
    summary = train_tiny(
        tmp_path / "uncond-labelled", image_dir, "model.overrides.num_classes=0", "preview.per_class=0"
    )
    assert summary["step"] == 4


def test_fine_tuning_on_data_with_another_class_count(tmp_path, image_dir):
    import shutil

    from moh_dit.sampling.sources import load_transformer

    from ..helpers.factories import tiny_train_config

    source_run = tmp_path / "two-classes"
    train_tiny(source_run, image_dir, "preview.per_class=0")
    three = tmp_path / "three"
    shutil.copytree(image_dir, three)
    shutil.copytree(image_dir / "dark", three / "grey")
    config = tiny_train_config(tmp_path / "x", three)
    with pytest.raises(ConfigError, match="has 2 classes but this run has 3: pass --init-classes resize"):
        Trainer(load_config(config, [f"model.init_from={source_run}"]))
    source, _ = load_transformer(source_run)
    before = source.state_dict()
    table = "y_embedder.embedding_table.weight"
    for mode in ("resize", "reinit"):
        out = tmp_path / mode
        extra = [f"train.output_dir={out}", f"model.init_from={source_run}", f"model.init_classes={mode}"]
        trainer = Trainer(load_config(config, [*extra, "train.max_steps=1", "preview.per_class=0"]))
        after = trainer.unwrapped.state_dict()
        assert all(torch.equal(before[k], after[k]) for k in before if k != table)
        assert after[table].shape == (4, 32) and before[table].shape == (3, 32)  # 3 classes + null, 2 + null
        kept = [torch.equal(after[table][i], before[table][i]) for i in (0, 1)] + [
            torch.equal(after[table][3], before[table][2])
        ]
        assert kept == ([True] * 3 if mode == "resize" else [False] * 3)
        trainer.run()
        start = json.loads((out / "manifest.json").read_text())["events"][0]
        assert (
            start["init"]["new"] == [table] and start["init"]["classes"] == [2, 3] and len(start["init"]["kept"]) > 50
        )
    # the command line: --init-from and --init-classes, and a one-class model to fine-tune into an unconditional one
    import train as train_script

    train_script.main(
        [
            "--init-from",
            str(source_run),
            "--init-classes",
            "reinit",
            *as_overrides(tiny_train_config(tmp_path / "cli", image_dir)),
            "model.overrides.num_classes=0",
            "train.max_steps=1",
            "preview.per_class=0",
        ]
    )
    assert load_transformer(tmp_path / "cli")[0].y_embedder is None


def test_init_from_records_the_architecture_of_the_weights_not_the_config_preset(tmp_path, image_dir):
    """With init_from the weights are the architecture: the run's config, manifest and card name the preset the
    weights match (the config's preset is not used), and an override the weights contradict is an error."""
    from moh_dit import create_model

    from ..helpers.factories import tiny_train_config

    dit = tmp_path / "dit-transformer"
    create_model("DiT-Ti/4", sample_size=8, in_channels=3, num_classes=2).save_pretrained(dit)
    config = tiny_train_config(tmp_path / "from-dit", image_dir)
    config["model"] = {"preset": "MoH-DiT-Ti/4-50", "init_from": str(dit), "overrides": {"patch_size": 4}}
    Trainer(load_config(config, ["train.max_steps=1", "preview.per_class=0"])).run()
    assert yaml.safe_load((tmp_path / "from-dit" / "config.yaml").read_text())["model"]["preset"] == "DiT-Ti/4"
    manifest = json.loads((tmp_path / "from-dit" / "pipeline" / "manifest.json").read_text())
    assert manifest["source"]["training"]["preset"] == "DiT-Ti/4"
    assert "DiT-Ti/4" in (tmp_path / "from-dit" / "pipeline" / "README.md").read_text()

    config["model"]["overrides"] = {"patch_size": 2, "hidden_size": 32}
    config["train"]["output_dir"] = str(tmp_path / "contradicted")
    with pytest.raises(ConfigError, match=r"contradict .*patch_size=2 \(the weights have 4\), hidden_size=32"):
        Trainer(load_config(config))

    source_run = tmp_path / "tiny"  # an architecture no preset has
    train_tiny(source_run, image_dir, "preview.per_class=0", "train.max_steps=1")
    out = tmp_path / "from-tiny"
    train_tiny(out, image_dir, f"model.init_from={source_run}", "train.max_steps=1", "preview.per_class=0")
    assert yaml.safe_load((out / "config.yaml").read_text())["model"]["preset"] == "custom"
    assert json.loads((out / "pipeline" / "manifest.json").read_text())["source"]["training"]["preset"] is None


def test_snr_gamma_reaches_the_objective(tmp_path, image_dir):
    from ..helpers.factories import tiny_train_config

    trainer = Trainer(load_config(tiny_train_config(tmp_path / "run", image_dir), ["train.snr_gamma=5"]))
    assert trainer.objective.snr_gamma == 5 and trainer.objective.mse_weights[0] < 1e-3


def test_cosine_learning_rate_matches_torch_after_a_linear_warm_up():
    from moh_dit.training.setup import learning_rate

    config = load_config(
        None,
        [
            "optim.lr=1e-3",
            "optim.min_lr=1e-5",
            "optim.warmup_steps=10",
            "optim.schedule=cosine",
            "train.max_steps=110",
        ],
    )
    warm = [learning_rate(config, s) for s in range(10)]
    assert warm == pytest.approx([1e-3 * (s + 1) / 10 for s in range(10)])
    # after warm-up: torch's CosineAnnealingLR over the remaining 100 steps, down to min_lr
    param = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([param], lr=1e-3)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=100, eta_min=1e-5)
    expected = []
    for _ in range(101):
        expected.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert [learning_rate(config, s) for s in range(10, 111)] == pytest.approx(expected, rel=1e-9)
    assert learning_rate(config, 60) == pytest.approx(1e-5 + (1e-3 - 1e-5) / 2)
    assert learning_rate(config, 500) == pytest.approx(1e-5)  # past the end: stays at min_lr
    constant = load_config(None, ["optim.lr=1e-3", "optim.warmup_steps=10", "train.max_steps=110"])
    assert [learning_rate(constant, s) for s in (9, 10, 109)] == pytest.approx([1e-3] * 3)
    with pytest.raises(ConfigError, match="optim.schedule"):
        load_config(None, ["optim.schedule=linear"])
    with pytest.raises(ConfigError, match="optim.min_lr"):
        load_config(None, ["optim.lr=1e-4", "optim.min_lr=1e-3"])


def test_a_cosine_run_logs_its_schedule_and_previews_with_the_chosen_sampler(tmp_path, image_dir, monkeypatch):
    import moh_dit.sampling.guidance as guidance
    from moh_dit.objectives.ddpm import DDPM
    from moh_dit.sampling.spec import GuidanceSpec
    from moh_dit.training.setup import learning_rate

    used, make = [], DDPM.make_scheduler
    monkeypatch.setattr(DDPM, "make_scheduler", lambda self, name: used.append(name) or make(self, name))
    out = tmp_path / "run"
    extra = ["optim.schedule=cosine", "optim.warmup_steps=1", "optim.min_lr=1e-4", "preview.scheduler=dpm-solver"]
    extra += ["preview.guidance_scale=2.5", "preview.guidance_interval=[100,600]", "preview.grid_averaging=400"]
    guided, averaged, shifts, guided_at = [], [], guidance.grid_shifts, GuidanceSpec.guided_at
    monkeypatch.setattr(
        GuidanceSpec, "guided_at", lambda self, *a: guided.append(self.interval) or guided_at(self, *a)
    )
    monkeypatch.setattr(guidance, "grid_shifts", lambda patch: averaged.append(patch) or shifts(patch))
    train_tiny(out, image_dir, *extra)
    config = load_config(out / "config.yaml")
    lrs = [m["lr"] for m in read_metrics(out)]
    assert lrs == pytest.approx([learning_rate(config, s) for s in range(4)])
    assert lrs[1] == pytest.approx(1e-3) and lrs[3] < lrs[2] < lrs[1]
    assert "dpm-solver" in used and (out / "samples" / "final.png").exists()
    assert guided and set(guided) == {(100, 600)}  # the preview grid guided in the configured interval
    assert averaged  # and averaged its patch grids at the low-noise steps
    # the exported pipeline records how the run drew its previews; a checkpoint's comes from the run's config
    from moh_dit.sampling.loading import recorded_sampling

    want = dict(guidance_scale=2.5, guidance_interval=[100, 600], scheduler="dpm-solver")
    want |= dict(num_inference_steps=config.preview.num_steps, grid_averaging=400)
    assert recorded_sampling(out).record() == recorded_sampling(out / "pipeline").record() == want
    assert recorded_sampling(sorted((out / "checkpoints").iterdir())[-1]).record() == want
    with pytest.raises(ConfigError, match="preview.scheduler"):
        load_config(None, ["preview.scheduler=euler"])


# ----------------------------------------------------------------------------------------------------
# Flow matching: everything the trainer does, with the other objective
# ----------------------------------------------------------------------------------------------------
FLOW = ("objective.name=flow", "train.snr_gamma=null")


@pytest.mark.parametrize("prediction", ["velocity", "x"])
def test_a_flow_run_trains_exports_and_samples_with_every_flow_sampler(tmp_path, image_dir, prediction):
    """Velocity prediction, and JiT's x-prediction (the network's output the clean image; recorded, so the pipeline
    turns it into the velocity each sampler takes)."""
    from moh_dit.objectives.flow_schedulers import FlowSDEScheduler
    from moh_dit.sampling.loading import load_pipeline
    from moh_dit.sampling.spec import SamplingSpec

    out = tmp_path / "flow"
    given = [f"objective.prediction={prediction}"] if prediction == "x" else []
    summary = train_tiny(out, image_dir, *FLOW, *given, "preview.scheduler=euler", "preview.num_steps=3")
    assert summary["step"] == 4 and (out / "samples" / "final.png").exists()
    records = read_metrics(out)
    assert all(np.isfinite(r["flow_loss"]) and r["moh_loss"] > 0 for r in records)  # MoH's loss is added
    pipe = load_pipeline(out, device="cpu")
    config = pipe.transformer.config
    recorded = {"name": "flow", "path": "linear", "convention": "moh-dit"} | ({"prediction": "x"} if given else {})
    assert config.objective == recorded and not config.learn_sigma
    assert pipe.transformer.out_channels == 3 and isinstance(pipe.scheduler, FlowSDEScheduler)  # SiT's protocol
    for name in pipe.objective.samplers:
        images = pipe([0, 1], sampling=SamplingSpec.create(name, 3, 2.0), output_type="np", progress=False).images
        assert images.shape == (2, 8, 8, 3) and np.isfinite(images).all()
    manifest = yaml.safe_load((out / "config.yaml").read_text())
    assert manifest["objective"]["name"] == "flow"
    card = (out / "pipeline" / "README.md").read_text()
    assert "flow matching, linear path" in card and "velocity MSE" in card
    assert ("x-prediction" in card) == (prediction == "x")


def test_a_meanflow_run_trains_resumes_exactly_exports_and_samples_in_one_step(tmp_path, image_dir):
    from safetensors.torch import load_file

    from moh_dit.sampling.loading import load_pipeline, recorded_sampling
    from moh_dit.sampling.spec import SamplingSpec
    from moh_dit.training.tracking import objective_loss

    common = ("objective.name=meanflow", "objective.guidance_mix=0.5", "train.snr_gamma=null")
    common += ("preview.num_steps=1", "preview.guidance_scale=1", "train.checkpoint_every=2")
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    summary = train_tiny(whole, image_dir, *common)
    train_tiny(cut, image_dir, *common, "train.max_steps=2", "preview.per_class=0")
    train_tiny(cut, image_dir, *common, "train.resume=latest")
    assert summary["step"] == 4 and (whole / "samples" / "final.png").is_file()
    records = read_metrics(whole)
    assert [objective_loss(r) for r in records] == [objective_loss(r) for r in read_metrics(cut)]
    assert all(np.isfinite(r["meanflow_loss"]) and r["moh_loss"] > 0 for r in records)
    assert any("head_usage" in r or any(k.startswith("heads") for k in r) for r in records)
    a, b = (load_file(r / "checkpoints" / "step-00000004" / "ema.safetensors") for r in (whole, cut))
    assert all(torch.equal(a[k], b[k]) for k in a)

    pipe = load_pipeline(whole, device="cpu")
    assert pipe.transformer.config.time_inputs == 2 and pipe.objective.name == "meanflow"
    assert recorded_sampling(whole / "pipeline") == SamplingSpec.create("meanflow", 1, 1.0)
    for steps in (1, 2):
        images = pipe(
            [0, 1], sampling=SamplingSpec.create("meanflow", steps, 1.0), output_type="np", progress=False
        ).images
        assert images.shape == (2, 8, 8, 3) and np.isfinite(images).all()
    card = (whole / "pipeline" / "README.md").read_text()
    assert "MeanFlow" in card and "JVP" in card


def test_a_gvp_run_trains_and_previews_with_no_other_override(tmp_path, image_dir):
    # the unset preview and evaluation samplers resolve to one the GVP path offers (DPM-Solver++ needs the linear one)
    from moh_dit.sampling.loading import recorded_sampling

    out = tmp_path / "gvp"
    train_tiny(out, image_dir, *FLOW, "objective.path=gvp", "train.max_steps=2", "preview.num_steps=2")
    assert (out / "samples" / "final.png").is_file() and recorded_sampling(
        out / "pipeline"
    ).sampler.scheduler == "euler"


def test_a_flow_run_resumes_to_the_same_losses_and_weights(tmp_path, image_dir):
    from safetensors.torch import load_file

    common = (*FLOW, "objective.time_sampling=logit-normal", "train.checkpoint_every=3", "preview.per_class=0")
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    train_tiny(whole, image_dir, *common, "train.max_steps=6")
    train_tiny(cut, image_dir, *common, "train.max_steps=3")
    train_tiny(cut, image_dir, *common, "train.max_steps=6", "train.resume=latest")
    assert [(m["step"], m["flow_loss"]) for m in read_metrics(cut)] == [
        (m["step"], m["flow_loss"]) for m in read_metrics(whole)
    ]
    assert not any("diffusion_loss" in m for m in read_metrics(whole))  # a flow run names its own loss
    a, b = (load_file(r / "checkpoints" / "step-00000006" / "ema.safetensors") for r in (whole, cut))
    assert all(torch.equal(a[k], b[k]) for k in a)
    from moh_dit.errors import ArtifactError

    # the objective is the run's, and the refusal says so first, by name
    with pytest.raises(ArtifactError, match=r"another set-up \(objective: 'flow' -> 'ddpm', model.learn_sigma"):
        train_tiny(cut, image_dir, "train.max_steps=7", "train.resume=latest", "preview.per_class=0")


def test_init_from_keeps_the_objective_of_the_weights(tmp_path, image_dir):
    first = tmp_path / "first"
    train_tiny(first, image_dir, *FLOW, "objective.convention=sit", "preview.per_class=0")
    tuned = tmp_path / "tuned"
    train_tiny(tuned, image_dir, "train.snr_gamma=null", f"model.init_from={first}", "preview.per_class=0")
    saved = MoHDiTPipeline.from_pretrained(tuned / "pipeline").transformer.config.objective
    assert saved == {"name": "flow", "path": "linear", "convention": "sit"}
    with pytest.raises(ConfigError, match=r"trained with the flow objective, not objective.name=ddpm"):
        train_tiny(tmp_path / "x", image_dir, "objective.name=ddpm", f"model.init_from={first}")
    with pytest.raises(ConfigError, match=r"trained with convention=sit, not objective.convention=repa"):
        train_tiny(tmp_path / "y", image_dir, *FLOW, "objective.convention=repa", f"model.init_from={first}")


def test_flow_runs_unconditional_and_in_bf16(tmp_path, image_dir):
    out = tmp_path / "uncond"
    train_tiny(out, image_dir, *FLOW, "model.overrides.num_classes=0", "preview.per_class=2", "preview.scheduler=heun")
    pipe = MoHDiTPipeline.from_pretrained(out / "pipeline")
    assert pipe.transformer.config.num_classes == 0 and (out / "samples" / "final.png").exists()
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(True)  # a process keeps one mixed precision; this test switches it
    try:
        train_tiny(tmp_path / "bf16", image_dir, *FLOW, "train.mixed_precision=bf16", "preview.per_class=0")
    finally:
        AcceleratorState._reset_state(True)
    assert np.isfinite(read_metrics(tmp_path / "bf16")[-1]["flow_loss"])


@pytest.mark.parametrize("objective", ["ddpm", "flow"])
def test_guidance_folded_into_training_from_the_ema_resumes_exactly_and_samples_unguided(
    tmp_path, image_dir, objective, caplog
):
    """Model Guidance (kappa 0.5: CFG 2 at one evaluation a step) from the EMA's predictions, after a warm-up of two
    steps: a run stopped at step 2 and resumed (the EMA network rebuilt from the restored EMA) ends as the whole one;
    the model records the guidance, and the command line samples it unguided unless asked."""
    from safetensors.torch import load_file

    from moh_dit.training.tracking import objective_loss

    from ..helpers.factories import run_in_process

    common = [f"objective.name={objective}", "objective.guidance_mix=0.5", "objective.guidance_warmup=2"]
    common += ["objective.guidance_source=ema", "train.checkpoint_every=2", "preview.per_class=0"]
    common += ["train.snr_gamma=null"] if objective == "flow" else []
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    summary = train_tiny(whole, image_dir, *common)
    train_tiny(cut, image_dir, *common, "train.max_steps=2")
    train_tiny(cut, image_dir, *common, "train.resume=latest")
    assert [objective_loss(r) for r in read_metrics(whole)] == [objective_loss(r) for r in read_metrics(cut)]
    a, b = (load_file(r / "checkpoints" / "step-00000004" / "ema.safetensors") for r in (whole, cut))
    assert all(torch.equal(a[k], b[k]) for k in a)
    unfolded = train_tiny(tmp_path / "plain", image_dir, *common[:1], *common[4:], "train.max_steps=2")
    warmup = [objective_loss(r) for r in read_metrics(tmp_path / "plain")]
    assert warmup == [objective_loss(r) for r in read_metrics(cut)][:2]  # the warm-up: no guidance yet
    pipe = MoHDiTPipeline.from_pretrained(summary["pipeline"])
    record = pipe.transformer.config.objective
    assert record["guidance_mix"] == 0.5 and record["guidance_scale"] == 1.0 and unfolded["step"] == 2
    logged = run_in_process("sample", [summary["pipeline"], "--per-class", "1", "--out", tmp_path / "g.png"], caplog)
    assert "guidance 1 " in logged or "guidance 1," in logged or "guidance 1)" in logged


@pytest.mark.parametrize(
    "objective",
    [
        ("train.gradient_checkpointing=true",),  # DDPM, gradient checkpointing
        ("objective.name=meanflow", "objective.guidance_mix=0.5", "train.snr_gamma=null"),  # a JVP through the route
    ],
    ids=["ddpm-checkpointing", "meanflow"],
)
def test_token_routing_trains_every_objective_and_leaves_sampling_alone(tmp_path, image_dir, objective):
    out = tmp_path / "run"
    routing = ("token_routing.share=0.5", "token_routing.first_block=1", "token_routing.last_block=-2")
    summary = train_tiny(out, image_dir, *routing, *objective, "train.max_steps=2", "preview.per_class=0")
    assert summary["step"] == 2 and all(np.isfinite(r["moh_loss"]) for r in read_metrics(out))
    pipe = MoHDiTPipeline.from_pretrained(summary["pipeline"])
    assert pipe.transformer._token_route is None  # sampling: every token in every block


def test_token_routing_settings_are_one_line_before_any_data_loads(tmp_path):
    for override, said in (
        ("token_routing.share=1.0", "token_routing.share must be a share of the tokens in \\[0, 1\\)"),
        ("token_routing.last_block=40", "token_routing: the routed span must be blocks first <= last"),
        ("token_routing.first_block=x", "must be a"),
    ):
        with pytest.raises((ConfigError, ValueError), match=said):
            load_config(None, ["token_routing.share=0.5", override] if "share" not in override else [override])


def test_init_from_a_run_with_the_config_that_trained_it_compares_resolved_values(tmp_path, image_dir):
    """The config's ``block: {rope: true}`` is the weights' recorded ``{..., rope_theta: 10000.0}``: fine-tuning a
    modern-block run with its own config starts; a theta the weights do not have is still a contradiction."""
    block = "model.overrides.block={norm: rmsnorm, mlp: swiglu, qk_norm: rmsnorm, rope: true}"
    source = tmp_path / "modern"
    train_tiny(source, image_dir, block, "preview.per_class=0", "train.max_steps=1")
    out = tmp_path / "fine-tuned"
    train_tiny(
        out, image_dir, block, f"model.init_from={source / 'pipeline'}", "train.max_steps=1", "preview.per_class=0"
    )
    assert (out / "pipeline").is_dir()
    with pytest.raises(ConfigError, match="contradict"):
        train_tiny(
            tmp_path / "other-theta", image_dir, block.replace("rope: true", "rope: true, rope_theta: 100"),
            f"model.init_from={source / 'pipeline'}", "train.max_steps=1", "preview.per_class=0",
        )  # fmt: skip


def test_a_start_that_fails_leaves_no_empty_output_folder(tmp_path, image_dir):
    """A run refused at its start (here: a teacher that does not exist) left an empty run folder behind."""
    from moh_dit.errors import ArtifactError

    out = tmp_path / "new" / "run"
    config = load_config(
        None, tiny_train_overrides(out, image_dir, "objective.name=distill", f"distill.teacher={tmp_path}/x")
    )
    with pytest.raises(ArtifactError, match="does not exist"):
        train(config)
    assert not out.exists()
