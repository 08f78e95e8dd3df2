r"""MoH-DiT against DiT at the embedded default's budget, and a DiT continue-tuned into MoH-DiT.

    python -m experiments.quality                      # both parts, default scale (hours on 2 CPU cores; resumable)
    python -m experiments.quality --part study          # MoH-DiT-Ti/4-{90,75,50} against DiT-Ti/4, 3 seeds
    python -m experiments.quality --part continue       # DiT -> MoH-DiT continue-tuning (uses the study's DiT runs)
    python -m experiments.quality --scale gpu           # 20k steps, 10k samples, DDPM-250, on a GPU
    python -m experiments.quality --scale tiny          # a smoke run (about 2 minutes on 2 cores: 116 s measured)
    python -m experiments.quality --report-only         # rewrite RESULTS.md from results.json

**The study** trains DiT-Ti/4 and its MoH-DiT twins at 90%, 75% and 50% active heads with the embedded
v2 default's recipe (experiments/configs/fashion_mnist_moh_v2.yaml: same data, steps, schedule, EMA) for every seed, samples
each with and without guidance, and scores them on the project's Fashion-MNIST classifier features: KID and
FID (90% bootstrap intervals per run), precision and recall; across seeds, means with 95% t-intervals and
differences to DiT paired by seed. Also: loss curves and per-layer head usage as noise decreases.

**Continue-tuning** (as the MoH paper continue-tunes LLaMA3): each seed's trained DiT is converted into
MoH-DiT at 75% and 50% active heads (``moh_dit.interop.dit_to_moh.dit_to_moh``: heads ranked by their contribution
become shared or routed, routers fitted to pick each token's most useful heads), scored at 0 steps, then
fine-tuned for N steps; against it, the DiT itself trained the same N steps with the same settings. KID is
measured along the way (curves against fine-tuning steps).

It runs in stages that add up: ``--seeds 0`` then ``--seeds 1`` (or ``--models``) each add their runs to
``results.json``, which keeps every earlier record made with the same settings; RESULTS.md is rewritten after
each run and lists what is still missing with the command that adds it. Finished runs, conversions and sample
sets are reused (a reused run is resumed, so a folder made by another recipe is refused), so an interrupted
experiment continues where it stopped.

    python -m experiments.quality --part study --seeds 0       # stage 1: every model at seed 0 (~1 h)
    python -m experiments.quality --part continue --seeds 0    # stage 2: continue-tuning of seed 0's DiT (~40 min)
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
from pathlib import Path

import numpy as np
import torch

from experiments.common import classifier_features, fashion_reference, sample_and_score
from experiments.quality_report import ARMS, CONVERSIONS, MODELS, RECIPE, TIMESTEPS, make_plots, report, slug
from experiments.report import save_results
from moh_dit.data.fashion_mnist import FashionMNIST
from moh_dit.diffusion import DiffusionObjective
from moh_dit.manifests import fingerprint_file, read_manifest
from moh_dit.sampling.generation import GenerationSettings
from moh_dit.sampling.loading import load_pipeline, load_transformer
from moh_dit.sampling.spec import SamplingSpec
from moh_dit.training.config import load_config
from moh_dit.training.quality import read_records
from moh_dit.training.tracking import objective_loss
from moh_dit.training.trainer import train

SCALES = {
    "tiny": dict(
        overrides=[
            "model.overrides.hidden_size=32",  # a smoke run: the narrowest model the presets' heads allow
            "model.overrides.head_dim=8",
            "train.max_steps=3",
            "train.global_batch_size=16",
            "data.subset_per_class=8",
            "log.log_every=1",
            "train.checkpoint_every=3",
            "optim.warmup_steps=1",
        ],
        samples=24,
        sampler=("ddim", 3),
        seeds=(0, 1),
        finetune_steps=2,
        reference=200,
        bootstrap=3,
    ),
    "default": dict(
        overrides=[],
        samples=2000,
        sampler=("dpm-solver", 20),
        seeds=(0, 1, 2),
        finetune_steps=600,
        reference=10000,
        bootstrap=20,
    ),
    "gpu": dict(
        overrides=["train.max_steps=20000", "train.global_batch_size=256"],
        samples=10000,
        sampler=("ddpm", 250),
        seeds=(0, 1, 2),
        finetune_steps=5000,
        reference=10000,
        bootstrap=20,
    ),
}
GUIDANCE = 3.0  # the guided setting: the best KID of the sweep in benchmarks/results/samplers_cpu.md; 1.0 is none
FINETUNE = ["optim.schedule=constant", "optim.lr=2e-4", "optim.warmup_steps=50", "ema.warmup=true"]
logger = logging.getLogger("experiments.quality")


# ----------------------------------------------------------------------------------------------------
# Training and scoring
# ----------------------------------------------------------------------------------------------------
def train_run(run: Path, overrides: list[str]) -> Path:
    """Train (or finish) one run with the study's recipe (``RECIPE``) and ``overrides``. A finished run goes
    through ``train`` too: resuming checks its recorded identity (architecture, data, seed, batch), so a
    folder made by another recipe is refused instead of being scored as this one."""
    done = train(
        load_config(
            {"base": str(RECIPE)},
            [
                *overrides,
                f"train.output_dir={run}",
                "train.resume=latest",
                "log.trackers=[]",
                "preview.per_class=0",
            ],
        )
    )
    if done["stop_reason"] != "max_steps":  # stopped by a signal: it saved a checkpoint; nothing to score yet
        raise SystemExit(f"{run} stopped at step {done['step']}; rerun the same command to continue from there")
    return run


def score(model: Path, folder: Path, guidance: float, sc: dict, reference: Path, extractor) -> dict:
    scheduler, steps = sc["sampler"]
    settings = GenerationSettings(
        num_samples=sc["samples"],
        seed=1000,
        batch_size=min(250, sc["samples"]),
        label_mode="balanced",
        sampling=SamplingSpec.create(scheduler=None, num_inference_steps=steps, guidance_scale=guidance),
    )
    return sample_and_score(model, folder, settings, scheduler, reference, extractor, sc["bootstrap"])


def losses_of(run: Path) -> tuple[list[tuple[int, float]], float]:
    lines = read_records(run / "metrics.jsonl")  # the loss records (not those of evaluations during training)
    speed = statistics.median(m["images_per_s"] for m in lines[1:] or lines)  # skip the warm-up window
    return [(m["step"], objective_loss(m)[1]) for m in lines], speed


@torch.no_grad()
def head_usage_by_timestep(run: Path, n: int = 64) -> np.ndarray | None:
    """(layers, heads, timesteps): share of noised test images' tokens that used each head."""
    model = load_pipeline(run, device="cpu").transformer.eval()
    if model.num_routed_layers == 0:
        return None
    test = FashionMNIST(split="test")
    x0 = torch.from_numpy(np.array(test.images[:n])).float().div(127.5).sub(1).unsqueeze(1)
    y, obj, g = torch.from_numpy(test.labels[:n]), DiffusionObjective(), torch.Generator().manual_seed(0)
    columns = []
    for t in TIMESTEPS:
        tt = torch.full((n,), t)
        with model.recording_head_usage() as usage:
            model(obj.add_noise(x0, torch.randn(x0.shape, generator=g), tt), tt, y)
        width = max(len(u) for u in usage)
        columns.append(np.stack([np.pad(u.numpy(), (0, width - len(u)), constant_values=np.nan) for u in usage]))
    return np.stack(columns, axis=-1)


# ----------------------------------------------------------------------------------------------------
# The two parts
# ----------------------------------------------------------------------------------------------------
def study_key(record: dict) -> tuple:
    return (
        MODELS.index(record["model"]) if record["model"] in MODELS else len(MODELS),
        record["model"],
        record["seed"],
    )


def continue_key(record: dict) -> tuple:
    return (record["seed"], list(ARMS).index(record["arm"]), record["step"])


def merge(earlier: list[dict], now: list[dict], key) -> list[dict]:
    """The records of this stage plus those of earlier stages that it did not redo, in a stable order."""
    redone = {key(r) for r in now}
    return sorted([r for r in earlier if key(r) not in redone] + now, key=key)


def run_study(sc: dict, out: Path, models, reference: Path, extractor, earlier=None, save=None) -> dict:
    """Train and score every (seed, model), seed by seed, so that a study stopped early has every model at
    the first seeds. ``earlier``: the part as a previous stage left it (kept where not redone); ``save``
    is called with the part after each run."""
    earlier = earlier or {"records": [], "head_usage": {}}
    records, usage = [], dict(earlier.get("head_usage") or {})

    def part(now: list[dict]) -> dict:
        return {"records": merge(earlier["records"], now, study_key), "head_usage": usage}

    for seed in sc["seeds"]:
        for model in models:
            run = train_run(
                out / "runs" / f"{slug(model)}-seed{seed}",
                [*sc["overrides"], f"model.preset={model}", f"train.seed={seed}"],
            )
            curve, speed = losses_of(run)
            rec = {
                "model": model,
                "seed": seed,
                "run_id": (read_manifest(run, "run") or {}).get("run_id"),
                "final_diffusion_loss": statistics.mean(v for _, v in curve[-3:]),
                "train_images_per_s": speed,
                "loss_curve": curve,
            }
            for guidance in (1.0, GUIDANCE):
                scores = score(run / "pipeline", run / f"samples-cfg{guidance:g}", guidance, sc, reference, extractor)
                rec[f"cfg{guidance:g}"] = scores
            records.append(rec)
            if model != "DiT-Ti/4" and (model not in usage or seed == min(sc["planned_seeds"])):
                u = head_usage_by_timestep(run)
                usage[model] = u.tolist() if u is not None else None
            logger.info("%s seed %d: KID %.4f / %.4f", model, seed, rec["cfg1"]["kid"], rec[f"cfg{GUIDANCE:g}"]["kid"])
            if save is not None:
                save(part(records))
    return part(records)


def run_continue(sc: dict, out: Path, reference: Path, extractor, earlier=None, save=None) -> dict:
    """Convert each seed's DiT, fine-tune every arm and score it along the way (see the module docstring);
    ``earlier`` and ``save`` as in ``run_study``."""
    from moh_dit.interop.dit_to_moh import dit_to_moh
    from moh_dit.sampling.pipeline import MoHDiTPipeline

    steps = sc["finetune_steps"]
    points = [0, steps // 2, steps]
    earlier_records = (earlier or {}).get("records", [])
    records = []

    def part(now: list[dict]) -> dict:
        return {
            "records": merge(earlier_records, now, continue_key),
            "points": points,
            "finetune": FINETUNE,
            "steps": steps,
        }

    for seed in sc["seeds"]:
        base = train_run(
            out / "runs" / f"DiT-Ti_4-seed{seed}", [*sc["overrides"], "model.preset=DiT-Ti/4", f"train.seed={seed}"]
        )
        folder = out / "continue" / f"seed{seed}"
        starts = {"DiT": base / "pipeline"}
        for name, (shared, top_k) in CONVERSIONS.items():
            converted = folder / f"converted-{name}"
            if not (converted / "model_index.json").exists():
                dit, _ = load_transformer(base / "pipeline")
                moh, report = dit_to_moh(dit, shared, top_k, seed=seed)
                pipe = load_pipeline(base / "pipeline", device="cpu")
                source = {
                    "converted_from": str(base / "pipeline"),
                    "to_moh": True,
                    "deviation": report["model_relative_deviation"],
                }
                MoHDiTPipeline.build(moh, pipe.vae, pipe.id2label).save(converted, source)
            starts[name] = converted
        for arm, start in starts.items():
            run = train_run(
                folder / f"finetune-{arm}",
                [
                    *sc["overrides"],
                    *FINETUNE,
                    f"model.init_from={start}",
                    f"train.seed={seed}",
                    f"train.max_steps={steps}",
                    f"train.checkpoint_every={max(1, steps // 2)}",
                    "train.keep_last=3",
                ],
            )
            for point in points:
                model = start if point == 0 else run / "checkpoints" / f"step-{point:08d}"
                if arm == "DiT" and point == 0:  # the study scored this exact model already
                    tag = base / f"samples-cfg{GUIDANCE:g}"
                else:
                    tag = folder / f"samples-{arm}-step{point}-cfg{GUIDANCE:g}"
                scores = score(model, tag, GUIDANCE, sc, reference, extractor)
                records.append({"seed": seed, "arm": arm, "step": point, **scores})
                logger.info("continue seed %d %s step %d: KID %.4f", seed, arm, point, scores["kid"])
                if save is not None:
                    save(part(records))
    return part(records)


def run_experiment(
    scale: str = "default", out: str | Path = "experiments/results", models=MODELS, seeds=None, part: str = "all"
) -> dict:
    """Run ``part`` of the experiment for ``models`` and ``seeds`` (default: the scale's seeds) into ``out``.

    The experiment runs in stages: ``results.json`` keeps every record of earlier stages made with the same
    settings (scale, recipe, sampler, guidance, fine-tuning), and each stage adds or redoes its own; results
    made with other settings are moved aside, never mixed in. ``RESULTS.md`` is rewritten after every run and
    says which runs are still missing and the command that adds them."""

    sc = dict(SCALES[scale])
    sc["planned_seeds"] = sc["seeds"]
    if seeds is not None:
        sc["seeds"] = tuple(seeds)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    reference, extractor = fashion_reference(out, sc["reference"]), classifier_features()
    made_by = experiment_identity(scale)
    previous = json.loads((out / "results.json").read_text()) if (out / "results.json").exists() else {}
    if previous and previous.get("made_by") != made_by:
        aside = out / "results.previous.json"
        logger.warning("%s was made with other settings; moved to %s, starting afresh", out / "results.json", aside)
        (out / "results.json").replace(aside)
        previous = {}
    done = [r["model"] for r in (previous.get("study") or {}).get("records", [])]
    named = list(dict.fromkeys([*models, *done]))
    result = {
        "scale": scale,
        "made_by": made_by,
        "settings": {k: v for k, v in sc.items() if k not in ("seeds", "planned_seeds")}
        | {"seeds": list(sc["planned_seeds"])},
        "guidance": GUIDANCE,
        "models": sorted(named, key=lambda m: (MODELS.index(m) if m in MODELS else len(MODELS), m)),
        "study": previous.get("study"),
        "continue": previous.get("continue"),
        "notes": list(previous.get("notes", [])),
    }

    # the plots are drawn when a part ends (a second or more each); the numbers are written after every run
    plots = make_plots(result, out) if previous else {}

    def save(name: str):
        def write(part_result: dict) -> None:
            result[name] = part_result
            save_results(out, result, report(result, plots))

        return write

    if part in ("all", "study"):
        result["study"] = run_study(sc, out, models, reference, extractor, previous.get("study"), save("study"))
        plots = make_plots(result, out)
    if part in ("all", "continue"):
        result["continue"] = run_continue(sc, out, reference, extractor, previous.get("continue"), save("continue"))
        plots = make_plots(result, out)
    save_results(out, result, report(result, plots))
    return result


def experiment_identity(scale: str) -> dict:
    """What makes two stages' records comparable: the scale's settings, the recipe file's content, the
    guidance and the fine-tuning settings."""
    return {
        "scale": scale,
        "settings": json.loads(json.dumps(SCALES[scale])),
        "recipe_sha256": fingerprint_file(RECIPE),
        "guidance": GUIDANCE,
        "finetune": FINETUNE,
    }


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scale", choices=list(SCALES), default="default")
    p.add_argument("--part", choices=["all", "study", "continue"], default="all")
    p.add_argument("--out", default=None, help="default: experiments/results (tiny: experiments/results-tiny)")
    p.add_argument("--models", nargs="+", default=list(MODELS))
    p.add_argument("--seeds", nargs="+", type=int, default=None)
    p.add_argument("--report-only", action="store_true", help="rewrite RESULTS.md from an existing results.json")
    p.add_argument("--note", default=None, help="add a note on how runs were made to results.json and RESULTS.md")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    out = Path(args.out or ("experiments/results" if args.scale != "tiny" else "experiments/results-tiny"))

    if args.report_only or args.note:
        result = json.loads((out / "results.json").read_text())
        if args.note:
            result.setdefault("notes", []).append(args.note)
        save_results(out, result, report(result, make_plots(result, out)))
    else:
        run_experiment(args.scale, out, args.models, args.seeds, args.part)
    print(f"wrote {out}/RESULTS.md")


if __name__ == "__main__":
    from moh_dit.cli.common import run_cli

    run_cli(main)  # bad input: one line, as the commands say it
