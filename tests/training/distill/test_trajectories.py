"""The teacher's trajectories for trajectory distillation (moh_dit/training/distill/trajectories.py, trajectory_sources.py,
moh_dit/cli/trajectories.py): the sampler's states against a hand-written Euler, the grid with the student's times,
a set recorded in pieces (a stopped recording finished later, on two processes) equal to one recorded at once, a
folder of another plan refused before anything is written, a set of another teacher refused, a missing or damaged
shard named; and a trajectory distillation that records its set, trains and resumes exactly."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from safetensors.torch import load_file

from moh_dit.errors import ArtifactError, ConfigError
from moh_dit.seeding import index_generator
from moh_dit.training.config import load_config
from moh_dit.training.distill.sources import warn_of_seed
from moh_dit.training.distill.trajectories import (
    MANIFEST,
    NOISE_STREAM,
    StoredTrajectories,
    TrajectoryPlan,
    record_trajectories,
    run_teacher_sampler,
    trajectory_grid,
)
from moh_dit.training.trainer import train

from ...helpers.factories import run_command, tiny_train_config, torchrun, train_tiny

TEACHER = {"sha256": "ab" * 32, "objective": {"name": "flow"}, "guidance": {"scale": 2.0}}


def toy_velocity(z, t, labels):
    """A smooth velocity with a label: v = (0.5 + t) z + label."""
    return (0.5 + t).reshape(-1, 1, 1, 1) * z + labels.reshape(-1, 1, 1, 1).float()


def plan(**changed) -> TrajectoryPlan:
    fields = dict(teacher=TEACHER, sampler="euler", steps=4, grid=trajectory_grid(4, (1, 2)), count=7, shard_size=3,
                  seed=0, null_share=0.25, null_id=2, num_classes=2, shape=[1, 2, 2])  # fmt: skip
    return TrajectoryPlan(**(fields | changed))


def record(folder, the_plan=None, **kw):
    calls = []

    def velocity(z, t, labels):
        calls.append(len(z))
        return toy_velocity(z, t, labels)

    return record_trajectories(folder, the_plan or plan(), velocity, lambda: sum(calls), torch.device("cpu"), **kw)


def test_the_grid_holds_the_teachers_steps_and_the_students_sampling_times():
    assert trajectory_grid(4, (1, 2)) == [1.0, 0.75, 0.5, 0.25, 0.0]
    assert trajectory_grid(3, (1, 2, 4)) == [1.0, 0.75, 0.666666667, 0.5, 0.333333333, 0.25, 0.0]


def test_the_sampler_keeps_one_state_per_grid_time_as_a_hand_written_euler_does():
    grid = [1.0, 0.6, 0.25, 0.0]
    z = torch.randn(3, 1, 2, 2, generator=torch.Generator().manual_seed(0))
    labels = torch.tensor([0, 1, 2])
    states = run_teacher_sampler(toy_velocity, z, labels, grid, "euler")
    expected = [z]  # z_next = z + (s_next - s) v(z, s)
    for s, s_next in zip(grid, grid[1:]):
        expected.append(expected[-1] + (s_next - s) * toy_velocity(expected[-1], torch.full((3,), s), labels))
    torch.testing.assert_close(states, torch.stack(expected, 1), rtol=1e-5, atol=1e-6)


def test_the_second_order_samplers_follow_the_exact_trajectory_closer_than_euler():
    """dz/dt = c z has z(s) = z(1) exp(c (s - 1)): Heun and UniPC keep states nearer it than Euler at every time."""
    grid = trajectory_grid(8, (1, 2))
    z = torch.randn(4, 1, 2, 2, generator=torch.Generator().manual_seed(1))
    exact = torch.stack([z * torch.exp(torch.tensor(1.5 * (s - 1))) for s in grid], 1)
    errors = {
        name: (run_teacher_sampler(lambda x, t, y: 1.5 * x, z, torch.zeros(4), grid, name) - exact).abs().max()
        for name in ("euler", "heun", "unipc")
    }
    assert errors["heun"] < errors["euler"] / 5 and errors["unipc"] < errors["euler"] / 2, (
        errors
    )  # its first step: Euler


def test_a_recording_stopped_and_finished_later_equals_one_made_at_once(tmp_path):
    whole = record(tmp_path / "whole")
    assert whole["complete"] and len(whole["shards"]) == 3 and whole["cost"]["images"] == 7
    assert whole["cost"]["evaluations"] == 7 * 4  # one evaluation per Euler step and trajectory
    cut = tmp_path / "cut"
    record(cut)
    (cut / "shard-00001.safetensors").unlink()  # as a stopped recording leaves it: some shards, an open plan
    manifest = json.loads((cut / MANIFEST).read_text())
    (cut / MANIFEST).write_text(json.dumps({"plan": manifest["plan"], "complete": False}))
    again = record(cut)
    assert again["shards"] == whole["shards"]  # bit for bit
    states = load_file(cut / "shard-00002.safetensors")
    assert states["states"].shape == (1, 5, 1, 2, 2) and states["index"].tolist() == [6]


def test_a_folder_of_another_plan_is_refused_before_anything_is_written(tmp_path):
    record(tmp_path / "set")
    before = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "set").iterdir()}
    with pytest.raises(ConfigError, match=r"another teacher or other settings \(steps: 4 -> 5"):
        record(tmp_path / "set", plan(steps=5))
    assert {p.name: p.stat().st_mtime_ns for p in (tmp_path / "set").iterdir()} == before


def test_a_set_of_another_teacher_an_unfinished_set_and_a_damaged_or_missing_shard_are_refused(tmp_path):
    record(tmp_path / "set")
    stored = StoredTrajectories(tmp_path / "set", TEACHER)
    assert stored.count == 7 and stored.identity()["teacher"] == TEACHER
    with pytest.raises(ConfigError, match="another teacher"):
        StoredTrajectories(tmp_path / "set", TEACHER | {"sha256": "cd" * 32})
    shard = tmp_path / "set" / "shard-00001.safetensors"
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match="shard-00001.safetensors is damaged"):
        StoredTrajectories(tmp_path / "set", TEACHER)
    shard.unlink()
    with pytest.raises(ArtifactError, match="shard-00001.safetensors is missing"):
        StoredTrajectories(tmp_path / "set", TEACHER)
    (tmp_path / "open").mkdir()
    (tmp_path / "open" / MANIFEST).write_text(json.dumps({"plan": plan().record(), "complete": False}))
    with pytest.raises(ConfigError, match="unfinished"):
        StoredTrajectories(tmp_path / "open", TEACHER)


def test_a_sets_noises_are_apart_from_the_evaluation_images_at_the_runs_seed():
    """The in-training evaluation samples images 0, 1, ... at the run's seed (sampling's per-index noise); a set
    recorded at that seed draws from a stream of its own, so no trajectory starts from an evaluation image's noise
    (before the stream, trajectory i was evaluation image i, its label too)."""
    evaluation = torch.stack([torch.randn(1, 2, 2, generator=index_generator(0, i)) for i in range(50)])
    own, _ = plan(count=50, noise_stream=NOISE_STREAM).draw(range(50), torch.device("cpu"))
    distance = (own[:, None] - evaluation[None]).flatten(2).norm(dim=2)
    assert distance.min() > 1e-3  # not one noise shared with the first 50 evaluation images
    before, _ = plan(count=50).draw(range(50), torch.device("cpu"))  # a plan recorded without the stream
    assert torch.equal(before, evaluation)
    again, _ = plan(count=50, noise_stream=NOISE_STREAM).draw(range(10, 20), torch.device("cpu"))
    assert torch.equal(again, own[10:20])  # still drawn from the index alone: shards and processes agree


def test_a_finished_set_recorded_before_the_noise_stream_trains_with_a_warning_an_unfinished_one_is_refused(
    tmp_path, caplog
):
    old = record(tmp_path / "old")  # the plan without a stream, as sets were recorded before it
    assert "noise_stream" not in old["plan"]
    assert record(tmp_path / "old", plan(noise_stream=NOISE_STREAM))["shards"] == old["shards"]
    stored = StoredTrajectories(tmp_path / "old", TEACHER)
    with caplog.at_level("WARNING", logger="moh_dit.train"):
        warn_of_seed(stored, 1)  # another seed: its own warning, no overlap with that seed's evaluation images
    assert "recorded at seed 0, this run's train.seed is 1" in caplog.text and "image noises" not in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="moh_dit.train"):
        warn_of_seed(stored, 0)  # the set's seed: the run's evaluation images are its first trajectories
    assert "recorded from sampling's own image noises at seed 0" in caplog.text
    new = record(tmp_path / "new", plan(noise_stream=NOISE_STREAM))
    caplog.clear()
    with caplog.at_level("WARNING", logger="moh_dit.train"):
        warn_of_seed(StoredTrajectories(tmp_path / "new", TEACHER), 0)
    assert new["plan"]["noise_stream"] == NOISE_STREAM and caplog.text == ""
    manifest = json.loads((tmp_path / "old" / MANIFEST).read_text())
    (tmp_path / "old" / MANIFEST).write_text(json.dumps({"plan": manifest["plan"], "complete": False}))
    with pytest.raises(ConfigError, match="other settings \\(noise_stream"):
        record(tmp_path / "old", plan(noise_stream=NOISE_STREAM))


def test_the_pairs_read_the_chosen_trajectorys_two_states_and_its_label(tmp_path):
    record(tmp_path / "set")
    stored = StoredTrajectories(tmp_path / "set", TEACHER)
    pick = torch.tensor([0.0, 0.5, 0.99])  # trajectories 0, 3 and 6
    first, second, labels = stored.pairs({"pick": pick}, torch.tensor([0, 1, 2]), torch.tensor([4, 3, 2]), "cpu")
    shards = [load_file(tmp_path / "set" / f"shard-0000{k}.safetensors") for k in range(3)]
    torch.testing.assert_close(first[1], shards[1]["states"][0, 1])
    torch.testing.assert_close(second[2], shards[2]["states"][0, 2])
    assert labels.tolist() == [shards[0]["labels"][0], shards[1]["labels"][0], shards[2]["labels"][0]]


@pytest.fixture(scope="module")
def flow_teacher(image_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("teacher") / "flow"
    train_tiny(out, image_dir, "objective.name=flow", "train.max_steps=4", "preview.per_class=0")
    return out


TRAJECTORY = ["objective.name=distill", "distill.method=trajectory", "distill.trajectory_count=6",
              "distill.trajectory_shard_size=2", "distill.trajectory_steps=3", "distill.grid_share=0.5",
              "preview.per_class=0"]  # fmt: skip


def test_the_command_records_on_two_processes_what_one_process_records(flow_teacher, tmp_path):
    """moh-dit trajectories on two processes (torchrun on CPU: two processes that see each other, not two recorders of
    one process each), stopped after its first shards and run again, equals one process."""
    args = ["--teacher", flow_teacher, "--count", "6", "--shard-size", "2", "--steps", "3"]
    run_command([sys.executable, "-m", "moh_dit", "trajectories", *args, "--out", tmp_path / "one"])
    two = tmp_path / "two"
    first = run_command(torchrun("-m", "moh_dit", "trajectories", *args, "--out", two))
    assert first.stdout.count("trajectories, ") == 1 and "(2 process(es))" in first.stdout
    (two / "shard-00002.safetensors").unlink()
    manifest = json.loads((two / MANIFEST).read_text())
    (two / MANIFEST).write_text(json.dumps({"plan": manifest["plan"], "complete": False}))
    done = run_command(torchrun("-m", "moh_dit", "trajectories", *args, "--out", two))
    assert "6 trajectories" in done.stdout
    shards = [json.loads((f / MANIFEST).read_text())["shards"] for f in (tmp_path / "one", two)]
    assert shards[0] == shards[1]


def test_a_trajectory_distillation_records_its_set_trains_and_refuses_another_teachers_set(
    flow_teacher, image_dir, tmp_path
):
    config = tiny_train_config(tmp_path / "student", image_dir)
    summary = train(load_config(config, [f"distill.teacher={flow_teacher}", *TRAJECTORY, "train.max_steps=2"]))
    run = tmp_path / "student"
    assert summary["step"] == 2 and (run / "trajectories" / MANIFEST).is_file()
    record_ = json.loads((run / "trajectories" / MANIFEST).read_text())
    assert record_["complete"] and record_["plan"]["teacher"]["sha256"] and record_["cost"]["evaluations"] > 0
    objective = json.loads((run / "pipeline" / "transformer" / "config.json").read_text())["objective"]
    assert objective["method"] == "trajectory"
    other = tmp_path / "other"
    train_tiny(other, image_dir, "objective.name=flow", "train.max_steps=2", "preview.per_class=0", "train.seed=5")
    again = [f"distill.teacher={other}", *TRAJECTORY, f"distill.trajectories={run / 'trajectories'}"]
    with pytest.raises(ConfigError, match="another teacher"):
        train(load_config(tiny_train_config(tmp_path / "s2", image_dir), again))
    assert not (tmp_path / "s2" / "checkpoints").exists()


def test_the_documented_pair_records_a_set_that_the_documented_config_trains_on(flow_teacher, image_dir, tmp_path):
    """As docs/objective.md writes them, in fresh processes: moh-dit trajectories --config CONFIG (overrides) records
    the set the same config's run asks for (its guidance 3, grid [1, 2, 4], Euler), and train.py trains on it; only
    the sizes are made small, on both sides alike."""
    from pathlib import Path

    from ...helpers.factories import tiny_train_overrides

    root = Path(__file__).resolve().parents[3]
    config = root / "configs" / "fashion_mnist_moh_distill_trajectory.yaml"
    small = [*tiny_train_overrides(tmp_path / "student", image_dir), f"distill.teacher={flow_teacher}",
             "distill.trajectory_count=6", "distill.trajectory_shard_size=2", "distill.trajectory_steps=3",
             "train.max_steps=2", "optim.warmup_steps=1", "preview.per_class=0", "log.eval_every=0"]  # fmt: skip
    recorded = run_command(
        [sys.executable, "-m", "moh_dit", "trajectories", "--config", config, *small, "--out", tmp_path / "set"]
    )
    assert "6 trajectories" in recorded.stdout
    plan_ = json.loads((tmp_path / "set" / MANIFEST).read_text())["plan"]
    assert plan_["sampler"] == "euler" and plan_["teacher"]["guidance"]["scale"] == 3.0 and 0.25 in plan_["grid"]
    run_command(
        [sys.executable, root / "train.py", "--config", config, *small, f"distill.trajectories={tmp_path / 'set'}"]
    )
    assert (
        json.loads((tmp_path / "student" / "pipeline" / "transformer" / "config.json").read_text())["objective"][
            "method"
        ]
        == "trajectory"
    )
    assert not (tmp_path / "student" / "trajectories").exists()  # it trained on the set given, recording none


@pytest.mark.slow  # a recording and a training in fresh processes; the set's checks alone: the tests above
def test_a_set_of_another_seed_trains_the_run_and_the_run_says_so(flow_teacher, image_dir, tmp_path, caplog):
    """The command's help and the run agree: a set recorded at seed 0 trains a run of train.seed=1, with a warning that
    the two seeds share the teacher's samples."""
    from moh_dit.cli.trajectories import build_parser

    assert "a set recorded at another seed than the run's train.seed trains it, and the run says so" in " ".join(
        build_parser().description.split()
    )
    args = [
        "--teacher",
        str(flow_teacher),
        "--count",
        "6",
        "--shard-size",
        "2",
        "--steps",
        "3",
        "--grid-steps",
        "1",
        "2",
    ]
    run_command([sys.executable, "-m", "moh_dit", "trajectories", *args, "--out", tmp_path / "set"])
    config = tiny_train_config(tmp_path / "s", image_dir)
    with caplog.at_level("WARNING"):
        train(load_config(config, [f"distill.teacher={flow_teacher}", *TRAJECTORY, "train.max_steps=1", "train.seed=1",
                                   f"distill.trajectories={tmp_path / 'set'}"]))  # fmt: skip
    assert "was recorded at seed 0, this run's train.seed is 1" in caplog.text


def test_the_command_without_a_teacher_or_with_overrides_but_no_config_says_so(tmp_path):
    from moh_dit.cli.trajectories import build_parser, resolve

    with pytest.raises(ConfigError, match="name the teacher: --teacher RUN, or --config CONFIG"):
        resolve(build_parser().parse_args(["--out", str(tmp_path)]))
    with pytest.raises(ConfigError, match="distill.teacher=x: a config override needs --config"):
        resolve(build_parser().parse_args(["distill.teacher=x", "--out", str(tmp_path)]))


def test_a_key_of_another_method_is_refused_in_one_line(flow_teacher, image_dir, tmp_path):
    config = tiny_train_config(tmp_path / "s", image_dir)
    with pytest.raises(ConfigError, match="distill.tangent_warmup: not an option of distill.method=trajectory"):
        load_config(config, [f"distill.teacher={flow_teacher}", *TRAJECTORY, "distill.tangent_warmup=5"])
    with pytest.raises(ConfigError, match="distill.trajectory_count: not an option of distill.method=meanflow"):
        load_config(
            config, ["objective.name=distill", f"distill.teacher={flow_teacher}", "distill.trajectory_count=5"]
        )


def test_a_trajectory_distillation_stopped_in_its_recording_and_in_training_resumes_as_an_uninterrupted_one(
    flow_teacher, image_dir, tmp_path
):
    """One process: the run stopped after a shard of its set (as a kill would leave it) and again after two training
    steps, resumed each time, ends with the set, the per-step losses, the teacher's evaluations and the weights of a
    run made at once."""
    from safetensors.torch import load_file as weights

    def run(out, *more):
        config = tiny_train_config(out, image_dir)
        return train(load_config(config, [f"distill.teacher={flow_teacher}", *TRAJECTORY, "train.checkpoint_every=2",
                                          *more]))  # fmt: skip

    whole, cut = tmp_path / "whole", tmp_path / "cut"
    run(whole, "train.max_steps=4")
    run(cut, "train.max_steps=2")
    for shard in ("shard-00001.safetensors", "shard-00002.safetensors"):  # the recording stopped after its first shard
        (cut / "trajectories" / shard).unlink()
    manifest = json.loads((cut / "trajectories" / MANIFEST).read_text())
    (cut / "trajectories" / MANIFEST).write_text(json.dumps({"plan": manifest["plan"], "complete": False}))
    run(cut, "train.max_steps=4", "train.resume=latest")
    sets = [json.loads((r / "trajectories" / MANIFEST).read_text())["shards"] for r in (whole, cut)]
    assert sets[0] == sets[1]
    records = [[json.loads(x) for x in (r / "metrics.jsonl").read_text().splitlines()] for r in (whole, cut)]
    keys = ("step", "distill_loss", "teacher_evaluations")
    assert [[r.get(k) for k in keys] for r in records[0]] == [[r.get(k) for k in keys] for r in records[1]]
    final = [weights(r / "pipeline" / "transformer" / "diffusion_pytorch_model.safetensors") for r in (whole, cut)]
    assert all(torch.equal(final[0][k], final[1][k]) for k in final[0])


def test_trajectories_drawn_online_train_and_resume_as_an_uninterrupted_run(flow_teacher, image_dir, tmp_path):
    """distill.trajectories=online: each step runs the teacher's sampler on the step's own noise and labels (nothing
    stored, the teacher's evaluations counted), and a stopped run resumes to the same losses."""

    def run(out, *more):
        config = tiny_train_config(out, image_dir)
        extra = [
            f"distill.teacher={flow_teacher}",
            *TRAJECTORY,
            "distill.trajectories=online",
            "train.checkpoint_every=2",
        ]
        return train(load_config(config, [*extra, *more]))

    run(tmp_path / "whole", "train.max_steps=4")
    run(tmp_path / "cut", "train.max_steps=2")
    run(tmp_path / "cut", "train.max_steps=4", "train.resume=latest")
    assert not (tmp_path / "whole" / "trajectories").exists()
    records = [
        [json.loads(x) for x in (tmp_path / r / "metrics.jsonl").read_text().splitlines()] for r in ("whole", "cut")
    ]
    keys = ("step", "distill_loss", "teacher_evaluations")
    assert [[r.get(k) for k in keys] for r in records[0]] == [[r.get(k) for k in keys] for r in records[1]]
    assert records[0][-1]["teacher_evaluations"] >= 4 * 4 * 3  # four steps of four samples, three sampler steps each
