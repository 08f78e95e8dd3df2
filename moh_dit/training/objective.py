"""A run's objective from its config (the ``objective`` section, ``train.snr_gamma``) and, with
``model.init_from``, from the weights it starts from: the record its model carries and the training options.

Which keys belong to which objective is the registry's (``record_keys``, ``training_keys`` of
:data:`moh_dit.objectives.registry.OBJECTIVES`), so nothing here names an objective.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import TYPE_CHECKING, Any

from moh_dit.argtypes import is_number
from moh_dit.errors import ConfigError
from moh_dit.objectives import DEFAULT_OBJECTIVE, OBJECTIVES, entry, objective_class, objective_name

if TYPE_CHECKING:
    from moh_dit.objectives.base import Objective
    from moh_dit.sampling.spec import SamplingSpec
    from moh_dit.training.config_sections import Config

__all__ = [
    "check_objective",
    "objective_record",
    "training_options",
    "run_objective",
    "run_objective_class",
    "run_sampling",
    "with_objective_defaults",
]


def _value(config: Config, dotted: str) -> Any:
    section, key = dotted.split(".")
    return getattr(getattr(config, section), key)


def _key(dotted: str) -> str:
    return dotted.split(".")[1]


def objective_record(config: Config, weights: dict | None = None, init_from: str | None = None) -> dict:
    """The full record of the run's objective (``{"name": ..., <record keys>}``): what the config says, and where it
    says nothing (``null``), what the weights of ``init_from`` record (``weights``), else the objective's defaults.
    The config contradicting the weights is an error: their meaning (time input, path) is fixed by training."""
    given = config.objective.name
    theirs = objective_name(weights) if init_from else None
    if given is not None and theirs is not None and given != theirs:
        raise ConfigError(
            f"{init_from} was trained with the {theirs} objective, not objective.name={given}: its weights predict "
            f"{entry(theirs).summary}; drop objective.name to continue with it"
        )
    name = given or theirs or DEFAULT_OBJECTIVE
    record = {"name": name}
    for dotted in entry(name).record_keys:
        key, mine = _key(dotted), _value(config, dotted)
        recorded = (weights or {}).get(key) if theirs == name else None
        if mine is not None and recorded is not None and mine != recorded:
            raise ConfigError(
                f"{init_from} was trained with {key}={recorded}, not {dotted}={mine}: the weights keep theirs; drop "
                f"{dotted}"
            )
        value = mine if mine is not None else recorded
        if value is not None:
            record[key] = value
    return record


def training_options(config: Config, name: str, record: dict | None = None) -> dict[str, Any]:
    """The training options of objective ``name`` (and of the variant its ``record`` names: a distillation's method)
    from the config (loss weighting, time sampling); a key left ``null`` takes the objective's own default."""
    options = {_key(dotted): _value(config, dotted) for dotted in entry(name).training_keys_of(record)}
    return {key: value for key, value in options.items() if value is not None}


def _class_default(name: str, key: str) -> Any:
    return inspect.signature(objective_class(name).__init__).parameters[key].default


def with_objective_defaults(config: Config) -> Config:
    """``config`` with the training keys that several objectives share (``objective.time_sampling``, ...) and that
    it leaves ``null`` filled in: the run's objective's defaults, so that the config a run writes says what it
    trains with (flow draws uniform times, MeanFlow logit-normal ones). A run whose objective is not known yet
    (``model.init_from`` without ``objective.name``) keeps them ``null``; one whose objective does not use a key
    records the first owner's default (what moh-dit 0.4 wrote)."""
    chosen = config.objective.name or (None if config.model.init_from else DEFAULT_OBJECTIVE)
    if chosen is None:
        return config
    owners: dict[str, list[str]] = {}
    for name, found in OBJECTIVES.items():
        for dotted in found.training_keys:
            owners.setdefault(dotted, []).append(name)
    filled = {}
    for dotted, names in owners.items():
        if len(names) > 1 and _value(config, dotted) is None:
            filled[_key(dotted)] = _class_default(chosen if chosen in names else names[0], _key(dotted))
    config = (
        dataclasses.replace(config, objective=dataclasses.replace(config.objective, **filled)) if filled else config
    )
    return _previews_of_folded_guidance(config, chosen)


def _previews_of_folded_guidance(config: Config, chosen: str) -> Config:
    """A run whose objective folds guidance into training (MeanFlow, a distillation, DDPM or flow with
    ``objective.guidance_*``) previews as its model samples: at scale 1, one evaluation per step, where the preview's
    scale is the grid default (CFG 4, which the embedded default's file also sets); another scale is kept (CFG on top
    of the folded guidance). The pipeline records it, so ``moh-dit sample`` and the demo draw so too."""
    from moh_dit.objectives.registry import sampling_guidance
    from moh_dit.sampling.spec import GRID_GUIDANCE

    record = {key: getattr(config.objective, key) for key in ("guidance_scale", "guidance_mix")}
    own = sampling_guidance(chosen, {k: v for k, v in record.items() if v is not None})
    if own is None or config.preview.guidance_scale != GRID_GUIDANCE:
        return config
    return dataclasses.replace(config, preview=dataclasses.replace(config.preview, guidance_scale=own))


def run_objective_class(config: Config) -> type[Objective]:
    """The class of the objective a run trains, known before its model is built: ``objective.name``, else what the
    weights of ``model.init_from`` record (read without loading them), else the default."""
    name = config.objective.name
    if name is None and config.model.init_from:
        from moh_dit.sampling.sources import recorded_objective

        name = recorded_objective(config.model.init_from)["name"]
    name = name or DEFAULT_OBJECTIVE
    return objective_class(name, _variant_record(config, name))


def _variant_record(config: Config, name: str) -> dict[str, Any]:
    """What the config says of the objective's variant (a distillation's ``distill.method``), as a record."""
    key = entry(name).variant_key
    dotted = [d for d in entry(name).record_keys if _key(d) == key]
    return {key: _value(config, dotted[0])} if key is not None and dotted else {}


def run_objective(config: Config, record: dict, learn_sigma: bool) -> Objective:
    """The objective a run trains with: its model's ``record`` and the config's training options."""
    name = objective_name(record)
    return objective_class(name, record).from_record(
        record, learn_sigma=learn_sigma, **training_options(config, name, record)
    )


def check_objective(config: Config, defaults: Config) -> None:
    """Every objective key of the config, once: a known objective, no key of another objective set (it would be
    ignored: ``defaults`` says what unset is), valid values, and preview and evaluation samplers that sample it. With
    ``model.init_from`` and no ``objective.name`` the weights decide; they are checked when they load
    (:func:`objective_record`)."""
    section, model = config.objective, config.model
    if section.name is not None:
        entry(section.name)  # names the known objectives
    snr = config.train.snr_gamma
    if snr is not None and not (is_number(snr) and snr == snr and 0 < snr < float("inf")):
        raise ConfigError(f"train.snr_gamma must be a number > 0 (e.g. 5) or null, got {snr!r}")
    if "objective" in model.overrides:
        raise ConfigError(
            "model.overrides.objective: the objective section says what the model learns (objective.name)"
        )
    chosen = section.name or (None if model.init_from else DEFAULT_OBJECTIVE)
    if chosen is None:
        return
    mine = {*entry(chosen).record_keys, *entry(chosen).training_keys}
    # unset is the default, or what with_objective_defaults fills in (a config checked again after loading)
    filled = with_objective_defaults(
        dataclasses.replace(defaults, objective=dataclasses.replace(defaults.objective, name=chosen))
    )
    for other, found in OBJECTIVES.items():
        for dotted in (*found.record_keys, *found.training_keys) if other != chosen else ():
            if dotted not in mine and _value(config, dotted) not in (_value(defaults, dotted), _value(filled, dotted)):
                raise ConfigError(
                    f"{dotted} applies to the {other} objective; this run trains {chosen} (objective.name)"
                )
    record = objective_record(config) if not model.init_from else {"name": chosen}
    objective = run_objective(config, record, learn_sigma=False)  # checks the values

    wants = objective.model_config().get("learn_sigma")
    if wants is not None and model.overrides.get("learn_sigma", wants) != wants:
        raise ConfigError(
            f"model.overrides.learn_sigma={model.overrides['learn_sigma']}: {objective.describe()} needs {wants}"
        )
    # a sampler the user set must sample the objective (an unset one resolves to one that does: run_sampling); the
    # evaluations' only when they run
    for key, spec, used in (
        ("preview", config.preview.sampling(), True),
        ("log.eval_sampling", config.log.eval_sampling.sampling(), config.log.eval_every > 0),
    ):
        if used and spec.sampler.scheduler is not None:
            try:
                objective.check_sampler(spec.sampler.scheduler)
            except ConfigError as err:
                raise ConfigError(f"{key}.{err}") from None


def run_sampling(spec: SamplingSpec, objective: Objective) -> SamplingSpec:
    """A config's sampling ``spec`` (previews, evaluations) with an unset scheduler resolved for the run's
    ``objective``: the fast protocol's sampler where the objective and its path offer it, else the first they do."""
    if spec.sampler.scheduler is not None:
        return spec
    return spec.replace(scheduler=objective.protocol("fast", given=False)[0])
