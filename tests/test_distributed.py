"""Every multi-process job on two CPU processes, started with torchrun and with accelerate launch, stopped as
schedulers and crashes stop them, and resumed: training (a killed rank, a signal to the launcher, another process
count, gradient accumulation, two nodes on one machine), N-sample generation, evaluation of a model, and latent
extraction. A resumed job must end where an uninterrupted one ends, bit for bit."""

import json
import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from moh_dit.run_folder import RunLayout
from moh_dit.training.tracking import objective_loss

from .helpers.factories import make_image_folder, tiny_train_overrides, train_tiny
from .helpers.launch import ROOT, Job, alive, free_port, launch, run_job

TRAIN = ROOT / "train.py"
# each job runs with one launcher by default and with the other in the slow tests (``pytest -m slow``)
SLOW = pytest.mark.slow
# long enough that a stop lands in the middle (the two processes make about 40 steps a second here)
STEPS, EVERY = 100, 10


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    root = tmp_path_factory.mktemp("images")
    make_image_folder(root)
    return root


def run_args(out, images, *extra):
    return tiny_train_overrides(
        out, images, f"train.max_steps={STEPS}", f"train.checkpoint_every={EVERY}", "preview.per_class=0", *extra
    )


def losses(run):
    records = [json.loads(line) for line in (Path(run) / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], objective_loss(r)[1], r["moh_loss"]) for r in records if "moh_loss" in r]


def final_weights(run):
    ckpt = RunLayout(run).latest_checkpoint()
    return {
        **{f"model.{k}": v for k, v in load_file(ckpt / "model" / "diffusion_pytorch_model.safetensors").items()},
        **{f"ema.{k}": v for k, v in load_file(ckpt / "ema.safetensors").items()},
    }


def assert_same_run(run, reference):
    """The same per-step losses and bit-identical final weights as an uninterrupted run."""
    assert losses(run) == losses(reference)
    a, b = final_weights(run), final_weights(reference)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def assert_complete_checkpoints(run, world=2):
    """Every checkpoint a resume could pick holds all of its files, those of every rank included."""
    layout = RunLayout(run)
    for step, ckpt in layout.list_checkpoints():
        names = {p.name for p in ckpt.iterdir()}
        wanted = {"manifest.json", "trainer_state.json", "model", "ema.safetensors", "optimizer.pt"}
        wanted |= {f"rng-rank{r}.{ext}" for r in range(world) for ext in ("safetensors", "json")}
        assert wanted <= names, (step, sorted(wanted - names))
        assert json.loads((ckpt / "trainer_state.json").read_text())["step"] == step


@pytest.fixture(scope="module")
def reference(images, tmp_path_factory):
    """An uninterrupted two-process run (torchrun)."""
    out = tmp_path_factory.mktemp("reference") / "run"
    run_job(launch("torchrun", TRAIN, *run_args(out, images)), out.with_suffix(".log"))
    return out


def newest_step(run) -> int:
    found = RunLayout(run).list_checkpoints()
    return found[-1][0] if found else 0


# ----------------------------------------------------------------------------------------------------
# Training
# ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "launcher,victim,sig", [("torchrun", 0, signal.SIGTERM), pytest.param("accelerate", 1, signal.SIGINT, marks=SLOW)]
)
def test_a_killed_rank_and_a_signal_to_the_launcher_stop_the_run_and_each_resume_is_exact(
    launcher, victim, sig, images, reference, tmp_path
):
    """One run stopped twice, as clusters stop jobs (one launch of each kind of stop instead of a run for each,
    since every launch pays torch's start-up on every process): a killed rank ends the run promptly; the resume,
    stopped by a signal to the launcher, leaves one checkpoint every rank agrees on; the resume of that ends
    where the uninterrupted run ends, bit for bit."""
    out = tmp_path / "run"
    job = Job(launch(launcher, TRAIN, *run_args(out, images)), tmp_path / "killed.log")
    try:
        job.wait_for(lambda: newest_step(out) >= EVERY, "a first checkpoint")
        ranks = job.ranks()
        assert sorted(ranks) == [0, 1]
        os.kill(ranks[victim], signal.SIGKILL)
        code, _ = job.finish(timeout=60)
    finally:
        job.kill()
    assert code != 0
    assert not any(alive(pid) for pid in ranks.values())  # the other rank did not hang on its dead peer
    killed_at = newest_step(out)
    assert killed_at < STEPS - EVERY, "the run ended before the kill: the test proves nothing"
    assert_complete_checkpoints(out)

    job = Job(launch(launcher, TRAIN, *run_args(out, images, "train.resume=latest")), tmp_path / "stopped.log")
    try:
        job.wait_for(lambda: newest_step(out) > killed_at, "a checkpoint after the resume")
        sent = time.time()
        job.proc.send_signal(sig)
        code, _ = job.finish(timeout=60)
        seconds = time.time() - sent
    finally:
        job.kill()
    assert code != 0 and seconds < 15, (code, seconds)
    step = newest_step(out)
    assert step < STEPS, "the run ended before the signal: the test proves nothing"
    # the ranks agreed on the step: one line from the main process names it, and the checkpoint has every rank
    assert job.text.count(f"stopped at step {step} by {sig.name}") == 1, job.text[-3000:]
    assert_complete_checkpoints(out)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["events"][-1] == {**manifest["events"][-1], "event": "stopped", "step": step, "reason": sig.name}

    run_job(launch(launcher, TRAIN, *run_args(out, images, "train.resume=latest")), tmp_path / "resumed.log")
    assert_same_run(out, reference)


PROBE = ROOT / "tests" / "helpers" / "ddp_probe.py"


def probe(out, images, *extra, steps=4, launcher="torchrun"):
    """Two processes under the probing trainer (``tests/helpers/ddp_probe.py``): what each rank saw and held."""
    out.mkdir()
    args = tiny_train_overrides(out / "run", images, f"train.max_steps={steps}", "preview.per_class=0", *extra)
    run_job(launch(launcher, PROBE, out, *args), out / "probe.log")
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)], args


def test_a_resume_on_another_process_count_is_refused_unless_elastic(images, tmp_path):
    from moh_dit.errors import ConfigError
    from moh_dit.training.config import load_config
    from moh_dit.training.trainer import Trainer

    from .helpers.ddp_probe import ProbeTrainer

    ranks, args = probe(tmp_path / "two", images, "train.checkpoint_every=10", steps=14)
    run = tmp_path / "two" / "run"
    from_step_10 = [*args, f"train.resume={RunLayout(run).checkpoint(10)}"]
    with pytest.raises(ConfigError, match=r"written by 2 processes x 1 accumulation steps, this run has 1 processes"):
        Trainer(load_config(None, from_step_10))

    one = ProbeTrainer(load_config(None, [*from_step_10, "train.elastic_resume=true"]))
    one.run()
    # the global batch of every step is the same items; only the random draws per process differ
    for step in range(10, 14):
        assert sorted(one.seen[step - 10]) == sorted(ranks[0]["seen"][step] + ranks[1]["seen"][step])
    events = json.loads((run / "manifest.json").read_text())["events"]
    resumed = [e for e in events if e["event"] == "resume"][-1]
    assert resumed["world_size"] == 1 and resumed["elastic_from"] == {"world_size": 2, "grad_accum_steps": 1}
    state = json.loads((RunLayout(run).checkpoint(14) / "trainer_state.json").read_text())
    assert (state["world_size"], state["grad_accum_steps"]) == (1, 1)


# MeanFlow's JVP runs on the bare module, past DDP: the trainer averages its gradients by hand
MEANFLOW = ("objective.name=meanflow", "objective.guidance_mix=0.5", "train.snr_gamma=null")


@pytest.fixture(scope="module")
def flow_teacher(images, tmp_path_factory):
    """A tiny flow run (four steps) to distil from."""
    out = tmp_path_factory.mktemp("teacher") / "flow"
    train_tiny(out, images, "objective.name=flow", "train.max_steps=4", "preview.per_class=0")
    return out


def distill(teacher, derivative="finite-difference"):
    return ("objective.name=distill", f"distill.teacher={teacher}", f"distill.derivative={derivative}")


@pytest.mark.parametrize(
    "launcher, objective",
    # MeanFlow's in the default suite (its gradients are averaged by hand); the plain ones on demand
    [
        pytest.param("torchrun", (), marks=SLOW),
        ("torchrun", MEANFLOW),
        ("torchrun", "distill"),
        pytest.param("accelerate", (), marks=SLOW),
    ],
    ids=["torchrun", "torchrun-meanflow", "torchrun-distill", "accelerate"],
)
def test_gradient_accumulation_on_two_processes_averages_every_micro_batch(
    launcher, objective, images, tmp_path, request
):
    """Two processes, two micro-batches each: the applied gradient is the mean of the four micro-batches' (a
    distillation's too: its teacher beside the student on every rank, outside DDP)."""
    from moh_dit.training.config import load_config
    from moh_dit.training.trainer import Trainer

    if objective == "distill":
        objective = distill(request.getfixturevalue("flow_teacher"))
    accumulation = ("train.grad_accum_steps=2", "train.global_batch_size=8", *objective)
    ranks, args = probe(tmp_path / "two", images, *accumulation, steps=2, launcher=launcher)
    saved = [torch.load(tmp_path / "two" / f"rank{r}.pt", weights_only=True) for r in range(2)]
    assert all(len(s["batches"]) == 2 and len(s["batches"][0][0]) == 2 for s in saved)  # 2 micro-batches of 2
    assert ranks[0]["weights_sha"] == ranks[1]["weights_sha"]
    applied = saved[0]["grads"]
    assert all(torch.equal(applied[n], saved[1]["grads"][n]) for n in applied)  # all-reduced once per step

    # the same step on one process, by hand: the mean of the four micro-batches' gradients
    one = Trainer(load_config(None, [*args, "train.output_dir=" + str(tmp_path / "one"), "train.grad_accum_steps=4"]))
    model = one.unwrapped
    for rank, batches in enumerate(s["batches"] for s in saved):
        for micro, (x, y) in enumerate(batches):
            one.rank = rank  # the random draws of that rank's micro-batch
            (one._micro_step(x, y, micro, False)[0] / 4).backward()
    trained = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    assert applied.keys() == trained.keys()
    for name, grad in trained.items():
        torch.testing.assert_close(applied[name], grad, rtol=1e-5, atol=1e-8, msg=name)


@SLOW
def test_two_nodes_on_one_machine_train_and_resume_as_one_node_does(images, reference, tmp_path):
    out = tmp_path / "run"

    def on_two_nodes(*extra, tag):
        port = free_port()
        nodes = [
            Job(
                launch("torchrun", TRAIN, *run_args(out, images, *extra), nproc=1, nodes=(2, r, port)),
                tmp_path / f"{tag}{r}.log",
            )
            for r in range(2)
        ]
        try:
            codes = [node.finish(timeout=300)[0] for node in nodes]
        finally:
            for node in nodes:
                node.kill()
        assert codes == [0, 0], [node.text[-2000:] for node in nodes]
        return [node.text for node in nodes]

    first = on_two_nodes(f"train.max_steps={STEPS // 2}", tag="first")
    assert "2 process(es)" in first[0] and "saved checkpoint" in first[0]
    assert "saved checkpoint" not in first[1]  # node 1's process is rank 1: it writes only its own RNG state
    assert_complete_checkpoints(out)
    on_two_nodes("train.resume=latest", tag="second")
    assert_same_run(out, reference)


# ----------------------------------------------------------------------------------------------------
# The spike guard and evaluations during training
# ----------------------------------------------------------------------------------------------------
FAULTY_TRAIN = ROOT / "tests" / "helpers" / "faulty_train.py"
# on rank 1 only: a spike at step 12 (its update skipped), a NaN at step 16 (a rollback to the checkpoint of 15)
FAULTS = {"rank": 1, "scale": {"12": 200.0, "16": "nan"}}


@SLOW
def test_the_spike_guard_on_two_processes_acts_alike_on_every_rank_and_resumes_exactly(images, tmp_path):
    """Faults on one rank: every rank skips the same update and rolls back to the same checkpoint (the decision
    uses the loss summed over processes), the weights stay equal on every rank, and a run killed after the
    rollback resumes to the same losses, weights, guard counts and quality curve as the uninterrupted run."""
    from .helpers.tiny_extractor import TINY

    guarded = [
        "train.max_steps=25",
        "train.checkpoint_every=5",
        "train.spike_guard=3",
        "train.spike_patience=2",
        "log.eval_every=10",
        "log.eval_samples=8",
        "log.eval_batch_size=2",
        f"log.eval_reference={images}",
        f"log.eval_extractor={TINY}",
        "log.eval_extractor_module=tests.helpers.tiny_extractor",
        "log.eval_sampling.num_steps=2",
        "log.eval_keep_best=kid",
    ]

    def run(out, *extra, faults=FAULTS, expect_ok=True):
        cmd = launch(
            "torchrun", FAULTY_TRAIN, *tiny_train_overrides(out, images, "preview.per_class=0", *guarded, *extra)
        )
        job = Job(
            cmd,
            out.with_suffix(f".{len(list(tmp_path.glob('*.log')))}.log"),
            env={"MOH_DIT_TEST_FAULTS": json.dumps(faults)},
        )
        code, _ = job.finish(timeout=300)
        assert (code == 0) == expect_ok, job.text[-4000:]
        return job.text

    whole = tmp_path / "whole"
    text = run(whole)
    assert "step 13: update skipped" in text and "rolled back to step-00000015" in text
    records = [json.loads(line) for line in (whole / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in records if "moh_loss" in r][-1]
    assert (last["skipped_updates"], last["rollbacks"]) == (2, 1)  # the NaN's update is not applied either
    checkpoint = load_file(whole / "checkpoints" / "step-00000015" / "model" / "diffusion_pytorch_model.safetensors")
    for rank in (0, 1):  # the rollback restored the checkpoint's weights on both ranks, exactly
        restored = load_file(whole / f"rollback-17-rank{rank}.safetensors")
        assert restored.keys() == checkpoint.keys() and all(torch.equal(restored[k], checkpoint[k]) for k in restored)
    final = [load_file(whole / f"final-rank{rank}.safetensors") for rank in (0, 1)]
    assert all(torch.equal(final[0][k], final[1][k]) for k in final[0])  # no rank drifted from the other
    assert [r["step"] for r in records if r.get("kind") == "evaluation"] == [10, 20, 25]

    cut = tmp_path / "cut"
    run(cut, faults=dict(FAULTS, die_at=18), expect_ok=False)  # killed after the rollback, before step 20
    assert newest_step(cut) == 15
    run(cut, "train.resume=latest")
    assert_same_run(cut, whole)
    evaluations = [
        [
            {k: v for k, v in r.items() if k != "seconds"}
            for r in map(json.loads, (run_ / "metrics.jsonl").read_text().splitlines())
            if r.get("kind")
        ]
        for run_ in (cut, whole)
    ]
    assert evaluations[0] == evaluations[1]
    # the best evaluation's EMA model, kept by the main process alone: the same step, score and weights either way
    from moh_dit.manifests import read_manifest

    kept = [read_manifest(run_ / "best", "pipeline")["source"] for run_ in (cut, whole)]
    best = min((r for r in evaluations[1] if r["kind"] == "evaluation"), key=lambda r: (r["kid"], r["step"]))
    assert [(k["step"], k["best"]["value"]) for k in kept] == [(best["step"], best["kid"])] * 2
    weights = [
        load_file(run_ / "best" / "transformer" / "diffusion_pytorch_model.safetensors") for run_ in (cut, whole)
    ]
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])


# ----------------------------------------------------------------------------------------------------
# Sampling, evaluating a model, extracting latents
# ----------------------------------------------------------------------------------------------------
SAMPLES = 32  # in blocks of 2, 100 guided DDPM steps each: a few seconds on two processes
SAMPLING = ["--num-samples", SAMPLES, "--num-steps", "100", "--protocol", "dit", "--cfg-scale", "2", "--seed", "1"]


def kill_rank_when(job, condition, what, rank):
    """SIGKILL one rank once ``condition`` holds; the launcher must then fail promptly, leaving no process."""
    try:
        job.wait_for(condition, what)
        ranks = job.ranks()
        os.kill(ranks[rank], signal.SIGKILL)
        code, _ = job.finish(timeout=60)
    finally:
        job.kill()
    assert code != 0 and not any(alive(pid) for pid in ranks.values())


def pngs(folder) -> int:
    return len(list(Path(folder).glob("*.png"))) if Path(folder).is_dir() else 0


@pytest.fixture(scope="module")
def one_process_samples(reference, tmp_path_factory):
    """The samples of an uninterrupted run on one process (in this process)."""
    from moh_dit.cli.sample import main as sample

    folder = tmp_path_factory.mktemp("one-process") / "samples"
    sample([str(reference), "--sample-dir", str(folder), "--batch-size", "2", *map(str, SAMPLING)])
    return folder.with_suffix(".npz")


# both launchers in the slow set: evaluating a model on two processes (below) resumes its samples after a kill
@pytest.mark.parametrize("launcher", [pytest.param("torchrun", marks=SLOW), pytest.param("accelerate", marks=SLOW)])
def test_sampling_on_two_processes_resumes_after_a_kill_to_the_same_images(
    launcher, reference, one_process_samples, tmp_path
):
    folder = tmp_path / "samples"
    cmd = launch(launcher, ROOT / "sample.py", reference, "--sample-dir", folder, "--batch-size", 2, *SAMPLING)
    kill_rank_when(Job(cmd, tmp_path / "killed.log"), lambda: pngs(folder) >= 4, "4 samples", rank=1)
    assert 0 < pngs(folder) < SAMPLES, "the kill did not land in the middle: the test proves nothing"
    present = pngs(folder)
    text = run_job(cmd, tmp_path / "resumed.log")
    assert f"{present} of {SAMPLES} images present" in text  # only the missing ones were made again
    a, b = np.load(one_process_samples), np.load(folder.with_suffix(".npz"))
    assert np.array_equal(a["arr_0"], b["arr_0"]) and np.array_equal(a["arr_1"], b["arr_1"])
    assert json.loads(str(b["moh_dit_manifest"]))["world_size"] == 2
    assert not list(folder.glob("*.tmp"))  # nothing half-written is left behind


@pytest.fixture(scope="module")
def flow_maps(flow_teacher, images, tmp_path_factory):
    """Two tiny flow maps of the flow teacher (MeanFlow's distillation): a lead (its guidance folded in, at a high
    rate, so that its jump is another) and the model it hands its first step to."""
    root = tmp_path_factory.mktemp("flow-maps")
    lead = ["distill.guidance_scale=3", "optim.lr=0.02", "train.max_steps=3"]
    for name, more in (("lead", lead), ("main", ["train.max_steps=2"])):
        train_tiny(root / name, images, *distill(flow_teacher), *more, "preview.per_class=0")
    return root / "lead", root / "main"


def test_a_hand_off_samples_on_two_processes_the_images_of_one(flow_maps, tmp_path):
    """N-sample generation with a lead (``--lead-model``) on two processes: each process loads the lead, and the set
    is the one a single process draws, image for image, its manifest naming the lead's weights."""
    from moh_dit.cli.sample import main as sample

    lead, main = flow_maps
    args = [main, "--num-samples", 8, "--num-steps", 2, "--lead-model", lead, "--seed", 1, "--batch-size", 2]
    one, two = tmp_path / "one", tmp_path / "two"
    sample([str(a) for a in [*args, "--sample-dir", one]])
    run_job(launch("torchrun", ROOT / "sample.py", *args, "--sample-dir", two), tmp_path / "two.log")
    a, b = np.load(one.with_suffix(".npz")), np.load(two.with_suffix(".npz"))
    assert np.array_equal(a["arr_0"], b["arr_0"]) and np.array_equal(a["arr_1"], b["arr_1"])
    manifest = json.loads(str(b["moh_dit_manifest"]))
    assert manifest["world_size"] == 2 and "lead" in json.dumps(manifest)
    alone = tmp_path / "alone"
    sample([str(a) for a in [*args[:5], "--seed", 1, "--batch-size", 2, "--sample-dir", alone]])
    assert not np.array_equal(np.load(alone.with_suffix(".npz"))["arr_0"], a["arr_0"])  # the lead drew the first step


@pytest.mark.parametrize("launcher", ["accelerate", pytest.param("torchrun", marks=SLOW)])
def test_evaluating_a_model_on_two_processes_resumes_after_a_kill_to_the_same_numbers(
    launcher, reference, one_process_samples, tmp_path
):
    from moh_dit.cli.evaluate import main as evaluate

    from .helpers.tiny_extractor import TINY

    ref = tmp_path / "ref.npz"
    np.savez(ref, arr_0=np.random.default_rng(0).integers(0, 256, (40, 8, 8, 3), dtype=np.uint8))
    scoring = ["--reference", ref, "--extractor", TINY, "--extractor-module", "tests.helpers.tiny_extractor"]
    expected = evaluate(
        ["--samples", str(one_process_samples), *map(str, scoring), "--out", str(tmp_path / "one.json")]
    )

    folder = tmp_path / "samples"
    cmd = launch(
        launcher,
        ROOT / "evaluate_fid.py",
        "--model",
        reference,
        *scoring,
        "--sample-dir",
        folder,
        "--sample-batch-size",
        2,
        *SAMPLING,
        "--out",
        tmp_path / "two.json",
    )
    kill_rank_when(Job(cmd, tmp_path / "killed.log"), lambda: pngs(folder) >= 4, "4 samples", rank=0)
    assert 0 < pngs(folder) < SAMPLES and not (tmp_path / "two.json").exists()
    run_job(cmd, tmp_path / "resumed.log")
    result = json.loads((tmp_path / "two.json").read_text())
    assert result["metrics"] == expected["metrics"]
    assert result["samples"]["manifest"]["world_size"] == 2


@pytest.fixture(scope="module")
def many_images(tmp_path_factory):
    """600 images of 64 px and a tiny VAE: a few seconds of extraction in blocks of 2."""
    from PIL import Image

    from .helpers.factories import tiny_vae

    root = tmp_path_factory.mktemp("many")
    rng = np.random.default_rng(0)
    for name in ("a", "b"):
        (root / "images" / name).mkdir(parents=True)
        for i in range(300):
            Image.fromarray(rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)).save(
                root / "images" / name / f"{i}.png"
            )
    tiny_vae().save_pretrained(root / "vae")
    return root


# both launchers in the slow set: tests/data/test_latents.py resumes an extraction on another number of processes
@pytest.mark.parametrize("launcher", [pytest.param("torchrun", marks=SLOW), pytest.param("accelerate", marks=SLOW)])
def test_latent_extraction_on_two_processes_resumes_after_a_kill_to_the_same_file(
    launcher, many_images, tmp_path, caplog
):
    from .helpers.factories import run_in_process

    args = ["-m", "moh_dit", "latents", "--data-path", many_images / "images", "--image-size", 64]
    args += ["--vae", many_images / "vae", "--num-workers", 0, "--batch-size", 2, "--commit-every", 0]
    run_in_process("latents", [*args[3:], "--out", tmp_path / "one.npy"], caplog)

    out = tmp_path / "two.npy"
    cmd = launch(launcher, *args, "--out", out)

    def records():  # per-process records of finished blocks, once they hold 5 blocks each
        found = tmp_path.glob(".two.npy.partial.npy.done-*.json")
        return [p for p in found if len(json.loads(p.read_text() or "{}")) >= 5]

    kill_rank_when(Job(cmd, tmp_path / "killed.log"), lambda: len(records()) == 2, "5 blocks done per process", rank=0)
    assert not out.exists()
    text = run_job(cmd, tmp_path / "resumed.log")
    done = int(text.split(" of 300 blocks done")[0].rsplit(" ", 1)[1])
    assert 10 <= done < 300, "the kill did not land in the middle: the test proves nothing"
    assert np.load(tmp_path / "one.npy").tobytes() == np.load(out).tobytes()
    manifest = json.loads(out.with_name("two.npy.json").read_text())
    assert manifest["attempts"] == 2 and manifest["world_size"] == 2


# ----------------------------------------------------------------------------------------------------
# Flow matching, REPA and post-hoc EMA on two processes
# ----------------------------------------------------------------------------------------------------
# meanflow in the default suite: every block option, REPA, its hand-averaged gradients; flow and ddpm on demand
@pytest.mark.parametrize("objective", [pytest.param("flow", marks=SLOW), "meanflow", pytest.param("ddpm", marks=SLOW)])
def test_a_run_with_repa_and_post_hoc_ema_resumes_exactly_on_two_processes(objective, images, tmp_path):
    """Flow matching (with every block option and LightningDiT's cosine loss), MeanFlow (guided in training, its
    gradients averaged by hand; with every block option) or DDPM, REPA's alignment and post-hoc EMA snapshots on two
    processes: a run stopped at step 4 and resumed ends as the uninterrupted one, bit for bit: per-step losses (the
    alignment's too), weights, EMA, the power-function EMAs and their snapshots; its pipeline leaves the projectors
    out."""
    from moh_dit.sampling.pipeline import MoHDiTPipeline

    extra = [f"objective.name={objective}", "train.snr_gamma=null", "train.checkpoint_every=4", "preview.per_class=0"]
    extra += ["repa.encoder=moh-dit-test-tokens", "repa.encoder_module=tests.helpers.tiny_encoder", "repa.depth=2"]
    every_option = ["model.overrides.block={norm: rmsnorm, mlp: swiglu, qk_norm: rmsnorm, rope: true}"]
    extra += {
        "flow": ["ema.posthoc_every=8", "objective.time_sampling=logit-normal", "objective.cosine_loss=1.0"]
        + every_option,
        "meanflow": ["ema.posthoc_every=8", "objective.guidance_mix=0.5", *every_option],
        "ddpm": ["ema.posthoc_every=8"],
    }[objective]

    def run(out, *more, tag):
        args = tiny_train_overrides(out, images, *extra, *more)
        return run_job(launch("torchrun", TRAIN, *args), tmp_path / f"{tag}.log")

    whole, cut = tmp_path / "whole", tmp_path / "cut"
    run(whole, "train.max_steps=8", tag="whole")
    run(cut, "train.max_steps=4", tag="first")
    run(cut, "train.max_steps=8", "train.resume=latest", tag="resumed")
    records = [[json.loads(line) for line in (r / "metrics.jsonl").read_text().splitlines()] for r in (whole, cut)]
    keys = ("step", "moh_loss", "repa_loss")
    assert [[r[k] for k in keys] + [objective_loss(r)] for r in records[0]] == [
        [r[k] for k in keys] + [objective_loss(r)] for r in records[1]
    ]
    assert_same_run(cut, whole)
    for name in ("posthoc_ema.safetensors",):
        a, b = (load_file(RunLayout(r).latest_checkpoint() / name) for r in (whole, cut))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    snapshots = [dict(RunLayout(r).list_snapshots()) for r in (whole, cut)]
    assert sorted(snapshots[0]) == [2, 4, 6, 8]  # 8 images a snapshot, 4 a step
    for step, path in snapshots[0].items():
        a, b = load_file(path), load_file(snapshots[1][step])
        assert all(torch.equal(a[k], b[k]) for k in a)
    pipe = MoHDiTPipeline.from_pretrained(whole / "pipeline")
    assert pipe.transformer.projectors is None
    assert (pipe.transformer.config.get("objective") or {}).get("name", "ddpm") == objective


def stopped_and_resumed_as_whole(images, tmp_path, extra: list[str]) -> tuple:
    """Train 8 steps on two processes in one go, and 4 then 4 more resumed in another folder; the two runs must be
    the same bit for bit. Returns their folders ``(whole, cut)``; the logs are ``whole.log``, ``first.log``,
    ``resumed.log`` under ``tmp_path``."""

    def run(out, *more, tag):
        return run_job(launch("torchrun", TRAIN, *tiny_train_overrides(out, images, *extra, *more)), tmp_path / tag)

    whole, cut = tmp_path / "whole", tmp_path / "cut"
    run(whole, "train.max_steps=8", tag="whole.log")
    run(cut, "train.max_steps=4", tag="first.log")
    run(cut, "train.max_steps=8", "train.resume=latest", tag="resumed.log")
    assert_same_run(cut, whole)
    return whole, cut


STABILISED = ["distill.loss=opt-grad", "distill.spatial_invariance=true", "distill.tangent_warmup=4",
              "distill.tangent_clamp=1", "distill.anchor=0.5", "distill.grid_share=0.5"]  # fmt: skip
TRAJECTORY = ["distill.method=trajectory", "distill.trajectory_count=6", "distill.trajectory_shard_size=2",
              "distill.trajectory_steps=3", "distill.grid_share=0.5"]  # fmt: skip
RCM = ["distill.method=rcm", "distill.trajectory_count=6", "distill.trajectory_shard_size=2", "distill.trajectory_steps=3",
       "distill.student_updates=2", "distill.vsd_start=2", "distill.dmd_steps=[1,2]", "distill.dmd_input=generator"]  # fmt: skip
# ECT with its curriculum: the step 0.2 for steps 0-2, 0.1 from 3 (the resume at 4 falls inside), 0.05 from 6
ECT = ["distill.method=ect", "distill.ect_dt=0.05", "distill.guidance_scale=2.0", "distill.grid_share=0.5",
       "distill.ect_dt_start=0.2", "distill.ect_dt_every=3"]  # fmt: skip
DMD2 = ["distill.method=dmd2", "distill.fake_updates=2", "distill.gan_weight=0.01", "distill.gan_start=2", "distill.gan_time=[0.02,0.4]",
        "distill.dmd_steps=[1,2]", "distill.dmd_input=generator", "distill.real_guidance=1.5"]  # fmt: skip

SID = [*DMD2, "distill.method=sid", "distill.sid_alpha=1.0"]
# the later grid step's own real-score scale and a share of the samples from pure noise (each process draws its own)
SID_SPLIT = [*SID, "distill.real_guidance_later=1.0", "distill.dmd_first_share=0.75"]
# the real score's scale ramped from 1.5 to 1 over 5 steps: guided on the first generator step, unguided after the resume
SID_RAMP = [*SID, "distill.real_guidance_end=1.0", "distill.real_guidance_ramp=5"]
# the fake score's own guidance (SiD-LSG): trained through its guided prediction at 1.5, read at 2
SID_LSG = [*SID, "distill.fake_guidance=1.5", "distill.fake_guidance_eval=2.0"]
# the middle's input the first jump of a frozen lead (a flow map: the flow_maps fixture's), loaded on each process
SID_LEAD = [*SID, "distill.dmd_input=lead"]
# backward simulation noised afresh: the path's own noises drawn by each process with the rest of its step's draws
SID_FRESH = [*SID, "distill.dmd_input=generator_fresh"]
# DMD's regression from each sample's start time on the set the run records (0.5 added to its grid) on both processes
DMD2_REGRESSION = [*DMD2, "distill.regression=0.5", "distill.regression_from=start", "distill.trajectory_count=6",
                   "distill.trajectory_shard_size=2", "distill.trajectory_steps=3"]  # fmt: skip

# VSD weighted as Jensen-Shannon by the discriminator's logits (its own times would be refused): each process's batch
# normalises its own weights, the gradients averaged as every other term's
DMD2_JS = [*(o for o in DMD2 if not o.startswith("distill.gan_time=")), "distill.vsd_divergence=js"]


@pytest.mark.parametrize(
    "derivative, student",
    [
        pytest.param("finite-difference", ["distill.end_time_blocks=1"], marks=SLOW),
        pytest.param("finite-difference", ["optim.new_lr_scale=3"], marks=SLOW),  # a variant of the split's route
        pytest.param("finite-difference", STABILISED, marks=SLOW),
        pytest.param(None, TRAJECTORY, marks=SLOW),  # rcm records and trains on a set too; the command on two
        (None, DMD2),  # processes: tests/training/distill/test_trajectories.py
        pytest.param(None, RCM, marks=SLOW),
        pytest.param(None, SID, marks=SLOW),  # DMD2's pieces, the scores differentiated in the generator's steps
        pytest.param(None, SID_SPLIT, marks=SLOW),
        pytest.param(None, SID_RAMP, marks=SLOW),
        pytest.param(None, SID_LSG, marks=SLOW),
        pytest.param(None, SID_LEAD, marks=SLOW),
        pytest.param(None, SID_FRESH, marks=SLOW),
        pytest.param(None, DMD2_REGRESSION, marks=SLOW),
        pytest.param(None, DMD2_JS, marks=SLOW),
        pytest.param(None, ECT, marks=SLOW),  # its target's forward without gradient on the bare network
        pytest.param("jvp", ["distill.end_time_blocks=1"], marks=SLOW),
    ],
    ids=[
        "finite-difference-split",
        "finite-difference-interval-own-lr",
        "stabilised",
        "trajectory",
        "dmd2",
        "rcm",
        "sid",
        "sid-later-share",
        "sid-ramp",
        "sid-lsg",
        "sid-lead",
        "sid-fresh",
        "dmd2-regression-start",
        "dmd2-js",
        "ect",
        "jvp-split",
    ],
)
def test_a_distillation_resumes_exactly_on_two_processes(derivative, student, flow_teacher, images, tmp_path, request):
    """A distillation (MoH student, the teacher's routing-held finite differences or a JVP, Decoupled MeanFlow's split
    or MeanFlow's new interval embedding in its own optimizer group at 3x the rate; the stabilisers and a grid share;
    trajectory distillation recording its set of trajectories on both processes) stopped at step 4 and resumed on two
    processes ends as the uninterrupted one, bit for bit, the teacher's evaluations and the networks' passes and
    updates counted alike (DMD2: its fake score and discriminator too, their gradients averaged over the processes,
    the GAN term switched on at step 2, two-step backward simulation, the real score at its own guidance; SiD with a frozen lead's first jump as the middle's input); every checkpoint
    names its teacher and a resume beside another is refused (tests/training/distill/test_teacher.py)."""
    base = (
        distill(flow_teacher, derivative)
        if derivative
        else ("objective.name=distill", f"distill.teacher={flow_teacher}")
    )
    extra = [*base, *student, "train.checkpoint_every=4", "preview.per_class=0"]
    if student is SID_LEAD:
        extra.append(f"distill.lead_model={request.getfixturevalue('flow_maps')[0]}")
    whole, cut = stopped_and_resumed_as_whole(images, tmp_path, extra)
    assert len(losses(whole)) >= 2 and all(np.isfinite(loss) for _, loss, _ in losses(whole))
    for run in (whole, cut):  # the teacher each checkpoint was trained beside (a resume compares it)
        state = json.loads((RunLayout(run).latest_checkpoint() / "trainer_state.json").read_text())
        assert state["frozen_provenance"]["teacher"]["weights"] == str(
            flow_teacher / "pipeline"
        )  # a run: its pipeline
    spent = (
        "teacher_evaluations",
        "network_evaluations",
        "generator_updates",
        "student_updates",
        "fake_score_updates",
    )
    counted = [[[json.loads(line).get(k) for k in spent] for line in (r / "metrics.jsonl").read_text().splitlines()]
               for r in (whole, cut)]  # fmt: skip
    assert counted[0] == counted[1] and counted[0][-1][0] > 0 and counted[0][-1][1] > 0
    if student in (DMD2, DMD2_JS, RCM):  # the fake score and its optimizer, as the whole run's
        for name in ("fake_score.safetensors", "fake_score.optimizer.pt"):
            a, b = (RunLayout(r).latest_checkpoint() / "companions" / name for r in (whole, cut))
            assert a.read_bytes() == b.read_bytes() or name.endswith(".pt"), name
    if student is ECT:  # the curriculum's step as logged, across the resume: 0.2, 0.1 from step 3, 0.05 from 6
        steps = [[json.loads(line).get("ect_dt") for line in (r / "metrics.jsonl").read_text().splitlines()]
                 for r in (whole, cut)]  # fmt: skip
        sizes = [round(v, 6) for v in steps[1] if v is not None]
        assert steps[0] == steps[1] and sizes == [0.2] * 3 + [0.1] * 3 + [0.05] * 2, sizes
    if student is TRAJECTORY:  # the same set of trajectories, recorded on two processes in either run
        sets = [json.loads((r / "trajectories" / "trajectories.json").read_text())["shards"] for r in (whole, cut)]
        assert sets[0] == sets[1] and len(sets[0]) == 3


@SLOW  # single-process resume with routing: tests/training; two processes: the other runs here
def test_a_run_with_token_routing_resumes_exactly_on_two_processes(images, tmp_path):
    """TREAD on two processes with the modern block (RoPE at the kept tokens' positions) and REPA aligned inside the
    routed span: a run stopped at step 4 and resumed ends as the uninterrupted one, bit for bit (the routes come from
    the step's generator)."""
    extra = ["token_routing.share=0.5", "token_routing.first_block=1", "token_routing.last_block=-2"]
    extra += ["repa.encoder=moh-dit-test-tokens", "repa.encoder_module=tests.helpers.tiny_encoder", "repa.depth=4"]
    extra += ["model.overrides.block={norm: rmsnorm, mlp: swiglu, rope: true}", "train.checkpoint_every=4"]
    extra += ["objective.name=flow", "train.snr_gamma=null", "preview.per_class=0"]
    stopped_and_resumed_as_whole(images, tmp_path, extra)
    log = (tmp_path / "whole.log").read_text()
    assert "token routing (TREAD): 8 of 16 tokens per image skip blocks 1-4" in log  # of 6


@SLOW  # any way of naming the teacher, on one process: tests/training/distill/test_teacher.py
def test_a_distillation_resumes_on_two_processes_with_its_teacher_given_by_another_path(
    flow_teacher, images, tmp_path
):
    """On two processes too, the teacher is what it computes: resumed with a copy of the teacher's folder, the
    student ends bit for bit as one trained beside the original in one go."""
    import shutil

    copy = tmp_path / "teacher-copy"
    shutil.copytree(flow_teacher, copy)
    common = ["objective.name=distill", "train.checkpoint_every=4", "preview.per_class=0"]

    def run(out, teacher, *more, tag):
        args = tiny_train_overrides(out, images, *common, f"distill.teacher={teacher}", *more)
        return run_job(launch("torchrun", TRAIN, *args), tmp_path / tag)

    whole, cut = tmp_path / "whole", tmp_path / "cut"
    run(whole, flow_teacher, "train.max_steps=8", tag="whole.log")
    run(cut, flow_teacher, "train.max_steps=4", tag="first.log")
    run(cut, copy, "train.max_steps=8", "train.resume=latest", tag="resumed.log")
    assert_same_run(cut, whole)
