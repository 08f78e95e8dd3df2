"""What each guidance method costs per image: classifier-free guidance (its two halves in one batched forward), APG
and CFG-Zero* (the same forward, another mix), autoguidance by a guide of the main model's size (a checkpoint
of its run) and by a smaller one (one forward of each model per step), and guidance folded into training (``folded``:
one conditional evaluation per step). Seconds per image of each in the same run
(interleaved rounds, medians), and their ratio to CFG's, at the same steps and guided steps.

    python benchmarks/guidance.py --model runs/fashion_mnist_moh \\
        --guide quarter=runs/fashion_mnist_moh/checkpoints/step-00002000 --guide small=runs/small
    python benchmarks/guidance.py --rounds 2 --images 4                   # untrained models, a smoke run

Without ``--model`` the embedded default's architecture runs with random weights, guided by a copy of itself
(``same-size``) and by a model of half its width (``half-width``): the times are real. Writes
``runs/benchmarks/guidance_<cpu|cuda>[_tag].{json,md}`` (``--out benchmarks/results`` publishes).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

if not __package__:  # run as a file (python benchmarks/x.py): the repository root holds the benchmarks package
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from benchmarks.caches import benchmark_pipeline
from benchmarks.timing import DEFAULT_OUT, OUT_HELP, interleaved_rounds, write_report
from experiments.arms import counted_rows

RULES = ("cfg", "apg", "cfg-zero-star")


def untrained_guides(pipe) -> dict:
    """A copy of the main model (a checkpoint of the same run) and a model of half its width (a smaller run)."""
    from moh_dit import create_model

    main = pipe.transformer
    torch.manual_seed(1)
    half = create_model("MoH-DiT-Ti/4-75", hidden_size=64, sample_size=28, in_channels=1, num_classes=10)
    return {"same-size": type(main).from_config(main.config).eval(), "half-width": half.eval()}


def named_path(text: str) -> tuple[str, str]:
    """``NAME=PATH`` of ``--guide``."""
    name, sep, path = text.partition("=")
    if not (sep and name and path):
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected NAME=PATH, e.g. quarter=runs/x/checkpoints/step-00002000"
        )
    return name, path


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="a run, pipeline, checkpoint or transformer folder")
    p.add_argument(
        "--guide", action="append", default=[], type=named_path, metavar="NAME=PATH", help="a guide model, repeatable"
    )
    p.add_argument("--scheduler", default=None, help="default: the model's recorded sampler")
    p.add_argument("--steps", type=int, default=25)
    p.add_argument("--scale", type=float, default=2.0)
    p.add_argument("--images", type=int, default=16)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--tag", default=None)
    p.add_argument("--out", type=Path, default=Path(DEFAULT_OUT), help=OUT_HELP)
    args = p.parse_args(argv)
    from moh_dit.sampling.guides import Guide
    from moh_dit.sampling.spec import SamplingSpec

    pipe, device = benchmark_pipeline(args.model)
    base = pipe.preview_sampling if args.model else SamplingSpec()
    # every method guides every step here: autoguidance does (EDM2), and the same guided steps make times comparable
    base = base.replace(
        scheduler=args.scheduler or base.sampler.scheduler,
        num_inference_steps=args.steps,
        guidance_scale=args.scale,
        guidance_interval=None,
        guidance_noise=None,
    )
    guides = dict(args.guide) if args.model else untrained_guides(pipe)
    labels = [i % pipe.transformer.config.num_classes for i in range(args.images)]
    noise_shape = (args.images, pipe.transformer.in_channels, *(pipe.transformer.config.sample_size,) * 2)
    noise = torch.randn(noise_shape, generator=torch.Generator().manual_seed(0)).to(device)
    specs = {rule: base.replace(guidance_rule=rule, rule_options=None) for rule in RULES}
    # one evaluation per step: how a model with guidance folded into training samples (objective.guidance_scale)
    specs["folded"] = base.replace(guidance_scale=1.0)
    attached = {}
    for name, guide in guides.items():
        if isinstance(guide, str):  # loaded as sampling loads it
            spec = base.replace(guide=guide)
            attached[name] = pipe.guide_for(spec)
        else:  # an untrained model
            spec = base.replace(guide=f"untrained-{name}")
            attached[name] = Guide.of(guide.to(device), spec.guide, name)
        specs[f"ag-{name}"] = spec

    def sampler(name):
        spec = specs[name]
        guide = attached.get(name.removeprefix("ag-")) if name.startswith("ag-") else None

        def run():
            return pipe(labels, sampling=spec, guide=guide, latents=noise, output_type="latent", progress=False).images

        return run

    runs = {name: sampler(name) for name in specs}
    evaluations = {name: counted_rows(pipe, run) / args.images for name, run in runs.items()}
    params = {name: sum(p.numel() for p in a.model.parameters()) for name, a in attached.items()}
    seconds = interleaved_rounds(runs, device, warmup=1, rounds=args.rounds, per_round=1)
    cfg = statistics.median(seconds["cfg"]) / args.images
    rows = []
    for name, times in seconds.items():
        median = statistics.median(times) / args.images
        guide = name.removeprefix("ag-") if name.startswith("ag-") else None
        rows.append(
            {
                "method": name,
                "seconds_per_image": median,
                "vs_cfg": median / cfg,
                "main_model_evaluations_per_image": evaluations[name],
                "guide_parameters": params.get(guide),
                "rounds": times,
            }
        )
    device_name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    model = args.model or "the embedded default's architecture, untrained"
    main_params = sum(p.numel() for p in pipe.transformer.parameters())
    lines = [
        f"# Guidance methods: sampling time per image on {model} ({device_name}, {torch.get_num_threads()} threads)",
        "",
        f"Written by `python benchmarks/guidance.py`. {args.images} images per call, {args.rounds} interleaved rounds, "
        f"medians; {base.describe()}, every step guided. The main model has {main_params / 1e6:.2f}M parameters.",
        "",
        "| method | s / image | vs CFG | main model's evaluations per image | guide parameters |",
        "|---|---|---|---|---|",
    ]
    for row in rows:
        guide = f"{row['guide_parameters'] / 1e6:.2f}M" if row["guide_parameters"] else "-"
        lines.append(
            f"| {row['method']} | {row['seconds_per_image']:.4f} | {row['vs_cfg']:.2f}x | "
            f"{row['main_model_evaluations_per_image']:g} | {guide} |"
        )
    stem = f"guidance_{device.type}" + (f"_{args.tag}" if args.tag else "")
    result = {"model": model, "device": device_name, "sampling": base.record(), "images": args.images, "rows": rows}
    write_report(args.out, stem, result, lines)
    return result


if __name__ == "__main__":
    from moh_dit.cli.common import run_cli

    run_cli(main)  # bad input: one line, as the commands say it
