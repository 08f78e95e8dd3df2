r"""Few steps from a trained model: the embedded default (DDPM) and its flow twin distilled into 1-, 2- and 4-step
samplers (configs/fashion_mnist_moh_distill.yaml and its DDPM twin fashion_mnist_moh_distill_ddpm.yaml), against
their teachers at 25 steps and against MeanFlow trained from scratch on the same data and budget (the few-step
study's records):

    teachers     configs/fashion_mnist_moh.yaml and configs/fashion_mnist_moh_flow.yaml at each seed (batch 16 x 8300
                 steps; the runs this study trains itself, so that every time is measured on one machine)
    students     each teacher's distillation config at each seed, from its own seed's teacher (830 steps, a tenth of
                 the teacher's): finite differences, MeanFlow's interval embedding; the DDPM teacher's student with
                 uniform times and lr 1e-3 (its velocity head is new)
    ablations    seed 0 of the flow twin's student with a JVP instead of finite differences, and with Decoupled
                 MeanFlow's split (the last 4 of 12 blocks on the end time) instead of the interval embedding; the
                 DDPM teacher's student with the flow twin's recipe (logit-normal times, lr 3e-4)

The guidance folded into each student is the one its teacher samples best with at 25 steps: the flow twin's CFG 3
in its recorded interval (the few-step study's sweep), the embedded default's recorded CFG 4 in DiT's timesteps
100-500. Students evaluate themselves during training (500 samples in one and two steps, every 166 steps). At the
end every model is scored with 1000 class-balanced samples: KID, FID, precision and recall on the project's
classifier features against the 10,000 Fashion-MNIST test images, with the network evaluations per image counted;
students paired with their teachers by seed. Each training's time is its steps over its median images per second as
its own log measured them (the teachers and the students each ran two at a time on the machine's two cores).

    python -m experiments.distill --part train    # teachers, then students and ablations (resumable)
    python -m experiments.distill --part score    # students at 1, 2, 4 steps; teachers at 25
    python -m experiments.distill --report-only

Points already in the records are kept, not redone (--rescore redoes them).

Writes experiments/results/distill/{RESULTS.md, results.json, *.png}.
"""

from __future__ import annotations

import json
from pathlib import Path

from experiments.arms import STUDY_SCALES, curve_point, run_name, score_model, train_arm
from experiments.common import ROOT, render_grid, scoring_context
from experiments.distill_report import KINDS, STUDENT_STEPS, TEACHER_STEPS, plot, report
from experiments.report import is_recorded, open_study, save_results, study_arguments, with_row
from moh_dit.errors import NonFiniteLossError
from moh_dit.training.quality import read_records

TEACHERS = {"ddpm": ("configs/fashion_mnist_moh.yaml", []), "flow": ("configs/fashion_mnist_moh_flow.yaml", [])}
TEACHER_SAMPLERS = {"ddpm": "dpm-solver", "flow": "euler"}  # the fast protocol of each (the recipes study's)
# the guidance each teacher samples best with at 25 steps (null: the one it records), folded into its students
TEACHER_SCALES = {"ddpm": None, "flow": 3.0}
# each teacher's distillation config (the DDPM teacher's: uniform times and lr 1e-3 for its student's new head)
DISTILL = {"flow": "configs/fashion_mnist_moh_distill.yaml", "ddpm": "configs/fashion_mnist_moh_distill_ddpm.yaml"}
# at seed 0: the flow twin's student with a JVP and with the split; the DDPM student with the flow twin's recipe
# (MeanFlow's logit-normal times, lr 3e-4: the recipe every DDPM student had before its own config)
ABLATIONS = {
    "flow": {"jvp": ["distill.derivative=jvp"], "split": ["distill.end_time_blocks=4"]},
    "ddpm": {"flowrecipe": ["objective.time_sampling=logit-normal", "optim.lr=3e-4"]},
}
# the students' runs are a tenth of the teachers': five evaluations along them, as along the teachers'
SCALES = {
    "cpu": STUDY_SCALES["cpu"] | {"student_eval": ["log.eval_every=166", "log.eval_samples=500"]},
    "tiny": STUDY_SCALES["tiny"] | {"student_eval": ["log.eval_every=2", "log.eval_samples=20"]},
}
MATCH = ("arm", "seed", "steps", "scale")  # a scored row's identity


def student_arms(seed: int, out: Path) -> dict[str, tuple[str, list[str]]]:
    """The students of ``seed``: one per teacher, each from that seed's run, and the flow twin's ablations."""
    arms = {}
    for kind in KINDS:
        teacher = out / "runs" / run_name(kind, seed)
        scale = TEACHER_SCALES[kind]
        guidance = [] if scale is None else [f"distill.guidance_scale={scale}"]
        arms[f"distill-{kind}"] = (DISTILL[kind], [f"distill.teacher={teacher}", *guidance])
    for kind, ablations in ABLATIONS.items():
        config, student = arms[f"distill-{kind}"]
        arms |= {f"distill-{kind}-{name}": (config, [*student, *extra]) for name, extra in ablations.items()}
    return arms


def ablation_arms(kind: str) -> list[str]:
    return [f"distill-{kind}-{name}" for name in ABLATIONS.get(kind, {})]


def model_of(arm: str, seed: int, out: Path) -> Path:
    return out / "runs" / run_name(arm, seed) / "pipeline"


# ----------------------------------------------------------------------------------------------------
# The parts
# ----------------------------------------------------------------------------------------------------
def part_train(sc: dict, out: Path, reference: Path, seeds, result: dict) -> None:
    """Each seed's teachers, then its students (seed 0 also the ablations); a part stopped early resumes where it
    stopped (every run resumes from its latest checkpoint)."""
    for seed in seeds:
        for kind in KINDS:
            result["training"][run_name(kind, seed)] = train_arm(kind, seed, sc, out, reference, TEACHERS)
            save(out, result)
        arms = student_arms(seed, out)
        student_sc = sc | {"eval": sc["student_eval"]}
        for arm in arms:
            if seed != 0 and any(arm in ablation_arms(kind) for kind in KINDS):
                continue
            result["training"][run_name(arm, seed)] = _train_student(arm, seed, student_sc, out, reference, arms)
            save(out, result)


def _train_student(arm: str, seed: int, sc: dict, out: Path, reference: Path, arms: dict) -> dict:
    """A student trained (or reused); one whose loss stops being finite is recorded as diverged, with its curve so
    far, and the study goes on (an ablation may well diverge: that is its answer)."""
    try:
        return train_arm(arm, seed, sc, out, reference, arms)
    except NonFiniteLossError as err:
        metrics = out / "runs" / run_name(arm, seed) / "metrics.jsonl"
        curve = [curve_point(r) for r in read_records(metrics, "evaluation")] if metrics.is_file() else []
        return {"arm": arm, "seed": seed, "diverged": str(err).splitlines()[0], "curve": curve}


def part_score(ctx: dict, seeds, result: dict) -> None:
    """Every student at 1, 2 and 4 steps without guidance (it is folded in), every teacher at 25 steps with the
    guidance folded into its students; then a grid of seed 0's students at 1 and 2 steps."""
    for seed in seeds:
        for kind in KINDS:
            arms = [f"distill-{kind}", *ablation_arms(kind)]
            for arm in arms:
                if seed == 0 or arm == f"distill-{kind}":
                    for steps in STUDENT_STEPS:
                        _score_once(result, ctx, arm, seed, "meanflow", steps, 1.0)
            teacher = model_of(kind, seed, ctx["out"])
            scale = TEACHER_SCALES[kind] or _recorded_scale(teacher)
            _score_once(result, ctx, kind, seed, TEACHER_SAMPLERS[kind], TEACHER_STEPS, scale)
    for kind in KINDS:
        for steps in (1, 2):
            grid = ctx["out"] / f"grid_distill-{kind}_{steps}step.png"
            if not grid.exists() and model_of(f"distill-{kind}", 0, ctx["out"]).is_dir():
                render_grid(model_of(f"distill-{kind}", 0, ctx["out"]), grid, "meanflow", steps, 1.0)


def _recorded_scale(model: Path) -> float:
    from moh_dit.sampling.loading import recorded_sampling

    return recorded_sampling(model).guidance.scale


def _score_once(result: dict, ctx: dict, arm: str, seed: int, scheduler: str, steps: int, scale: float) -> None:
    identity = dict(arm=arm, seed=seed, steps=steps, scale=scale)
    if "diverged" in result["training"].get(run_name(arm, seed), {}):
        return  # no model to score: the report says where it diverged
    if ctx.get("rescore") or not is_recorded(result["scores"], MATCH, identity):
        scores = score_model(model_of(arm, seed, ctx["out"]), run_name(arm, seed), scheduler, steps, scale, ctx)
        result["scores"] = with_row(result["scores"], MATCH, identity | {"scheduler": scheduler} | scores)
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
    args = p.parse_args(argv)
    sc = SCALES[args.scale]
    out = Path(args.out)
    result, seeds, lock = open_study(args, sc, "distill", {"training": {}, "scores": []})  # lock: held to the end
    result["meanflow"] = meanflow_from_scratch(out)
    if not args.report_only:
        ctx = scoring_context(args, sc)
        out = ctx["out"]
        if args.part in ("train", "all"):
            part_train(sc, out, ctx["reference"], seeds, result)
        if args.part in ("score", "all"):
            part_score(ctx, seeds, result)
    out.mkdir(parents=True, exist_ok=True)
    save(out, result)
    plot(result, out)
    return result


if __name__ == "__main__":
    from moh_dit.cli.common import run_cli

    run_cli(main)  # bad input: one line, as the commands say it
