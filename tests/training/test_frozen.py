"""Models beside the student (moh_dit/training/frozen.py): a model an objective declares is loaded by training, frozen
in eval mode, handed to the objective's forward_losses, kept out of the optimizer, the EMA and the checkpoints'
weights, recorded by identity in the run and its checkpoints; a resume beside another one is refused in one line."""

import json

import pytest
import torch
from safetensors import safe_open

from moh_dit.errors import ArtifactError, ConfigError
from moh_dit.manifests import fingerprint_module
from moh_dit.objectives.ddpm import DDPM
from moh_dit.training import frozen, frozen_roles
from moh_dit.training.config import load_config
from moh_dit.training.trainer import Trainer

from ..helpers.factories import tiny_train_config


class Probe(frozen.FrozenModel):
    """A small network a test objective reads beside the student."""

    role = "probe"

    def __init__(self, seed: int) -> None:
        torch.manual_seed(seed)
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.5))

    def modules(self):
        return [self.net]

    def identity(self):
        return {"source": "probe", "sha256": fingerprint_module(self.net)}


@pytest.fixture
def probe_objective(monkeypatch):
    """DDPM declaring a ``probe`` beside the student; its forward_losses notes what it was handed."""
    seen, seed = [], {"value": 0}
    entry = frozen_roles.FrozenEntry(lambda config, objective: False, lambda *_: Probe(seed["value"]), "a test probe")
    monkeypatch.setitem(frozen_roles.FROZEN_MODELS, "probe", entry)
    monkeypatch.setattr(DDPM, "frozen_models", ("probe",))
    inner = DDPM.forward_losses

    def forward_losses(self, model, noised, labels, drop, want_heads, autocast, frozen=None, *rest):
        probe = frozen["probe"]
        x = torch.ones(2, 4)
        seen.append((not probe.net.training, torch.equal(probe.net(x), probe.net(x)), torch.is_grad_enabled()))
        return inner(self, model, noised, labels, drop, want_heads, autocast, frozen, *rest)

    monkeypatch.setattr(DDPM, "forward_losses", forward_losses)
    return seen, seed


def test_a_declared_model_is_loaded_frozen_handed_over_and_kept_out_of_training(tmp_path, image_dir, probe_objective):
    seen, _ = probe_objective
    config = load_config(tiny_train_config(tmp_path / "run", image_dir), ["train.max_steps=2", "preview.per_class=0"])
    trainer = Trainer(config)
    probe = trainer.frozen["probe"]
    theirs = {id(p) for p in probe.net.parameters()}
    assert not any(id(p) in theirs for g in trainer.optimizer.param_groups for p in g["params"])
    assert len(trainer.ema.shadow_params) == len(list(trainer.unwrapped.parameters()))
    assert all(not p.requires_grad for p in probe.net.parameters())
    trainer.run()
    assert seen and all(evaluated and deterministic for evaluated, deterministic, _ in seen)  # eval mode: no dropout
    checkpoint = tmp_path / "run" / "checkpoints" / "step-00000002"
    with safe_open(str(checkpoint / "model" / "diffusion_pytorch_model.safetensors"), "pt") as f:
        assert not any("net" in key for key in f.keys())  # noqa: SIM118 (safe_open has no __iter__)
    identity = probe.identity()
    assert json.loads((checkpoint / "trainer_state.json").read_text())["frozen"] == {"probe": identity}
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert manifest["identity"]["frozen"] == {"probe": identity}


def test_a_resume_beside_another_model_is_refused_in_one_line(tmp_path, image_dir, probe_objective):
    _, seed = probe_objective
    overrides = ["train.max_steps=2", "preview.per_class=0"]
    Trainer(load_config(tiny_train_config(tmp_path / "run", image_dir), overrides)).run()
    seed["value"] = 1  # other weights under the same role
    again = ["train.max_steps=4", "train.resume=latest", "preview.per_class=0"]
    with pytest.raises(ArtifactError, match=r"another set-up \(frozen\.probe\.sha256"):
        Trainer(load_config(tiny_train_config(tmp_path / "run", image_dir), again))
    # the checkpoint alone (copied into a new folder) says it too
    elsewhere = tmp_path / "copy"
    (elsewhere / "checkpoints").mkdir(parents=True)
    import shutil

    shutil.copytree(tmp_path / "run" / "checkpoints" / "step-00000002", elsewhere / "checkpoints" / "step-00000002")
    with pytest.raises(ConfigError, match="was trained beside other frozen models \\(probe: probe"):
        Trainer(load_config(tiny_train_config(elsewhere, image_dir), again)).run()


def test_frozen_models_check_what_they_are_given():
    models = frozen.FrozenModels({"probe": Probe(0)})
    models["probe"].freeze("cpu")
    with pytest.raises(KeyError, match="no 'teacher' model beside the student"):
        models["teacher"]
    student = torch.nn.Linear(4, 4)
    models.check_apart(student)
    with pytest.raises(RuntimeError, match="shares parameters"):
        models.check_apart(models["probe"].net)
    with pytest.raises(ConfigError, match="no loader"):
        objective = type("Needy", (), {"frozen_models": ("reward",), "name": "needy"})()
        frozen_roles.load_frozen_models(None, objective, None, None, "cpu")


def test_an_earlier_record_of_a_models_path_is_no_difference_but_other_keys_are():
    """A frozen model's ``source`` (the path it was given by, recorded by earlier versions) is dropped where a model's
    identity (named by its weights) no longer has it; elsewhere, and where both have it, it stays compared."""
    from moh_dit.manifests import differences, without_retired_keys

    now = {"frozen": {"teacher": {"sha256": "ab", "guidance": {"scale": 2.0}}}, "data": {"name": "x"}}
    old = {"frozen": {"teacher": {"sha256": "ab", "guidance": {"scale": 2.0}, "source": "/a"}}, "data": {"name": "x"}}
    assert differences(without_retired_keys(old, now), now) == []
    other = {**old, "data": {"name": "x", "source": "/a"}}  # not a model's identity: still a difference
    assert differences(without_retired_keys(other, now), now) == [("data.source", "/a", "<absent>")]
    both = {"frozen": {"teacher": {**now["frozen"]["teacher"], "source": "/b"}}, "data": {"name": "x"}}
    assert differences(without_retired_keys(old, both), both) == [("frozen.teacher.source", "/a", "/b")]
