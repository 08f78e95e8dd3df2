"""The distillation study's budget (experiments/distill_dmd2.py): how long a stage trains so that the whole
distillation spends the teacher's training in network evaluations (:data:`BUDGET`), counted step by step as the
stage's objective spends them, and the settings a stage takes from its own length (a ramp of the real score's scale
over it) or from a smaller batch (its EMA's decay, a late GAN term's first step)."""

from __future__ import annotations

import functools
import math

from experiments.distill_dmd2_settings import BATCH, BUDGET, OVER_BUDGET, SHARES

__all__ = ["load_arm", "counted_objective", "fill_budget", "at_batch"]


def load_arm(config: str, overrides: list[str]):
    """An arm's config with its overrides, without its teacher (a run folder that may not exist yet), and without the
    choice of its best evaluation until the budget has set its evaluations (``log.eval_every``: the choice needs them)."""
    from experiments.common import ROOT
    from moh_dit.training.config import load_config

    evaluated = any(o.startswith("log.eval_every=") for o in overrides)
    kept = [o for o in overrides if not o.startswith("distill.teacher")]
    return load_config(ROOT / config, [o for o in kept if evaluated or not o.startswith("log.eval_keep_best=")])


def counted_objective(loaded):
    """The objective of an arm's loaded config as the budget counts it: the teacher's evaluations as if guided
    wherever the teacher is not unguided (two per evaluation)."""
    from moh_dit.training.objective import objective_record, run_objective

    guided = {"scale": 1.0 if loaded.distill.guidance_scale == 1 else 2.0}
    return run_objective(loaded, objective_record(loaded) | {"time": "moh-dit", "guidance": guided}, False)


def fill_budget(
    config: str, overrides: list[str], spent: float, sc: dict, stretch: int = 1, share: float = 1.0
) -> tuple[list[str], list[str]]:
    """The length and evaluations of a stage that spends what is left of :data:`BUDGET` after ``spent`` (the start's
    counted cost) and, for a run that records its own set of trajectories, that set (as if every evaluation were
    guided), at its objective's count per image (the teacher's evaluations as if all guided) and its own batch:
    ``(train overrides, evaluation overrides)``; ``stretch`` times that length past the budget, evaluated at the same steps as the run
    within it and on; ``share`` of what is left (:func:`budget_share`). At the smoke scale the smoke run's length and
    evaluations."""
    ramp = _provisional_ramp(overrides)
    loaded = load_arm(config, [*overrides, *ramp])
    if sc.get("smoke"):
        return _ramp_over(ramp, loaded.train.max_steps), sc["student_eval"]
    section = loaded.distill
    objective = counted_objective(loaded)
    if "trajectories" in objective.frozen_models_for(vars(section)) and section.trajectories is None:
        spent += section.trajectory_count * (section.trajectory_steps or 25) * 2.0  # its own set, before it trains
    cycle = getattr(objective, "student_updates", getattr(objective, "fake_updates", 0)) + 1
    limit = spent + share * (BUDGET - spent)
    batch = loaded.train.global_batch_size  # the study's BATCH, or an arm's own (more, smaller updates)
    steps = 0  # step by step, as each step spends (a stage whose terms start late spends less before)
    while True:
        cost = batch * (objective.step_forwards(steps) + objective.teacher_forwards_at(steps))
        if spent + cost > limit:
            break
        spent, steps = spent + cost, steps + 1
    steps = steps // cycle * cycle
    if steps < 8 * cycle:
        raise SystemExit(f"the budget leaves {steps} steps after {spent:,.0f} evaluations: too few to train")
    every = max(cycle, math.floor(steps / 8 / cycle) * cycle)  # eight points on the curve, the last at the end
    length = [f"train.max_steps={steps * stretch}", f"train.checkpoint_every={every}", *_ramp_over(ramp, steps)]
    return length, [f"log.eval_every={every}", "log.eval_samples=500"]


def _provisional_ramp(overrides: list[str]) -> list[str]:
    """For an arm that ramps the real score's scale (``distill.real_guidance_end``) with no ramp of its own, the ramp
    that lets its config load while the budget sets the stage's length; the scale's end above 1 keeps every step's
    cost the same whatever the ramp (an end at 1, unguided, would not: give its ramp)."""
    ends = [o.split("=", 1)[1] for o in overrides if o.startswith("distill.real_guidance_end=")]
    if not ends or any(o.startswith("distill.real_guidance_ramp=") for o in overrides):
        return []
    if float(ends[-1]) <= 1:
        raise SystemExit(
            "a ramp of the real score's scale to 1 changes the stage's cost: give distill.real_guidance_ramp"
        )
    return ["distill.real_guidance_ramp=1"]


def _ramp_over(provisional: list[str], steps: int) -> list[str]:
    """The ramp of the real score's scale over the stage's ``steps`` within the budget, for an arm that has only the
    provisional one (:func:`_provisional_ramp`)."""
    return [f"distill.real_guidance_ramp={steps}"] if provisional else []


def at_batch(config: str, overrides: list[str], batch: int) -> tuple[str, list[str]]:
    """An arm at a smaller batch: its EMA's decay to the power batch / :data:`BATCH` (the EMA steps once per generator
    update, so the scored generator keeps the same share of its start over the more updates), and a late GAN term's
    first step times BATCH / batch (it switches on at the same share of the images)."""
    decay = _ema_decay(config, tuple(o for o in overrides if o.startswith("ema."))) ** (batch / BATCH)
    scaled = [
        f"distill.gan_start={int(o.split('=')[1]) * BATCH // batch}" if o.startswith("distill.gan_start=") else o
        for o in overrides
    ]
    return config, [*scaled, f"train.global_batch_size={batch}", f"ema.decay={decay:.6f}"]


@functools.cache
def _ema_decay(config: str, overrides: tuple[str, ...]) -> float:
    """The EMA's decay of ``config`` with ``overrides`` (loaded once per pair)."""
    return load_arm(config, list(overrides)).ema.decay


def budget_share(arm: str) -> float:
    """The share of what the budget leaves after its start that ``arm`` spends (:data:`SHARES`; 1: all of it)."""
    return next((share for prefix, share in SHARES.items() if arm.startswith(prefix)), 1.0)


def over_budget(arm: str) -> int:
    """How many times the steps the budget leaves ``arm`` trains (1: within the budget; :data:`OVER_BUDGET`)."""
    return OVER_BUDGET.get(arm.rsplit("-", 1)[-1], 1)
