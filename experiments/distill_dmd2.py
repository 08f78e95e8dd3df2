"""The distillation study's DMD2 arms as its references train them (experiments/distill.py trains and scores them):
the GAN term on real data, enough generator updates, the real score at its own guidance, two steps by backward
simulation, and the whole distillation within the teacher's training in network evaluations.

    short-{kind}              the trajectory stage DMD2 starts from, at a quarter of the earlier set (1024 trajectories)
                              and 830 steps (the DDPM teacher's new output layer: 1245), its configs'
    dmd2s-{kind}-g{r}         DMD2 from that student: the real score guided at r (1: none), the GAN term on real
                              data (FastGen's weight 1e-3, from the start, at the fake score's rate), two steps by
                              backward simulation on [1, 0.5, 0], four fake-score updates per generator update; as
                              many steps as the budget leaves after the trajectory stage
        -nogan                the same without the GAN term
        -data                 two steps from the data noised to 0.5 (FastGen's) instead of the generator's own
        -f1                   one fake-score update per generator update (SiD's, SiDA's): 2.5x the generator updates
        -lr3e-5               a third of the rate (the first curves were flat from a fifth of their length)
        -nogan-cos            without the GAN term, the rate's cosine decay to 0 at the end (the generator's and the
                              fake score's: both runs above got worse in their second half)
    dmd2g-{kind}-g{r}         DMD2 from the teacher itself, the whole budget
    ganonly-{kind}            a GAN fine-tune of the teacher's weights (GDD, D2O): no distillation loss, one
                              discriminator update per generator update, the whole budget
    dmd2f-{kind}-g{r}         the recipe at the chosen scale (and the sampler's, where it differs) from the
                              full-length trajectory student (`trajectory-{kind}`: 4096 trajectories and 3320 steps,
                              0.84 of the budget), as `dmd2t` starts (the seed-0 sweep's start sets where one step
                              ends); what the budget leaves is about 830 steps
        -nogan                the same without the GAN term (`dmd2t`'s recipe with two steps by backward simulation)
        -nogan-f1             and one fake-score update per generator update: 2.2x the generator updates
        -nogan-f8             and eight: a fake score that tracks the generator more closely, at 0.55x the updates
        -nogan-x4             four times the steps the budget leaves (a measurement over the budget, reported as
                              such: where the curve that was still falling at the budget's end turns)
        -nogan-middle{m}      the two-step grid's middle at m (:data:`MIDDLES`) instead of 0.5, in training and
                              sampling (recorded with the generator)
    dmd2f-{kind}-g1-ganlate   the references' own pairing (:data:`GAN_LATE`): the real score unguided, the GAN term on
                              real data at DMD2's ImageNet-64 weight (3e-3) switched on late (SiDA's order, DMD2's
                              resumed run), so that the sharpness comes from the data rather than from the guidance
        -x4                   four times the steps the budget leaves, so that the discriminator has time to act
    dmd2f-{kind}-g{r}-ganlate the same GAN term at the recipe's scale: whether switched on late it pays for its passes
    dmd2f-{kind}-g{r}-ganlow  the late GAN term with its discriminator at low noise (:data:`GAN_LOW`: its own times,
                              where the late term's discriminator could tell real from generated), at the recipe's
                              scale and unguided (`-g1-ganlow`)
    dmd2f-{kind}-g{1,1.5,2}-nogan  the real score below the sampler's scale from the same start, without the GAN term
                              (:data:`VARIETY_SCALES`: the issue's sweep beside the recipe's sampler scale)
    half-{kind}               the full trajectory stage at half its steps (the same 4096 trajectories): its curve's
                              second half gained 0.9 KID at one step for 0.2 of the budget
    dmd2h-{kind}-g{r}         the recipe from it (and -nogan): about twice dmd2f's DMD2 steps
    low-{kind}                the full trajectory stage recorded at a lower guidance (:data:`LOW_SCALE`: 1.5 and 2
                              against the samplers' 3 and 4), so that the start DMD2 refines keeps more variety
    dmd2l-{kind}-g{r}-nogan   the recipe without the GAN term from it, the real score at the sampler's scale putting
                              the guidance back (the variety lever the three-seed record points to)
        -x4                   four times the steps the budget leaves (over the budget, reported as such)
    mid-{kind}                the same start recorded between (:data:`MID_SCALE`: 2 and 3)
    dmd2mid-{kind}-g{r}-nogan the recipe without the GAN term from it, as `dmd2l-*`
    few-{kind}                the full trajectory stage (all its steps) on a quarter of its recorded set (1024
                              trajectories): the recording is half the full stage's cost, so a start as good as the
                              full one on a quarter of the set would leave DMD2 about three times the steps
    dmd2few-{kind}-g{r}-nogan the recipe without the GAN term from it, as `dmd2l-*`, for what the budget leaves
    fewlow-{kind}, fewmid-{kind}  the cheaper start recorded at the lower and the middle guidance: the variety lever
                              (recall) with the three times as many generator updates its curves still wanted
    dmd2fewl-*, dmd2fewmid-*  the recipe without the GAN term from them (`-{kind}-g{r}-nogan`, and `-ema998`: the
                              start's share held over the longer stage, the cheaper start's best measured balance)
    dmd2f-{kind}-g{r}-nogan-reg{w}, -feat{w}[-t{t}]  the recipe with DMD's regression (:data:`REGRESSION`) on its
                              start's own set, by the squared error or the teacher's features
    ectfew-{kind}, dmd2ecf-*  ECT (its intervals uniform) from the cheaper start for half of what the budget leaves
                              after it, then the recipe without the GAN term from it (`-{kind}-g{r}-nogan`, `-ema998`)
    ectfew{tail}-{kind}       ECT's variants (:data:`ECT_STARTS`: a third of the rate, the fixed steps 0.05 and 0.1),
                              and the step 0.05 with a quarter or three quarters of what the cheaper start leaves
                              (`dts25`, `dts75`; `distill_dmd2_settings.ECT_SPLITS`), each with DMD2 from it
                              (`dmd2ecf{tail}-*`; `-fresh` on :data:`FRESH_DMD2`'s arms: backward simulation afresh)
    fewuni-{kind}             the cheaper start with its intervals drawn as the stage's other draws
                              (`distill.grid_share=0`), on the same recorded set: ECT at the step 0.05 from it
                              (`ectfewuni-{kind}`, :data:`ECT_START_OF`) and DMD2 from that (`dmd2ecfuni-*`)
    sidecfdt-{kind}-g{r}-nogan[-ema998]  SiD's score-identity loss (`distill.method: sid`, :data:`SID`) in place of
                              VSD, from ECT's start at the step 0.05, at the settings of DMD2 from it (each EMA);
                              `-f1`: SiD's one fake-score update per generator update, `-lr3e-4`: three times
                              the rate (`-lr3e-4-alpha{0.5,1}`: with SiD's alpha lower), `-x4`: past the budget;
                              `sidecfdt-{kind}-g{r}[-ema998]-ganlate`: the GAN term switched on late (SiDA's pairing)
                              `-lsg`, `-fakeread2`: the fake score's own guidance (SiD-LSG's, `distill.fake_guidance`:
                              trained and read at the real score's scale; `distill.fake_guidance_eval` 2: trained
                              unguided, read at 2; `distill_dmd2_settings.LSG_ARMS`)
                              `-b8`, `-b4`, `-b2`: a half, a quarter and an eighth of the batch, that many times
                              the updates in the same evaluations (`distill_dmd2_settings.SMALLER_BATCHES`,
                              `BATCH_BASES`; `-alpha1-real8-ganlate-b4`: with the late GAN term, on from the same
                              share of the images); `-fake{m}x`: the fake score at m times the generator's rate
                              (`distill_dmd2_settings.FAKE_RATES`); `-alpha1-real8-b4-x2`: twice the steps the
                              budget leaves (over the budget, reported as such; `-best-x2`: its best two-step
                              evaluation on training images kept and scored, `KEEP_BEST`); `-beta0`: Adam without its first
                              moment (SiD's, rCM's; `distill_dmd2_settings.ADAM_BETA0`); `-karras`: the loss's noise
                              levels uniform over Karras sigmas (FastGen's, SiD's); the configs' arms with
                              `-rerun`: the same recipe at another seed of the stage (`RERUN_SEED`, `RERUNS`), and
                              `-lead[-middle{0.3,0.2,0.1}]`: the middle trained on the frozen start's jump (`LEAD_ARMS`)
    sidfew-{kind}-g{r}-nogan[-ema998]-*  the same SiD arms in place of DMD2 from the cheaper start (`dmd2few-*`),
                              without ECT: about twice the budget left to SiD; `sidecfdts25-*`: after a quarter of
                              it to ECT (`ectfewdts25-*`)
    dmd2m-{kind}-g{r}-nogan   the recipe without the GAN term from the MeanFlow-distilled student (`meanflow-{kind}`,
                              level with its teacher at four steps), for what the budget leaves after it
    rcm-{kind}                rCM's route in one run (configs/fashion_mnist_moh_rcm.yaml): the trajectory loss on
                              1024 trajectories, and from the short stage's length on a VSD term at the recipe's
                              real-score scale, the fake score on 1 of 5 steps at a fifth of the rate; the budget
                              fills with its own set counted
    ect-{kind}                CMT's own second stage in place of DMD2 (configs/fashion_mnist_moh_ect.yaml): the full
                              trajectory student post-trained by consistency with a small fixed step (ECT's, 0.01),
                              the teacher's guided velocity for the step; as many steps as the budget leaves after it
    uni-{kind}                the full trajectory stage with its intervals drawn uniformly over the recorded grid's
                              times (`distill.grid_share=0`) instead of nine in ten on the samplers' own: a start
                              whose jumps cover every interval, as CMT's mid-training's do (on the full stage's
                              own recorded set: only the intervals drawn differ)
    ectu-{kind}               ECT (as `ect-{kind}`) from it: whether a start covering every interval is what the
                              small fixed step needs (from the grid-trained start it diverges)
    ectc-{kind}               ECT from the grid-trained start with ECT's own curriculum (:data:`ECT_CURRICULUM`): the
                              step starts at the 4-step grid's spacing, so that the first jumps asked for start on
                              the grid times that start learned, and halves every 100 steps down to 0.01
    ect-{kind}-uniform        ECT from the grid-trained start with its own intervals drawn uniformly
                              (`distill.grid_share=0`), so that the jumps its targets ask for (from `t - 0.01`) are
                              trained as often as the ones asked of
        -x4                   four times the steps the budget leaves (over the budget, reported as such: its two
                              steps were still falling at the budget's end)

Each DMD2 arm sets every key it is measured with, so that a later change of a config's defaults leaves its meaning.
The lengths are counted, not guessed: a stage's steps are what the teacher's budget (8,300 steps x 16 images x 3 =
398,400 network evaluations) leaves after the student it starts from (its run's counted cost), at the stage's own
count per image (:meth:`moh_dit.objectives.distill.dmd2.DMD2Distill.step_forwards`, the teacher's guided evaluations
included as if every one were guided), rounded down to whole cycles of generator and fake-score updates.
"""

from __future__ import annotations

import itertools
from pathlib import Path

from experiments.distill_dmd2_budget import (  # noqa: F401 (re-exported: the study reads them here)
    at_batch,
    budget_share,
    counted_objective,
    fill_budget,
    load_arm,
    over_budget,
)
from experiments.distill_dmd2_divergence import DIVERGENCE_ARMS, DIVERGENCE_PREFIXES
from experiments.distill_dmd2_settings import (  # the settings, re-exported where the study and its tests read them
    ANCHORS,
    BATCH_BASES,
    BUDGET,
    CHOSEN_SCALE,
    ECT,
    ECT_CURRICULUM,
    ECT_DMD2,
    ECT_START_OF,
    ECT_STARTS,
    ECT_VARIETY_SCALE,
    FEW_SHARE,
    FRESH,
    FRESH_DMD2,
    FROM_SHORT,
    FROM_TEACHER,
    FULL_VARIANTS,
    GAN_LATE,
    GAN_LOW,
    GAN_ONLY,
    HELD_PAST_BUDGET,
    KEEP_BEST,
    LEAD_ARMS,
    LEAD_BASES,
    LEAD_INPUT,
    LEAD_KIND_ARMS,
    LEAD_PREFIXES,
    LOW_SCALE,
    MID_SCALE,
    MIDDLES,
    RCM,
    RCM_RECIPE,
    REAL_SCALES,
    RECIPE,
    REGRESSION,
    RERUN_SEED,
    RERUNS,
    SAMPLER_SCALE,
    SHARES,
    SHORT,
    SID,
    SID_BESIDE,
    SID_VARIANTS,
    SMALLER_BATCHES,
    START_SET,
    VARIANTS,
    VARIETY_SCALES,
)

__all__ = ["ARMS", "BUDGET", "CHOSEN_SCALE", "REAL_SCALES", "RECIPE_SCALE", "dmd2_arms", "budget_arm", "three_seed_arms",
           "fill_budget", "over_budget", "budget_share"]  # fmt: skip


def _overrides(settings: dict) -> list[str]:
    """``section.key=value`` overrides of ``settings`` (a bare key is the ``distill`` section's)."""
    return [f"{key if '.' in key else 'distill.' + key}={str(value).replace(' ', '')}" for key, value in settings.items()]  # fmt: skip


def _label(scale: float) -> str:
    return f"g{scale:g}"


def _variant_name(name: str, suffix: str, change: dict) -> str:
    """``{name}-{suffix}``, less ``-nogan`` where ``change`` turns the GAN term on."""
    return f"{name.replace('-nogan', '') if 'distill.gan_weight' in change else name}-{suffix}"


def dmd2_arms(
    kinds: tuple[str, ...], runs: Path, seed: int, sc: dict, full: dict[str, tuple[str, list[str]]]
) -> dict[str, tuple[str, list[str]]]:
    """Every arm of these DMD2 measurements (``(config, overrides)`` each, the teacher and the student it starts from
    named for ``seed``), in an order that trains a start before its students; ``sc``: the scale (its smoke run's set
    of trajectories); ``full``: each kind's full trajectory student's arm (the half stage is it at half its steps)."""
    arms: dict[str, tuple[str, list[str]]] = {}
    for kind in kinds:
        teacher = f"distill.teacher={runs / f'{kind}-seed{seed}'}"
        arms[f"short-{kind}"] = (SHORT[kind], [teacher, *sc.get("trajectory", [])])
        start = _started(runs, f"dmd2s-{kind}", seed)
        for scale in REAL_SCALES[kind]:
            base = RECIPE | {"real_guidance": scale}
            name = f"dmd2s-{kind}-{_label(scale)}"
            arms[name] = (FROM_SHORT[kind], [teacher, start, *_overrides(base)])
            if scale == CHOSEN_SCALE[kind]:
                for suffix, change in VARIANTS.items():
                    arms[f"{name}-{suffix}"] = (FROM_SHORT[kind], [teacher, start, *_overrides(base | change)])
        chosen = RECIPE | {"real_guidance": CHOSEN_SCALE[kind]}
        arms[f"dmd2g-{kind}-{_label(CHOSEN_SCALE[kind])}"] = (FROM_TEACHER[kind], [teacher, *_overrides(chosen)])
        arms[f"ganonly-{kind}"] = (FROM_TEACHER[kind], [teacher, *_overrides(RECIPE | GAN_ONLY)])
        config, overrides = full[kind]
        loaded = load_arm(config, overrides)
        steps = loaded.train.max_steps
        arms[f"half-{kind}"] = (config, [*overrides, f"train.max_steps={steps // 2}"])
        for prefix in ("dmd2f", "dmd2h"):
            origin = _started(runs, f"{prefix}-{kind}", seed)
            # the recipe's scale, and the sampler's (dmd2t's real score) where they differ
            for scale in dict.fromkeys((CHOSEN_SCALE[kind], REAL_SCALES[kind][-1])):
                name, settings = f"{prefix}-{kind}-{_label(scale)}", RECIPE | {"real_guidance": scale}
                arms[name] = (FROM_SHORT[kind], [teacher, origin, *_overrides(settings)])
                variants = FULL_VARIANTS if prefix == "dmd2f" else {"nogan": VARIANTS["nogan"]}
                for suffix, change in variants.items():
                    arms[f"{name}-{suffix}"] = (FROM_SHORT[kind], [teacher, origin, *_overrides(settings | change)])
            for scale in VARIETY_SCALES[kind] if prefix == "dmd2f" else ():  # the full start's, without the GAN term
                variety = f"{prefix}-{kind}-{_label(scale)}-nogan"
                settings = RECIPE | {"real_guidance": scale} | VARIANTS["nogan"]
                arms.setdefault(variety, (FROM_SHORT[kind], [teacher, origin, *_overrides(settings)]))
        arms[f"low-{kind}"] = (config, [*overrides, f"distill.guidance_scale={LOW_SCALE[kind]}"])
        settings = RECIPE | {"real_guidance": RECIPE_SCALE[kind]} | VARIANTS["nogan"]
        arms[f"mid-{kind}"] = (config, [*overrides, f"distill.guidance_scale={MID_SCALE[kind]}"])
        few = max(1, loaded.distill.trajectory_count // FEW_SHARE)
        arms[f"few-{kind}"] = (config, [*overrides, f"distill.trajectory_count={few}"])
        for name, scale in (("fewlow", LOW_SCALE[kind]), ("fewmid", MID_SCALE[kind])):  # the two levers together
            arms[f"{name}-{kind}"] = (config, [*arms[f"few-{kind}"][1], f"distill.guidance_scale={scale}"])
        arms[f"fewuni-{kind}"] = (config, [*arms[f"few-{kind}"][1], "distill.grid_share=0.0"])  # every interval drawn
        # ECT (its intervals uniform) for half of what the cheaper start leaves: a start for DMD2 (`dmd2ecf{tail}-`)
        for tail, change in ECT_STARTS.items():
            stage = f"ectfew{tail}-{kind}"
            arms[stage] = (ECT[kind], [teacher, _started(runs, stage, seed), "distill.grid_share=0.0", *_overrides(change)])  # fmt: skip
        # the recipe from the lower-guidance starts, from the start on a quarter of the set, the MeanFlow student and ECT's
        for prefix in ("dmd2l", "dmd2mid", "dmd2few", "dmd2fewl", "dmd2fewmid", "dmd2m", *ECT_DMD2):
            origin = _started(runs, f"{prefix}-{kind}", seed)
            arms[f"{prefix}-{kind}-{_label(RECIPE_SCALE[kind])}-nogan"] = (
                FROM_SHORT[kind],
                [teacher, origin, *_overrides(settings)],
            )
        # from ECT's start at a lower real-score scale: whether DMD2 keeps more of the recall ECT adds
        variety = RECIPE | {"real_guidance": ECT_VARIETY_SCALE} | VARIANTS["nogan"]
        arms[f"dmd2ecf-{kind}-{_label(ECT_VARIETY_SCALE)}-nogan"] = (FROM_SHORT[kind], [teacher, _started(runs, f"dmd2ecf-{kind}", seed), *_overrides(variety)])  # fmt: skip
        dmd2l = f"dmd2l-{kind}-{_label(RECIPE_SCALE[kind])}-nogan"
        arms[f"{dmd2l}-x4"] = arms[dmd2l]  # the variety lever's curve still fell at the budget's end
        arms |= _recipe_variants(arms, kind)
        arms |= _sid_arms(arms, kind)
        arms |= _lead_arms(arms, kind, seed)
        for scale in (1.0, RECIPE_SCALE[kind]):  # unguided, as the references pair it, and at the recipe's scale
            for suffix, gan in (("ganlate", GAN_LATE), ("ganlow", GAN_LOW)):
                late, settings = f"dmd2f-{kind}-{_label(scale)}-{suffix}", RECIPE | gan | {"real_guidance": scale}
                arms[late] = (
                    FROM_SHORT[kind],
                    [teacher, _started(runs, "dmd2f-" + kind, seed), *_overrides(settings)],
                )
        unguided = f"dmd2f-{kind}-g1-ganlate"
        arms[f"{unguided}-x4"] = arms[unguided]  # long enough for its discriminator to act (past the budget, reported)
        # the full stage's own recorded set, so that only the intervals drawn differ (its cost counts the set again)
        recorded = f"distill.trajectories={runs / f'trajectory-{kind}-seed{seed}' / 'trajectories'}"
        arms[f"uni-{kind}"] = (config, [*overrides, recorded, "distill.grid_share=0.0"])
        recipe = f"dmd2f-{kind}-{_label(RECIPE_SCALE[kind])}-nogan"  # with DMD's regression on its start's own set
        arms |= {f"{recipe}-{suffix}": (FROM_SHORT[kind], [*arms[recipe][1], recorded, *_overrides(change)]) for suffix, change in REGRESSION.items()}  # fmt: skip
        on_grid = "distill.grid_share=0.9"  # the trajectory stage's times (nine in ten intervals on the samplers' grids)  # fmt: skip
        for prefix in ("ect", "ectu"):  # CMT's second stage from the grid-trained start and from the uniform one
            arms[f"{prefix}-{kind}"] = (ECT[kind], [teacher, _started(runs, f"{prefix}-{kind}", seed), on_grid])
        curriculum = [f"distill.{key}={value}" for key, value in ECT_CURRICULUM.items()]
        arms[f"ectc-{kind}"] = (ECT[kind], [teacher, _started(runs, f"ectc-{kind}", seed), on_grid, *curriculum])
        uniform = f"ect-{kind}-uniform"  # its own intervals drawn uniformly
        arms[uniform] = (ECT[kind], [teacher, _started(runs, uniform, seed), "distill.grid_share=0.0"])
        arms[f"{uniform}-x4"] = arms[uniform]  # its two steps still fell at the budget's end: where the curve turns
        rcm = RCM_RECIPE | {"real_guidance": CHOSEN_SCALE[kind]}
        arms[f"rcm-{kind}"] = (RCM[kind], [teacher, *_overrides(rcm), *sc.get("trajectory", [])])
    return arms


def _lead_arms(arms: dict[str, tuple[str, list[str]]], kind: str, seed: int) -> dict[str, tuple[str, list[str]]]:
    """The SiD arms of :data:`LEAD_BASES` from ECT's start (at each split of :data:`LEAD_PREFIXES`) trained for the
    hand-off (:data:`LEAD_ARMS`, and the teacher's own of :data:`LEAD_KIND_ARMS`), and the config's own arm again at
    another seed of the stage (``-rerun``)."""
    extra = {}
    for tail, prefix in itertools.product(LEAD_BASES[kind], LEAD_PREFIXES):  # the arms varied, at each ECT split
        config_arm = f"{prefix}-{kind}-{_label(RECIPE_SCALE[kind])}-nogan-{tail}"
        arm_config, arm_overrides = arms[config_arm]
        if prefix == "sidecfdt" and tail in RERUNS[kind]:  # the config's arm again at another seed (train.seed wins)
            extra[f"{config_arm}-rerun"] = (arm_config, [*arm_overrides, f"train.seed={seed + RERUN_SEED}"])
        lead = next(o.split("=", 1)[1] for o in arm_overrides if o.startswith("distill.student_from="))
        resolved = {SAMPLER_SCALE: RECIPE_SCALE[kind], START_SET: f"{Path(lead).parent / f'{start_of(start_of(config_arm))}-seed{seed}' / 'trajectories'}"}  # fmt: skip
        for lead_tail, change in (LEAD_ARMS | LEAD_KIND_ARMS.get(kind, {})).items():
            change = {k: resolved.get(v, v) if isinstance(v, str) else v for k, v in (LEAD_INPUT | change).items()}
            name = _variant_name(config_arm, lead_tail, change)
            extra[name] = (arm_config, [*arm_overrides, *_overrides(change), f"distill.lead_model={lead}"])
    return extra


def _sid_arms(arms: dict[str, tuple[str, list[str]]], kind: str) -> dict[str, tuple[str, list[str]]]:
    """SiD's arms: each DMD2 stage SiD replaces (:data:`SID_BESIDE`; the recipe without the GAN term), at the EMA of
    the configs (0.995) and at 0.998 (each teacher's chain config is one of the two), with the method alone changed;
    and their variants (:data:`SID_VARIANTS`)."""
    sid = {}
    for prefix, dmd2_prefix in SID_BESIDE.items():
        beside = f"{dmd2_prefix}-{kind}-{_label(RECIPE_SCALE[kind])}-nogan"
        for dmd2 in (beside, f"{beside}-ema998"):
            config, overrides = arms[dmd2]
            name = prefix + dmd2.removeprefix(dmd2.split("-")[0])
            sid[name] = (config, [*overrides, *_overrides(SID)])
            named = {}
            for suffix, change in SID_VARIANTS.items():
                named[suffix] = _variant_name(name, suffix, change)
                sid[named[suffix]] = (config, [*sid[name][1], *_overrides(change)])
            for base, (tail, batch) in itertools.product(BATCH_BASES, SMALLER_BATCHES.items()):
                sid[f"{named[base]}-{tail}"] = at_batch(*sid[named[base]], batch)
            # the real score at 8 at batch 4 (the flow twin's config among these) run on past the budget, as a user might
            at_batch4 = f"{named['alpha1-real8']}-b4"
            sid[f"{at_batch4}-x2"] = sid[at_batch4]
            sid[f"{at_batch4}-best-x2"] = (config, [*sid[at_batch4][1], *_overrides(KEEP_BEST)])  # its best kept
    return sid


def _recipe_variants(arms: dict[str, tuple[str, list[str]]], kind: str) -> dict[str, tuple[str, list[str]]]:
    """The recipe's (and the cheaper starts' recipes') variants that change one setting of an arm already in
    ``arms``: the start held by a longer EMA, past the budget with the recipe's share held, the two-step grid's middle."""
    variants = {}
    for prefix in ("dmd2f", "dmd2few", "dmd2fewl", "dmd2fewmid", *ECT_DMD2):
        name = f"{prefix}-{kind}-{_label(RECIPE_SCALE[kind])}-nogan"
        config, extra = arms[name]
        for middle in MIDDLES if prefix == "dmd2f" else ():  # in training and sampling (recorded with the generator)
            moved = [o for o in extra if not o.startswith("distill.dmd_midpoint=")]
            variants[f"{name}-middle{middle:g}"] = (config, [*moved, f"distill.dmd_midpoint={middle}"])
        for suffix, decay in ANCHORS.items():
            variants[f"{name}-{suffix}"] = (config, [*extra, f"ema.decay={decay}"])
        for suffix, decay in HELD_PAST_BUDGET.get(prefix, {}).items():
            variants[f"{name}-{suffix}-x4"] = (config, [*extra, f"ema.decay={decay}"])
        for arm in (name, f"{name}-ema998") if prefix in FRESH_DMD2 else ():  # the DMD2 configs' arms
            variants[f"{arm}-fresh"] = (config, [*(variants.get(arm) or arms[arm])[1], *_overrides(FRESH)])
            for suffix, change in DIVERGENCE_ARMS.items() if prefix in DIVERGENCE_PREFIXES else ():  # f-distill's
                variants[_variant_name(f"{arm}-fresh", suffix, change)] = (config, [*variants[f"{arm}-fresh"][1], *_overrides(change)])  # fmt: skip
    return variants


def _started(runs: Path, stage: str, seed: int) -> str:
    """The override that starts ``stage`` (``{prefix}-{kind}``) from its start's run at ``seed`` (:data:`STARTS`)."""
    return f"distill.student_from={runs / f'{start_of(stage)}-seed{seed}'}"


THREE_SEED_START = "dmd2f"  # the start seed 0 chose (the full trajectory student: every shorter one ended worse)
# the real score's scale of the three-seed recipe: each sampler's, as in the configs (from the full start the default's
# r = 4 beat its r = 2 at one and two steps, and the flow twin's sampler scale is its CHOSEN_SCALE)
RECIPE_SCALE = {kind: scales[-1] for kind, scales in REAL_SCALES.items()}


def three_seed_arms(kinds: tuple[str, ...]) -> set[str]:
    """The arms trained at every seed: each teacher's recipe from the start seed 0 chose and its twin without the GAN
    term (their start, the trajectory student, is a method of the study, at every seed already)."""
    chosen = {f"{THREE_SEED_START}-{k}-{_label(RECIPE_SCALE[k])}" for k in kinds}
    return chosen | {f"{a}-nogan" for a in chosen}


# the arms whose length the budget sets
STAGES = ("dmd2s-", "dmd2f-", *SHARES, *(f"{p}-" for p in ECT_DMD2), *(f"{p}-" for p in SID_BESIDE), "dmd2h-", "dmd2l-", "dmd2mid-", "dmd2few-", "dmd2fewl-", "dmd2fewmid-", "dmd2m-", "dmd2g-", "ganonly-", "rcm-", "ect-", "ectu-", "ectc-")  # fmt: skip
# every arm of these measurements, by its name's start
ARMS = ("short-", "half-", "low-", "mid-", "few-", "fewlow-", "fewmid-", "fewuni-", "uni-", *STAGES)


def budget_arm(arm: str) -> bool:
    """Whether ``arm`` is a DMD2 stage whose length the teacher's budget sets."""
    return arm.startswith(STAGES)


# a stage's prefix: the arm it starts from, by its name's start
STARTS = {"dmd2s-": "short", "dmd2f-": "trajectory", "dmd2h-": "half", "dmd2l-": "low", "dmd2mid-": "mid", "dmd2few-": "few", "dmd2fewl-": "fewlow", "dmd2fewmid-": "fewmid", "dmd2m-": "meanflow",
          "ect-": "trajectory", "ectu-": "uni", "ectc-": "trajectory"}  # fmt: skip
STARTS |= {f"ectfew{tail}-": ECT_START_OF.get(tail, "few") for tail in ECT_STARTS} | {f"dmd2ecf{tail}-": f"ectfew{tail}" for tail in ECT_STARTS}  # fmt: skip
STARTS |= {f"{prefix}-": STARTS[f"{dmd2_prefix}-"] for prefix, dmd2_prefix in SID_BESIDE.items()}


def start_of(arm: str) -> str | None:
    """The arm a stage starts from (its cost counts towards the budget), or ``None`` (the teacher)."""
    prefix = next((p for p in STARTS if arm.startswith(p)), None)
    return None if prefix is None else f"{STARTS[prefix]}-{arm.split('-')[1]}"
