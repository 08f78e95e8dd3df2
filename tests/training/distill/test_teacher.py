"""A distillation's teacher (moh_dit/training/distill/teacher.py) and the run around it: a student that starts as its flow
teacher (any interval, MeanFlow's embedding at zero or Decoupled MeanFlow's split) or with its DDPM teacher's backbone;
a teacher that does not fit the data refused in one line before training; the teacher recorded in the run, its
checkpoints and the student's config and card; a resume beside another teacher or without one refused; the student
sampled in one step by the command line."""

import json
import math
import re

import pytest
import torch
import yaml

from moh_dit.errors import ArtifactError, ConfigError
from moh_dit.objectives import objective_of
from moh_dit.sampling.loading import load_pipeline
from moh_dit.training.config import load_config
from moh_dit.training.trainer import Trainer, train

from ...helpers.factories import make_image_folder, run_in_process, tiny_train_config, train_tiny


@pytest.fixture(scope="module")
def teachers(image_dir, tmp_path_factory):
    """A tiny flow teacher and a tiny DDPM teacher (four steps each), guided-able (label dropout)."""
    root = tmp_path_factory.mktemp("teachers")
    train_tiny(root / "flow", image_dir, "objective.name=flow", "train.max_steps=4", "preview.per_class=0")
    train_tiny(root / "ddpm", image_dir, "train.max_steps=4", "preview.per_class=0")
    return root


def distill_config(out, image_dir, teacher, *extra):
    config = tiny_train_config(out, image_dir)
    overrides = ["objective.name=distill", f"distill.teacher={teacher}", "train.max_steps=2", "preview.per_class=0"]
    return load_config(config, [*overrides, *extra])


@pytest.mark.parametrize("split", [0, 2])
def test_a_flow_teachers_student_starts_as_the_teacher(teachers, image_dir, tmp_path, split):
    """Every teacher tensor copied, MeanFlow's interval embedding at zero (or Decoupled MeanFlow's split: no new
    tensor): the untrained student's velocity is the teacher's at every time, and its average velocity over any
    interval is the teacher's instantaneous one."""
    trainer = Trainer(distill_config(tmp_path / "s", image_dir, teachers / "flow", f"distill.end_time_blocks={split}"))
    student, teacher = trainer.unwrapped.eval(), trainer.frozen["teacher"]
    interval = [f"h_embedder.mlp.{i}.{w}" for i in (0, 2) for w in ("bias", "weight")]
    assert trainer.init_report["new"] == ([] if split else interval)
    g = torch.Generator().manual_seed(0)
    z, t = torch.randn(3, 3, 8, 8, generator=g), torch.tensor([0.2, 0.5, 0.9])
    labels = torch.tensor([0, 1, 0])
    with torch.no_grad():
        theirs = teacher.objective.linear_velocity(teacher.model, z, t, labels)
        objective = trainer.objective
        ours = objective.linear_velocity(student, z, t, labels)
        over_an_interval = objective.sign * student(z, objective.network_time(t, t * 0.3), labels).sample
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)
    if not split:  # the interval's embedding adds nothing yet
        torch.testing.assert_close(over_an_interval, theirs, rtol=0, atol=1e-6)
    record = student.config.objective
    assert record["name"] == "distill" and record["time"] == "moh-dit" and record["end_time_blocks"] == split
    assert record["teacher"]["sha256"] == teacher.fingerprint and record["teacher"]["objective"]["name"] == "flow"


def test_a_ddpm_teachers_student_starts_as_its_teacher_in_its_parameterization(teachers, image_dir, tmp_path, caplog):
    """distill.head=teacher: the student of a DDPM teacher sees the teacher's input scale and timestep and
    predicts its noise with the teacher's noise channels (the variance rows cut off), so that up to noise_until the
    untrained student's velocity is the teacher's, and its average velocity over any interval the teacher's
    instantaneous one; later the divisor stays 1 - noise_until. With distill.head=velocity (the default) the output layer is new (a
    velocity of C channels)."""
    trainer = Trainer(distill_config(tmp_path / "s", image_dir, teachers / "ddpm", "distill.head=teacher"))
    student, teacher = trainer.unwrapped.eval(), trainer.frozen["teacher"]
    assert trainer.init_report["new"] == [f"h_embedder.mlp.{i}.{w}" for i in (0, 2) for w in ("bias", "weight")]
    assert student.out_channels == 3 and student.config.objective["time"] == "ddpm"  # DiT's timestep of the level
    assert student.config.objective["head"] == "noise" and student.config.objective["noise_until"] == 0.5
    g = torch.Generator().manual_seed(0)
    z, t, labels = torch.randn(3, 3, 8, 8, generator=g), torch.tensor([0.2, 0.5, 0.9]), torch.tensor([0, 1, 0])
    objective = trainer.objective
    with torch.no_grad():
        theirs = teacher.objective.linear_velocity(teacher.model, z, t, labels)
        ours = objective.linear_velocity(student, z, t, labels)
        over_an_interval = objective.average_velocity(student, z, t, t * 0.3, labels).sample.float()
    # up to noise_until the teacher's; at 0.9 its noise over 1 - 0.5 instead of 1 - 0.9
    expected = theirs * torch.tensor([1.0, 1.0, 0.1 / 0.5]).view(-1, 1, 1, 1)
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(over_an_interval, expected, rtol=1e-5, atol=1e-5)

    with caplog.at_level("WARNING", logger="moh_dit.train"):
        velocity = Trainer(distill_config(tmp_path / "v", image_dir, teachers / "ddpm"))
    assert "final_layer.linear.weight" in velocity.init_report["new"]
    assert "objective.time_sampling=uniform" in caplog.text  # the recipe that made such a student converge
    assert "head" not in velocity.unwrapped.config.objective
    assert torch.equal(velocity.unwrapped.blocks[0].attn.qkv.weight, teacher.model.blocks[0].attn.qkv.weight)
    with pytest.raises(ConfigError, match="distill.head"):
        distill_config(tmp_path / "x", image_dir, teachers / "ddpm", "distill.head=eps")
    with pytest.raises(ConfigError, match="distill.head=noise"):
        Trainer(distill_config(tmp_path / "f", image_dir, teachers / "flow", "distill.head=noise"))
    with pytest.raises(ConfigError, match="distill.noise_until"):
        Trainer(distill_config(tmp_path / "u", image_dir, teachers / "flow", "distill.noise_until=0.7"))
    with pytest.raises(ConfigError, match="distill.noise_until"):
        Trainer(distill_config(tmp_path / "w", image_dir, teachers / "ddpm", "distill.noise_until=1.5"))


def test_a_teacher_that_does_not_fit_is_one_line_before_training(teachers, image_dir, tmp_path):
    other = tmp_path / "three-classes"
    make_image_folder(other)
    (other / "bright").rename(other / "light")  # other class names
    with pytest.raises(ConfigError, match=r"the teacher .* does not fit this run's data: other class names"):
        Trainer(distill_config(tmp_path / "a", other, teachers / "flow"))
    with pytest.raises(ConfigError, match=r"does not fit this run's data: sample_size 8 \(this run's data: 16\)"):
        Trainer(
            distill_config(tmp_path / "b", other.parent / "three-classes", teachers / "flow", "data.image_size=16")
        )
    with pytest.raises(ConfigError, match="a distillation learns from a trained model: name it with distill.teacher"):
        load_config(tiny_train_config(tmp_path / "c", other), ["objective.name=distill"])
    with pytest.raises(ConfigError, match=r"distill.teacher applies to a distillation \(objective.name=distill\)"):
        load_config(tiny_train_config(tmp_path / "c", other), [f"distill.teacher={teachers / 'flow'}"])
    with pytest.raises(
        ConfigError, match=r"hidden_size=64 contradict the teacher's .* 'model\.overrides=\{\}' on the"
    ):
        Trainer(
            load_config(
                tiny_train_config(tmp_path / "d", image_dir),
                ["objective.name=distill", f"distill.teacher={teachers / 'flow'}", "model.overrides.hidden_size=64"],
            )
        )


def test_the_teacher_is_recorded_and_a_resume_needs_the_same_one(teachers, image_dir, tmp_path, caplog):
    out = tmp_path / "student"
    guided = ("distill.guidance_scale=2.0", "distill.guidance_times=[0.2,0.9]", "train.checkpoint_every=2")
    preview = ("preview.per_class=1", "preview.num_steps=1", "preview.guidance_scale=1.0")  # as the distill configs
    summary = train(distill_config(out, image_dir, teachers / "flow", *guided, *preview))
    identity = json.loads((out / "manifest.json").read_text())["identity"]["frozen"]["teacher"]
    state = json.loads((out / "checkpoints" / "step-00000002" / "trainer_state.json").read_text())
    assert state["frozen"]["teacher"] == identity and identity["guidance"]["scale"] == 2.0
    assert identity["guidance"]["times"] == [0.2, 0.9] and "source" not in identity  # what it computes, not a path
    assert state["frozen_provenance"]["teacher"]["weights"].endswith("pipeline")
    pipe = load_pipeline(summary["pipeline"], device="cpu")
    record = pipe.transformer.config.objective
    assert record["teacher"]["sha256"] == identity["sha256"] and record["guidance"]["scale"] == 2.0
    card = (summary["pipeline"] / "README.md").read_text()
    assert "MeanFlow distilled from" in card and identity["sha256"][:12] in card
    assert pipe.preview_sampling.sampler.num_steps == 1 and objective_of(pipe.transformer).name == "distill"
    more = ("train.max_steps=4", "train.resume=latest")
    with pytest.raises(
        ConfigError, match=r"does not hold the weights this run was trained beside \(nor does any checkp"
    ):
        Trainer(distill_config(out, image_dir, teachers / "ddpm", *guided, *more))  # another teacher
    with pytest.raises(ArtifactError, match=r"another set-up \(distill\.guidance_scale: 2.0 -> 4.0"):  # other guidance
        Trainer(distill_config(out, image_dir, teachers / "flow", *more))
    # a run of an earlier moh-dit recorded the teacher's path in its identity: it still resumes with the same teacher
    manifest, state_file = out / "manifest.json", out / "checkpoints" / "step-00000002" / "trainer_state.json"
    recorded = json.loads(manifest.read_text())
    recorded["identity"]["frozen"]["teacher"]["source"] = "/elsewhere/flow/pipeline"
    manifest.write_text(json.dumps(recorded))
    state["frozen"]["teacher"]["source"] = "/elsewhere/flow/pipeline"
    state_file.write_text(json.dumps(state))
    model_file = out / "checkpoints" / "step-00000002" / "model" / "config.json"
    model_config = json.loads(model_file.read_text())
    model_config["objective"]["teacher"]["source"] = "/elsewhere/flow/pipeline"
    model_file.write_text(json.dumps(model_config))
    assert train(distill_config(out, image_dir, teachers / "flow", *guided, *more))["step"] == 4
    recorded = json.loads(manifest.read_text())
    recorded["identity"]["frozen"]["teacher"]["sha256"] = "0" * 64  # other weights are still another run
    manifest.write_text(json.dumps(recorded))
    with pytest.raises(ArtifactError, match=r"another set-up \(distill\.teacher \(its weights\)"):
        Trainer(distill_config(out, image_dir, teachers / "flow", *guided, *more))
    # the student samples in one step with the command line, guidance folded in (the CLI's default scale 1)
    logged = run_in_process(
        "sample", [summary["pipeline"], "--per-class", "1", "--out", tmp_path / "grid.png"], caplog
    )
    assert "meanflow, 1 step," in logged and "guidance 1" in logged and (tmp_path / "grid.png").is_file()
    # evaluate --model samples it in one step, unguided; so does the demo's page with its defaults
    import evaluate_fid

    from ...helpers.tiny_extractor import TINY

    evaluate_fid.main(
        ["--model", str(summary["pipeline"]), "--reference", str(image_dir), "--extractor", TINY, "--num-samples", "4",
         "--sample-batch-size", "4", "--out", str(tmp_path / "m.json")]
    )  # fmt: skip
    identity = json.loads((tmp_path / "m.json").read_text())["samples"]["manifest"]["identity"]
    assert (identity["scheduler"]["name"], identity["num_inference_steps"], identity["guidance_scale"]) == (
        "MeanFlowScheduler", 1, 1.0
    )  # fmt: skip
    assert identity["objective"]["teacher"]["sha256"] == record["teacher"]["sha256"]
    pytest.importorskip("gradio")
    from moh_dit.sampling.demo import api_endpoint

    grid, _, info = api_endpoint(pipe)("dark", images=2)
    assert "meanflow, 1 step" in info and grid.size[0] > 8


def test_a_students_saved_config_trains_again_and_custom_without_weights_is_one_line(teachers, image_dir, tmp_path):
    """The tiny teacher matches no preset, so its student's saved config says ``model.preset: custom``: that config is
    what ``train.py --config`` reads back, and it trains again (the teacher's weights name the architecture); the same
    preset where no weights name one is refused in one line."""
    out = tmp_path / "student"
    train(distill_config(out, image_dir, teachers / "flow"))
    saved = yaml.safe_load((out / "config.yaml").read_text())
    assert saved["model"]["preset"] == "custom" and saved["distill"]["teacher"] == str(teachers / "flow")
    saved["train"]["output_dir"] = str(tmp_path / "again")
    assert train(load_config(saved))["step"] == 2
    for broken in (["objective.name=flow"], ["distill.student=preset"]):  # no teacher's weights build the model
        with pytest.raises(ConfigError, match=r"^model.preset custom says the architecture came from weights[^\n]*$"):
            load_config(saved, broken)


def test_a_checkpoint_of_another_codebase_teaches_in_its_own_convention(image_dir, tmp_path):
    """A REPA checkpoint file (``distill.teacher_format=repa``, read as ``moh-dit convert`` reads it): the student is
    its architecture in REPA's time convention and starts as it; a checkpoint records no guidance, so none is folded
    in unless the config gives it; the latent space it does not record is not held against it."""
    from moh_dit.interop.sit import to_flow_state_dict
    from moh_dit.model.network import MoHDiT

    torch.manual_seed(0)
    repa = MoHDiT(
        sample_size=8, patch_size=2, in_channels=3, hidden_size=32, depth=2, num_heads=4, attention_type="mha",
        num_classes=2, learn_sigma=False, objective={"name": "flow", "path": "linear", "convention": "repa"},
    )  # fmt: skip
    torch.save({"ema": to_flow_state_dict(repa, "repa")}, tmp_path / "repa.pt")
    checkpoint = ("distill.teacher_format=repa", "distill.teacher_num_heads=4")  # a width of no DiT preset
    config = distill_config(tmp_path / "s", image_dir, tmp_path / "repa.pt", *checkpoint)
    trainer = Trainer(config)
    student, teacher = trainer.unwrapped.eval(), trainer.frozen["teacher"]
    assert student.config.objective["time"] == "repa" and teacher.guidance.scale == 1.0
    assert student.config.objective["teacher"]["sha256"] == teacher.fingerprint
    assert teacher.provenance()["weights"] == str(tmp_path / "repa.pt")
    z, t, labels = torch.randn(2, 3, 8, 8), torch.tensor([0.3, 0.8]), torch.tensor([0, 1])
    with torch.no_grad():
        ours = trainer.objective.linear_velocity(student, z, t, labels)
        theirs = -repa(z, t, labels).sample  # REPA's network velocity points from noise to data at time t
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)
    with pytest.raises(ConfigError, match="distill.teacher_format must be one of"):
        distill_config(tmp_path / "x", image_dir, tmp_path / "repa.pt", "distill.teacher_format=edm")
    without = distill_config(tmp_path / "y", image_dir, tmp_path / "repa.pt", "distill.teacher_format=repa")
    with pytest.raises(ConfigError, match=r"cannot infer the number of heads .*: give distill.teacher_num_heads=N, or "
                       r"the run, checkpoint or pipeline folder"):  # fmt: skip
        Trainer(without)


def test_the_student_can_keep_its_teachers_time_embedding(teachers, image_dir, tmp_path):
    """distill.train_time_embedding=false: the embedding of t stays the teacher's through training (frozen, out of
    the gradient); by default it trains like every other weight."""
    for train_it in (False, True):
        trainer = Trainer(
            distill_config(
                tmp_path / str(train_it), image_dir, teachers / "flow", f"distill.train_time_embedding={train_it}"
            )
        )
        trainer.run()
        teacher = trainer.frozen["teacher"].model.t_embedder
        student = trainer.unwrapped.t_embedder
        same = all(torch.equal(a, b) for a, b in zip(student.parameters(), teacher.parameters()))
        assert same is not train_it
        assert all(p.requires_grad is train_it for p in student.parameters())


def test_the_new_head_can_learn_at_its_own_rate(teachers, image_dir, tmp_path):
    """optim.new_lr_scale: the tensors the student did not take from its DDPM teacher (the velocity head, the interval
    embedding) form their own optimizer group at that multiple of the schedule's rate; the copied backbone keeps the
    schedule's; a resume that changes whether there are two groups is one line."""
    from moh_dit.training.setup import learning_rate

    trainer = Trainer(distill_config(tmp_path / "s", image_dir, teachers / "ddpm", "optim.new_lr_scale=4"))
    names = {id(p): name for name, p in trainer.unwrapped.named_parameters()}
    groups = trainer.optimizer.param_groups
    assert [g["new"] for g in groups] == [False, True]
    assert sorted(names[id(p)] for p in groups[1]["params"]) == sorted(trainer.init_report["new"])
    trainer.run()
    lr = learning_rate(trainer.config, trainer.step - 1)
    assert [g["lr"] for g in groups] == pytest.approx([lr, 4 * lr])
    one = Trainer(
        distill_config(tmp_path / "s", image_dir, teachers / "ddpm", "train.max_steps=3", "train.resume=latest")
    )
    assert len(one.optimizer.param_groups) == 1  # the default: every tensor at the schedule's rate
    with pytest.raises(ArtifactError, match="optim.new_lr_scale"):
        one.run()
    with pytest.raises(ConfigError, match="optim.new_lr_scale"):
        distill_config(tmp_path / "x", image_dir, teachers / "ddpm", "optim.new_lr_scale=0")


def test_a_noise_students_sampler_is_its_teachers_ddim_after_noise_until(teachers, image_dir, tmp_path):
    """The untrained student of a DDPM teacher, sampled in two MeanFlow steps by the pipeline (the grid 1, 0.5, 0):
    from pure noise ``z_1`` its first step is ``z_1 - 0.5 (F - z_1) / (1 - 0.5)`` with its teacher's noise ``F`` (the
    bounded divisor), the second DDIM's step with the teacher's noise; the pipeline feeds it the input scale of each
    time and converts its noise into the step's velocity."""
    from moh_dit.objectives.ddpm import linear_path_input
    from moh_dit.sampling.pipeline import MoHDiTPipeline

    trainer = Trainer(distill_config(tmp_path / "s", image_dir, teachers / "ddpm", "distill.head=noise"))
    student, teacher = trainer.unwrapped.eval(), trainer.frozen["teacher"].model
    pipe = MoHDiTPipeline.build(student, None, None, "meanflow")
    noise = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(1))
    labels = [0, 1]
    sampled = pipe(labels, 1.0, 2, latents=noise.clone(), output_type="latent", progress=False).images
    z = noise.double()

    def teachers_noise(z, now):
        model_in, tau = linear_path_input(z.float(), torch.full((2,), now))
        return teacher(model_in, tau.float(), torch.tensor(labels)).sample[:, :3].double()

    with torch.no_grad():
        z = z - 0.5 * (teachers_noise(z, 1.0) - z) / 0.5
        eps = teachers_noise(z, 0.5)
        z = (z - 0.5 * eps) / 0.5  # DDIM to 0: the clean image as predicted
    torch.testing.assert_close(sampled, z.float(), rtol=1e-4, atol=1e-4 * float(z.abs().max()))


def test_a_distillation_resumes_with_its_teacher_given_any_way_and_after_the_teacher_trained_on(image_dir, tmp_path):
    """The teacher is what it computes: the same weights given by another path (absolute, a copied folder, its
    pipeline) resume the student; a teacher run that trained on since gives back the checkpoint of the weights the
    student was trained beside (the log says which); a run cannot teach itself."""
    import shutil

    teacher = tmp_path / "teacher"
    teacher_args = ("objective.name=flow", "preview.per_class=0", "train.checkpoint_every=2", "train.keep_last=5")
    train_tiny(teacher, image_dir, *teacher_args, "train.max_steps=4")
    shutil.copytree(teacher, tmp_path / "copy")
    out = tmp_path / "student"
    train(distill_config(out, image_dir, teacher, "train.checkpoint_every=1"))
    for given, steps in ((teacher.resolve(), 3), (tmp_path / "copy", 4), (teacher / "pipeline", 5)):
        summary = train(distill_config(out, image_dir, given, f"train.max_steps={steps}", "train.resume=latest"))
        assert summary["step"] == steps
    train_tiny(teacher, image_dir, *teacher_args, "train.max_steps=8", "train.resume=latest")  # the teacher trains on
    summary = train(distill_config(out, image_dir, teacher, "train.max_steps=6", "train.resume=latest"))
    assert summary["step"] == 6
    state = json.loads((out / "checkpoints" / "step-00000006" / "trainer_state.json").read_text())
    assert state["frozen_provenance"]["teacher"]["weights"].endswith("step-00000004"), state["frozen_provenance"]
    with pytest.raises(ConfigError, match="a run cannot teach itself"):
        distill_config(out, image_dir, out)


def test_a_resume_that_changes_how_the_student_trains_is_logged_recorded_and_carded(
    teachers, image_dir, tmp_path, caplog
):
    """distill.loss (how it trains) may change on resume: said in the log, recorded in the manifest's resume event,
    and the card's loss and its line of changed settings describe the run as it was trained."""
    out = tmp_path / "s"
    train(distill_config(out, image_dir, teachers / "flow", "distill.derivative=finite-difference"))
    with caplog.at_level("WARNING"):
        train(distill_config(out, image_dir, teachers / "flow", "distill.derivative=finite-difference",
                             "distill.loss=opt-grad", "train.max_steps=3", "train.resume=latest", "preview.per_class=1"))  # fmt: skip
    assert "resuming with changed settings: distill.loss: 'l2' -> 'opt-grad'" in caplog.text
    resumed = [e for e in json.loads((out / "manifest.json").read_text())["events"] if e["event"] == "resume"]
    assert resumed[-1]["changed"]["distill.loss"] == ["l2", "opt-grad"]
    card = (out / "pipeline" / "README.md").read_text()
    assert "| resumed with other settings | at step 2: `distill.loss` 'l2' -> 'opt-grad', " in card
    assert "FastGen's opt-grad" in card.split("| loss |")[1].split("\n")[0]


@pytest.mark.parametrize(
    ("first", "then", "said"),
    [
        (["distill.method=trajectory", "distill.trajectory_count=4", "distill.trajectory_steps=2"],
         ["distill.method=meanflow", "distill.derivative=finite-difference"], "distill.method: 'trajectory' -> 'meanflow'"),
        ([], ["distill.guidance_scale=2.5"], "distill.guidance_scale: 4.0 -> 2.5"),
        ([], ["distill.end_time_blocks=1"], "distill.end_time_blocks: 0 -> 1"),
    ],
)  # fmt: skip
def test_a_resume_that_changes_what_the_student_is_is_refused_in_one_line_naming_the_key(
    teachers, image_dir, tmp_path, first, then, said
):
    """Its method, its teacher's guidance folded into its target, its time split: another student, refused before
    anything is written, in one line that names the config key and both values."""
    out = tmp_path / "s"
    base = [] if first else ["distill.derivative=finite-difference"]
    train(distill_config(out, image_dir, teachers / "flow", *base, *first))
    before = {p.name: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()}
    overrides = [o for o in (*base, *first) if not any(o.split("=")[0] == t.split("=")[0] for t in then)]
    overrides = [o for o in overrides if not (o.startswith("distill.trajectory") and "meanflow" in str(then))]
    with pytest.raises(ArtifactError, match=re.escape(f"another set-up ({said})")) as caught:
        train(distill_config(out, image_dir, teachers / "flow", *overrides, *then, "train.max_steps=3",
                             "train.resume=latest"))  # fmt: skip
    assert "\n" not in str(caught.value)
    assert {p.name: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()} == before


def test_every_distill_key_is_what_the_student_is_where_it_came_from_or_how_it_trains():
    """Each method's table entry decides its keys' sides; a key of the section that no side names would be neither
    refused nor logged on resume."""
    import dataclasses

    from moh_dit.objectives.distill.methods import METHODS, identity_keys, keys_of_other_methods
    from moh_dit.training.config_sections import DistillSection
    from moh_dit.training.run_identity import run_settings

    for name, found in METHODS.items():
        assert set(found.identity) | set(found.provenance) <= set(found.keys), name
        section = {f.name: f.default for f in dataclasses.fields(DistillSection)} | {"method": name}
        settings = run_settings({"optim": {}, "ema": {}, "log": {}, "preview": {}, "train": {}, "data": {},
                                 "objective": {"name": "distill"}, "distill": section})["distill"]  # fmt: skip
        assert not set(settings) & set(identity_keys(name)) and not set(settings) & keys_of_other_methods(name)
        assert set(settings) | set(identity_keys(name)) | keys_of_other_methods(name) == set(section), name
    assert "loss" in run_settings({"optim": {}, "ema": {}, "log": {}, "preview": {}, "train": {}, "data": {},
                                   "objective": {"name": "distill"}, "distill": {"loss": "l2", "method": None}})["distill"]  # fmt: skip


def test_the_silent_cases_say_a_word(teachers, image_dir, tmp_path, caplog):
    """A student used as a teacher with guidance stacks guidance on its folded one; a student of another width takes
    almost nothing from its teacher; a negative guidance scale is refused (it would push each class from itself)."""
    student = tmp_path / "student"
    train(distill_config(student, image_dir, teachers / "flow", "distill.derivative=finite-difference"))
    with caplog.at_level("WARNING"):
        Trainer(distill_config(tmp_path / "a", image_dir, student, "distill.guidance_scale=3",
                               "distill.derivative=finite-difference"))  # fmt: skip
    assert "has guidance folded into its training already" in caplog.text and "distill.guidance_scale=1" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING"):
        wide = ["distill.student=preset", "model.overrides.hidden_size=64", "model.overrides.head_dim=16"]
        Trainer(
            distill_config(tmp_path / "b", image_dir, teachers / "flow", *wide, "distill.derivative=finite-difference")
        )
    assert "takes only" in caplog.text and "starts nearly from scratch" in caplog.text
    with pytest.raises(ConfigError, match="distill.guidance_scale must be a finite number >= 0"):
        distill_config(tmp_path / "c", image_dir, teachers / "flow", "distill.guidance_scale=-1")


def test_a_dmd2_student_of_a_ddpm_teacher_hears_no_warning_about_meanflows_times(
    teachers, image_dir, tmp_path, caplog
):
    """Its output layer is new (a velocity where the teacher predicts noise), but DMD2 draws its times from its own
    grids: MeanFlow's warning about logit-normal times is not its (it was, for configs/fashion_mnist_moh_dmd2_ddpm.yaml)."""
    with caplog.at_level("WARNING"):
        Trainer(distill_config(tmp_path / "d", image_dir, teachers / "ddpm", "distill.method=dmd2"))
    assert "rarely reach pure noise" not in caplog.text
    with caplog.at_level("WARNING"):
        Trainer(distill_config(tmp_path / "m", image_dir, teachers / "ddpm", "distill.derivative=finite-difference"))
    assert "rarely reach pure noise" in caplog.text  # MeanFlow's own student still hears it


def test_the_log_says_which_part_of_the_guidance_comes_from_the_teachers_record(teachers, image_dir, tmp_path, caplog):
    """A config's own scale with the teacher's recorded interval is logged as the interval alone from the record, so
    that the recorded scale in the same line is not read as the one in use."""
    from moh_dit.training.distill.teacher import _guidance_of

    for extra, said in ((["distill.guidance_scale=3"], "guidance interval from"), ([], "guidance scale and interval from")):  # fmt: skip
        caplog.clear()
        section = distill_config(tmp_path / "a", image_dir, teachers / "flow", *extra).distill
        with caplog.at_level("INFO", logger="moh_dit.train"):
            scale, _, _ = _guidance_of(section)
        assert said in caplog.text and (scale == 3.0) == bool(extra)
    caplog.clear()
    given = ["distill.guidance_scale=3", "distill.guidance_times=[0.2,0.9]"]
    with caplog.at_level("INFO", logger="moh_dit.train"):
        assert _guidance_of(distill_config(tmp_path / "b", image_dir, teachers / "flow", *given).distill)[:2] == (3.0, (0.2, 0.9))  # fmt: skip
    assert "from its record" not in caplog.text  # nothing taken from it


def test_sid_from_a_ddpm_teacher_differentiates_its_guided_noise_prediction(teachers, image_dir, tmp_path):
    """SiD's real score is the DDPM teacher's noise prediction read as a velocity of the linear path, guided: its
    generator step has a finite loss and a gradient for the generator, and counts the teacher's passes three times
    over (a forward and its backward)."""
    trainer = Trainer(
        distill_config(tmp_path / "s", image_dir, teachers / "ddpm", "distill.method=sid", "distill.fake_updates=1",
                       "distill.dmd_steps=[1]", "distill.real_guidance=2.0", "train.max_steps=2", "preview.per_class=0")
    )  # fmt: skip
    teacher = trainer.frozen["teacher"]
    trainer.run()
    records = [json.loads(line) for line in (tmp_path / "s" / "metrics.jsonl").read_text().splitlines()]
    first = next(r for r in records if "sid_loss" in r)
    assert math.isfinite(first["sid_loss"]) and first["sid_loss"] != 0 and first["grad_norm"] > 0
    assert teacher.evaluations % 3 == 0 and teacher.evaluations > 0
