r"""Guidance in an interval of timesteps, on the embedded default's trained model: KID and FID (90% bootstrap
intervals) and per-class KID of class-balanced samples for each guidance scale and interval, with a grid
of each. Guidance at every step (DiT's way) is the baseline row; ``G@FIRST-LAST`` guides only the steps
whose training timestep lies in FIRST..LAST (``MoHDiTPipeline(guidance_interval=...)``); a ``+avgT`` suffix
also averages the prediction over shifted patch grids at the steps with timestep <= T
(``MoHDiTPipeline(grid_averaging=T)``).

    python -m experiments.guidance_interval                          # the default's model (v7), every setting
    python -m experiments.default_comparison --out runs/v7s1 --only v7s1 \
        --recipe "v7s1=configs/fashion_mnist_moh.yaml:train.seed=1"       # the same recipe, seed 1
    python -m experiments.guidance_interval --models v7s1=runs/v7s1/runs/v7s1/pipeline --settings 2 3 4@100-500
    python -m experiments.guidance_interval --settings 4@100-500+avg100 4@100-500+avg200

The models come from ``python -m experiments.default_comparison`` (v7 is the default's recipe). Sample folders are reused when their records match, so an interrupted study
continues. Writes RESULTS.md, results.json and grids under experiments/results/guidance_interval/.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from experiments.common import (
    add_scoring_arguments,
    describe_reference,
    kept_rows,
    real_recognition,
    reference_protocol,
    render_grid,
    sample_and_score,
    start_scoring,
)
from experiments.report import class_tables, save_results
from moh_dit.sampling.generation import GenerationSettings
from moh_dit.sampling.spec import SamplingSpec

MODELS = {"v7": "experiments/results/default/runs/v7/pipeline"}
# guidance at every step (the comparison's 2 and the default's earlier grid guidance 3), then intervals:
# ends near the noise levels of Kynkaenniemi et al.'s EDM2 interval (sigma 0.28 .. 5.4 is t 85 .. 585 on
# DiT's linear schedule), one end moved at a time, and guidance cut only at low noise
SETTINGS = (
    "2",
    "3",
    "4@100-500",
    "4@100-600",
    "3@100-600",
    "4@100-400",
    "5@100-500",
    "4@50-500",
    "4@150-500",
    "3@100-999",
    "4@100-999",
    # the default's setting with its patch grids averaged at the low-noise steps
    "4@100-500+avg100",
    "4@100-500+avg200",
)


def parse_setting(text: str) -> tuple[float, tuple[int, int] | None, int | None]:
    """``"4"`` -> (4.0, None, None); ``"4@100-600"`` -> (4.0, (100, 600), None); ``"4@100-600+avg100"`` ->
    (4.0, (100, 600), 100): guidance scale, guided interval, grid averaging."""
    guidance, suffix, averaging = text.partition("+avg")
    scale, _, interval = guidance.partition("@")
    try:
        if suffix and not averaging:
            raise ValueError("+avg without a timestep")
        value = float(scale)
        spec = SamplingSpec.create(
            scheduler=None,
            guidance_interval=tuple(int(v) for v in interval.split("-")) if interval else None,
            grid_averaging=int(averaging) if averaging else None,
        )
        return value, spec.guidance.interval, spec.sampler.grid_averaging
    except ValueError:  # ConfigError is one too
        raise SystemExit(
            f"a setting is GUIDANCE[@FIRST-LAST][+avgT] (e.g. 4@100-600 or 4@100-600+avg100), got {text!r}"
        ) from None


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=[f"{k}={v}" for k, v in MODELS.items()], help="NAME=PIPELINE")
    p.add_argument("--settings", nargs="+", default=list(SETTINGS), help="GUIDANCE or GUIDANCE@FIRST-LAST")
    add_scoring_arguments(p, "experiments/results/guidance_interval")
    args = p.parse_args(argv)
    out, reference, extractor = start_scoring(args)
    protocol = {k: getattr(args, k) for k in ("samples", "scheduler", "steps", "bootstrap")} | reference_protocol(args)
    real = real_recognition(args.reference_count)
    rows = kept_rows(out, protocol)  # other models' and settings' rows stay; the ones run now are replaced
    for spec in args.models:
        name, _, model = spec.partition("=")
        if not model:
            raise SystemExit(f"--models wants NAME=PIPELINE, got {spec!r}")
        for text in args.settings:
            scale, interval, averaging = parse_setting(text)
            settings = GenerationSettings(
                num_samples=args.samples,
                seed=1000,  # the comparison's seed and labels: the guidance-2/3 rows are its samples' twins
                batch_size=250,
                label_mode="balanced",
                sampling=SamplingSpec.create(
                    scheduler=None,
                    num_inference_steps=args.steps,
                    guidance_scale=scale,
                    guidance_interval=interval,
                    grid_averaging=averaging,
                ),
            )
            tag = f"{args.scheduler}{args.steps}-cfg{scale:g}" + settings.sampling.tag()
            folder = out / "runs" / name / f"samples-{tag}-n{args.samples}"
            scores = sample_and_score(
                Path(model), folder, settings, args.scheduler, reference, extractor, args.bootstrap
            )
            grid = out / f"grid_{name}_{tag}.png"
            render_grid(
                Path(model),
                grid,
                args.scheduler,
                args.steps,
                scale,
                guidance_interval=interval,
                grid_averaging=averaging,
            )
            rows[f"{name} {text}"] = dict(
                scores,
                model=name,
                pipeline=model,
                guidance=scale,
                interval=interval,
                grid_averaging=averaging,
                grid=grid.name,
            )
            logging.info("%s %s: KID %.3f FID %.1f", name, text, scores["kid"], scores["fid"])
            result = {"protocol": protocol, "rows": rows, "real_recognised": real}
            save_results(out, result, report(result))  # after every row: resumable
    return result


def report(result: dict) -> str:
    protocol, rows = result["protocol"], result["rows"]
    lines = [
        "# Guidance in an interval of timesteps",
        "",
        f"{protocol['samples']} class-balanced samples per row ({protocol['scheduler']}, {protocol['steps']} steps, "
        f"seed 1000), scored against the {describe_reference(protocol)} with the project's classifier features; "
        f"90% bootstrap intervals over {protocol['bootstrap']} resamples. `G@A-B`: guidance G at the steps whose "
        "training timestep is in A..B, none elsewhere; `G`: guidance at every step; `+avgT`: the prediction "
        "averaged over the patch grid's shifts at the steps with timestep <= T (grid averaging). Reproduce: "
        "`python -m experiments.guidance_interval` (docs/sampling.md explains the choice).",
        "",
        "| model | setting | KID | FID | precision | recall | ms / image |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in rows.items():
        (kid_lo, kid_hi), (fid_lo, fid_hi) = r["kid_interval"], r["fid_interval"]
        ms = f"{1000 * r['seconds_per_image']:.0f}" if r.get("seconds_per_image") else "-"
        lines.append(
            f"| {r['model']} | {name.split(' ', 1)[1]} | {r['kid']:.2f} [{kid_lo:.2f}, {kid_hi:.2f}] | "
            f"{r['fid']:.1f} [{fid_lo:.1f}, {fid_hi:.1f}] | {r['precision']:.3f} | {r['recall']:.3f} | {ms} |"
        )
    note = "Guidance changes what the classifier recognises far less than how the samples look; per-class KID is the measure."
    lines += [
        "",
        "ms / image: the wall time of generating the row's samples on whatever machine made them (CPU rows share it "
        "with other work), a rough guide: outside the interval one forward pass replaces two; grid averaging runs "
        "the steps it averages on four shifted copies in one batch.",
        "",
        *class_tables(rows, result.get("real_recognised"), what="model, setting", note=note),
        "",
        "Grids: seed 0, eight samples per class.",
        "",
        *[f"**{n}**\n\n![{n}]({r['grid']})\n" for n, r in rows.items()],
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    from moh_dit.cli.common import run_cli

    run_cli(main)  # bad input: one line, as the commands say it
