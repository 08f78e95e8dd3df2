"""MoH-DiT against DiT at small scale, several seeds: train, sample, evaluate, report.

    python experiments/quality.py                  # default scale: about 55 minutes on 2 CPU cores
    python experiments/quality.py --scale gpu      # 20k steps, 10k samples per model, DDPM-250, on a GPU
    python experiments/quality.py --scale tiny     # a smoke run (seconds)

Trains DiT-Ti/4 and its MoH-DiT twins at 90%, 75% and 50% active heads on Fashion-MNIST at equal steps and
data, for every seed; samples each model with and without guidance; evaluates FID, precision and recall
(and the classifier-logit Inception Score) with the project's Fashion-MNIST classifier as feature extractor
(Inception metrics are added when its weights are present); writes ``RESULTS.md``, ``results.json``, loss
curves and head-usage heatmaps (which heads the routers choose, per layer, as noise decreases). Finished
runs are reused, so an interrupted experiment continues where it stopped.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from experiments import fmnist_classifier
from moh_dit.artifacts import sample_npz_path
from moh_dit.config import load_config
from moh_dit.data import FashionMNIST
from moh_dit.diffusion import DiffusionObjective
from moh_dit.evaluation import EvaluationError, InceptionFeatures, evaluate, load_images, resolve_extractor
from moh_dit.generate import GenerationSettings, generate_samples, load_pipeline
from moh_dit.training import train

ROOT = Path(__file__).resolve().parents[1]
MODELS = ("DiT-Ti/4", "MoH-DiT-Ti/4-90", "MoH-DiT-Ti/4-75", "MoH-DiT-Ti/4-50")
SCALES = {
    "tiny": dict(
        steps=3,
        batch=16,
        samples=24,
        sample_steps=3,
        scheduler="ddim",
        seeds=(0,),
        subset_per_class=8,
        reference=200,
        log_every=1,
    ),
    "default": dict(
        steps=450,
        batch=64,
        samples=300,
        sample_steps=25,
        scheduler="ddim",
        seeds=(0, 1, 2),
        subset_per_class=0,
        reference=10000,
        log_every=25,
    ),
    "gpu": dict(
        steps=20000,
        batch=256,
        samples=10000,
        sample_steps=250,
        scheduler="ddpm",
        seeds=(0, 1, 2),
        subset_per_class=0,
        reference=10000,
        log_every=200,
    ),
}
GUIDANCE = 1.5  # the DiT papers' FID setting
logger = logging.getLogger("experiments.quality")


def slug(name: str) -> str:
    return name.replace("/", "_")


def reference_npz(out: Path, count: int) -> Path:
    """The Fashion-MNIST test split (first ``count`` images) as an ADM-style uint8 npz."""
    path = out / f"reference_fmnist_test_{count}.npz"
    if not path.exists():
        test = FashionMNIST(split="test")
        np.savez(path, arr_0=np.repeat(test.images[:count, :, :, None], 3, axis=3))
    return path


def train_one(model: str, seed: int, sc: dict, out: Path) -> Path:
    run = out / "runs" / f"{slug(model)}-seed{seed}"
    if (run / "pipeline" / "model_index.json").exists():
        return run
    config = {
        "base": str(ROOT / "configs" / "fashion_mnist_moh.yaml"),
        "model": {"preset": model},
        "data": {"subset_per_class": sc["subset_per_class"]},
        "optim": {"warmup_steps": min(100, sc["steps"] // 4)},
        # short runs: a constant 0.995 EMA would still hold ~10% of the initial weights after 450 steps
        "ema": {"warmup": True},
        "log": {"log_every": sc["log_every"], "sample_per_class": 0, "trackers": []},
        # resume=latest: an interrupted experiment continues its runs (a fresh folder starts at step 0)
        "train": {
            "seed": seed,
            "output_dir": str(run),
            "max_steps": sc["steps"],
            "global_batch_size": sc["batch"],
            "checkpoint_every": sc["steps"],
            "resume": "latest",
        },
    }
    train(load_config(config))
    return run


def metrics_of(run: Path) -> tuple[list[dict], float, float]:
    lines = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    final = statistics.mean(m["diffusion_loss"] for m in lines[-3:])
    speed = statistics.median(m["images_per_s"] for m in lines[1:] or lines)  # skip the warm-up window
    return lines, final, speed


@torch.no_grad()
def head_usage_by_timestep(run: Path, timesteps: list[int], n: int = 64) -> Optional[np.ndarray]:
    """(layers, heads, timesteps) share of tokens using each head, on noised test images."""
    pipe = load_pipeline(run, device="cpu")
    model = pipe.transformer.eval()
    if model.config.attention_type != "moh" or model.num_routed_layers == 0:
        return None
    test = FashionMNIST(split="test")
    x0 = torch.from_numpy(np.array(test.images[:n])).float().div(127.5).sub(1).unsqueeze(1)
    y = torch.from_numpy(test.labels[:n])
    obj = DiffusionObjective()
    g = torch.Generator().manual_seed(0)
    cols = []
    for t in timesteps:
        tt = torch.full((n,), t)
        xt = obj.add_noise(x0, torch.randn(x0.shape, generator=g), tt)
        masks = model(xt, tt, y, return_head_masks=True).head_masks
        cols.append(np.stack([m.float().mean(dim=(0, 1)).numpy() for m in masks]))  # (layers, heads)
    return np.stack(cols, axis=-1)


def sample_and_score(run: Path, seed: int, guidance: float, sc: dict, ref: Path, extractors) -> dict:
    tag = f"samples-cfg{guidance:g}"
    pipe = load_pipeline(run, device="cuda" if torch.cuda.is_available() else "cpu", scheduler=sc["scheduler"])
    settings = GenerationSettings(
        num_samples=sc["samples"],
        seed=1000 + seed,
        batch_size=250,
        guidance_scale=guidance,
        num_inference_steps=sc["sample_steps"],
        label_mode="balanced",
    )
    start = time.time()
    existing = sample_npz_path(run / tag).exists()
    npz = generate_samples(pipe, run / tag, settings)
    images_per_s = None if existing else sc["samples"] / (time.time() - start)
    timing_file = run / f"{tag}.timing.json"
    if images_per_s is not None:
        timing_file.write_text(json.dumps({"images_per_s": images_per_s}))
    elif timing_file.exists():
        images_per_s = json.loads(timing_file.read_text())["images_per_s"]
    samples = load_images(npz)
    result = {"sampling_images_per_s": images_per_s}
    for name, ext in extractors.items():
        metrics = evaluate(samples, ref, ext, batch_size=500, pr_block=5000)["metrics"]
        result.update({f"{name}_{k}": v for k, v in metrics.items()})
    return result


def aggregate(records: list[dict], keys: list[str]) -> dict:
    out = {}
    for key in keys:
        vals = [r[key] for r in records if r.get(key) is not None]
        if vals:
            out[key] = {
                "mean": statistics.mean(vals),
                "std": statistics.stdev(vals) if len(vals) > 1 else 0.0,
                "values": vals,
            }
    return out


def run_experiment(scale: str = "default", out: str | Path = "experiments/results", models=MODELS, seeds=None) -> dict:
    sc = dict(SCALES[scale])
    if seeds is not None:
        sc["seeds"] = tuple(seeds)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    ref = reference_npz(out, sc["reference"])
    extractors = {"clf": resolve_extractor(fmnist_classifier.register(), None, "cpu")}
    try:
        extractors["inception"] = InceptionFeatures()
    except EvaluationError as err:
        logger.info("Inception metrics skipped: %s", str(err).split(".")[0])
    timesteps = [999, 800, 600, 400, 200, 50]
    records, curves, usage = [], {}, {}
    for model in models:
        for seed in sc["seeds"]:
            run = train_one(model, seed, sc, out)
            lines, final_loss, train_speed = metrics_of(run)
            curves.setdefault(model, []).append([(m["step"], m["diffusion_loss"]) for m in lines])
            rec = {"model": model, "seed": seed, "final_diffusion_loss": final_loss, "train_images_per_s": train_speed}
            for guidance in (1.0, GUIDANCE):
                scores = sample_and_score(run, seed, guidance, sc, ref, extractors)
                rec.update({f"{k}@cfg{guidance:g}": v for k, v in scores.items()})
            records.append(rec)
            if seed == sc["seeds"][0]:
                u = head_usage_by_timestep(run, timesteps)
                if u is not None:
                    usage[model] = u
            logger.info(
                "%s seed %d: %s", model, seed, {k: round(v, 4) for k, v in rec.items() if isinstance(v, float)}
            )
    keys = sorted({k for r in records for k in r if k not in ("model", "seed")})
    summary = {m: aggregate([r for r in records if r["model"] == m], keys) for m in models}
    result = {
        "scale": scale,
        "settings": sc,
        "guidance": GUIDANCE,
        "models": list(models),
        "records": records,
        "summary": summary,
        "head_usage_timesteps": timesteps,
        "head_usage": {m: u.tolist() for m, u in usage.items()},
        "extractors": list(extractors),
    }
    (out / "results.json").write_text(json.dumps(result, indent=2))
    plots = make_plots(curves, usage, timesteps, out)
    (out / "RESULTS.md").write_text(report(result, plots))
    return result


def make_plots(curves, usage, timesteps, out: Path) -> dict:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return {}
    plots = {}
    fig, ax = plt.subplots(figsize=(6, 4))
    for model, runs in curves.items():
        steps = [s for s, _ in runs[0]]
        losses = np.array([[v for _, v in r[: len(steps)]] for r in runs if len(r) >= len(steps)])
        ax.plot(steps, losses.mean(0), label=model)
        if len(losses) > 1:
            ax.fill_between(steps, losses.min(0), losses.max(0), alpha=0.2)
    ax.set_xlabel("step")
    ax.set_ylabel("diffusion loss (MSE + VB)")
    ax.set_yscale("log")
    ax.legend()
    ax.set_title("Training loss (mean over seeds, band = min..max)")
    fig.tight_layout()
    fig.savefig(out / "loss_curves.png", dpi=110)
    plt.close(fig)
    plots["loss"] = "loss_curves.png"
    for model, u in usage.items():
        layers = u.shape[0]
        fig, axes = plt.subplots(1, layers, figsize=(2.2 * layers, 2.8), sharey=True)
        for layer in range(layers):
            ax = np.atleast_1d(axes)[layer]
            im = ax.imshow(u[layer], vmin=0, vmax=1, cmap="viridis", aspect="auto")
            ax.set_xticks(range(len(timesteps)), [str(t) for t in timesteps], rotation=90, fontsize=6)
            ax.set_title(f"layer {layer}", fontsize=8)
            ax.set_xlabel("timestep", fontsize=7)
        np.atleast_1d(axes)[0].set_ylabel("head")
        fig.colorbar(im, ax=list(np.atleast_1d(axes)), shrink=0.8, label="share of tokens")
        fig.suptitle(f"{model}: head usage vs timestep (noise decreases to the right)", fontsize=9)
        name = f"head_usage_{slug(model)}.png"
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        plots[model] = name
    return plots


def _fmt(stat: Optional[dict], digits: int = 3) -> str:
    if not stat:
        return "n/a"
    return f"{stat['mean']:.{digits}f} ± {stat['std']:.{digits}f}"


def report(result: dict, plots: dict) -> str:
    sc, summary, models = result["settings"], result["summary"], result["models"]
    g = f"cfg{result['guidance']:g}"
    lines = [
        "# MoH-DiT vs DiT on Fashion-MNIST",
        "",
        f"Scale `{result['scale']}`: {sc['steps']} training steps of batch {sc['batch']} (pixel space, 28 x 28), "
        f"seeds {list(sc['seeds'])}; {sc['samples']} samples per model and guidance setting "
        f"({sc['scheduler']}, {sc['sample_steps']} steps, class-balanced labels), scored against the first "
        f"{sc['reference']} test images with the project's Fashion-MNIST classifier features "
        f"(`experiments/fmnist_classifier.py`). Mean ± standard deviation over seeds. "
        f"Reproduce: `python experiments/quality.py --scale {result['scale']}`.",
        "",
        f"| model | FID (no guidance) | FID (guidance {result['guidance']:g}) | precision | recall | final loss | "
        "train img/s | sample img/s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for m in models:
        s = summary[m]
        lines.append(
            f"| {m} | {_fmt(s.get('clf_fid@cfg1'), 2)} | {_fmt(s.get(f'clf_fid@{g}'), 2)} | "
            f"{_fmt(s.get(f'clf_precision@{g}'))} | {_fmt(s.get(f'clf_recall@{g}'))} | "
            f"{_fmt(s.get('final_diffusion_loss'), 4)} | {_fmt(s.get('train_images_per_s'), 0)} | "
            f"{_fmt(s.get(f'sampling_images_per_s@{g}'), 0)} |"
        )
    lines += [
        "",
        "Precision and recall are for the guided samples; `results.json` has every number per seed,",
        "including the unguided precision/recall and the classifier Inception Score.",
        "",
    ]
    if "loss" in plots:
        lines += [f"![loss curves]({plots['loss']})", ""]
    for m in models:
        if m in plots:
            lines += [f"![{m} head usage]({plots[m]})", ""]
    lines += ["## Conclusion", "", conclusion(result), ""]
    return "\n".join(lines)


def _verdict(
    summary: dict, base: str, model: str, key: str, higher_is_better: bool
) -> Optional[tuple[float, float, str]]:
    """(model mean, baseline mean, verdict): a difference counts only beyond twice the seed-to-seed spread."""
    b, s = summary[base].get(key), summary[model].get(key)
    if not b or not s:
        return None
    diff = s["mean"] - b["mean"]
    if abs(diff) <= 2 * max(b["std"], s["std"]):
        return s["mean"], b["mean"], "within the seed-to-seed spread"
    better = diff > 0 if higher_is_better else diff < 0
    return s["mean"], b["mean"], ("better" if better else "worse") + " by more than twice the seed spread"


def conclusion(result: dict) -> str:
    """An honest reading of the table, metric by metric, against the first model (DiT)."""
    summary, base = result["summary"], result["models"][0]
    g = f"cfg{result['guidance']:g}"
    if len(summary[base].get(f"clf_fid@{g}", {}).get("values", [])) < 2:
        return "Too few seeds for a conclusion (use the default or gpu scale)."
    parts = []
    for m in result["models"][1:]:
        bits = []
        for label, key, higher, digits in (
            ("guided FID", f"clf_fid@{g}", False, 2),
            ("precision", f"clf_precision@{g}", True, 3),
            ("recall", f"clf_recall@{g}", True, 3),
        ):
            v = _verdict(summary, base, m, key, higher)
            if v:
                bits.append(f"{label} {v[0]:.{digits}f} vs {v[1]:.{digits}f} ({v[2]})")
        parts.append(f"- {m} against {base}: " + "; ".join(bits) + ".")
    return "\n".join(parts) + (
        "\n\nAt this scale the comparison says how MoH behaves with fewer active heads on a small budget; it does "
        "not settle the paper's ImageNet claims, whose margins are smaller than DiT's own seed spread."
    )


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scale", choices=list(SCALES), default="default")
    p.add_argument("--out", default=None, help="default: experiments/results (tiny: experiments/results-tiny)")
    p.add_argument("--models", nargs="+", default=list(MODELS))
    p.add_argument("--seeds", nargs="+", type=int, default=None)
    p.add_argument("--report-only", action="store_true", help="rewrite RESULTS.md from an existing results.json")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    out = args.out or ("experiments/results" if args.scale != "tiny" else "experiments/results-tiny")
    if args.report_only:
        result = json.loads((Path(out) / "results.json").read_text())
        plots = {"loss": "loss_curves.png"} | {m: f"head_usage_{slug(m)}.png" for m in result["head_usage"]}
        (Path(out) / "RESULTS.md").write_text(report(result, plots))
    else:
        run_experiment(args.scale, out, args.models, args.seeds)
    print(f"wrote {out}/RESULTS.md")


if __name__ == "__main__":
    main()
