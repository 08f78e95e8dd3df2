r"""Sample quality per model evaluation: which sampler and how many steps, and how much guidance.

On one trained model (the embedded default), every sampler draws the same class-balanced images from the
same initial noise (a paired comparison), at least 2,000 per setting, scored against the 10,000
Fashion-MNIST test images with the project's classifier features: KID and FID with 90% bootstrap
intervals, precision, recall, and the wall time per image. NFE counts denoiser calls per image (a guided
step evaluates the conditional and the unconditional half in one batched call, as the papers count it).

    python -m benchmarks.samplers runs/fashion_mnist_moh                 # the grid and the guidance sweep
    python -m benchmarks.samplers runs/fashion_mnist_moh --samples 5000
    # every setting as the embedded default samples: guided at timesteps 100-500, grids averaged below 100
    python -m benchmarks.samplers runs/fashion_mnist_moh --guidance 4 --guidance-interval 100 500 \
        --grid-averaging 100 --sweep-guidance 3 5 --work runs/sampler-study-v7 --out benchmarks/results/v7

Settings are measured in order of use (the DDPM-250 reference, the fast solvers, the guidance sweep, then
the rest) and the report is rewritten after each; `--limit-minutes 90` stops starting new ones after 90
minutes, and the same command later continues (a CPU study of every setting takes about 2.5 hours).

Also measured: how FID and KID of the same sampler change with the number of samples scored (FID's bias),
which is why small-sample comparisons here use KID. Writes runs/benchmarks/samplers_<device> (--out benchmarks/results publishes).{json,md,png};
sample sets are kept under --work and reused, so an interrupted study continues.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

if not __package__:  # run as a file (python benchmarks/x.py): the repository root holds the benchmarks package
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.timing import DEFAULT_OUT, OUT_HELP
from experiments.common import (
    add_reference_argument,
    classifier_features,
    describe_reference,
    fashion_reference,
    reference_protocol,
    sample_and_score,
)
from moh_dit.cli.common import finite_float
from moh_dit.evaluation.features import load_images
from moh_dit.evaluation.scoring import evaluate
from moh_dit.sampling.generation import GenerationSettings
from moh_dit.sampling.options import add_placement_options
from moh_dit.sampling.sample_sets import sample_npz_path
from moh_dit.sampling.spec import GRID_AVERAGING_OFF, SamplingSpec

# (scheduler, steps): DiT's DDPM with the learned variance, then solvers that use the noise prediction only
GRID = [
    ("ddpm", 250),
    ("ddpm", 100),
    ("ddpm", 50),
    ("ddim", 50),
    ("ddim", 25),
    ("ddim", 10),
    ("dpm-solver", 25),
    ("dpm-solver", 20),
    ("dpm-solver", 10),
    ("unipc", 25),
    ("unipc", 10),
    ("dpm-solver-sde", 25),
    ("dpm-solver-sde", 20),
]
SWEEP_SAMPLERS = [("dpm-solver", 20), ("ddim", 25)]
GUIDANCE = [1.0, 1.5, 2.0, 3.0, 4.0, 6.0]

# The order the settings are measured in, so that a study stopped early (--limit-minutes) has the most
# useful numbers: the DDPM-250 reference, the fast candidates, the guidance sweep of the first fast
# sampler, then the expensive and the remaining settings.
PRIORITY = [("ddpm", 250), ("dpm-solver", 20), ("dpm-solver", 10), ("dpm-solver", 25), ("unipc", 10), ("unipc", 25)]
PRIORITY += [("ddim", 25), ("ddim", 10)]


def plan(
    grid_guidance: float, quick: bool, sweep_guidance: Sequence[float] = GUIDANCE
) -> tuple[list[tuple], list[tuple]]:
    """The grid's and the sweep's settings as (scheduler, steps, guidance), each list in report order. The
    sweep runs ``sweep_guidance`` and the grid's own guidance on each of :data:`SWEEP_SAMPLERS`."""
    grid = GRID[:1] + GRID[6:7] if quick else GRID
    scales = sorted({*sweep_guidance, grid_guidance}) if sweep_guidance else []
    sweep = [(*SWEEP_SAMPLERS[0], g) for g in (scales[:2] if quick else scales)]
    sweep += [] if quick else [(*SWEEP_SAMPLERS[1], g) for g in scales]
    return [(s, n, grid_guidance) for s, n in grid], sweep


def measuring_order(grid: list[tuple], sweep: list[tuple]) -> list[tuple]:
    first = [setting for setting in grid if setting[:2] in PRIORITY]
    first.sort(key=lambda setting: PRIORITY.index(setting[:2]))
    first_sweep = [setting for setting in sweep if setting[:2] == SWEEP_SAMPLERS[0]]
    return list(dict.fromkeys(first + first_sweep + grid + sweep))


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="a run or pipeline folder")
    p.add_argument("--samples", type=int, default=2000)
    p.add_argument("--guidance", type=float, default=2.0, help="guidance of the sampler grid")
    p.add_argument("--batch-size", type=int, default=250)
    p.add_argument("--bootstrap", type=int, default=20)
    add_reference_argument(p)
    p.add_argument("--work", default="runs/sampler-study", help="where the sample sets are kept")
    p.add_argument("--out", default=DEFAULT_OUT, help=OUT_HELP)
    p.add_argument("--quick", action="store_true", help="a smoke run: 2 samplers, 2 guidance values")
    p.add_argument(
        "--sweep-guidance",
        type=finite_float,
        nargs="*",
        default=list(GUIDANCE),
        metavar="SCALE",
        help="guidance scales of the sweep, beside --guidance (none given: no sweep)",
    )
    add_placement_options(
        p,
        "every setting guides only the steps at training timesteps FIRST..LAST (default: every step)",
        "every setting averages the prediction over the patch grid's shifts at timesteps <= LAST (default: off)",
    )
    p.add_argument(
        "--limit-minutes",
        type=float,
        default=0.0,
        help="start no new setting after this many minutes (0: no limit); a rerun continues where it stopped",
    )
    args = p.parse_args(argv)
    if args.grid_averaging == GRID_AVERAGING_OFF:
        args.grid_averaging = None
    try:
        placed = SamplingSpec.create(
            scheduler=None, guidance_interval=args.guidance_interval, grid_averaging=args.grid_averaging
        )
    except ValueError as err:  # ConfigError is one too
        p.error(str(err))
    args.guidance_interval = placed.guidance.interval
    torch.set_flush_denormal(True)
    work, out = Path(args.work), Path(args.out)
    work.mkdir(parents=True, exist_ok=True)
    reference, extractor = fashion_reference(work, args.reference_count), classifier_features()
    grid, sweep = plan(args.guidance, args.quick, args.sweep_guidance)
    done: dict[tuple, dict] = {}

    def score(scheduler: str, steps: int, guidance: float) -> dict:
        settings = GenerationSettings(
            num_samples=args.samples,
            seed=1000,
            batch_size=min(args.batch_size, args.samples),  # fewer samples than a batch: no block of padding
            label_mode="balanced",
            sampling=placed.replace(scheduler=scheduler, num_inference_steps=steps, guidance_scale=guidance),
        )
        folder = sample_folder(scheduler, steps, guidance)
        row = sample_and_score(Path(args.model), folder, settings, scheduler, reference, extractor, args.bootstrap)
        print(
            f"{scheduler:>15} {steps:>4} steps, guidance {guidance:g}: KID {row['kid']:.5f}  FID {row['fid']:.2f}  "
            f"{row['seconds_per_image']:.3f} s/image",
            flush=True,
        )
        return dict(row, scheduler=scheduler, steps=steps, nfe=steps, guidance=guidance, folder=str(folder))

    def sample_folder(scheduler: str, steps: int, guidance: float) -> Path:
        where = placed.tag()
        return work / f"{scheduler}{steps}-cfg{guidance:g}{where}-n{args.samples}"

    start = time.time()
    for setting in measuring_order(grid, sweep):
        sampled = sample_npz_path(sample_folder(*setting)).exists()  # only scoring left: never cut off
        if args.limit_minutes and not sampled and time.time() - start > 60 * args.limit_minutes:
            print(f"--limit-minutes {args.limit_minutes:g} reached; rerun the same command to continue", flush=True)
            break
        done[setting] = score(*setting)
        write_results(args, grid, sweep, done, out, final=False)
    return write_results(args, grid, sweep, done, out, final=True, reference=reference, extractor=extractor)


def write_results(args, grid, sweep, done, out: Path, final: bool, reference=None, extractor=None) -> dict:
    """The JSON, the markdown report and the plot of what is measured so far (after every setting, so an
    interrupted study shows its numbers)."""
    rows = [done[s] for s in grid if s in done]
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else (platform.processor() or "cpu")
    result = {
        "model": args.model,
        # the weights every row was sampled from (read from the sample sets' manifests)
        "transformer_sha256": sorted({r["transformer_sha256"] for r in done.values()}),
        "device": device,
        "samples": args.samples,
        **reference_protocol(args),
        "guidance": args.guidance,
        "guidance_interval": args.guidance_interval,
        "grid_averaging": args.grid_averaging,
        "grid": rows,
        "sweep": [done[s] for s in sweep if s in done],
        "pending": [list(s) for s in dict.fromkeys(grid + sweep) if s not in done],
        "sample_size_effect": [],
    }
    reference_row = done.get(("ddpm", 250, args.guidance))
    if final and reference_row:
        result["sample_size_effect"] = sample_size_effect(
            Path(reference_row["folder"]), reference, extractor, args.samples
        )
    result["choice"] = choose(rows) if reference_row and any(r["nfe"] <= 25 for r in rows) else None
    out.mkdir(parents=True, exist_ok=True)
    kind = "cuda" if torch.cuda.is_available() else "cpu"
    (out / f"samplers_{kind}.json").write_text(json.dumps(result, indent=2, default=str))
    (out / f"samplers_{kind}.md").write_text(report(result, f"samplers_{kind}.png"))
    plot(result, out / f"samplers_{kind}.png")
    return result


def choose(rows: list[dict]) -> dict:
    """The fast default: among settings with at most 25 model evaluations, the one with the fewest whose KID
    is within 5% of the best of them, the better KID among equals. (Not simply the cheapest within 5% of
    DDPM-250: where a fast solver beats DDPM-250, that would give away the better images for a few
    milliseconds.) The cost is counted in model evaluations, not seconds: at equal evaluations the solvers'
    wall times differ by their few element-wise operations, less than a shared CPU's timing noise. Also says
    whether it meets the goal, KID within 5% of DDPM-250's."""
    reference = next(r for r in rows if (r["scheduler"], r["steps"]) == ("ddpm", 250))
    fast = [r for r in rows if r["nfe"] <= 25]
    best_kid = min(r["kid"] for r in fast)
    # KID is unbiased, so a small sample set can score below 0: 5% of its size, not 1.05 times it
    close = [r for r in fast if r["kid"] <= best_kid + 0.05 * abs(best_kid)]
    best = min(close, key=lambda r: (r["nfe"], r["kid"]))
    return {
        "scheduler": best["scheduler"],
        "steps": best["steps"],
        "kid": best["kid"],
        "ddpm250_kid": reference["kid"],
        "within_5_percent": bool(best["kid"] <= reference["kid"] + 0.05 * abs(reference["kid"])),
        "speedup": reference["seconds_per_image"] / best["seconds_per_image"],
    }


def sample_size_effect(folder: Path, reference: Path, extractor, total: int) -> list[dict]:
    """FID and KID of the first n images of one sample set, for growing n: FID's expected value falls with n
    (its bias), KID's does not."""
    images = load_images(sample_npz_path(folder))
    rows = []
    for n in sorted({min(n, total) for n in (250, 500, 1000, total)}):
        m = evaluate(images[:n], reference, extractor, batch_size=500, pr_block=5000)["metrics"]
        rows.append({"samples": n, "fid": m["fid"], "kid": m["kid"], "kid_std": m["kid_std"]})
    return rows


def _placement(result: dict) -> str:
    """Where a study's settings guided and averaged, in words."""
    spec = SamplingSpec.create(
        scheduler=None, guidance_interval=result.get("guidance_interval"), grid_averaging=result.get("grid_averaging")
    )
    return spec.placement()


def report(result: dict, image: str) -> str:
    choice = result["choice"]
    # results written before the study took an interval or averaging guided every step and averaged nothing
    placement = _placement(result)
    lines = [
        f"# Samplers: quality per model evaluation ({result['device']})",
        "",
        f"Model: `{result['model']}` (weights sha256 {', '.join(h[:12] for h in result.get('transformer_sha256', []))}). {result['samples']} class-balanced samples per setting, the same initial "
        f"noise for every sampler; scored against the {describe_reference(result)} with the project's "
        "classifier features; [90% bootstrap intervals]. NFE: denoiser calls per image (guided halves batched).",
        "",
        f"## Samplers at guidance {result['guidance']:g} {placement}",
        "",
        "| sampler | NFE | KID | FID | precision | recall | s / image |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in result["grid"]:
        lines.append(_row(r, f"{r['scheduler']} | {r['nfe']}"))
    if choice:
        lines += [
            "",
            f"Chosen fast default: **{choice['scheduler']} {choice['steps']} steps**, KID {choice['kid']:.4f} "
            f"against DDPM-250's {choice['ddpm250_kid']:.4f} ("
            + ("within 5%: the goal is met" if choice["within_5_percent"] else "not within 5%: the goal is missed")
            + f"), {choice['speedup']:.1f}x faster per image: of the settings of at most 25 model evaluations "
            "whose KID is within 5% of the best of them, the one with the fewest (the better KID among equals).",
        ]
    lines += [
        "",
        "## Guidance",
        "",
        f"Every row guided {placement}.",
        "",
        "| sampler | guidance | KID | FID | precision | recall | s / image |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in result["sweep"]:
        lines.append(_row(r, f"{r['scheduler']} {r['steps']} | {r['guidance']:g}"))
    if result["sample_size_effect"]:
        lines += [
            "",
            "## FID and KID against the number of samples scored",
            "",
            f"The first n images of the DDPM-250 set ({result['grid'][0]['folder']}):",
            "",
            "| samples | FID | KID |",
            "|---|---|---|",
        ]
        lines += [
            f"| {r['samples']} | {r['fid']:.2f} | {r['kid']:.4f} (± {r['kid_std']:.4f}) |"
            for r in result["sample_size_effect"]
        ]
    if result["pending"]:
        pending = ", ".join(f"{s} {n} (guidance {g:g})" for s, n, g in result["pending"])
        lines += ["", f"**Not measured yet** (rerun the same command to continue): {pending}."]
    lines += ["", f"![KID and FID against model evaluations]({image})", ""]
    return "\n".join(lines)


def _row(r: dict, head: str) -> str:
    (klo, khi), (flo, fhi) = r["kid_interval"], r["fid_interval"]
    return (
        f"| {head} | {r['kid']:.4f} [{klo:.4f}, {khi:.4f}] | {r['fid']:.1f} [{flo:.1f}, {fhi:.1f}] | "
        f"{r['precision']:.3f} | {r['recall']:.3f} | {r['seconds_per_image']:.3f} |"
    )


def plot(result: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for name in dict.fromkeys(r["scheduler"] for r in result["grid"]):
        rows = sorted((r for r in result["grid"] if r["scheduler"] == name), key=lambda r: r["nfe"])
        nfe = [r["nfe"] for r in rows]
        for ax, key in zip(axes[:2], ("kid", "fid")):
            y = np.array([r[key] for r in rows])
            err = np.array([[r[key] - r[f"{key}_interval"][0], r[f"{key}_interval"][1] - r[key]] for r in rows]).T
            err = np.maximum(err, 0.0)  # intervals are centred on the value; guard results written by older code
            ax.errorbar(nfe, y, yerr=err, marker="o", capsize=3, label=name)
    for ax, key in zip(axes[:2], ("KID", "FID")):
        ax.set_xscale("log")
        ax.set_xlabel("model evaluations per image (NFE)")
        ax.set_ylabel(f"{key} (classifier features; lower is better)")
        ax.set_title(f"{key} against NFE, guidance {result['guidance']:g}")
        if result["grid"]:
            ax.legend(fontsize=7)
    for sampler, steps in SWEEP_SAMPLERS:
        rows = [r for r in result["sweep"] if (r["scheduler"], r["steps"]) == (sampler, steps)]
        if rows:
            axes[2].plot(
                [r["guidance"] for r in rows], [r["kid"] for r in rows], marker="o", label=f"{sampler} {steps}"
            )
    placement = _placement(result)
    if placement != SamplingSpec().placement():
        fig.suptitle(f"every setting guided {placement}", fontsize=9)
    axes[2].set_xlabel("guidance scale")
    axes[2].set_ylabel("KID")
    axes[2].set_title("guidance sweep")
    if result["sweep"]:
        axes[2].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    from moh_dit.cli.common import run_cli

    run_cli(main)  # bad input: one line, as the commands say it
