"""What diffusers' sampling caches save on a moh-dit model: seconds per image with each cache against the uncached
sampler, measured in the same run (interleaved rounds, medians), at each step count; with the share of block
computations each cache skipped and how far its images move from the uncached ones (the same noise).

    python benchmarks/caches.py --model runs/fashion_mnist_moh                      # the run's recorded sampling
    python benchmarks/caches.py --model runs/fashion_mnist_moh_flow --scheduler euler --tag flow
    python benchmarks/caches.py --rounds 2 --images 4                               # untrained, a smoke run

Without ``--model`` the embedded default's architecture runs with random weights (every path carrying signal): the
times are real, but what a cache skips depends on the trained model, so report trained runs (docs/results.md does).
Writes ``runs/benchmarks/caches_<cpu|cuda>[_tag].{json,md}`` (``--out benchmarks/results`` publishes).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

if not __package__:  # run as a file (python benchmarks/x.py): the repository root holds the benchmarks package
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from benchmarks.timing import DEFAULT_OUT, OUT_HELP, interleaved_rounds, write_report

CACHES = ("none", "first-block", "magcache", "taylorseer")


def benchmark_pipeline(model: str | None) -> tuple[object, torch.device]:
    """The pipeline a sampling benchmark times, on the GPU where there is one: ``model`` (a run, pipeline,
    checkpoint or transformer folder) or, without one, :func:`untrained_default`; progress bars off."""
    from moh_dit.sampling.loading import load_pipeline

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    pipe = load_pipeline(model, device=str(device)) if model else untrained_default(device)
    pipe.set_progress_bar_config(disable=True)
    return pipe, device


def untrained_default(device: torch.device):
    """The embedded default's model (configs/fashion_mnist_moh.yaml: MoH-DiT-Ti/4-75 at width 128) with random
    weights, its zero-initialised layers drawn too, in a pipeline with its preview sampling."""
    from moh_dit import create_model
    from moh_dit.sampling.pipeline import MoHDiTPipeline

    torch.manual_seed(0)
    model = create_model("MoH-DiT-Ti/4-75", hidden_size=128, sample_size=28, in_channels=1, num_classes=10)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "adaLN" in name or "final_layer.linear" in name:
                p.normal_(0, 0.02)
    return MoHDiTPipeline.build(model.to(device).eval(), None, {i: str(i) for i in range(10)}, "dpm-solver")


def block_computations(pipe, run) -> int:
    """How many block computations a sampling run made: the blocks' qkv projections counted (a skipped or
    predicted block or attention does not run its own)."""
    calls = [0]
    handles = [
        b.attn.qkv.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
        for b in pipe.transformer.blocks
    ]
    try:
        run()
        cached = calls[0]
    finally:
        for handle in handles:
            handle.remove()
    return cached


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="a run, pipeline, checkpoint or transformer folder")
    p.add_argument("--scheduler", default=None, help="default: the model's recorded sampler")
    p.add_argument("--steps", type=int, nargs="+", default=[25, 50])
    p.add_argument("--caches", nargs="+", choices=CACHES, default=list(CACHES))
    p.add_argument("--images", type=int, default=16, help="images per sampling call (one batch)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--tag", default=None)
    p.add_argument("--out", type=Path, default=Path(DEFAULT_OUT), help=OUT_HELP)
    args = p.parse_args(argv)
    from moh_dit.sampling.spec import SamplingSpec

    pipe, device = benchmark_pipeline(args.model)
    base = (
        pipe.preview_sampling if args.model else SamplingSpec.create(guidance_scale=4.0, guidance_interval=(100, 500))
    )
    base = base.replace(scheduler=args.scheduler or base.sampler.scheduler)
    classes = pipe.transformer.config.num_classes
    labels = [i % classes for i in range(args.images)] if classes else None
    noise_shape = (args.images, pipe.transformer.in_channels, *(pipe.transformer.config.sample_size,) * 2)
    noise = torch.randn(noise_shape, generator=torch.Generator().manual_seed(0)).to(device)

    def sampler(spec):
        def run():
            kwargs = dict(class_labels=labels) if labels else dict(num_images=args.images)
            return pipe(**kwargs, sampling=spec, latents=noise, output_type="latent", progress=False).images

        return run

    specs = {
        (steps, cache): base.replace(
            num_inference_steps=steps, cache=None if cache == "none" else cache, cache_options=None
        )
        for steps in args.steps
        for cache in args.caches
    }
    runs = {key: sampler(spec) for key, spec in specs.items()}
    # the outputs on the same noise (and MagCache's calibration, done once per setting, before any timing)
    outputs = {key: run() for key, run in runs.items()}
    computed = {key: block_computations(pipe, run) for key, run in runs.items()}
    seconds = interleaved_rounds(runs, device, warmup=0, rounds=args.rounds, per_round=1)
    rows = []
    for (steps, cache), times in seconds.items():
        median = statistics.median(times) / args.images
        plain = statistics.median(seconds[(steps, "none")]) / args.images if (steps, "none") in seconds else None
        reference = outputs.get((steps, "none"))
        rows.append(
            {
                "steps": steps,
                "cache": cache,
                "describe": specs[(steps, cache)].describe(),
                "seconds_per_image": median,
                "speedup": plain / median if plain else None,
                "block_computations": computed[(steps, cache)],
                "computed_share": computed[(steps, cache)] / computed[(steps, "none")]
                if (steps, "none") in computed
                else None,
                "max_abs_difference": float((outputs[(steps, cache)] - reference).abs().max())
                if reference is not None
                else None,
                "rounds": times,
            }
        )
    device_name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    model = args.model or "the embedded default's architecture, untrained"
    lines = [
        f"# Sampling caches on {model} ({device_name}, {torch.get_num_threads()} threads)",
        "",
        f"Written by `python benchmarks/caches.py`. {args.images} images per call, {args.rounds} interleaved rounds, "
        f"medians; sampling as {base.describe()} (steps as in the table). Speed-up: the uncached sampler's seconds per "
        "image over the cache's, in the same run. Blocks computed: the share of the uncached run's block computations "
        "that ran (MagCache's calibration not counted). Difference: the largest absolute difference of the model's "
        "output from the uncached one on the same noise.",
        "",
        "| steps | cache | s / image | speed-up | blocks computed | max difference |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        share = f"{row['computed_share']:.0%}" if row["computed_share"] is not None else "-"
        speed = f"{row['speedup']:.2f}x" if row["speedup"] else "-"
        diff = f"{row['max_abs_difference']:.3g}" if row["max_abs_difference"] is not None else "-"
        lines.append(
            f"| {row['steps']} | {row['cache']} | {row['seconds_per_image']:.4f} | {speed} | {share} | {diff} |"
        )
    stem = f"caches_{device.type}" + (f"_{args.tag}" if args.tag else "")
    result = {"model": model, "device": device_name, "sampling": base.record(), "images": args.images, "rows": rows}
    write_report(args.out, stem, result, lines)
    return result


if __name__ == "__main__":
    from moh_dit.cli.common import run_cli

    run_cli(main)  # bad input: one line, as the commands say it
