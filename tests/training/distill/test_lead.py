"""A DMD2/SiD generator whose later grid steps train on a frozen lead model's first steps (``distill.dmd_input: lead``,
``distill.lead_model``; moh_dit/training/distill/lead.py): the input at the two-step grid's middle is the lead's own
jump from the same noise, the lead's forwards are counted with the generator's, it stays out of the trained state,
a run resumes bit for bit and a resume beside other lead weights is refused, and every wrong key is one line."""

from __future__ import annotations

import json
from contextlib import nullcontext

import pytest
import torch

from moh_dit.errors import ArtifactError, ConfigError
from moh_dit.training.config import load_config
from moh_dit.training.trainer import Trainer, train

from ...helpers.factories import tiny_train_config, train_tiny
from .test_companions import DMD2, _cut_at_3_and_resumed_is_the_same, _PassCounter, dmd2

# a flow map of the teacher (MeanFlow's distillation), the kind of start a DMD2/SiD stage begins from
FLOW_MAP = ["objective.name=distill", "distill.guidance_scale=2.0", "preview.per_class=0", "train.checkpoint_every=2"]
LEAD = ["distill.method=sid", "distill.gan_weight=0", "distill.dmd_input=lead", "distill.guidance_times=[0,1]"]


@pytest.fixture(scope="module")
def teacher_and_lead(image_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("lead")
    train_tiny(root / "teacher", image_dir, "objective.name=flow", "train.max_steps=4", "preview.per_class=0")
    config = tiny_train_config(root / "lead", image_dir)
    train(load_config(config, [f"distill.teacher={root / 'teacher'}", *FLOW_MAP, "train.max_steps=2"]))
    return root / "teacher", root / "lead"


def test_the_middle_starts_where_the_leads_own_jump_from_the_same_noise_lands(teacher_and_lead, image_dir, tmp_path):
    """The generator's input at 0.5 is the lead's average-velocity jump from its noise at 1 to 0.5 (written out
    here); at 1 it is the noise itself. The lead is frozen, apart from the student, and named in the description."""
    teacher, lead = teacher_and_lead
    trainer = Trainer(dmd2(tmp_path / "s", image_dir, teacher, *LEAD, f"distill.lead_model={lead}"))
    frozen = trainer.frozen["lead"]
    assert not any(p.requires_grad for p in frozen.parameters())
    assert f"later steps from the lead {lead}'s" in trainer.objective.describe_loss()
    objective, model = frozen.lead.objective, frozen.lead.model
    noise = torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    labels, start = torch.tensor([0, 1, 2, 0]), torch.tensor([1.0, 0.5, 0.5, 1.0])
    z = trainer.objective.lead_input(frozen, noise.clone(), noise, start, labels, None, nullcontext)
    one, half = torch.ones(4), torch.full((4,), 0.5)
    with torch.no_grad():
        u = objective.average_velocity(model, noise, one, half, labels, None).sample.float()
    torch.testing.assert_close(z[1:3], (noise - 0.5 * u)[1:3])
    assert torch.equal(z[[0, 3]], noise[[0, 3]])
    # a row trained without its label (drop) takes the lead's jump at the null class
    drop = torch.tensor([False, False, True, False])
    z = trainer.objective.lead_input(frozen, noise.clone(), noise, start, labels, drop, nullcontext)
    null = torch.where(drop, model.null_class_id, labels)
    with torch.no_grad():
        u = objective.average_velocity(model, noise, one, half, null, None).sample.float()
    torch.testing.assert_close(z[1:3], (noise - 0.5 * u)[1:3])


def test_a_run_on_the_leads_jump_counts_its_passes_resumes_exactly_and_refuses_another_lead(
    teacher_and_lead, image_dir, tmp_path
):
    """Six steps of SiD's two-step generator on the lead's jump: the evaluations the logs add up equal a count by hooks
    on every network run (the lead's forwards with the generator's); the run records the lead's weights; stopped at
    step 3 and resumed it is the uninterrupted run bit for bit; a resume beside other lead weights stops in one line."""
    teacher, lead = teacher_and_lead
    more = [*LEAD, f"distill.lead_model={lead}"]
    trainer = Trainer(dmd2(tmp_path / "s", image_dir, teacher, *more, "train.max_steps=6"))
    counter = _PassCounter(trainer.unwrapped, trainer.companions["fake_score"].module.score)
    lead_rows = _PassCounter(trainer.frozen["lead"].lead.model)
    teacher_rows = _PassCounter(trainer.frozen["teacher"].model)
    trainer.run()
    records = [json.loads(line) for line in (tmp_path / "s" / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in records if "generator_updates" in r][-1]
    assert lead_rows.total > 0  # the middle's rows were drawn
    assert last["network_evaluations"] == pytest.approx(counter.total + _expected_lead(trainer, 6))
    assert last["teacher_evaluations"] == pytest.approx(teacher_rows.total)
    state = json.loads((sorted((tmp_path / "s" / "checkpoints").iterdir())[-1] / "trainer_state.json").read_text())
    assert state["frozen"]["lead"]["sha256"] == trainer.frozen["lead"].lead.fingerprint
    _cut_at_3_and_resumed_is_the_same(tmp_path / "s", tmp_path / "cut", image_dir, teacher, more)
    other = tmp_path / "other"
    train(
        load_config(
            tiny_train_config(other, image_dir), [f"distill.teacher={teacher}", *FLOW_MAP, "train.max_steps=1"]
        )
    )
    with pytest.raises(ArtifactError, match=r"another set-up \(distill\.lead_model \(its weights\): ") as caught:
        train(dmd2(tmp_path / "s", image_dir, teacher, *LEAD, f"distill.lead_model={other}", "train.max_steps=7",
                   "train.resume=latest"))  # fmt: skip
    assert "\n" not in str(caught.value)


def test_its_evaluations_score_the_hand_off_it_is_trained_for_as_evaluate_does(
    teacher_and_lead, image_dir, tmp_path, monkeypatch
):
    """Evaluated at two steps and also at one, a generator trained after a lead scores its two steps as the hand-off
    (the record says so): the numbers and images ``moh-dit evaluate --lead-model`` gives for the checkpoint, not those
    of its own two steps (``--lead-model none``); its one step is the generator alone."""
    from moh_dit.cli import evaluate as evaluate_cli
    from moh_dit.training.quality import EVALUATION, read_records

    from ...helpers.tiny_extractor import TINY

    teacher, lead = teacher_and_lead
    tiny = ["--extractor", TINY, "--extractor-module", "tests.helpers.tiny_extractor"]
    evals = ["log.eval_every=2", "log.eval_samples=6", "log.eval_batch_size=4", f"log.eval_reference={image_dir}",
             f"log.eval_extractor={TINY}", "log.eval_extractor_module=tests.helpers.tiny_extractor",
             "log.eval_sampling.num_steps=2", "log.eval_also_steps=[1]"]  # fmt: skip
    run = tmp_path / "s"

    def second_copy(*args):
        raise AssertionError("the evaluations load the lead again")

    monkeypatch.setattr("moh_dit.sampling.pipeline.load_lead", second_copy)  # they take the run's frozen lead
    train(dmd2(run, image_dir, teacher, *LEAD, f"distill.lead_model={lead}", "train.max_steps=2", *evals))
    monkeypatch.undo()
    (logged,) = read_records(run / "metrics.jsonl", EVALUATION)
    assert logged["lead"] == {"model": str(lead), "steps": 1, "at_steps": [2]}
    assert logged["sampling"]["lead"] == {"model": str(lead), "steps": 1}

    def offline(name: str, steps: int, *more: str) -> dict:
        return evaluate_cli.main(
            ["--model", str(run / "checkpoints" / "step-00000002"), "--reference", str(image_dir), *tiny,
             "--num-samples", "6", "--label-mode", "balanced", "--sample-batch-size", "4", "--scheduler", "meanflow",
             "--num-steps", str(steps), "--cfg-scale", "1", "--device", "cpu", "--sample-dir", str(tmp_path / name),
             *more]
        )  # fmt: skip

    handoff, alone, one = (
        offline("handoff", 2, "--lead-model", str(lead)),
        offline("alone", 2, "--lead-model", "none"),
        offline("one", 1),
    )
    kept = json.loads((run / logged["file"]).read_text())["samples"]["manifest"]
    assert kept["identity"] == handoff["samples"]["manifest"]["identity"]
    assert kept["images_sha256"] == handoff["samples"]["manifest"]["images_sha256"]
    assert kept["images_sha256"] != alone["samples"]["manifest"]["images_sha256"]
    for key in ("kid", "fid", "precision", "recall"):
        assert logged[key] == handoff["metrics"][key], key  # to the last digit
        assert logged[f"{key}@1"] == one["metrics"][key], key


def test_every_sample_on_the_last_jump_counts_the_leads_jump_for_each(teacher_and_lead, image_dir, tmp_path):
    """distill.dmd_first_share 0: every generator sample starts at the middle on the lead's jump, and the evaluations
    the logs add up count that jump for every image (one lead forward each) with the networks' own."""
    teacher, lead = teacher_and_lead
    more = [*LEAD, f"distill.lead_model={lead}", "distill.dmd_first_share=0", "train.max_steps=2"]
    trainer = Trainer(dmd2(tmp_path / "s", image_dir, teacher, *more))
    assert trainer.objective.simulated_forwards() == 1.0
    counter = _PassCounter(trainer.unwrapped, trainer.companions["fake_score"].module.score)
    lead_rows = _PassCounter(trainer.frozen["lead"].lead.model)
    trainer.run()
    last = [json.loads(line) for line in (tmp_path / "s" / "metrics.jsonl").read_text().splitlines()][-1]
    assert lead_rows.total == _expected_lead(trainer, 2)  # every image of both steps
    assert last["network_evaluations"] == pytest.approx(counter.total + lead_rows.total)


def _expected_lead(trainer, steps: int) -> float:
    """The lead's forwards the counts include: per image, the share of the middle's rows times one jump, on every
    step (the fake score's steps make the generator's samples too), at the global batch."""
    return trainer.objective.simulated_forwards() * steps * trainer.config.train.global_batch_size


@pytest.mark.parametrize(
    ("more", "message"),
    [
        (["distill.dmd_input=lead"], "distill.dmd_input=lead trains the later steps on a lead model's first steps"),
        (["distill.lead_model=x"], "distill.lead_model=x is read only with distill.dmd_input=lead"),
        (
            ["distill.dmd_input=lead", "distill.lead_model=x", "distill.dmd_steps=[1]"],
            r"distill.dmd_steps=\[1\] has none",
        ),
        (["distill.method=rcm", "distill.dmd_input=lead", "distill.lead_model=x"], "not distill.method=rcm's"),
        (["distill.dmd_input=leader"], "distill.dmd_input must be one of data, generator, generator_fresh, lead"),
    ],
)
def test_a_wrong_lead_key_is_one_line(teacher_and_lead, image_dir, tmp_path, more, message):
    teacher, _ = teacher_and_lead
    with pytest.raises((ConfigError, ArtifactError), match=message) as caught:
        Trainer(dmd2(tmp_path / "s", image_dir, teacher, *more))
    assert "\n" not in str(caught.value)


def test_a_missing_lead_folder_is_one_line_naming_the_key(teacher_and_lead, image_dir, tmp_path):
    teacher, _ = teacher_and_lead
    missing = tmp_path / "no-such-run"
    with pytest.raises(ConfigError, match=rf"distill.lead_model={missing}: .*does not exist") as caught:
        Trainer(dmd2(tmp_path / "s", image_dir, teacher, *LEAD, f"distill.lead_model={missing}"))
    assert "\n" not in str(caught.value)


def test_a_lead_that_cannot_step_like_the_generator_is_refused(teacher_and_lead, image_dir, tmp_path):
    """The flow teacher samples by Euler steps of its velocity, not by flow-map jumps: it cannot lead."""
    teacher, _ = teacher_and_lead
    with pytest.raises(ConfigError, match="cannot take a generator's first steps") as caught:
        Trainer(dmd2(tmp_path / "s", image_dir, teacher, *LEAD, f"distill.lead_model={teacher}"))
    assert "\n" not in str(caught.value)


assert DMD2  # the shared settings the runs above start from


def test_the_exported_generator_names_its_lead_and_sampling_without_it_is_warned_once(
    teacher_and_lead, image_dir, tmp_path, caplog
):
    """The generator's pipeline records its lead (the card says how to sample it); sampled at two steps without that
    lead the pipeline warns once, with it or at one step it does not, and the hand-off with it runs."""
    from moh_dit.sampling.loading import load_pipeline
    from moh_dit.sampling.spec import SamplingSpec

    teacher, lead = teacher_and_lead
    train(dmd2(tmp_path / "s", image_dir, teacher, *LEAD, f"distill.lead_model={lead}", "train.max_steps=3"))
    card = (tmp_path / "s" / "pipeline" / "README.md").read_text()
    assert f"sample two steps with `--lead-model {lead}" in card
    pipe = load_pipeline(tmp_path / "s" / "pipeline", device="cpu")
    assert pipe.trained_lead["model"] == str(lead / "pipeline")  # the weights the run loaded: the lead run's pipeline
    warned = "trained on the first step of"
    with caplog.at_level("WARNING", logger="moh_dit.sampling"):
        for _ in range(2):
            pipe([0, 1], sampling=SamplingSpec.create("meanflow", 2, 1.0), output_type="pt")
    assert sum(warned in r.getMessage() for r in caplog.records) == 1
    caplog.clear()
    with caplog.at_level("WARNING", logger="moh_dit.sampling"):
        pipe([0, 1], sampling=SamplingSpec.create("meanflow", 1, 1.0), output_type="pt")
        led = pipe([0, 1], sampling=SamplingSpec.create("meanflow", 2, 1.0, lead_model=str(lead)), output_type="pt")
    assert not any(warned in r.getMessage() for r in caplog.records)
    assert led.images.shape == (2, 3, 8, 8)
