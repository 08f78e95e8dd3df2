r"""Post-hoc EMA (EDM2): rebuild the EMA of any relative width sigma_rel at any snapshot's step from a run trained
with ema.posthoc_every, or sweep widths (and guidance scales) and score each as `moh-dit evaluate --model` does.

    moh-dit ema runs/fmnist --sigma-rel 0.07 --out pipelines/fmnist-ema0.07            # a pipeline folder
    moh-dit ema runs/fmnist --sigma-rel 0.07 --step 6000 --out ema.07 --transformer-only
    moh-dit ema runs/fmnist --sweep 0.02 0.05 0.1 0.15 0.2 --sweep-cfg 1 3 --reference ref.npz \
        --num-samples 2000 --out sweeps/fmnist                                         # table + plot

The record of a rebuilt EMA (the pipeline's manifest, or posthoc_ema.json) names every snapshot and coefficient.
EDM2 found the best width much shorter with guidance than without; sweep both.
"""

import argparse

from moh_dit.cli.common import add_sampling_arguments, positive_int
from moh_dit.logs import setup_logging


def _sigma_rel(text: str) -> float:
    value = float(text)
    if not 0 < value < (1 / 12) ** 0.5:
        raise argparse.ArgumentTypeError(f"sigma_rel must be between 0 and 0.2887, got {text}")
    return value


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run", help="a run folder trained with ema.posthoc_every > 0")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--sigma-rel", type=_sigma_rel, help="rebuild the EMA of this relative width")
    what.add_argument("--sweep", type=_sigma_rel, nargs="+", metavar="SIGMA_REL", help="score these widths")
    p.add_argument("--step", type=positive_int, default=None, help="a snapshot's step (default: the newest)")
    p.add_argument("--out", required=True, help="the pipeline folder to write, or the sweep's folder")
    p.add_argument("--transformer-only", action="store_true", help="with --sigma-rel: a transformer folder")
    g = p.add_argument_group("the sweep (with --sweep): what is sampled and how it is scored")
    g.add_argument("--sweep-cfg", type=float, nargs="+", default=None, help="guidance scales (default: --cfg-scale)")
    g.add_argument(
        "--reference",
        default=None,
        help="ADM reference batch .npz, a folder / .npz of real images, or a named one (fashion-mnist-test, "
        "fashion-mnist-train)",
    )
    g.add_argument("--extractor", default="inception")
    g.add_argument("--extractor-module", default=None)
    g.add_argument("--extractor-weights", default=None)
    g.add_argument("--sample-batch-size", type=positive_int, default=64)
    g.add_argument("--device", default=None)
    add_sampling_arguments(g, guidance=1.0, protocol="fast", num_samples=2000)
    return p


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    if args.sigma_rel is not None and (args.sweep_cfg or args.reference):
        parser.error("--sweep-cfg and --reference score a --sweep; --sigma-rel writes one rebuilt EMA")
    if args.sweep is not None and not args.reference:
        parser.error("--sweep scores every width against --reference (a reference .npz or a folder of real images)")
    if args.sweep is not None and args.transformer_only:
        parser.error("--transformer-only writes one rebuilt EMA (--sigma-rel)")
    setup_logging()
    from pathlib import Path

    from moh_dit.errors import OutputError

    out = Path(args.out)
    if args.sigma_rel is not None:
        from moh_dit.training.posthoc_export import export_posthoc

        if out.exists() and any(out.iterdir()) and not args.overwrite:
            raise OutputError(f"{out} is not empty; pass --overwrite to replace it")
        written = export_posthoc(args.run, args.sigma_rel, out, args.step, args.transformer_only)
        print(f"wrote the EMA of sigma_rel {args.sigma_rel:g} to {written}")
        return
    from moh_dit.devices import resolve_device
    from moh_dit.evaluation.features import import_extractor_module, resolve_extractor
    from moh_dit.evaluation.reference import resolve_reference
    from moh_dit.sampling.generation import GenerationSettings
    from moh_dit.sampling.options import spec_from_args
    from moh_dit.sampling.sources import recorded_objective
    from moh_dit.snapshots import snapshots_up_to
    from moh_dit.training.posthoc_export import sweep

    snapshots_up_to(args.run, args.step)  # no snapshot there: one line before any extractor is loaded
    spec = spec_from_args(args, objective=recorded_objective(args.run))
    settings = GenerationSettings(args.num_samples, args.seed, args.sample_batch_size, args.label_mode, spec)
    import_extractor_module(args.extractor_module)
    device = str(resolve_device(args.device))
    extractor = resolve_extractor(args.extractor, args.extractor_weights, device)
    scales = args.sweep_cfg or [spec.guidance.scale]
    reference = resolve_reference(args.reference)  # a named one (fashion-mnist-test) is made once
    result = sweep(args.run, args.sweep, scales, settings, reference, extractor, out, args.step, device=device)
    best = min(result["rows"], key=lambda r: r["kid"])
    print(
        f"wrote {out / 'posthoc_sweep.md'}; lowest KID {best['kid']:.5f}: {best['weights']}, guidance {best['guidance']:g}"
    )
