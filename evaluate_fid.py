"""Evaluate FID, sFID, Inception Score, precision and recall like the ADM evaluator (DiT / MoH-DiT papers).

Existing samples (ADM .npz with arr_0, or a folder of PNGs):
    python evaluate_fid.py --samples samples/xl90.npz --reference VIRTUAL_imagenet256_labeled.npz

A model (run folder, checkpoint or pipeline folder): sample N images first (resumable, any number of
processes), then evaluate on the main process:
    accelerate launch --num_processes 8 evaluate_fid.py --model runs/imagenet256/moh-dit-xl-2-90 \
        --reference VIRTUAL_imagenet256_labeled.npz --num-samples 50000 --cfg-scale 1.5 --guidance-channels 3

Inception weights: --inception-weights PATH, else $MOH_DIT_INCEPTION_WEIGHTS, else the torch hub cache
($TORCH_HOME/hub/checkpoints/weights-inception-2015-12-05-6726825d.pth).
"""
import argparse
import importlib
import json
import logging
import sys
from pathlib import Path

import numpy as np
import torch


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--samples", help="ADM-style .npz (arr_0) or a folder of images")
    src.add_argument("--model", help="run folder, checkpoint or pipeline folder to sample from")
    p.add_argument("--reference", required=True, help="ADM reference batch .npz, or a folder / .npz of real images")
    p.add_argument("--extractor", default="inception", help="'inception' (paper protocol) or a torch-fidelity extractor name")
    p.add_argument("--extractor-module", default=None, help="python module to import first (it may register extractors)")
    p.add_argument("--inception-weights", default=None)
    p.add_argument("--batch-size", type=int, default=100, help="feature extraction batch size")
    p.add_argument("--fp16-distances", action="store_true", help="emulate ADM's float16 precision/recall distances")
    p.add_argument("--no-cache", action="store_true", help="do not read or write cached reference statistics")
    p.add_argument("--out", default=None, help="JSON file for all numbers and settings (default: beside the samples)")
    p.add_argument("--device", default=None)
    g = p.add_argument_group("sampling (with --model)")
    g.add_argument("--num-samples", type=int, default=50000)
    g.add_argument("--cfg-scale", type=float, default=1.5)
    g.add_argument("--guidance-channels", type=int, default=None, help="3 reproduces the papers' guidance")
    g.add_argument("--num-steps", type=int, default=250)
    g.add_argument("--scheduler", choices=["ddpm", "ddim", "dpm-solver"], default=None)
    g.add_argument("--label-mode", choices=["uniform", "balanced"], default="uniform")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--sample-batch-size", type=int, default=64)
    g.add_argument("--sample-dir", default=None, help="default: <model>/eval-samples-<settings>")
    g.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32")
    return p


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from moh_dit.evaluation import EvaluationError, evaluate, format_table, load_images, resolve_extractor

    if args.extractor_module:
        importlib.import_module(args.extractor_module)
    settings = {k: v for k, v in vars(args).items()}
    if args.model:
        from accelerate import Accelerator

        from moh_dit.generate import GenerationSettings, generate_samples, load_pipeline

        accelerator = Accelerator(cpu=not torch.cuda.is_available())
        pipe = load_pipeline(args.model, accelerator.device, args.dtype, args.scheduler)
        gen = GenerationSettings(num_samples=args.num_samples, seed=args.seed, batch_size=args.sample_batch_size,
                                 guidance_scale=args.cfg_scale, num_inference_steps=args.num_steps,
                                 guidance_channels=args.guidance_channels, label_mode=args.label_mode)  # fmt: skip
        tag = f"n{args.num_samples}-cfg{args.cfg_scale}-ch{args.guidance_channels or 'all'}-{args.scheduler or 'ddpm'}{args.num_steps}-seed{args.seed}"
        sample_dir = Path(args.sample_dir or Path(args.model) / f"eval-samples-{tag}")
        npz = generate_samples(pipe, sample_dir, gen, accelerator)
        if not accelerator.is_main_process:
            return {}
        settings["scheduler"] = type(pipe.scheduler).__name__
        samples_path = npz
    else:
        samples_path = Path(args.samples)
    try:
        samples = load_images(samples_path)
        extractor = resolve_extractor(args.extractor, args.inception_weights, args.device)
        result = evaluate(samples, args.reference, extractor, args.batch_size, args.fp16_distances, cache=not args.no_cache)
    except EvaluationError as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    result["samples"] = str(samples_path)
    result["command_line"] = settings
    out = Path(args.out) if args.out else Path(str(samples_path).rstrip("/")).with_suffix(".metrics.json")
    out.write_text(json.dumps(result, indent=2, default=lambda o: o.tolist() if isinstance(o, np.ndarray) else str(o)))
    print(format_table(result["metrics"]))
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    from moh_dit.cli import run_cli

    run_cli(main)
