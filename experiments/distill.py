r"""Few steps from a trained model: the embedded default (DDPM) and its flow twin distilled into 1-, 2- and 4-step
samplers by each method (``distill.method``), against their teachers at 25 steps and against MeanFlow trained from
scratch on the same data and budget (the few-step study's records):

    teachers     configs/fashion_mnist_moh.yaml and configs/fashion_mnist_moh_flow.yaml at each seed (batch 16 x 8300
                 steps; trained by this study, so that every time is measured on one machine)
    meanflow     MeanFlow distillation with the stabilisers (configs/fashion_mnist_moh_distill.yaml, its DDPM twin
                 fashion_mnist_moh_distill_ddpm.yaml), from each teacher at the same seed
    trajectory   trajectory distillation (configs/fashion_mnist_moh_distill_trajectory.yaml, its DDPM twin): the
                 teacher's trajectories recorded by the run, then secants
    cmt          the trajectory student post-trained by MeanFlow (configs/fashion_mnist_moh_distill_cmt.yaml: CMT's
                 second stage), from the same seed's trajectory student
    v05          moh-dit 0.5's recipe (experiments/configs/distill_v05.yaml, distill_ddpm_v05.yaml) over the
                 same four-times-longer run: the failure the others repair
    dmd2         DMD2 from the teacher (configs/fashion_mnist_moh_dmd2.yaml, its DDPM twin), 3320 steps
    dmd2t        DMD2 from the same seed's trajectory student (fashion_mnist_moh_dmd2_trajectory.yaml), 830 steps
    gan          the flow twin's two DMD2 students with the GAN term
    ablations    each teacher's meanflow student with one stabiliser changed at a time: each key's default (the
                 flow twin's every key, the default's loss and anchor)
    dmd2 study   DMD2 as its references train it, within the teacher's cost (experiments/distill_dmd2.py): a short
                 trajectory stage, then DMD2 with the GAN term on real data, the real score at its own guidance and
                 two steps by backward simulation; the real score's scale, the GAN term, the two-step input, the
                 grid's middle and the fake score's rate measured at seed 0; the recipe from the full trajectory
                 student (dmd2f); DMD2 from the teacher; a GAN fine-tune

v05, gan, the ablations and the dmd2 study's seed-0 measurements run at seed 0; named with --arms they run at every
seed given (--seeds 1 2 --arms meanflow-flow-no-clamp confirms an ablation on two more seeds). ``--arms dmd2-study``
names every arm of the dmd2 study (the seeds as said) and the trajectory students its dmd2f stages start from.

Every student trains 3320 steps (four times 0.5's 830) and evaluates itself every 415 (500 samples, one and two
steps); the dmd2 study's stages as many steps as the teacher's budget leaves, evaluated eight times. At the end every
model is scored with 5000 class-balanced samples at 1, 2 and 4 steps (the dmd2 study's at its 1 and 2; the rows of
the arms before the dmd2 study: 1000 samples): KID, FID,
precision and recall on the project's classifier features against the 10,000 Fashion-MNIST test images, with the
network evaluations per image counted; students paired with their teachers by seed. A dmd2 study generator with a
start is also scored at two steps with the start's first jump (a hand-off, ``--lead-model``: rows of their own,
paired with the generator alone). The cost of each distillation is counted beside it
(experiments/distill_report.py): the teacher's network evaluations for targets and trajectories, the student's own,
the images and the wall-clock, against the teacher's training.

    python -m experiments.distill --part train    # teachers, then students, baselines and ablations (resumable)
    python -m experiments.distill --part score    # students at 1, 2, 4 steps; teachers at 25
    python -m experiments.distill --arms dmd2-study    # the dmd2 study alone (the teachers first)
    python -m experiments.distill --scale tiny --out /tmp/distill    # the smoke run: one run of each kind (3 to 6 minutes on 2 cores: 5.6 measured beside two trainings)
    python -m experiments.distill --report-only

Points already in the records are kept, not redone (--rescore redoes them).

Writes experiments/results/distill/{RESULTS.md, results.json, *.png}.
"""

from __future__ import annotations

import json
from pathlib import Path

from experiments.arms import STUDY_SCALES, curve_point, run_name, score_model, train_arm
from experiments.common import ROOT, render_grid, scoring_context
from experiments.distill_dmd2 import (
    ARMS,
    budget_arm,
    budget_share,
    dmd2_arms,
    fill_budget,
    over_budget,
    start_of,
    three_seed_arms,
)
from experiments.distill_dmd2_report import plot_costs, whole_cost
from experiments.distill_report import (
    GAN,
    KINDS,
    METHODS,
    STUDENT_STEPS,
    TEACHER_STEPS,
    plot,
    report,
    run_cost,
)
from experiments.report import is_recorded, open_study, save_results, study_arguments, with_row
from moh_dit.errors import NonFiniteLossError
from moh_dit.training.quality import read_records

TEACHERS = {"ddpm": ("configs/fashion_mnist_moh.yaml", []), "flow": ("configs/fashion_mnist_moh_flow.yaml", [])}
TEACHER_SAMPLERS = {"ddpm": "dpm-solver", "flow": "euler"}  # the fast protocol of each (the recipes study's)
# the guidance each teacher samples best with at 25 steps (null: the one it records), folded into its students
TEACHER_SCALES = {"ddpm": None, "flow": 3.0}
# each method's config per teacher ({seed} and {runs} filled in: the cmt student starts from its trajectory student)
CONFIGS = {
    "meanflow": {"flow": "configs/fashion_mnist_moh_distill.yaml", "ddpm": "configs/fashion_mnist_moh_distill_ddpm.yaml"},
    "trajectory": {
        "flow": "configs/fashion_mnist_moh_distill_trajectory.yaml",
        "ddpm": "configs/fashion_mnist_moh_distill_trajectory_ddpm.yaml",
    },
    "cmt": {"flow": "configs/fashion_mnist_moh_distill_cmt.yaml", "ddpm": "configs/fashion_mnist_moh_distill_cmt_ddpm.yaml"},
    "v05": {"flow": "experiments/configs/distill_v05.yaml", "ddpm": "experiments/configs/distill_ddpm_v05.yaml"},
    "dmd2": {"flow": "configs/fashion_mnist_moh_dmd2.yaml", "ddpm": "configs/fashion_mnist_moh_dmd2_ddpm.yaml"},
    "dmd2t": {
        "flow": "configs/fashion_mnist_moh_dmd2_trajectory.yaml",
        "ddpm": "configs/fashion_mnist_moh_dmd2_trajectory_ddpm.yaml",
    },
}  # fmt: skip
EXTRA = {f"{m}": ["distill.student_from={runs}/trajectory-{kind}-seed{seed}"] for m in ("cmt", "dmd2t")}
EXTRA["dmd2t"].append("distill.dmd_input=data")  # as it was measured, before its config took backward simulation
SEED_0_ONLY = ("v05",)  # by default (at other seeds when named with --arms: `selected`)
OWN_LENGTH = ("cmt", "dmd2t")  # started from a trajectory student: their configs' steps, not the study's
STUDENT_STEPS_RUN = 3320  # four times 0.5's 830
# each teacher's meanflow student with its config changed, each key's default measured. The flow twin's loss is
# FastGen's opt-grad (better than MeanFlow's l2 on three seeds); its anchor, grid, r's law and warm-up were measured on
# the l2 recipe before that (``l2-*``: the l2 recipe with one more key changed), the clamp on both. The default's
# student keeps l2 (opt-grad measured no better there: ``opt-grad``)
L2 = ["distill.loss=l2", "distill.spatial_invariance=false", "objective.adaptive_eps=0.01"]
OPT_GRAD = ["distill.loss=opt-grad", "distill.spatial_invariance=true", "objective.adaptive_eps=10"]
FLOW_ABLATIONS = {
    "no-clamp": ["distill.tangent_clamp=null"],
    "l2": L2,
    "l2-anchor": [*L2, "distill.anchor=1.0"],
    "l2-no-clamp": [*L2, "distill.tangent_clamp=null"],
    "l2-grid": [*L2, "distill.grid_share=0.5", "distill.grid_steps=[1,2,4]"],
    "l2-r-law": [*L2, "objective.time_mean=0.4", "distill.r_time_sampling=logit-normal", "distill.r_time_mean=-1.2"],
    "l2-warmup": [*L2, "distill.tangent_warmup=1000"],
    "l2-plain": [*L2, "objective.adaptive_power=0"],  # MeanFlow's loss without its adaptive weight
}
ABLATIONS = {"flow": FLOW_ABLATIONS, "ddpm": {"opt-grad": OPT_GRAD, "anchor": ["distill.anchor=1.0"]}}
SCALES = {
    "cpu": STUDY_SCALES["cpu"]
    | {
        "samples": 5000,  # the final table's (the arms before the dmd2 study were scored with 1000: their rows say so)
        "student_eval": ["log.eval_every=415", "log.eval_samples=500"],
        "student_length": [f"train.max_steps={STUDENT_STEPS_RUN}", "train.checkpoint_every=415"],
    },
    "tiny": STUDY_SCALES["tiny"]
    | {
        "student_eval": ["log.eval_every=2", "log.eval_samples=20"],
        "student_length": [],
        "trajectory": ["distill.trajectory_count=8", "distill.trajectory_shard_size=4", "distill.trajectory_steps=3"],
        "smoke": True,  # the dmd2 study's stages at the smoke run's length, not the budget's
        "seeds": (0,),  # a smoke run: every kind of run once (the arms below), a few minutes on 2 cores
        "arms": (
            "meanflow-flow",
            "trajectory-ddpm",
            "cmt-ddpm",
            "dmd2-flow",
            "dmd2t-ddpm",
            "short-flow",
            "dmd2s-flow-g2",
            "meanflow-flow-l2",
        ),  # fmt: skip
    },
}
MATCH = ("arm", "seed", "steps", "scale", "samples")  # a scored row's identity (and how many samples scored it)
HANDOFF_MATCH = (*MATCH, "lead")  # a hand-off's: and the student whose jump leads


def student_arms(seed: int, out: Path, sc: dict) -> dict[str, tuple[str, list[str]]]:
    """Every student of ``seed``: each method from that seed's teacher of each kind, each teacher's ablations and
    the GAN term (which of them the study runs by default: `selected`). Arm names: ``{method}-{kind}``,
    ``meanflow-{kind}-{ablation}``; ``sc``: the scale (its students' length)."""
    arms, runs = {}, out / "runs"
    length = sc["student_length"]
    for method, configs in CONFIGS.items():
        for kind, config in configs.items():
            teacher = runs / run_name(kind, seed)
            scale = TEACHER_SCALES[kind]
            guidance = [] if scale is None else [f"distill.guidance_scale={scale}"]
            extra = [e.format(runs=runs, kind=kind, seed=seed) for e in EXTRA.get(method, [])]
            steps = [] if method in OWN_LENGTH else length
            extra += sc.get(method, [])  # the scale's own settings of the method (a smoke run's small set)
            arms[f"{method}-{kind}"] = (config, [f"distill.teacher={teacher}", *guidance, *steps, *extra])
    for kind in KINDS:
        config, student = arms[f"meanflow-{kind}"]
        arms |= {f"meanflow-{kind}-{name}": (config, [*student, *extra]) for name, extra in ABLATIONS[kind].items()}
    arms |= {arm: (arms[base][0], [*arms[base][1], "distill.gan_weight=0.001"]) for arm, base in GAN.items()}
    return arms | dmd2_arms(KINDS, runs, seed, sc, {kind: arms[f"trajectory-{kind}"] for kind in KINDS})


def dmd2_study(out: Path, sc: dict) -> list[str]:
    """The dmd2 study's arms, and the other methods' students some of them start from (the full trajectory student)."""
    arms = [arm for arm in student_arms(0, out, sc) if arm.startswith(ARMS)]
    starts = {start_of(arm) for arm in arms} - {None, *arms}
    return [*sorted(starts), *arms]


GROUPS = {"dmd2-study": dmd2_study}  # --arms names for several


def selected(arm: str, seed: int, only: list[str] | None, sc: dict | None = None) -> bool:
    """Whether the study trains and scores ``arm`` at ``seed``: the arms named (``--arms``) at every seed, those a
    group names (``--arms dmd2-study``) at the seeds the study gives them; without names every method at every seed,
    and 0.5's recipe, the GAN term, the ablations and the dmd2 study's seed-0 measurements at seed 0 only; at the smoke
    scale (``sc["arms"]``) only its arms, one of each kind of run."""
    if only:
        return arm in only and (arm not in getattr(only, "grouped", ()) or in_group(arm, seed))
    if sc is not None and sc.get("arms") is not None:
        return arm in sc["arms"]
    return by_policy(arm, seed)


def by_policy(arm: str, seed: int) -> bool:
    """The study's own choice of seeds for ``arm``: seed 0 for its one-seed measurements, every seed otherwise."""
    if arm.startswith(ARMS):
        return seed == 0 or arm in three_seed_arms(KINDS)
    return seed == 0 or not (arm.split("-")[0] in SEED_0_ONLY or arm in GAN or is_ablation(arm))


def in_group(arm: str, seed: int) -> bool:
    """Whether a group's ``arm`` trains at ``seed``: a study's own arm at the seeds it gives it, another method's
    student a stage starts from at seed 0, or at the seeds where a stage trained at every seed starts from it."""
    if arm.startswith(ARMS):
        return by_policy(arm, seed)
    return seed == 0 or arm in {start_of(a) for a in three_seed_arms(KINDS)}


class Named(list):
    """The arms ``--arms`` names, and of them those a group named (``grouped``: at the study's seeds for them)."""

    grouped: frozenset = frozenset()


def scored_steps(arm: str) -> tuple[int, ...]:
    """The step counts ``arm`` is scored at: the dmd2 study's at the goal's 1 and 2 (a DMD2 generator trains those
    grids only, ``distill.dmd_steps``, and 4 steps would more than double each of its 5000-sample scorings), every
    other student at 1, 2 and 4."""
    return (1, 2) if arm.startswith(ARMS) else STUDENT_STEPS


def is_ablation(arm: str) -> bool:
    """``meanflow-{kind}-{ablation}``: a meanflow student with one stabiliser changed."""
    method, _, rest = arm.partition("-")
    kind, _, name = rest.partition("-")
    return method == "meanflow" and name in ABLATIONS.get(kind, {})


def model_of(arm: str, seed: int, out: Path) -> Path:
    """The model the study scores: the run's final pipeline, or for an arm that keeps its best evaluation (``-best``)
    the pipeline it kept (``<run>/best``)."""
    return out / "runs" / run_name(arm, seed) / ("best" if "best" in arm.split("-") else "pipeline")


# ----------------------------------------------------------------------------------------------------
# The parts
# ----------------------------------------------------------------------------------------------------
def part_train(sc: dict, out: Path, reference: Path, seeds, result: dict, only: list[str] | None = None) -> None:
    """Each seed's teachers, then its students (``only``: these arms); a part stopped early resumes where it stopped
    (every run resumes from its latest checkpoint, a set of trajectories from its last shard)."""
    for seed in seeds:
        for kind in KINDS:
            result["training"][run_name(kind, seed)] = train_arm(kind, seed, sc, out, reference, TEACHERS)
            save(out, result)
        arms = student_arms(seed, out, sc)
        student_sc = sc | {"eval": sc["student_eval"]}
        for arm in arms:  # in order: a cmt student after its trajectory student
            if not selected(arm, seed, only, sc):
                continue
            arm_sc = student_sc
            if budget_arm(arm):  # as long as the teacher's budget allows after the student it starts from
                config, extra = arms[arm]
                spent = _spent_before(arm, seed, result)
                length, evals = fill_budget(config, extra, spent, sc, over_budget(arm), budget_share(arm))
                arms, arm_sc = arms | {arm: (config, [*extra, *length])}, sc | {"eval": evals}
            record = _train_student(arm, seed, arm_sc, out, reference, arms)
            result["training"][run_name(arm, seed)] = record | run_cost(out / "runs" / run_name(arm, seed))
            save(out, result)


def _spent_before(arm: str, seed: int, result: dict) -> float:
    """The counted network evaluations of the student ``arm`` starts from, with the students that one started from
    (0 from the teacher)."""
    start = start_of(arm)
    if start is None:
        return 0.0
    whole = whole_cost(result["training"], start, seed)
    if whole is None:
        raise SystemExit(f"{arm} starts from {start} at seed {seed}, which has no counted cost yet: train it first")
    return whole


def _train_student(arm: str, seed: int, sc: dict, out: Path, reference: Path, arms: dict) -> dict:
    """A student trained (or reused); one whose loss stops being finite is recorded as diverged, with its curve so
    far, and the study goes on (an ablation may well diverge: that is its answer)."""
    try:
        return train_arm(arm, seed, sc, out, reference, arms)
    except NonFiniteLossError as err:
        metrics = out / "runs" / run_name(arm, seed) / "metrics.jsonl"
        curve = [curve_point(r) for r in read_records(metrics, "evaluation")] if metrics.is_file() else []
        return {"arm": arm, "seed": seed, "diverged": str(err).splitlines()[0], "curve": curve}


def part_score(ctx: dict, seeds, result: dict, only: list[str] | None = None) -> None:
    """Every trained student at its step counts (:func:`scored_steps`) without guidance (it is folded in), a dmd2 study's
    two-step generator also with its start's first jump (:func:`_score_handoff`), every teacher at 25 steps with the
    guidance folded into its students; then grids of seed 0's students at 1 and 2 steps."""
    for seed in seeds:
        for arm in student_arms(seed, ctx["out"], ctx["scale"]):
            if not selected(arm, seed, only, ctx["scale"]) or not model_of(arm, seed, ctx["out"]).is_dir():
                continue
            for steps in scored_steps(arm):
                _score_once(result, ctx, arm, seed, "meanflow", steps, 1.0)
            _score_handoff(result, ctx, arm, seed)
        for kind in KINDS:
            teacher = model_of(kind, seed, ctx["out"])
            if not teacher.is_dir():
                continue  # not trained (yet): the report lists the seeds each row has
            scale = TEACHER_SCALES[kind] or _recorded_scale(teacher)
            _score_once(result, ctx, kind, seed, TEACHER_SAMPLERS[kind], TEACHER_STEPS, scale)
    for method in METHODS:
        for kind in KINDS:
            for steps in (1, 2):
                grid = ctx["out"] / f"grid_{method}-{kind}_{steps}step.png"
                if not grid.exists() and model_of(f"{method}-{kind}", 0, ctx["out"]).is_dir():
                    render_grid(model_of(f"{method}-{kind}", 0, ctx["out"]), grid, "meanflow", steps, 1.0)


def _recorded_scale(model: Path) -> float:
    from moh_dit.sampling.loading import recorded_sampling

    return recorded_sampling(model).guidance.scale


def _score_once(result: dict, ctx: dict, arm: str, seed: int, scheduler: str, steps: int, scale: float) -> None:
    identity = dict(arm=arm, seed=seed, steps=steps, scale=scale, samples=ctx["samples"])
    if "diverged" in result["training"].get(run_name(arm, seed), {}):
        return  # no model to score: the report says where it diverged
    if ctx.get("rescore") or not is_recorded(result["scores"], MATCH, identity):
        scores = score_model(model_of(arm, seed, ctx["out"]), run_name(arm, seed), scheduler, steps, scale, ctx)
        result["scores"] = with_row(result["scores"], MATCH, identity | {"scheduler": scheduler} | scores)
        save(ctx["out"], result)


def _score_handoff(result: dict, ctx: dict, arm: str, seed: int) -> None:
    """A dmd2 study's two-step generator with its first jump taken by the student it started from (a hand-off,
    moh_dit/sampling/leads.py): the same two network evaluations, no more training. Kept in ``result["handoff"]``
    apart from the students' own rows, each paired with its student alone by the report."""
    start = start_of(arm) if arm.startswith(ARMS) else None
    if start is None or "diverged" in result["training"].get(run_name(arm, seed), {}):
        return
    lead = model_of(start, seed, ctx["out"])
    if not lead.is_dir():
        return
    identity = dict(arm=arm, seed=seed, steps=2, scale=1.0, samples=ctx["samples"], lead=start)
    rows = result.setdefault("handoff", [])
    if ctx.get("rescore") or not is_recorded(rows, HANDOFF_MATCH, identity):
        scores = score_model(model_of(arm, seed, ctx["out"]), run_name(arm, seed), "meanflow", 2, 1.0, ctx, lead=lead)
        result["handoff"] = with_row(rows, HANDOFF_MATCH, identity | {"scheduler": "meanflow"} | scores)
        save(ctx["out"], result)


def meanflow_from_scratch(out: Path) -> list[dict]:
    """The few-step study's MeanFlow rows (trained from scratch on the teachers' budget), as recorded."""
    path = ROOT / "experiments" / "results" / "fewstep" / "results.json"
    if not path.is_file():
        return []
    rows = json.loads(path.read_text())["scores"]
    return [r for r in rows if r["kind"] == "meanflow"]


def save(out: Path, result: dict) -> None:
    save_results(out, result, report(result))


# ----------------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> dict:
    p = study_arguments(__doc__, ["train", "score"], SCALES, "cpu", "experiments/results/distill")
    p.add_argument("--rescore", action="store_true", help="redo points already in the records (default: kept)")
    p.add_argument("--arms", nargs="+", default=None, help="train and score only these students (default: all)")
    args = p.parse_args(argv)
    sc = SCALES[args.scale]
    out = Path(args.out)
    if args.arms:  # a group's name stands for its arms (at the seeds the study gives them)
        grouped = {a for name in args.arms if name in GROUPS for a in GROUPS[name](out, sc)}
        explicit = {name for name in args.arms if name not in GROUPS}
        args.arms = Named(a for name in args.arms for a in (GROUPS[name](out, sc) if name in GROUPS else [name]))
        args.arms.grouped = frozenset(grouped - explicit)
    unknown = sorted(set(args.arms or ()) - set(student_arms(0, out, sc)))
    if unknown:  # a misspelt arm would otherwise train and score nothing, silently
        p.error(f"--arms: no student {', '.join(unknown)}; the study's: {', '.join(student_arms(0, out, sc))}")
    result, seeds, lock = open_study(args, sc, "distill", {"training": {}, "scores": []})  # lock: held to the end
    result["meanflow"] = meanflow_from_scratch(out)
    if not args.report_only:
        ctx = scoring_context(args, sc, scale=sc)
        out = ctx["out"]
        if args.part in ("train", "all"):
            part_train(sc, out, ctx["reference"], seeds, result, args.arms)
        if args.part in ("score", "all"):
            part_score(ctx, seeds, result, args.arms)
    out.mkdir(parents=True, exist_ok=True)
    save(out, result)
    plot(result, out)
    plot_costs(result, out)
    return result


if __name__ == "__main__":
    from moh_dit.cli.common import run_cli

    run_cli(main)  # bad input: one line, as the commands say it
