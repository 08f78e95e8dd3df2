"""Networks trained beside the student (moh_dit/training/distill/companions.py) as DMD2 trains them
(moh_dit/objectives/distill/dmd2.py): the fake score starts as the teacher and trains on its own steps only, the generator on
its; both in every checkpoint with their optimizers and restored exactly on resume; the exported pipeline holds the
generator alone and samples in one step through the command line; a checkpoint without the fake score, or with one
of another architecture, is refused in one line."""

from __future__ import annotations

import json
from functools import partial

import pytest
import torch
from safetensors.torch import load_file, save_file

from moh_dit.errors import ArtifactError, ConfigError
from moh_dit.run_folder import RunLayout
from moh_dit.training.config import load_config
from moh_dit.training.trainer import Trainer, train

from ...helpers.factories import run_in_process, tiny_train_config, train_tiny

DMD2 = ["objective.name=distill", "distill.method=dmd2", "distill.fake_updates=2", "distill.gan_weight=0.01",
        "distill.dmd_steps=[1,2]", "preview.per_class=0", "train.checkpoint_every=3"]  # fmt: skip


@pytest.fixture(scope="module")
def flow_teacher(image_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("teacher") / "flow"
    train_tiny(out, image_dir, "objective.name=flow", "train.max_steps=4", "preview.per_class=0")
    return out


def dmd2(out, image_dir, teacher, *more):
    return load_config(tiny_train_config(out, image_dir), [f"distill.teacher={teacher}", *DMD2, *more])


def test_the_fake_score_starts_as_the_teacher_and_each_network_trains_on_its_own_steps(
    flow_teacher, image_dir, tmp_path
):
    trainer = Trainer(dmd2(tmp_path / "s", image_dir, flow_teacher, "train.max_steps=3"))
    fake = trainer.companions["fake_score"].module
    teacher = trainer.frozen["teacher"].model.state_dict()
    assert all(torch.equal(v.cpu(), teacher[k].cpu()) for k, v in fake.score.state_dict().items())
    assert fake.head is not None  # the GAN term is on
    before_student = {k: v.clone() for k, v in trainer.unwrapped.state_dict().items()}
    before_fake = {k: v.clone() for k, v in fake.state_dict().items()}
    trainer.run()  # steps 0 (generator), 1 and 2 (fake score)
    student_moved = any(not torch.equal(v, before_student[k]) for k, v in trainer.unwrapped.state_dict().items())
    fake_moved = any(not torch.equal(v, before_fake[k]) for k, v in fake.state_dict().items())
    assert student_moved and fake_moved
    records = [json.loads(line) for line in (tmp_path / "s" / "metrics.jsonl").read_text().splitlines()]
    losses = [r for r in records if "vsd_loss" in r]
    assert [r["vsd_loss"] > 0 for r in losses] == [True, False, False]  # the generator's step, then the fake score's
    assert [r["fake_score_loss"] > 0 for r in losses] == [False, True, True]


@pytest.mark.parametrize(
    "gan",
    [[], ["distill.gan_time=[0.02,0.4]"], ["distill.vsd_divergence=js"]],
    ids=["vsd-times", "own-times", "js-weighted"],
)
def test_a_dmd2_run_stopped_and_resumed_ends_as_an_uninterrupted_one_with_its_fake_score(
    flow_teacher, image_dir, tmp_path, gan
):
    """Bit for bit, with the discriminator at the VSD loss's times and at its own (distill.gan_time: drawn apart), and
    with VSD weighted by its density ratio (distill.vsd_divergence: js)."""
    train(dmd2(tmp_path / "whole", image_dir, flow_teacher, "train.max_steps=6", *gan))
    train(dmd2(tmp_path / "cut", image_dir, flow_teacher, "train.max_steps=3", *gan))
    train(dmd2(tmp_path / "cut", image_dir, flow_teacher, "train.max_steps=6", "train.resume=latest", *gan))
    for name in ("companions/fake_score.safetensors", "ema.safetensors", "model/diffusion_pytorch_model.safetensors"):
        a, b = (load_file(RunLayout(tmp_path / r).latest_checkpoint() / name) for r in ("whole", "cut"))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name
    records = [
        [json.loads(x) for x in (tmp_path / r / "metrics.jsonl").read_text().splitlines()] for r in ("whole", "cut")
    ]
    keys = ("step", "distill_loss", "vsd_loss", "fake_score_loss", "gan_generator", "gan_discriminator")
    assert [[r.get(k) for k in keys] for r in records[0]] == [[r.get(k) for k in keys] for r in records[1]]


def test_the_exported_generator_is_alone_and_samples_in_one_step_from_the_command_line(
    flow_teacher, image_dir, tmp_path, caplog
):
    train(dmd2(tmp_path / "s", image_dir, flow_teacher, "train.max_steps=3"))
    pipeline = tmp_path / "s" / "pipeline"
    weights = load_file(pipeline / "transformer" / "diffusion_pytorch_model.safetensors")
    assert not any(k.startswith(("score.", "head.")) for k in weights)
    scheduler = json.loads((pipeline / "scheduler" / "scheduler_config.json").read_text())
    assert scheduler["renoise"] is True
    run_in_process("sample", [pipeline, "--per-class", "1", "--num-steps", "1", "--out", tmp_path / "g.png"], caplog)
    assert (tmp_path / "g.png").is_file()


def test_a_checkpoint_without_the_fake_score_or_with_another_is_refused_in_one_line(flow_teacher, image_dir, tmp_path):
    run = tmp_path / "s"
    train(dmd2(run, image_dir, flow_teacher, "train.max_steps=3"))
    fake = RunLayout(run).latest_checkpoint() / "companions" / "fake_score.safetensors"
    weights = load_file(fake)
    name = next(k for k in weights if k.endswith("head.out.weight"))
    save_file(weights | {name: torch.zeros(1, 3)}, fake)
    with pytest.raises(ArtifactError, match="fake_score.safetensors is for another architecture"):
        train(dmd2(run, image_dir, flow_teacher, "train.max_steps=6", "train.resume=latest"))
    fake.unlink()
    with pytest.raises(ArtifactError, match="holds no fake_score"):
        train(dmd2(run, image_dir, flow_teacher, "train.max_steps=6", "train.resume=latest"))


def test_dmd2_refuses_float16(flow_teacher, image_dir, tmp_path):
    """DMD2 diverges in float16 (its authors', FastGen's finding): refused in one line."""
    from moh_dit.errors import ConfigError

    with pytest.raises(ConfigError, match="diverges in float16"):
        dmd2(tmp_path / "a", image_dir, flow_teacher, "train.mixed_precision=fp16")


@pytest.mark.slow  # a fresh training process in bf16 autocast on the CPU: half a minute
@pytest.mark.parametrize("method", [[], ["distill.method=sid"]], ids=["dmd2", "sid"])
def test_dmd2_trains_in_bfloat16(flow_teacher, image_dir, tmp_path, method):
    """bf16 autocast trains DMD2 (on the CPU here) with finite losses; and SiD, its scores differentiated under it."""
    import sys
    from pathlib import Path

    from ...helpers.factories import run_command, tiny_train_overrides

    root = Path(__file__).resolve().parents[3]
    overrides = tiny_train_overrides(tmp_path / "b", image_dir, f"distill.teacher={flow_teacher}", *DMD2, *method)
    run_command([sys.executable, root / "train.py", *overrides, "train.max_steps=3", "train.mixed_precision=bf16"])
    records = [json.loads(line) for line in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert all(torch.isfinite(torch.tensor(r["distill_loss"])) for r in records if "distill_loss" in r)


def test_repa_beside_dmd2_is_refused_in_one_line(flow_teacher, image_dir, tmp_path):
    """REPA aligns the student's tokens; DMD2's steps alternate between the generator and the fake score."""
    from moh_dit.errors import ConfigError

    with pytest.raises(ConfigError, match="repa.encoder aligns the student's tokens; distill.method=dmd2 trains"):
        dmd2(tmp_path / "a", image_dir, flow_teacher, "repa.encoder=[dinov2-vit-b]")


class _PassCounter:
    """Every block pass of the networks trained, by forward hooks: rows x (1 + 2 when a backward follows) / depth, so
    a pass that stops at the discriminator's block counts its share of the depth. A brute-force count of what
    ``network_evaluations`` computes from the objective."""

    def __init__(self, *networks):
        self.total, self.handles = 0.0, []
        for net in networks:
            depth = len(net.blocks)
            for block in net.blocks:
                self.handles.append(block.register_forward_hook(partial(self._count, depth=depth)))

    def _count(self, module, inputs, out, depth):
        h = out[0] if isinstance(out, tuple) else out
        self.total += h.shape[0] * (3 if h.requires_grad else 1) / depth


def test_each_networks_updates_and_every_pass_are_counted_logged_recorded_and_carried_over_a_resume(
    flow_teacher, image_dir, tmp_path
):
    """Of 7 steps at 2 fake-score updates per generator update: generator at 0, 3, 6. The GAN term from step 2 (the
    fake score alone before). The passes the logs add up equal a count by hooks on every block of the generator and
    the fake score (the discriminator's passes stop at its block); the teacher's are apart."""
    more = ["train.max_steps=7", "distill.gan_start=2", "distill.gan_block=1", "distill.dmd_steps=[1]"]
    trainer = Trainer(dmd2(tmp_path / "s", image_dir, flow_teacher, *more))
    counter = _PassCounter(trainer.unwrapped, trainer.companions["fake_score"].module.score)
    trainer.run()
    records = [json.loads(line) for line in (tmp_path / "s" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "generator_updates" in r]
    assert [(r["step"], r["generator_updates"], r["fake_score_updates"]) for r in steps] == [
        (1, 1, 0), (2, 1, 1), (3, 1, 2), (4, 2, 2), (5, 2, 3), (6, 2, 4), (7, 3, 4)
    ]  # fmt: skip
    assert steps[-1]["network_evaluations"] == pytest.approx(counter.total)
    # the generator's EMA steps with its updates only (the fake score's steps leave it as it was): at decay d its start
    # keeps d ** generator_updates of the scored weights (docs/objective.md#dmd2)
    assert trainer.ema.optimization_step == 3
    # 3 generator steps x 4 images, guided at CFG 4 (two rows) but where the label was dropped (one)
    assert 3 * 4 < steps[-1]["teacher_evaluations"] <= 3 * 4 * 2
    gan = [r["gan_discriminator"] > 0 for r in records if "gan_discriminator" in r]
    assert gan == [False, False, True, False, True, True, False]  # the fake score's steps from step 2 on
    manifest = json.loads((tmp_path / "s" / "manifest.json").read_text())
    stopped = manifest["events"][-1]
    assert (stopped["generator_updates"], stopped["fake_score_updates"]) == (3, 4)
    card = (tmp_path / "s" / "pipeline" / "README.md").read_text()
    assert (
        "| spent | 3 generator updates; 4 fake-score updates; " in card
        and f"{steps[-1]['teacher_evaluations']} of the teacher" in card
    )
    # stopped at 4 and resumed: the counts go on from the checkpoint's
    train(dmd2(tmp_path / "cut", image_dir, flow_teacher, *more[1:], "train.max_steps=4"))
    train(dmd2(tmp_path / "cut", image_dir, flow_teacher, *more, "train.resume=latest"))
    cut = [json.loads(line) for line in (tmp_path / "cut" / "metrics.jsonl").read_text().splitlines()]
    keys = ("step", "generator_updates", "fake_score_updates", "network_evaluations", "teacher_evaluations")
    assert [[r.get(k) for k in keys] for r in cut if "step" in r] == [
        [r.get(k) for k in keys] for r in records if "step" in r
    ]


def test_the_regression_by_the_teachers_features_trains_the_generator_and_its_teacher_passes_are_counted(
    flow_teacher, image_dir, tmp_path
):
    """DMD's regression by the teacher-feature distance: logged on the generator's steps, and the passes the logs add
    up, with the real score's evaluations, equal a count by hooks on every block of the generator, the fake score and
    the teacher (the distance's pass on the trajectory's end without a gradient, on the sample with one)."""
    more = ["train.max_steps=4", "distill.dmd_steps=[1]", "distill.gan_weight=0", "distill.regression=0.5",
            "distill.regression_distance=teacher_features", "distill.regression_feature_time=0.1",
            "distill.trajectory_count=6", "distill.trajectory_shard_size=2", "distill.trajectory_steps=3"]  # fmt: skip
    trainer = Trainer(dmd2(tmp_path / "s", image_dir, flow_teacher, *more))
    assert "by the teacher's block features at flow time 0.1" in trainer.objective.describe_loss()
    teacher = trainer.frozen["teacher"].model
    counter = _PassCounter(trainer.unwrapped, trainer.companions["fake_score"].module.score, teacher)
    trainer.run()  # the trajectories were drawn before the counter's hooks: their cost is the set's, counted apart
    records = [json.loads(line) for line in (tmp_path / "s" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "generator_updates" in r]
    assert [r["regression"] > 0 for r in steps] == [True, False, False, True]  # the generator's steps
    assert steps[-1]["network_evaluations"] + steps[-1]["teacher_evaluations"] == pytest.approx(counter.total)


def test_the_regression_from_each_samples_start_time_records_its_times_and_refuses_a_set_without_them(
    flow_teacher, image_dir, tmp_path
):
    """distill.regression_from: start on a two-step generator whose middle is at 0.3: the set the run records holds
    0.3 (the plan adds the regression's times), the regression is logged on the generator's steps, and a set recorded
    without 0.3 is refused in one line before training."""
    common = ["distill.gan_weight=0", "distill.regression=0.5", "distill.trajectory_count=6",
              "distill.trajectory_shard_size=2", "distill.trajectory_steps=3", "train.max_steps=3"]  # fmt: skip
    middle = ["distill.dmd_midpoint=0.3", "distill.dmd_input=generator", "distill.regression_from=start"]
    trainer = Trainer(dmd2(tmp_path / "s", image_dir, flow_teacher, *common, *middle))
    assert (
        "regression on the teacher's trajectories from each sample's start time" in trainer.objective.describe_loss()
    )
    trainer.run()
    grid = json.loads((tmp_path / "s" / "trajectories" / "trajectories.json").read_text())["plan"]["grid"]
    assert any(abs(t - 0.3) < 1e-9 for t in grid)
    records = [json.loads(line) for line in (tmp_path / "s" / "metrics.jsonl").read_text().splitlines()]
    assert [r["regression"] > 0 for r in records if "generator_updates" in r] == [True, False, False]
    train(dmd2(tmp_path / "noise", image_dir, flow_teacher, *common, "train.max_steps=1"))  # from the noise: no 0.3
    folder = tmp_path / "noise" / "trajectories"
    with pytest.raises(
        ConfigError, match=r"no state at the regression's start times \(distill.regression_from=start\): \[0\.3\]"
    ):
        Trainer(dmd2(tmp_path / "again", image_dir, flow_teacher, *common, *middle, f"distill.trajectories={folder}"))


RCM = ["objective.name=distill", "distill.method=rcm", "distill.trajectory_count=6", "distill.trajectory_shard_size=2",
       "distill.trajectory_steps=3", "distill.student_updates=2", "distill.vsd_start=1", "distill.vsd_weight=0.5",
       "distill.dmd_steps=[1]", "preview.per_class=0", "train.checkpoint_every=3"]  # fmt: skip


def test_rcm_trains_the_secants_and_from_its_start_the_vsd_term_its_fake_score_on_one_step_in_three(
    flow_teacher, image_dir, tmp_path
):
    """rCM's schedule (student, student, fake score, ...), the VSD term from step 1, every pass counted as the hooks
    count them (the student's secant pass, its VSD sample and backward, the fake score's), the teacher's apart; stopped
    and resumed, the same run."""
    config = load_config(
        tiny_train_config(tmp_path / "s", image_dir), [f"distill.teacher={flow_teacher}", *RCM, "train.max_steps=6"]
    )
    trainer = Trainer(config)
    counter = _PassCounter(trainer.unwrapped, trainer.companions["fake_score"].module.score)
    trainer.run()
    records = [json.loads(line) for line in (tmp_path / "s" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "student_updates" in r]
    assert [(r["student_updates"], r["fake_score_updates"]) for r in steps] == [
        (1, 0),
        (2, 0),
        (2, 1),
        (3, 1),
        (4, 1),
        (4, 2),
    ]
    assert [r["vsd_loss"] > 0 for r in steps] == [False, True, False, True, True, False]  # from step 1, student steps
    assert [r["secant_loss"] > 0 for r in steps] == [True, True, False, True, True, False]
    assert steps[-1]["network_evaluations"] == pytest.approx(counter.total)
    cut = tmp_path / "cut"
    base = [f"distill.teacher={flow_teacher}", *RCM]
    train(load_config(tiny_train_config(cut, image_dir), [*base, "train.max_steps=3"]))
    train(load_config(tiny_train_config(cut, image_dir), [*base, "train.max_steps=6", "train.resume=latest"]))
    for name in ("companions/fake_score.safetensors", "model/diffusion_pytorch_model.safetensors"):
        a, b = (load_file(RunLayout(r).latest_checkpoint() / name) for r in (tmp_path / "s", cut))
        assert all(torch.equal(a[k], b[k]) for k in a), name


def test_sid_trains_through_both_scores_counts_their_backwards_and_resumes_exactly(flow_teacher, image_dir, tmp_path):
    """SiD on DMD2's pieces (distill.method=sid): its loss logged on the generator's steps, the fake score's on the
    others; the passes the logs add up, the teacher's included, equal a count by hooks on every block of the
    generator, the fake score and the teacher (each score's pass on a generator step with its backward); stopped at
    step 3 and resumed, the same run bit for bit."""
    more = ["distill.method=sid", "distill.sid_alpha=1.0", "distill.gan_weight=0", "distill.dmd_steps=[1]"]
    trainer = Trainer(dmd2(tmp_path / "s", image_dir, flow_teacher, *more, "train.max_steps=6"))
    assert "SiD's score-identity loss (alpha 1)" in trainer.objective.describe_loss()
    teacher = trainer.frozen["teacher"].model
    counter = _PassCounter(trainer.unwrapped, trainer.companions["fake_score"].module.score, teacher)
    trainer.run()
    records = [json.loads(line) for line in (tmp_path / "s" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "generator_updates" in r]
    assert [r["sid_loss"] != 0 for r in steps] == [True, False, False, True, False, False]
    assert [r["fake_score_loss"] > 0 for r in steps] == [False, True, True, False, True, True]
    assert steps[-1]["network_evaluations"] + steps[-1]["teacher_evaluations"] == pytest.approx(counter.total)
    _cut_at_3_and_resumed_is_the_same(tmp_path / "s", tmp_path / "cut", image_dir, flow_teacher, more)


def test_the_later_steps_own_real_score_scale_is_counted_recorded_and_kept_on_resume(
    flow_teacher, image_dir, tmp_path
):
    """distill.real_guidance_later on SiD's two-step generator with backward simulation: the teacher's evaluations the
    logs add up equal a count by hooks on the teacher (each row three passes, twice over where it is guided: the
    first step's rows at 2, the later step's unguided), the generator records the scale, and a resume that changes it
    is refused in one line naming the key."""
    more = ["distill.method=sid", "distill.gan_weight=0", "distill.dmd_input=generator", "distill.real_guidance=2",
            "distill.real_guidance_later=1", "distill.guidance_times=[0,1]", "train.max_steps=6"]  # fmt: skip
    trainer = Trainer(dmd2(tmp_path / "s", image_dir, flow_teacher, *more))
    assert "(1 on the later grid steps)" in trainer.objective.describe()
    assert trainer.objective.record()["real_guidance_later"] == 1.0 and len(trainer.objective.start_times) == 2
    counter = _PassCounter(trainer.frozen["teacher"].model)
    trainer.run()
    records = [json.loads(line) for line in (tmp_path / "s" / "metrics.jsonl").read_text().splitlines()]
    evaluations = [r for r in records if "generator_updates" in r][-1]["teacher_evaluations"]
    assert evaluations == pytest.approx(counter.total)
    assert 8 * 3 < evaluations < 8 * 3 * 2  # two generator steps of 4 rows, both scales drawn
    _a_resume_changing_it_is_refused(tmp_path / "s", image_dir, flow_teacher, more, "real_guidance_later", "3",
                                     r"1\.0 -> 3\.0")  # fmt: skip


@pytest.mark.parametrize("simulated", ["generator", "generator_fresh"])
def test_a_run_with_the_later_steps_scale_and_the_first_share_resumes_exactly(
    simulated, flow_teacher, image_dir, tmp_path
):
    """SiD's two-step generator with distill.real_guidance_later and distill.dmd_first_share, by either backward
    simulation, stopped at step 3 and resumed: the same run bit for bit (the generator, its EMA and the fake score)
    with the same counts logged."""
    more = ["distill.method=sid", "distill.gan_weight=0", f"distill.dmd_input={simulated}", "distill.real_guidance=2",
            "distill.real_guidance_later=1", "distill.dmd_first_share=0.75", "distill.guidance_times=[0,1]"]  # fmt: skip
    train(dmd2(tmp_path / "s", image_dir, flow_teacher, *more, "train.max_steps=6"))
    _cut_at_3_and_resumed_is_the_same(tmp_path / "s", tmp_path / "cut", image_dir, flow_teacher, more)
    keys = ("step", "generator_updates", "network_evaluations", "teacher_evaluations", "sid_loss")
    runs = [
        [json.loads(line) for line in (r / "metrics.jsonl").read_text().splitlines()]
        for r in (tmp_path / "s", tmp_path / "cut")
    ]
    whole, resumed = ([[r.get(k) for k in keys] for r in run if "generator_updates" in r] for run in runs)
    assert resumed == whole and len(whole) == 6


def test_a_ramped_real_score_scale_is_counted_step_by_step_recorded_and_resumes_exactly(
    flow_teacher, image_dir, tmp_path
):
    """distill.real_guidance_end over distill.real_guidance_ramp on SiD: the real score guided at 2 on the first
    generator step (step 0) and unguided on the second (step 5, past the ramp's 2 steps), so the teacher's evaluations
    the logs add up, equal to a count by hooks on the teacher, are 4 rows x 3 passes x (2 + 1); the generator records
    both keys, a resume that changes the ramp is refused in one line naming it, and the run stopped at step 3 and
    resumed is the same run bit for bit."""
    more = ["distill.method=sid", "distill.gan_weight=0", "distill.dmd_steps=[1]", "distill.real_guidance=2",
            "distill.real_guidance_end=1", "distill.real_guidance_ramp=2", "distill.guidance_times=[0,1]"]  # fmt: skip
    trainer = Trainer(dmd2(tmp_path / "s", image_dir, flow_teacher, *more, "train.max_steps=6"))
    assert "guided at 2, moving to 1 over 2 steps" in trainer.objective.describe()
    assert {k: trainer.objective.record()[k] for k in ("real_guidance_end", "real_guidance_ramp")} == {
        "real_guidance_end": 1.0,
        "real_guidance_ramp": 2,
    }
    counter = _PassCounter(trainer.frozen["teacher"].model)
    trainer.run()
    records = [json.loads(line) for line in (tmp_path / "s" / "metrics.jsonl").read_text().splitlines()]
    evaluations = [r for r in records if "generator_updates" in r][-1]["teacher_evaluations"]
    assert evaluations == pytest.approx(counter.total) == 4 * 3 * (2 + 1)
    _a_resume_changing_it_is_refused(
        tmp_path / "s", image_dir, flow_teacher, more, "real_guidance_ramp", "4", "2 -> 4"
    )
    _cut_at_3_and_resumed_is_the_same(tmp_path / "s", tmp_path / "cut", image_dir, flow_teacher, more)


def _a_resume_changing_it_is_refused(run, image_dir, teacher, more, key, value, change):
    """A resume of ``run`` with ``distill.key`` set to ``value`` instead of what ``more`` gave is refused in one line
    naming the key and ``change`` (a pattern: the recorded value -> the given one)."""
    kept = [o for o in more if not o.startswith(f"distill.{key}=")]
    with pytest.raises(ArtifactError, match=rf"another set-up \(distill\.{key}: {change}") as caught:
        train(
            dmd2(run, image_dir, teacher, *kept, f"distill.{key}={value}", "train.max_steps=7", "train.resume=latest")
        )
    assert "\n" not in str(caught.value)


def _cut_at_3_and_resumed_is_the_same(whole, cut, image_dir, teacher, more):
    """The run of ``more`` stopped at step 3 into ``cut`` and resumed to 6 ends as the uninterrupted ``whole``, bit for
    bit: the generator, its EMA and the fake score."""
    train(dmd2(cut, image_dir, teacher, *more, "train.max_steps=3"))
    train(dmd2(cut, image_dir, teacher, *more, "train.max_steps=6", "train.resume=latest"))
    for name in ("companions/fake_score.safetensors", "ema.safetensors", "model/diffusion_pytorch_model.safetensors"):
        a, b = (load_file(RunLayout(r).latest_checkpoint() / name) for r in (whole, cut))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name


def test_a_guided_fake_score_trains_and_reads_its_cfg_prediction_over_the_guidance_times_alone():
    """distill.fake_guidance: the fake score's loss is its own objective's on the prediction channels guided by hand
    from two plain forwards (conditional and unconditional) where a sample's flow time is in the guidance's times and
    its label kept, the conditional prediction elsewhere and the learned variance always the conditional's; its
    velocity is the teacher's rule (u + w (c - u)) on its own predictions. A fake score without an unconditional
    prediction is refused in one line."""
    from contextlib import nullcontext

    from moh_dit.errors import ConfigError
    from moh_dit.training.distill.companions import FakeScore
    from moh_dit.training.distill.teacher import TeacherGuidance

    from ...helpers.factories import tiny_model

    fake = FakeScore(tiny_model(signal=0.3, learn_sigma=True), gan=False)
    null = fake.score.null_class_id
    x, labels = torch.randn(16, 1, 8, 8), torch.arange(16) % 3
    drop = (torch.arange(16) % 5 == 4).long()
    guidance = TeacherGuidance(scale=3.0, times=(0.2, 0.8))
    y = torch.where(drop.bool(), torch.full_like(labels, null), labels)
    keep = torch.zeros_like(labels)

    losses, _, _ = fake.train_on(x, labels, drop, torch.Generator().manual_seed(0), nullcontext, guidance=guidance)
    own = fake.objective.noised(x, torch.Generator().manual_seed(0), x.device)
    c = fake.score(own.x_t, own.time, y, force_drop_ids=keep).sample
    u = fake.score(own.x_t, own.time, torch.full_like(y, null), force_drop_ids=keep).sample
    times = fake.objective.flow_times(own)
    rows = (times >= 0.2) & (times <= 0.8) & (y != null)
    assert rows.any() and (~rows & (y != null)).any() and (rows.sum() < 16)
    expected = c.clone()
    expected[rows, :1] = u[rows, :1] + 3.0 * (c[rows, :1] - u[rows, :1])
    torch.testing.assert_close(losses.loss, fake.objective.loss(expected.float(), own).loss)
    plain, _, _ = fake.train_on(x, labels, drop, torch.Generator().manual_seed(0), nullcontext)
    torch.testing.assert_close(plain.loss, fake.objective.loss(c.float(), own).loss)

    z, t = torch.randn(16, 1, 8, 8), torch.linspace(0.05, 0.95, 16)
    v = fake.velocity(z, t, labels, drop, nullcontext, guidance)
    vc = fake.objective.linear_velocity(fake.score, z, t, y, keep)
    vu = fake.objective.linear_velocity(fake.score, z, t, torch.full_like(y, null), keep)
    rows = (t >= 0.2) & (t <= 0.8) & (y != null)
    torch.testing.assert_close(v[rows], vu[rows] + 3.0 * (vc[rows] - vu[rows]))
    torch.testing.assert_close(v[~rows], vc[~rows])

    unconditional = FakeScore(tiny_model(class_dropout_prob=0.0), gan=False)
    with pytest.raises(ConfigError, match="trained without label dropout") as caught:
        unconditional.velocity(z, t, labels, None, nullcontext, guidance)
    assert "\n" not in str(caught.value)


def test_a_guided_fake_score_is_counted_recorded_and_resumes_exactly(flow_teacher, image_dir, tmp_path):
    """distill.fake_guidance and distill.fake_guidance_eval on SiD, every flow time guided and (in the counted run) no
    label dropped: the passes the logs add up equal a count by hooks on the generator and the fake score (each guided pass two halves),
    the generator records both scales, a resume that changes one is refused in one line naming it, and the run stopped
    at step 3 and resumed is the same run bit for bit."""
    more = ["distill.method=sid", "distill.gan_weight=0", "distill.dmd_steps=[1]", "distill.real_guidance=2",
            "distill.fake_guidance=2", "distill.fake_guidance_eval=3", "distill.guidance_times=[0,1]"]  # fmt: skip
    trainer = Trainer(dmd2(tmp_path / "counted", image_dir, flow_teacher, *more, "train.max_steps=6"))
    losses_of = trainer.objective.forward_losses  # no label dropped: every row guided, as the logs count them

    def kept(model, noised, labels, drop, *rest, **kw):
        return losses_of(model, noised, labels, None if drop is None else torch.zeros_like(drop), *rest, **kw)

    trainer.objective.forward_losses = kept
    assert "the fake score guided at 2 in training, read at 3 (SiD-LSG)" in trainer.objective.describe_loss()
    assert {k: trainer.objective.record()[k] for k in ("fake_guidance", "fake_guidance_eval")} == {
        "fake_guidance": 2.0,
        "fake_guidance_eval": 3.0,
    }
    counter = _PassCounter(trainer.unwrapped, trainer.companions["fake_score"].module.score)
    trainer.run()
    records = [json.loads(line) for line in (tmp_path / "counted" / "metrics.jsonl").read_text().splitlines()]
    assert [r for r in records if "generator_updates" in r][-1]["network_evaluations"] == pytest.approx(counter.total)
    train(dmd2(tmp_path / "s", image_dir, flow_teacher, *more, "train.max_steps=6"))
    _a_resume_changing_it_is_refused(tmp_path / "s", image_dir, flow_teacher, more, "fake_guidance_eval", "2",
                                     r"3\.0 -> 2\.0")  # fmt: skip
    _cut_at_3_and_resumed_is_the_same(tmp_path / "s", tmp_path / "cut", image_dir, flow_teacher, more)
