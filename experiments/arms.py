"""What the studies share to train and score their arms: a recipe trained (or reused) with the same command as
``train.py``, an arm at a seed with the study's evaluations during training, the run's pipeline, and a pipeline's
samples scored with the sampler's counted network evaluations. Studies import these (and ``common``, ``report``);
no study imports another."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

from experiments.common import ROOT, sample_and_score, smoke_run
from moh_dit.sampling.generation import GenerationSettings
from moh_dit.sampling.grids import sample_grid
from moh_dit.sampling.loading import load_pipeline, recorded_sampling
from moh_dit.sampling.spec import SamplingSpec
from moh_dit.training.config import load_config
from moh_dit.training.quality import read_records
from moh_dit.training.tracking import objective_loss
from moh_dit.training.trainer import train

# the budgets of the studies that train the embedded default's twins on 2 CPU cores (the backbone and few-step
# studies), and their smoke run
STUDY_SCALES = {
    "cpu": dict(
        overrides=[],
        eval=["log.eval_every=1660", "log.eval_samples=500"],  # 5 points: 1660, 3320, ... 8300
        samples=1000,
        seeds=(0, 1, 2),
        bootstrap=20,
    ),
    "tiny": dict(  # a smoke run (tests/test_experiments.py)
        overrides=smoke_run(),
        eval=["log.eval_every=2", "log.eval_samples=20"],
        samples=20,
        seeds=(0, 1),
        bootstrap=3,
    ),
}


def train_recipe(name: str, config: str, overrides: list[str], out: Path) -> dict:
    run = out / "runs" / name
    record = run.with_name(name + ".train.json")
    start = time.time()
    # a finished run goes through train() too: resuming checks that the folder was made by this recipe
    # (architecture, data, seed, batch), so a reused name cannot score another recipe's model
    summary = train(
        load_config(ROOT / config, [*overrides, f"train.output_dir={run}", "train.resume=latest", "log.trackers=[]"])
    )
    if summary["stop_reason"] != "max_steps":  # stopped by a signal: a checkpoint is saved
        raise SystemExit(f"{run} stopped at step {summary['step']}; rerun the same command to continue from there")
    if not record.exists():  # the training time of the call that finished the run
        record.write_text(json.dumps(dict(summary, wall_minutes=(time.time() - start) / 60), default=str))
    trained = json.loads(record.read_text())
    # the training speed from the run's own log: wall minutes also count whatever else the machine ran
    logged = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    speeds = sorted(r["images_per_s"] for r in logged if "images_per_s" in r)
    return dict(trained, median_images_per_s=speeds[len(speeds) // 2] if speeds else None)


def eval_overrides(sc: dict, reference: Path) -> list[str]:
    """The evaluations during training: the study's reference and the project's classifier features."""
    return [
        *sc["eval"],
        f"log.eval_reference={reference}",
        "log.eval_extractor=fmnist-classifier",
        "log.eval_extractor_module=experiments.fmnist_classifier",
    ]


def run_name(arm: str, seed: int) -> str:
    return f"{arm}-seed{seed}"


def train_arm(arm: str, seed: int, sc: dict, out: Path, reference: Path, arms: dict) -> dict:
    """Train (or reuse) one arm of ``arms`` (``(config, overrides)`` each) at one seed; its training record, speed and
    evaluation curve."""
    config, extra = arms[arm]
    evals = eval_overrides(sc, reference)
    if any(o.startswith("log.eval_reference=") for o in extra):  # an arm that chooses against its own reference
        evals = [o for o in evals if not o.startswith("log.eval_reference=")]
    # the seed first, so that an arm that reruns a recipe at another seed of its own sets it in its overrides
    overrides = [f"train.seed={seed}", *extra, *sc["overrides"], *evals]
    trained = train_recipe(run_name(arm, seed), config, overrides, out)
    run = out / "runs" / run_name(arm, seed)
    records = read_records(run / "metrics.jsonl")
    last = records[-1] if records else {}
    return {
        "arm": arm,
        "seed": seed,
        "steps": trained.get("step"),
        "median_images_per_s": trained["median_images_per_s"],
        "final_loss": objective_loss(last)[1] if last else None,
        "final_repa_loss": last.get("repa_loss"),
        "curve": [curve_point(r) for r in read_records(run / "metrics.jsonl", "evaluation")],
    }


def curve_point(record: dict) -> dict:
    """An evaluation during training as a study keeps it: the step, KID and FID, and those at more step counts
    (``kid@2``: log.eval_also_steps)."""
    return {k: v for k, v in record.items() if k == "step" or k.split("@")[0] in ("kid", "fid")}


def pipeline_of(out: Path, arm: str, seed: int) -> Path:
    return out / "runs" / run_name(arm, seed) / "pipeline"


def evaluations_per_image(model: Path, scheduler: str, steps: int) -> int:
    """How many times the sampler calls the network for one image (counted, not assumed)."""
    pipe = load_pipeline(model, device="cpu", scheduler=scheduler)
    calls = []
    handle = pipe.transformer.register_forward_hook(lambda *_: calls.append(1))
    try:
        sample_grid(pipe, [0], 1, 0, SamplingSpec.create(scheduler, steps, 1.0))
    finally:
        handle.remove()
    return len(calls)


def score(model: Path, scheduler: str, steps: int, guidance: float, sc: dict, reference: Path, extractor) -> dict:
    """2000 (the scale's count) class-balanced samples with the model's own guidance interval and grid averaging
    and this sampler, steps and guidance scale; scored, with the sampler's NFE."""
    recorded = recorded_sampling(model)  # the interval and averaging the run recorded
    spec = recorded.replace(scheduler=None, num_inference_steps=steps, guidance_scale=guidance)
    settings = GenerationSettings(
        num_samples=sc["samples"], seed=1000, batch_size=min(250, sc["samples"]), label_mode="balanced", sampling=spec
    )
    folder = model.parent / f"samples-{scheduler}{steps}-cfg{guidance:g}-n{sc['samples']}"
    scores = sample_and_score(model, folder, settings, scheduler, reference, extractor, sc["bootstrap"])
    return dict(
        scores, scheduler=scheduler, steps=steps, guidance=guidance, nfe=evaluations_per_image(model, scheduler, steps)
    )


def scores_row(scores: dict) -> dict:
    keep = ("kid", "kid_interval", "fid", "fid_interval", "precision", "recall", "seconds_per_image", "nfe")
    return {k: scores[k] for k in keep if k in scores} | {k: scores[k] for k in ("scheduler", "steps", "guidance")}


def score_model(
    model: Path,
    name: str,
    scheduler: str,
    steps: int,
    scale: float,
    ctx: dict,
    cache: str = "none",
    lead: Path | None = None,
) -> dict:
    """One sample set of ``model`` (its recorded guidance interval and grid averaging, this sampler, steps and scale,
    the cache; ``lead``: a hand-off, this model's first step taken by that one) scored (reused when it exists): KID
    with its 90% interval, FID, precision, recall, the seconds per image and the network evaluations per image
    counted (the lead's with them). ``ctx``: the study's ``out``, ``reference``, ``extractor``, ``samples``,
    ``bootstrap``; ``name`` names the sample folder."""
    spec = recorded_sampling(model).replace(
        scheduler=None, num_inference_steps=steps, guidance_scale=scale, cache=None if cache == "none" else cache,
        cache_options=None, lead_model=None if lead is None else str(lead),
    )  # fmt: skip
    samples = ctx["samples"]
    settings = GenerationSettings(
        samples, seed=1000, batch_size=min(250, samples), label_mode="balanced", sampling=spec
    )
    folder = (
        ctx["out"]
        / "samples"
        / (
            f"{name}-{scheduler}{steps}-cfg{scale:g}"
            + ("" if cache == "none" else f"-{cache}")
            + ("" if lead is None else f"-lead-{lead.parent.name}")
        )
    )
    scores = sample_and_score(
        model, folder.with_name(f"{folder.name}-n{samples}"), settings, scheduler, ctx["reference"], ctx["extractor"],
        ctx["bootstrap"],
    )  # fmt: skip
    keep = ("kid", "kid_interval", "fid", "precision", "recall", "seconds_per_image")
    return {k: scores[k] for k in keep if k in scores} | {"nfe": counted_evaluations(model, spec, scheduler)}


def counted_evaluations(model: Path, spec, scheduler: str) -> int:
    """Network evaluations of one image under ``spec``, counted: the rows of every forward (CFG's two halves and grid
    averaging's copies each count; a cache's skips do not lower it: the setting's uncached count; a hand-off's lead's
    count with the model's)."""
    pipe = load_pipeline(model, device="cpu", scheduler=scheduler)
    spec = spec.replace(scheduler=scheduler, cache=None)
    lead = pipe.lead_for(spec)
    return counted_rows(pipe, lambda: sample_grid(pipe, [0], 1, 0, spec), [] if lead is None else [lead.model])


def counted_rows(pipe, run: Callable[[], object], others: list | None = None) -> int:
    """The rows ``pipe``'s network (and ``others``: a hand-off's lead) evaluates in one call of ``run`` (CFG's two
    halves count twice), by forward hooks."""
    rows: list[int] = []
    handles = [
        net.register_forward_hook(lambda module, args, output: rows.append(args[0].shape[0]))
        for net in [pipe.transformer, *(others or [])]
    ]
    try:
        run()
    finally:
        for handle in handles:
            handle.remove()
    return sum(rows)


def run_config(run: Path):
    """The config a run wrote (``config.yaml``). A run whose weights came from elsewhere (a distillation's student: its
    teacher's architecture) records ``model.preset: custom``, which no preset loads: its preset is not used, so the
    default's stands in for it."""
    import yaml

    raw = yaml.safe_load((run / "config.yaml").read_text())
    custom = (raw.get("model") or {}).get("preset") == "custom"
    return load_config(run / "config.yaml", ["model.preset=MoH-DiT-Ti/4-75"] if custom else [])
