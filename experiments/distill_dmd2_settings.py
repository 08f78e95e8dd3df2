"""The measured settings the DMD2 study's arms are built from (experiments/distill_dmd2.py): the budget, the real
score's scales, the starts' guidance, each teacher's stage configs, the recipe and every variant's change of it, with
why each value is what it is. One table each; the arms are in ``distill_dmd2``."""

from __future__ import annotations

BUDGET = 8300 * 16 * 3  # the teachers' training in network evaluations (experiments/distill.py's teachers)
BATCH = 16
# the real score's scales measured at seed 0: none, 1.5, 2 and each teacher's sampler's (the flow twin's CFG 3, the
# default's recorded CFG 4 at DiT's timesteps 100-500)
REAL_SCALES = {"flow": (1.0, 1.5, 2.0, 3.0), "ddpm": (1.0, 1.5, 2.0, 4.0)}
# the scale the short start's variants are measured at: that sweep's best at seed 0 (500-sample one-step KID during
# training at matched steps: the flow twin's 18.3 / 15.3 / 13.7 at r = 1 / 2 / 3, step 640-660; the default's 18.2 at
# r = 1 against 14.8 at r = 2, step 600-620; its r = 1.5 and 4 not run there)
CHOSEN_SCALE = {"flow": 3.0, "ddpm": 2.0}
# the real score below the sampler's scale from the full start, without the GAN term: the issue's sweep (none, 1.5, 2)
# beside the recipe's sampler scale, and the variety lever the full start's variants point to (its recall falls with
# every longer run at the sampler's scale; the default's r = 2 there is its CHOSEN_SCALE already)
VARIETY_SCALES = {"flow": (1.0, 1.5, 2.0), "ddpm": (1.0, 1.5, 2.0)}
# the guidance the lower-guidance trajectory start records its trajectories at (the samplers' are 3 and 4): about half
LOW_SCALE = {"flow": 1.5, "ddpm": 2.0}
# the start between: two thirds to three quarters of the samplers' scale (the flow twin's start at half its CFG 3 lost
# two-step KID, 5.31 against 3.22, where the default's at half its CFG 4 kept it, 6.46 against 6.45)
MID_SCALE = {"flow": 2.0, "ddpm": 3.0}
# the share of the full trajectory stage's recorded set the cheaper start records (all the stage's steps on it)
FEW_SHARE = 4
# each teacher's config of a stage: the flow twin's, and the default's (`_ddpm`)
KIND_CONFIG = {"flow": "configs/fashion_mnist_moh_{}.yaml", "ddpm": "configs/fashion_mnist_moh_{}_ddpm.yaml"}
SHORT, FROM_SHORT, FROM_TEACHER, RCM, ECT = ({k: v.format(stem) for k, v in KIND_CONFIG.items()} for stem in (
    "distill_trajectory_short", "dmd2_trajectory", "dmd2", "rcm", "ect"))  # fmt: skip
# ECT's curriculum from the grid-trained start: from the 4-step grid's spacing (a step from t = 1 lands on 0.75, a time
# that start learned its jumps from), halved every 100 of the ~670 steps the budget leaves, to the fixed step's 0.01
ECT_CURRICULUM = {"ect_dt_start": 0.25, "ect_dt_every": 100}
RCM_RECIPE = {"student_updates": 4, "vsd_weight": 1.0, "fake_lr": 2e-4, "gan_weight": 0.001, "dmd_input": "generator",
              "dmd_steps": [1, 2], "trajectory_count": 1024}  # fmt: skip
VARIANTS = {  # a suffix of dmd2s-{kind}-g{r}: what it changes (the two-step middle is a key, not measured here)
    "nogan": {"distill.gan_weight": 0.0},
    "data": {"distill.dmd_input": "data"},
    "f1": {"distill.fake_updates": 1},
    "lr3e-5": {"optim.lr": 3e-5},
    # without the GAN term a run still got worse in its second half: the rate decayed to 0 by the end (both networks)
    "nogan-cos": {"distill.gan_weight": 0.0, "optim.schedule": "cosine"},
}
# every DMD2 arm's settings unless it changes one
RECIPE = {"gan_weight": 0.001, "gan_start": 0, "vsd_weight": 1.0, "dmd_input": "generator", "dmd_steps": [1, 2],
          "dmd_midpoint": 0.5, "fake_updates": 4}  # fmt: skip
GAN_ONLY = {"vsd_weight": 0.0, "gan_weight": 1.0, "fake_updates": 1}
# the full start's variants (its stage ended still falling, with 163 generator updates): more generator updates in the
# same budget, and the same run past the budget
FULL_VARIANTS = {
    "nogan": VARIANTS["nogan"],
    "nogan-f1": VARIANTS["nogan"] | VARIANTS["f1"],
    "nogan-f8": VARIANTS["nogan"] | {"distill.fake_updates": 8},  # whether a lagging fake score makes VSD seek modes
    "nogan-x4": VARIANTS["nogan"],
}
# the EMA's hold on the start: the generator's EMA steps once per generator update, so at the recipe's decay (0.995)
# and 163 updates the scored weights keep 0.995^163 = 44% of the start (its raw weights score worse: the EMA is an
# anchor, not a lag); a longer stage at that decay keeps less (9% at the cheaper start's 489). A suffix -ema{digits}
# sets a longer EMA: 0.998 keeps 38% over 489 updates (about the recipe's share) and 72% over 163; 0.999 keeps 61%
ANCHORS = {"ema998": 0.998, "ema999": 0.999}
# the recipe past the budget with its share held (-x4's 652 updates at 0.995 keep 4% of the start; 0.44^(1 / 652)):
# whether length is a lever once the anchor is not loosened with it
# (per start; the cheaper starts' recipes: their 38% at 0.998 over 488 updates, 0.38^(1 / 1952) over -x4's)
HELD_PAST_BUDGET = {"dmd2f": {"ema99874": 0.99874}, "dmd2few": {"ema9995": 0.9995}, "dmd2fewl": {"ema9995": 0.9995}}
# the references' pairing of the GAN term with an unguided real score (DMD2 on ImageNet-64 and SiDA fold no guidance
# into it: the discriminator on real data supplies the sharpness): DMD2's ImageNet-64 generator weight, switched on
# once the fake score has trained with the generator alone for a quarter of the stage (SiDA's order; DMD2's best
# ImageNet-64 run resumed a run without it)
GAN_LATE = {"gan_weight": 0.003, "gan_start": 200}
# the late term's discriminator told real from generated only at low noise (ROC area 0.83-0.88 at t = 0.1, 0.69-0.74
# at 0.3, near chance from 0.7; experiments.distill_diagnosis --part discriminator): its own times from the low end
GAN_LOW = GAN_LATE | {"gan_time": [0.02, 0.4]}
# the two-step grid's middle flow time (the recipe's is FastGen's 0.5; the issue asked for it measured): one nearer the
# data leaves the second step a refinement, one nearer the noise gives it more of the fresh noise to place
MIDDLES = (0.3, 0.7)
# DMD's regression (its mode-coverage term: the one-step sample of a trajectory's noise held to the teacher's end) on
# the recipe's start's own set, which that start paid for: DMD's weight 0.25 (with LPIPS there) and 1, by the squared
# error (`reg`), and by LPIPS's form in the teacher's block tokens (`feat`; moh_dit/objectives/distill/distances.py)
# read at the data and at flow time 0.3
FEATURES = {"regression_distance": "teacher_features"}
REGRESSION = {"reg0.25": {"regression": 0.25}, "reg1": {"regression": 1.0}, "feat0.25": {"regression": 0.25} | FEATURES,
              "feat1": {"regression": 1.0} | FEATURES, "feat1-t0.3": {"regression": 1.0, "regression_feature_time": 0.3} | FEATURES}  # fmt: skip
# a suffix: how many times the steps the budget leaves the arm trains (its cost above the budget, reported as such)
OVER_BUDGET = {"x4": 4}
# and twice (`-x2`), for the flow twin's two-step config at batch 4: its curves were flat over the last eighth on
# every seed, so whether a user who trains it longer keeps its quality (the same EMA, the same rate). Measured (seeds
# 0 and 2): two steps worse (3.74 against 2.64, 4.47 against 3.92), recall falling, one step better at seed 0 only
OVER_BUDGET["x2"] = 2
# a prefix: the share of what the budget leaves after its start that a stage spends, leaving the rest to a stage after
# it (ECT from the cheaper start, then DMD2 from that: a start with more of the teacher's recall, within the budget)
# ECT from the cheaper start, and DMD2 from it, by what its ECT stage changes: the prefixes' tail (`ectfew{tail}-`,
# `dmd2ecf{tail}-`) and its settings. At seed 1 the default's ECT (the rate 1e-4, the fixed step 0.01) degraded its
# start from its first evaluation on (one step 18.7 -> 49.7): a third of the rate (`lr`), or a fixed step five times
# longer, so that a target chains a fifth as many of the student's own jumps (`dt`; the twin configs' since), and ten
# times (`dt10`: where the longer step's gain turns, at seed 0)
ECT_STARTS = {"": {}, "lr": {"optim.lr": 3e-5}, "dt": {"distill.ect_dt": 0.05}, "dt10": {"distill.ect_dt": 0.1}}
# the budget's split between ECT at the step 0.05 and DMD2 from it (the others' is half each): a quarter and three
# quarters of what the cheaper start leaves to ECT (`ectfewdts{share}-`), the rest to DMD2 from it. Measured: half keeps
# the best two steps on both teachers (three quarters 1.81x and 2.08x against 1.75x and 1.91x over three seeds, for 0.02
# more recall; a quarter worse at seed 0), so the other arms and the configs keep half
ECT_SPLITS = {"dts25": 0.25, "dts75": 0.75}
ECT_STARTS |= {tail: ECT_STARTS["dt"] for tail in ECT_SPLITS}
# the cheaper start with its intervals drawn as the trajectory stage's other draws (logit-normal, snapped to the recorded
# grid; `distill.grid_share=0`) instead of nine in ten on the samplers' own (`fewuni-{kind}`), then ECT at the step 0.05
# from it (`ectfewuni-`): the cheaper start's jumps from times off the samplers' grids are its weak point, and each of
# ECT's targets rests on one of them (experiments.distill_diagnosis --part consistency). ECT's own step 0.01 from it too
# (`ectfewuni01-`): there the 0.01 target lands as close to the teacher's end as the start's own jump (RMS 0.208 against
# 0.205 at seed 0; 0.227 against 0.192 on the cheaper start). Measured: the 0.01 step still drifts at the default's
# seed 1, and DMD2 from `ectfewuni` is worse on both teachers at seed 0
# ECT's start by its tail where it is not the cheaper start (`few`)
ECT_START_OF = {"uni": "fewuni", "uni01": "fewuni"}
ECT_STARTS |= {"uni": ECT_STARTS["dt"], "uni01": {"distill.ect_dt": 0.01}}
# ECT at the step 0.05 from the cheaper start recorded at the lower guidance (`fewlow-{kind}`, `ectfewldt-`): the
# default's hand-off seemed to lose recall in the start's jump and the teacher's ODE (0.41-0.43 by Euler steps, read
# then as a bound against the DPM-Solver sampler's 0.49), and that start raised its two-step recall by 0.09-0.10.
# Measured (the default, seeds 0 and 1): its variety is gone after ECT (two-step recall 0.33 and 0.31), and the hand-off
# from it (`sidecfldt-*-lead-last`) is worse in KID (+0.26, +0.56) with recall level
ECT_START_OF["ldt"] = "fewlow"
ECT_STARTS["ldt"] = ECT_STARTS["dt"]
SHARES = {f"ectfew{tail}-": ECT_SPLITS.get(tail, 0.5) for tail in ECT_STARTS}
# the real score's scale from ECT's start below the recipe's (the samplers' 3 and 4): ECT's start has the teachers'
# recall at two steps more nearly (0.40-0.46), and DMD2 at the samplers' scale spends it (0.30-0.36)
ECT_VARIETY_SCALE = 2.0
ECT_DMD2 = tuple(f"dmd2ecf{tail}" for tail in ECT_STARTS)  # DMD2's prefix from each
# the next lever the curves point to is the target, not the length: SiD's score-identity loss (distill.method: sid, its
# alpha 1.2) in place of DMD's VSD, at the settings of the DMD2 stage it replaces (:data:`SID_BESIDE`), the rest of the
# budget spent as DMD2 spends it (a SiD generator step costs both scores' backwards as well: fewer generator updates)
SID = {"method": "sid", "sid_alpha": 1.2}
# a suffix of SiD's arm: what it changes. SiD's own runs update the fake score once per generator update (`f1`: about
# twice the generator updates in the budget); SiD moves its students more slowly per update than VSD at the recipe's
# rate, its curves still falling at the budget's end: three times the rate (`lr3e-4`, both networks), and the arm past
# the budget (`x4`, :data:`OVER_BUDGET`)
SID_VARIANTS = {"f1": {"distill.fake_updates": 1}, "lr3e-4": {"optim.lr": 3e-4}, "x4": {}}
# SiD's alpha below its 1.2 at that rate (the weight of the fake score's own gap; SiD's paper sweeps 0 to 1.2).
# Measured: alpha 1 at three times the rate beats DMD2 on the default at two steps on every seed (1.67x against 1.75x,
# its config until the real score's scale below) and is on DMD2's line on the flow twin; 0.5 worse; `f1` breaks the
# default's one step, `ganlate` costs updates without paying for them, and `x4` turns worse past the budget
SID_VARIANTS |= {f"lr3e-4-alpha{a:g}": {"optim.lr": 3e-4, "distill.sid_alpha": a} for a in (0.5, 1.0)}
# and alpha 1 at the recipe's own rate (measured only at three times it): whether the rate or the alpha carried it.
# Measured (seed 0): the alpha (two steps 5.27 and 2.49 against 5.39 and 2.79 at three times the rate); the flow twin
# over three seeds level with three times the rate (3.89 against 3.88), behind DMD2 at seed 1
SID_VARIANTS["alpha1"] = {"distill.sid_alpha": 1.0}
# SiDA's pairing: the GAN term on real data switched on once the fake score has trained alone (GAN_LATE's weight and
# start, on the fake score's features as DMD2's)
SID_VARIANTS["ganlate"] = {f"distill.{key}": value for key, value in GAN_LATE.items()}
# SiD's prefix: the prefix of the DMD2 stage it replaces (and so starts where that one starts). From the cheaper start
# itself (`sidfew`), without ECT: the default's SiD curves were still falling at the budget's end, and that start
# leaves about twice the budget
SID_BESIDE = {"sidecfdt": "dmd2ecfdt", "sidfew": "dmd2few"}
# and after a quarter of what the cheaper start leaves to ECT (`sidecfdts25`): ECT's two steps stop improving after
# about 500 steps, and SiD's curves after half were still falling. Measured (seed 0): two steps level with half's, one
# step worse, so half stays the split
SID_BESIDE["sidecfdts25"] = "dmd2ecfdts25"
SID_BESIDE["sidecfldt"] = "dmd2ecfldt"  # and after ECT from the lower-guidance start (`ectfewldt`)
# the real score below the sampler's scale at SiD's measured settings (alpha 1, three times the rate): the issue's sweep
# (none, 1.5, 2; VARIETY_SCALES), read with recall beside KID. DMD2's own sweep from the full start bought recall with
# KID; SiD's real score enters its loss twice (both gaps), so its scale may weigh differently. And above it
# (`SID_ABOVE`: a third more, the flow twin's 4, the default's 5), so that the sweep brackets its best. Measured (seed
# 0): below the sampler's scale KID is worse on both teachers for little recall (unguided 9.65 and 7.50 at two steps
# against 5.39 and 2.79). Over three seeds a third above it is better on the flow twin at every seed (1.67x against
# 1.82x at two steps) and level on the default (1.65x against 1.67x)
SID_ABOVE = (4.0, 5.0)
# and past it, since a third more was still the best point: the flow twin's 5 (two thirds more, already in SID_ABOVE)
# and the default's 6 (half as much again), 8 (twice) and 12 (three times). Measured (three seeds): the flow twin's 5
# worse at two steps (1.80x; its curves turn up late), better at one; the default's 6 and 8 better at every seed (1.60x,
# 1.50x), 12 level with 8 at two steps (1.51x) and better at one (2.9x against 3.1x): the configs take 4 and 12
SID_PAST = (6.0, 8.0, 12.0)
SID_REAL_SCALES = (*VARIETY_SCALES["flow"], *SID_ABOVE, *SID_PAST)
SID_VARIANTS |= {f"lr3e-4-alpha1-real{r:g}": SID_VARIANTS["lr3e-4-alpha1"] | {"distill.real_guidance": r} for r in SID_REAL_SCALES}  # fmt: skip
# the two changes that each helped at seed 0 together: alpha 1 at the recipe's rate with the real score above the
# sampler's. Measured (three seeds): the flow twin's 4 level with three times the rate at two steps (1.69x), better at
# one (9.11 against 9.64), its config; the default's 5 level with 4 (1.63x)
SID_VARIANTS |= {f"alpha1-real{r:g}": SID_VARIANTS["alpha1"] | {"distill.real_guidance": r} for r in SID_ABOVE}
# the default's real score past 12 for both step counts (`SID_BEYOND`: four and six times its sampler's 4), since 12
# still improved its one step on every seed. Measured (three seeds): 16 better than 12 at both step counts on every seed
# (1.47x at two steps), 24's two-step curves turn up late (1.53x): the default's config takes 16
SID_BEYOND = (16.0, 24.0)
SID_VARIANTS |= {f"lr3e-4-alpha1-real{r:g}": SID_VARIANTS["lr3e-4-alpha1"] | {"distill.real_guidance": r} for r in SID_BEYOND}  # fmt: skip
# and the flow twin's alpha 1 at the recipe's rate past 5 (`SID_ABOVE_RATE`), since 5 was ahead of its config's 4 there.
# Measured (three seeds): two steps level from 4 to 8 (1.69x-1.66x), one step better at each scale on every seed (8:
# 7.95, 3.8x): the flow twin's config takes 8; at 12 one step better again (7.69, 3.6x), two steps worse on every seed;
# 16, since one step still improved at 12. Measured (three seeds): worse at one step on every seed (8.06) and at two
# (1.95x): the one-step sweep peaks at 12
SID_ABOVE_RATE = (6.0, 8.0, 12.0, 16.0)
SID_VARIANTS |= {f"alpha1-real{r:g}": SID_VARIANTS["alpha1"] | {"distill.real_guidance": r} for r in SID_ABOVE_RATE}
# a student for one step alone (`-one`: `distill.dmd_steps` [1], every generator update at the one-step grid's start
# instead of half of them at the two-step grid's middle; its two steps sample on the start's grid), at each teacher's
# config scale and above it: one step kept improving with the scale past where two steps stopped (the flow twin's 5,
# the default's 12). Measured (three seeds): on the default one step alone beats both grids at one step (8.24 against
# 8.84 at 16, 2.65x; 8.45 against 9.01 at 12), its two steps worse (1.90x): the default's one-step config. On the flow
# twin one step level or worse (8.78 against 8.66 at 5, 8.31 against 7.95 at 8), but at 8 two steps level (1.64x
# against 1.66x) with 0.04 more recall on every seed. And the default's 24 alone, since its one step alone still
# improved from 12 to 16. Measured (three seeds): level with 16 (8.14 against 8.24, 2.62x; each seed ahead inside its
# interval), its curves still falling: the one-step config keeps 16
ONE_STEP = {"distill.dmd_steps": [1]}
ONE_STEP_ARMS = (
    "alpha1-real5",
    "alpha1-real8",
    "lr3e-4-alpha1-real12",
    "lr3e-4-alpha1-real16",
    "lr3e-4-alpha1-real24",
)
SID_VARIANTS |= {f"{name}-one": SID_VARIANTS[name] | ONE_STEP for name in ONE_STEP_ARMS}
# and the flow twin's one-step best scale alone (`alpha1-real12-one`): at 5 and 8 one step alone was level or worse on
# the flow twin, but 12 is where its one step peaks on both grids. Measured (seed 0): one step worse (6.45 against
# 6.28), two steps better with 0.04 more recall (2.85 against 3.03), behind the two-step config
SID_VARIANTS["alpha1-real12-one"] = SID_VARIANTS["alpha1-real12"] | ONE_STEP
# the default's one step alone with three fake-score updates per generator update instead of four (`-one-f3`): its
# one-step curves were still falling at the budget's end at 16 and 24, and three buy 271 generator updates instead of
# 232 in the same budget (one, SiD's own, broke its one step). Measured (three seeds): one step better on every seed
# (7.70 against 8.24, 2.48x), two steps worse (1.94x): the default's one-step config takes it
SID_VARIANTS["lr3e-4-alpha1-real16-one-f3"] = SID_VARIANTS["lr3e-4-alpha1-real16-one"] | {"distill.fake_updates": 3}
# the later step's real score at a scale of its own (`-later`: `distill.real_guidance_later`). At each teacher's sampler
# scale, the first step's at its config's: the flow twin's one step alone at 8 kept 0.04 more two-step recall at level
# KID, so the middle step trained at the first's scale may cost the variety the first lays out. And the later above the
# first, each teacher's two-step config at the first step and the scale past it at the later: a higher scale turned two
# steps worse with both steps at it, and which step's scale did it? Measured (three seeds): the sampler's scale at the
# later step worse at two steps on both teachers (1.73x against 1.66x, 1.58x against 1.47x), recall +0.016 on the flow
# twin and none on the default, one step level and better; above the first (12 after 8, 24 after 16) worse at both step
# counts (1.78x, 1.51x): one scale at both steps stays the configs'
LATER_SCALES = (("alpha1-real8", 3.0), ("lr3e-4-alpha1-real16", 4.0), ("alpha1-real8", 12.0), ("lr3e-4-alpha1-real16", 24.0))  # fmt: skip
SID_VARIANTS |= {f"{name}-later{r:g}": SID_VARIANTS[name] | {"distill.real_guidance_later": r} for name, r in LATER_SCALES}  # fmt: skip
# a quarter of the samples at the two-step grid's middle instead of half (`-first75`: `distill.dmd_first_share` 0.75),
# between the two grids and one step alone, at each teacher's config scale: the later step's scale did not carry one
# step alone's recall, so whether it is the middle's share of the updates. Measured (three seeds): worse at two steps on
# both teachers (1.73x against 1.66x, 1.53x against 1.47x), 0.015 more recall on the flow twin, one step worse on both
FIRST_SHARES = {"first75": 0.75}
SID_VARIANTS |= {f"{name}-{tail}": SID_VARIANTS[name] | {"distill.dmd_first_share": share} for name in ("alpha1-real8", "lr3e-4-alpha1-real16") for tail, share in FIRST_SHARES.items()}  # fmt: skip
# fewer fake-score updates per generator update past the default's one step alone, since three paid there: three on each
# teacher's two-step config (the flow twin's 8, the default's 16) and on the flow twin's one-step best (12, both grids),
# and two on the default's one step alone (one broke it, three helped). Measured (three seeds): three at two steps worse
# on both teachers (1.84x against 1.66x, 1.58x against 1.47x; the curves turn up sooner), one step level on the flow
# twin and better on the default (8.34 against 8.84); at the flow twin's 12 worse at both; two on the default's one step
# alone ahead at seeds 1 and 2, behind at 0 (7.49 against 7.70), with 0.02 less recall: the one-step config keeps three
FAKE_UPDATE_ARMS = {
    "f3": ("alpha1-real8", "alpha1-real12", "lr3e-4-alpha1-real16"),
    "f2": ("lr3e-4-alpha1-real16-one",),
}
SID_VARIANTS |= {f"{name}-{tail}": SID_VARIANTS[name] | {"distill.fake_updates": int(tail[1:])} for tail, names in FAKE_UPDATE_ARMS.items() for name in names}  # fmt: skip
# the two-step grid's middle trained from noised data (`-data`: `distill.dmd_input` data, FastGen's default) instead of
# the generator's own first step, at each teacher's two-step config: one step alone kept the flow twin 0.04 more
# two-step recall, and neither the middle's scale nor its share carried it; what is left is that it trains no middle
# from the generator's own samples (DMD2 from the full start was worse from noised data; SiD is not measured).
# Measured (three seeds): two steps worse on both teachers (1.92x against 1.66x, 1.66x against 1.47x), recall no higher
SID_VARIANTS |= {f"{name}-data": SID_VARIANTS[name] | {"distill.dmd_input": "data"} for name in ("alpha1-real8", "lr3e-4-alpha1-real16")}  # fmt: skip
# the real score's scale ramped down over the stage (`-to{r}`: `distill.real_guidance_end` r, its ramp the stage's
# steps within the budget), from each teacher's two-step config to its sampler's scale: above the sampler's scale the
# students move fastest, and their two-step curves turn up in the run's second half (more generator updates, `-f3`,
# turn them up sooner), so the scale comes down as they near the teacher
# and from further up, since the flow twin's ramp was still falling at its end at seed 0 and the default's fell short
# of its config: the flow twin's 12 down to 3, the default's 24 (its curves turned up late) down to 8
# Measured (three seeds; 24 to 8 at seed 0): the flow twin's 8 to 3 at two steps 1.61x against 1.66x (ahead at seeds 0
# and 2), +0.02 recall on every seed, one step worse on every seed; 12 to 3 level (1.65x); the default's 16 to 4 worse
# at both step counts on every seed, 24 to 8 worse at both: the configs keep one scale
RAMPS = (("alpha1-real8", 3.0), ("lr3e-4-alpha1-real16", 4.0), ("alpha1-real12", 3.0), ("lr3e-4-alpha1-real24", 8.0))
SID_VARIANTS |= {f"{name}-to{r:g}": SID_VARIANTS[name] | {"distill.real_guidance_end": r} for name, r in RAMPS}
# the flow twin's two routes to more two-step recall together: one step alone at its config's scale (+0.04 recall at
# level KID) with the ramp down to the sampler's scale (+0.02 on every seed, 1.61x): whether the two add up.
# Measured (three seeds): the most two-step recall of any arm (0.356, 0.17 below the teachers), its KID worse (1.83x)
SID_VARIANTS["alpha1-real8-one-to3"] = SID_VARIANTS["alpha1-real8-one"] | {"distill.real_guidance_end": 3.0}
# the fake score's own guidance (SiD-LSG's long and short guidance, `distill.fake_guidance`, `distill.fake_guidance_eval`)
# at each teacher's two-step config: `-lsg`, the fake score trained and read at the real score's scale (LSG's four
# scales alike: in the limit of a fake score that fits, the generator's target is unchanged, and only the fit differs);
# `-fakeread2`, the fake score trained unguided and read at 2 (its guided score is the generator's own, guided away
# from its unconditional one: matching that to the real score's target leaves the generator less sharp than it, the
# variety every data-free lever has missed). Each guided pass costs two, counted within the budget. Measured (seed 0):
# `-lsg` worse at two steps on both teachers (4.26 against 2.67, 5.92 against 4.52: two thirds of the generator
# updates, its curves turning up), `-fakeread2` level on the flow twin (2.73) and worse on the default (5.59)
LSG_ARMS = {"alpha1-real8": 8.0, "lr3e-4-alpha1-real16": 16.0}
SID_VARIANTS |= {f"{name}-lsg": SID_VARIANTS[name] | {"distill.fake_guidance": r} for name, r in LSG_ARMS.items()}
SID_VARIANTS |= {f"{name}-fakeread2": SID_VARIANTS[name] | {"distill.fake_guidance_eval": 2.0} for name in LSG_ARMS}
# backward simulation noised afresh (`-fresh`: distill.dmd_input generator_fresh, DMD2's own) at each teacher's two-step
# config: every arm above renoised the generator's first step with the sample's own start noise, where its sampler (and
# DMD2's code) noise each step afresh, so the middle it trained on was not the one it samples from. Measured (fresh
# chains, the flow twin at five seeds, the default at three): two-step recall higher on every seed (+0.046, +0.016) at
# level KID, one step level: SiD's two-step configs take it, and DMD2's (`dmd2ecfdt-*-fresh`: KID better on every seed)
FRESH = {"distill.dmd_input": "generator_fresh"}
FRESH_DMD2 = ("dmd2ecfdt", "dmd2few", "dmd2fewl")  # DMD2's configs' too (measured: better at two steps on every seed)
SID_VARIANTS |= {f"{name}-fresh": SID_VARIANTS[name] | FRESH for name in LSG_ARMS}
# smaller batches (`-b8`, `-b4`: 8 or 4 images a step instead of the study's 16) at each teacher's two-step config and
# the one-step bests: twice or four times the generator and fake-score updates in the same evaluations, the fake
# score's share of them kept (more fake-score updates per generator update left fewer of the generator's, and were
# worse). The EMA steps once per generator update, so its decay is the arm's own to the power batch / 16, keeping the
# same share of the start in the scored generator (docs/objective.md#dmd2); the rate is the arm's. Measured (three
# seeds): the flow twin's b4 better at two steps on every seed (3.20 against 3.52, 1.51x against 1.66x), one step
# inside the intervals (8.20 against 7.95): its config takes it; b8 level (1.68x); the default's b4 worse at two steps
# (1.62x against 1.47x), better at one at two seeds of three (8.37 against 8.84), its b8 (seed 0) worse at both, so its
# configs keep 16. With the ramp (`-to3-b8`, `-to3-b4`): 1.56x at b4. For one step (seed 0): the flow twin's 12 and
# the default's one-step config at b4 worse at one step (6.61 against 6.28, 8.76 against 8.07); the flow twin's 12 at b8
# level over three seeds (7.82 against 7.69: better at seeds 0 and 1, worse at 2)
# And batch 2 (`-b2`), since the flow twin's two steps gained from 16 to 4 with its curves no longer turning up.
# Measured (three seeds): worse than batch 4 (1.71x against 1.51x; its seed-2 curve turns up after the middle)
SMALLER_BATCHES = {"b8": 8, "b4": 4, "b2": 2}
# SiDA's pairing at the smaller batch (`alpha1-real8-ganlate-b4`): the GAN term on real data (GAN_LATE's weight, on
# from the same share of the run) at each teacher's two-step config. At 16 it cost updates without paying for them
# (160-250 generator updates); at batch 4 the flow twin makes 853, the GAN term's first chance to act. Measured (three
# seeds, the flow twin): its discriminator's passes leave 640 generator updates, and it is worse at both step counts on
# every seed (1.74x at two steps, one step 9.47 against 8.20) for 0.017 more two-step recall
SID_VARIANTS |= {f"{name}-ganlate": SID_VARIANTS[name] | SID_VARIANTS["ganlate"] for name in LSG_ARMS}
# And the default's configs at the smaller batch at a third of their rate (`alpha1-real16-b4`, `alpha1-real16-one-f3-b4`:
# the recipe's 1e-4, the flow twin's): a quarter of the batch gives noisier gradients, and its configs' three times the
# rate at batch 4 was worse at two steps and at one, where the flow twin at its 1e-4 gained. Measured (seed 0): worse
# than the configs at batch 16 at two steps (4.79 against 4.52) and at one (9.05 against 8.07), the curves still falling
SID_VARIANTS["alpha1-real16-one-f3"] = SID_VARIANTS["alpha1-real16"] | ONE_STEP | {"distill.fake_updates": 3}
# the fake score at a higher rate than the generator's (`-fake{m}x`: `distill.fake_lr` m times the run's rate; the
# default's three times at 16, twice its 3e-4) at each teacher's two-step config: more fake-score updates per generator
# update tracked the generator more closely but left fewer generator updates, and a higher rate costs none. Measured:
# the flow twin's at batch 4 mixed over three seeds (1.58x against 1.51x: better at seed 0, worse at seed 2), the
# default's (seed 0) worse at two steps (4.83 against 4.52) and one
FAKE_RATES = {"alpha1-real8": 3, "lr3e-4-alpha1-real16": 2}
RECIPE_RATE = 1e-4  # the DMD2 configs' optim.lr, where an arm does not set its own
SID_VARIANTS |= {f"{name}-fake{m}x": SID_VARIANTS[name] | {"distill.fake_lr": round(m * SID_VARIANTS[name].get("optim.lr", RECIPE_RATE), 12)} for name, m in FAKE_RATES.items()}  # fmt: skip
# Adam without its first moment (`-beta0`: optim.betas (0, 0.999) for the generator and the fake score alike), as SiD
# and rCM train their generators: in a two-player update a momentum of 0.9 keeps stepping along what the fake score
# said some ten updates ago, while the smaller batches' many updates move the fake score's target under it. At each
# teacher's two-step config (the flow twin's at batch 4, `alpha1-real8-beta0-b4`); the rate and everything else theirs
ADAM_BETA0 = {"optim.betas": [0.0, 0.999]}
SID_VARIANTS |= {f"{name}-beta0": SID_VARIANTS[name] | ADAM_BETA0 for name in LSG_ARMS}
# the VSD (SiD) loss's noise levels drawn as FastGen's DMD2 and SiD draw theirs (`-karras`: `distill.dmd_time_sampling`
# karras, uniform over EDM's Karras sigmas on the same range): half the draws above t = 0.74 instead of 0.5 and a
# quarter below 0.27, so the generator's loss weighs the layout of an image (high noise, where the two steps' variety
# is set) and its finest detail more, the middle less. At each teacher's two-step config (`alpha1-real8-karras-b4`)
SID_VARIANTS |= {f"{name}-karras": SID_VARIANTS[name] | {"distill.dmd_time_sampling": "karras"} for name in LSG_ARMS}
# the flow twin's two-step config past the budget as a user might train it, keeping its best two-step evaluation
# (`-best-x2`: log.eval_keep_best kid@2 against fashion-mnist-train, 10,000 training images; the kept model in
# <run>/best is the one scored on the test split): whether a choice made without the test images keeps a longer run
# from ending worse (its two steps turn up past the budget, `-x2`). Its 500-sample evaluations become part of the
# method: each costs 500 x 3 evaluations (one step and two), 25,500 over its 17, 6% of the teacher's budget
KEEP_BEST = {"log.eval_reference": "fashion-mnist-train", "log.eval_keep_best": "kid@2"}
# the configs' own arms trained again from the same start at another seed of the stage (`-rerun`: train.seed the
# study's seed + RERUN_SEED; the teacher, the start and the scoring's samples the same): how far two runs of one recipe
# land apart, against which the levers whose seeds disagreed (batch 2, the fake score at 3x) are read
RERUN_SEED = 1000
RERUNS = {"flow": ("alpha1-real8-b4",), "ddpm": ("ema998-lr3e-4-alpha1-real16",)}
# the configs' own arms with the two-step grid's middle trained on the first jump of the start they begin from, kept
# frozen (`-lead`: `distill.dmd_input` lead, `distill.lead_model` the start), instead of the generator's own first step:
# the hand-off (that jump, then the config's second) raised two-step recall on every seed of both teachers, and this
# trains the second jump for what the hand-off feeds it. Same budget (the start's jump costs what the generator's own
# did); scored alone and, as it is meant to sample, in the hand-off
LEAD_INPUT = {"distill.dmd_input": "lead"}
# and with the middle nearer the data (`-lead-middle0.3`: the start's jump from 1 to 0.3, which ECT's flow map takes as
# well as any, the generator's last step trained there on it): more of the image left to the start, whose own two
# steps keep recall 0.46 at seed 0 of the flow twin, and less to the generator's one-step map, which loses recall even
# from the teacher's own middle (0.42 against the teacher's 0.57: docs/results.md, where the variety goes)
# and with that last step's real score at the sampler's scale (`-lead-middle0.3-later`: `distill.real_guidance_later`
# the teacher's sampler's, :data:`SAMPLER_SCALE`): in the hand-off the generator's only step is the last, and the
# configs' real scores (8, 16) seek modes the sampler's scale does not
SAMPLER_SCALE = "sampler"  # a value resolved per teacher to its sampler's guidance scale (the study's RECIPE_SCALE)
# and the middle nearer the data still (`-lead-middle0.2`, `-lead-middle0.1`): 0.5 to 0.3 gained KID and recall together
# on the flow twin, so the sweep is bracketed on the data's side. Measured (the flow twin, five seeds): 0.2 keeps 0.020
# more recall on every seed at level KID (the flow twin's lead config since); 0.1 is worse in both at every seed run
LEAD_ARMS = {
    "lead": {},
    "lead-middle0.3": {"distill.dmd_midpoint": 0.3},
    "lead-middle0.2": {"distill.dmd_midpoint": 0.2},
    "lead-middle0.1": {"distill.dmd_midpoint": 0.1},
}
LEAD_ARMS["lead-middle0.3-later"] = LEAD_ARMS["lead-middle0.3"] | {"distill.real_guidance_later": SAMPLER_SCALE}
# the hand-off arms from ECT's start at the budget's split the configs use (half of what the cheaper start leaves) and
# at a quarter (`sidecfdts25-*-lead*`): ECT's own two steps gained 7% or less over its second half at four seeds of
# five, while the flow twin's hand-off at the middle 0.2 still fell at its stage's end at all five (its evaluations
# during training), so the quarter gives SiD about 1.4x the generator updates. Measured (the flow twin, five seeds):
# KID better on every seed (-0.34), recall worse on every seed (-0.016), one step level; not adopted (the goal met at
# two seeds of five against three)
LEAD_PREFIXES = ("sidecfdt", "sidecfdts25", "sidecfldt")  # and from the lower-guidance start's ECT (`ectfewldt`)
# every generator sample on the last jump (`-last`: `distill.dmd_first_share` 0): in the hand-off the generator makes
# only that jump, and the lead arms spent half their samples on its one step from noise, which the hand-off never
# samples; at the same budget (the start's jump for every sample costs half a forward more each) the last jump gets
# about twice the training. The flow twin's hand-off still fell where its stage stopped. Measured (fresh chains): the
# flow twin's meets the two-step goal at all five seeds (1.12x, recall 0.014 below; recall higher on every seed than
# with half the samples from noise; its lead config since), the default's is level (three seeds)
LEAD_ARMS |= {
    f"{name}-last": LEAD_ARMS[name] | {"distill.dmd_first_share": 0.0} for name in ("lead", "lead-middle0.2")
}
# and with the late GAN term on real data (`-lead-last-gan`, GAN_LATE's weight and start; the arm's name drops
# "-nogan"): with every sample on the last jump it is a real-data term on that jump alone, the loss the default's
# hand-off lacks (its generator's last jump loses 0.07 recall from either middle; the GAN term had only been tried on
# the whole generator). The default's alone: its arms train at the study's batch, where GAN_LATE's start is set.
# Measured (seed 0): worse in both (151 generator updates against 197)
LEAD_KIND_ARMS = {"ddpm": {"lead-last-gan": LEAD_ARMS["lead-last"] | {f"distill.{k}": v for k, v in GAN_LATE.items()}}}
# and DMD's regression from the teacher's own middle on that jump (`-lead-last-reg{w}`: distill.regression w from each
# sample's start time, on the chain's cheaper start's own set, which holds 0.5 and which that start paid for): in the
# variety diagnosis the generator's last jump lost 0.07 recall even from the teacher's own middle, and the regression
# holds that jump to where the teacher's sampler went from there. The default's alone, at DMD's 0.25 and at 1.
# Measured: worse in KID and recall on every seed at 1 (+1.86, -0.023), and at 0.25 at seed 0 (+0.76, -0.014)
START_SET = "start-set"  # a value resolved per arm and seed to its chain's cheaper start's recorded trajectories
LEAD_KIND_ARMS["ddpm"] |= {f"lead-last-reg{w:g}": LEAD_ARMS["lead-last"] | {"distill.regression": w, "distill.regression_from": "start", "distill.trajectories": START_SET} for w in (0.25, 1.0)}  # fmt: skip
# the arms the hand-off's arms vary (each teacher's config arm, :data:`RERUNS`; the flow twin's ramped real score's,
# planned beside ECT at a quarter, was dropped unrun: the last jump alone, `-last` above, met its two-step goal first)
# On the default, its SiD arm at the flow twin's batch and rate (`ema998-alpha1-real16-b4`: four times the generator
# updates), since its hand-off was still falling at the stage's end (9-17% over the last quarter at every seed).
# Measured (three seeds, `-lead-last`): level (-0.02 KID, -0.000 recall). And the last jump's real score at 8 and from
# 16 ramped to 4 (`ema998-lr3e-4-alpha1-real8`, `-real16-to4`). Measured: worse KID on every seed, recall level
LEAD_BASES = {"flow": RERUNS["flow"], "ddpm": (*RERUNS["ddpm"], "ema998-alpha1-real16-b4", "ema998-lr3e-4-alpha1-real8", "ema998-lr3e-4-alpha1-real16-to4")}  # fmt: skip
# the SiD arms also run at the smaller batches (SMALLER_BATCHES)
BATCH_BASES = ("alpha1-real8", "alpha1-real8-beta0", "alpha1-real8-karras", "lr3e-4-alpha1-real16",
               "alpha1-real8-to3", "alpha1-real12", "lr3e-4-alpha1-real16-one-f3", "alpha1-real8-ganlate",
               "lr3e-4-alpha1-real16-ganlate", "alpha1-real16", "alpha1-real16-one-f3", "alpha1-real8-fake3x",
               "alpha1-real8-fresh")  # fmt: skip
