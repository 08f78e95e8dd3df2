"""What makes a run this run, and what a resume may change: the identity a run's manifest records (the model's
architecture and objective record, the data, seed and global batch, the frozen models beside it), refused when another
on resume, and its settings (optimizer, EMA, logging, the objective's training options, a distillation's), which are
logged and recorded when a resume changes them (moh_dit/training/runs.py compares the two)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from moh_dit.objectives.registry import OBJECTIVES, entry
from moh_dit.training.config import Config, config_to_dict

if TYPE_CHECKING:
    from moh_dit.data.training_data import TrainingData
    from moh_dit.model.network import MoHDiT

__all__ = ["run_identity", "run_settings", "default_config_like"]


# model config keys moh-dit 0.3 did not have, with the value that means "not used"
_KEYS_AFTER_0_3 = {
    "objective": None,
    "repa_depth": None,
    "repa_dims": None,
    "repa_projector_dim": 2048,
    "block": None,
    "time_inputs": 1,
    "end_time_blocks": 0,
}
# the config keys that make a run this run (with the model's architecture and the data's fingerprint)
_IDENTITY_DATA_KEYS = ("name", "split", "image_size", "channels", "random_flip", "subset_per_class")
_IDENTITY_TRAIN_KEYS = ("seed", "global_batch_size")


def run_identity(config: Config, data: TrainingData, model: MoHDiT, frozen: dict | None = None) -> tuple[dict, dict]:
    """``(identity, settings)`` of a run. The identity (architecture, data, seed, global batch, the frozen models
    beside the student) makes a run this run: a resume with another identity is refused. Settings may change on
    resume; changes are logged and recorded in the run's manifest."""
    full = config_to_dict(config)
    identity = {
        # the objective's record and REPA's heads belong to the model; keys added after moh-dit 0.3 are recorded only
        # when set, so that its runs still resume
        "model": {
            k: v
            for k, v in dict(model.config).items()
            if not k.startswith("_") and not (k in _KEYS_AFTER_0_3 and v == _KEYS_AFTER_0_3[k])
        },
        "data": {k: full["data"][k] for k in _IDENTITY_DATA_KEYS}
        | {"fingerprint": data.description.get("fingerprint"), "vae_sha256": (data.vae_record or {}).get("sha256")}
        # what an epoch draws (recorded only when weighted, so that runs from before the key still resume)
        | ({"class_weights": data.description["class_weights"]} if "class_weights" in data.description else {}),
        "train": {k: full["train"][k] for k in _IDENTITY_TRAIN_KEYS},
    }
    if config.ema.posthoc_every:  # the EMAs the snapshots hold (recorded only when on: runs before it still resume)
        identity["ema"] = {"posthoc_sigma_rels": list(config.ema.posthoc_sigma_rels)}
    if frozen:  # the models beside the student, by identity (only when there are: runs without any still resume)
        identity["frozen"] = frozen
    return identity, run_settings(full)


def default_config_like(config: Config) -> Config:
    """The default config of ``config``'s objective and distillation method: a setting a run's manifest lacks (added
    by a later moh-dit) is no change where it has this default, so that an earlier run's keys compare as they were."""
    defaults = Config()
    return dataclasses.replace(
        defaults,
        objective=dataclasses.replace(defaults.objective, name=config.objective.name),
        distill=dataclasses.replace(defaults.distill, method=config.distill.method),
    )


def run_settings(full: dict) -> dict:
    """The settings part of a config (as ``config_to_dict`` gives it): what may change on resume."""
    volatile = ("resume", "overwrite", "output_dir", "elastic_resume")
    settings = {name: full[name] for name in ("optim", "ema", "log", "preview")}
    # the objective's training options (time sampling); what it is (name and record: path, conventions, MeanFlow's
    # guidance) is the model's identity
    recorded = {"name", *(dotted.split(".")[1] for found in OBJECTIVES.values() for dotted in found.record_keys)}
    settings["objective"] = {k: v for k, v in full.get("objective", {}).items() if k not in recorded}
    settings["train"] = {k: v for k, v in full["train"].items() if k not in volatile + _IDENTITY_TRAIN_KEYS}
    settings["data"] = {k: v for k, v in full["data"].items() if k not in _IDENTITY_DATA_KEYS and k != "vae"}
    # the sections beyond `objective` that configure it (a distillation's): how it trains; what the model is and where
    # things came from are not settings (the objective's table says which key is which)
    name = (full.get("objective") or {}).get("name")
    found = entry(name) if name is not None else None
    for section in found.sections if found is not None else ():
        given = full.get(section) or {}
        record = {found.variant_key: given.get(found.variant_key)} if found.variant_key else None
        skipped = found.not_settings(record)
        settings[section] = {k: v for k, v in given.items() if k not in skipped}
    return settings
