r"""Evaluate FID, sFID, Inception Score, precision and recall like the ADM evaluator (DiT / MoH-DiT papers),
and KID, the number to trust below about 10,000 samples.

Existing samples (ADM .npz with arr_0, or a folder of PNGs):
    python evaluate_fid.py --samples samples/xl90.npz --reference VIRTUAL_imagenet256_labeled.npz

A model (run folder, checkpoint or pipeline folder): sample N images first (resumable, any number of
processes), then evaluate on the main process:
    accelerate launch --num_processes 8 evaluate_fid.py --model runs/imagenet256/moh-dit-xl-2-90 \
        --reference VIRTUAL_imagenet256_labeled.npz --num-samples 50000 --cfg-scale 1.5 --guidance-channels 3

The reference may also be a folder or class-per-folder tree of real images (center-cropped as ADM does to
the samples' size, or --reference-size); `moh-dit reference` saves such a tree as a reference .npz.

Inception weights: --extractor-weights PATH, else $MOH_DIT_INCEPTION_WEIGHTS, else the torch hub cache
($TORCH_HOME/hub/checkpoints/weights-inception-2015-12-05-6726825d.pth).
"""

import argparse
import sys
from pathlib import Path

from moh_dit.cli.common import add_sampling_arguments, positive_int
from moh_dit.logs import setup_logging
from moh_dit.sampling.options import spec_from_args
from moh_dit.sampling.spec import EVAL_GUIDANCE, SamplingSpec


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--samples", help="ADM-style .npz (arr_0) or a folder of images")
    src.add_argument("--model", help="run folder, checkpoint or pipeline folder to sample from")
    p.add_argument(
        "--reference",
        required=True,
        help="ADM reference batch .npz, a folder / .npz of real images, or a named one (fashion-mnist-test, "
        "fashion-mnist-train)",
    )
    p.add_argument(
        "--reference-size",
        type=positive_int,
        default=None,
        help="center-crop size for an image-folder reference (default: the samples' size)",
    )
    p.add_argument(
        "--extractor", default="inception", help="'inception' (paper protocol) or a torch-fidelity extractor name"
    )
    p.add_argument(
        "--extractor-module", default=None, help="python module to import first (it may register extractors)"
    )
    p.add_argument(
        "--extractor-weights",
        "--inception-weights",
        dest="extractor_weights",
        default=None,
        help="weights file of the extractor (checked to hold plain tensors before it is loaded)",
    )
    p.add_argument("--batch-size", type=positive_int, default=100, help="feature extraction batch size")
    p.add_argument("--fp16-distances", action="store_true", help="emulate ADM's float16 precision/recall distances")
    p.add_argument("--no-cache", action="store_true", help="do not read or write cached reference statistics")
    p.add_argument(
        "--bootstrap",
        type=int,
        default=0,
        metavar="ROUNDS",
        help="add 90%% bootstrap intervals of FID and KID over this many resamples of the samples",
    )
    p.add_argument("--out", default=None, help="JSON file for all numbers and settings (default: beside the samples)")
    p.add_argument("--device", default=None)
    g = p.add_argument_group("sampling (with --model); defaults: the papers' FID protocol (see moh_dit.sampling.spec)")
    add_sampling_arguments(g, guidance=EVAL_GUIDANCE, protocol="paper", num_samples=50_000)
    g.add_argument("--sample-batch-size", type=positive_int, default=64, help="also the block size of the samples")
    g.add_argument("--sample-dir", default=None, help="default: <run>/eval-samples-step<N>-<settings>")
    p.set_defaults(_sampling_options=[(a.option_strings[0], a.dest, a.default) for a in g._group_actions])
    return p


def _check_sampling_options(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """With --samples nothing is sampled: a sampling option given there would be silently ignored."""
    if args.samples is None:
        return
    given = [flag for flag, dest, default in args._sampling_options if getattr(args, dest) != default]
    if given:
        parser.error(
            f"{', '.join(given)} choose how --model is sampled; --samples are scored as they are (their manifest "
            f"records how they were made)"
        )


def default_sample_dir(args, spec: SamplingSpec, source) -> Path:
    """One folder per model state and setting: a model that trains on gets a new folder, never stale samples."""
    root = source.run or (source.path if source.path.is_dir() else source.path.parent)
    step = f"step{source.step}-" if source.step is not None else ""
    tag = (
        f"{step}n{args.num_samples}-cfg{spec.guidance.scale:g}{spec.tag()}-ch{spec.guidance.channels or 'all'}-"
        f"{spec.sampler.scheduler}{spec.sampler.num_steps}-{args.dtype}-seed{args.seed}"
    )
    return root / f"eval-samples-{tag}"


def main(argv: list[str] | None = None, prog: str | None = None) -> dict:
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    _check_sampling_options(parser, args)
    setup_logging()
    # the paper protocol of the model's objective, without its recorded guidance
    if args.model is None:
        spec = spec_from_args(args, log=False, objective=None)
    else:
        from moh_dit.sampling.sources import recorded_objective

        spec_from_args(args, log=False, objective=None)  # a bad option fails before the model is looked at
        spec = spec_from_args(args, objective=recorded_objective(args.model))
    from moh_dit.evaluation.features import import_extractor_module, resolve_extractor
    from moh_dit.evaluation.reference import resolve_reference
    from moh_dit.evaluation.scoring import ScoringOptions, format_table, score_sample_set, write_metrics
    from moh_dit.files import ensure_writable_file
    from moh_dit.sampling.sample_sets import metrics_path_for, sample_npz_path

    # everything that can fail fast does so before sampling or feature extraction: the reference first (a missing one
    # is the user's to fix whatever the extractor), then the extractor's weights
    args.reference = str(resolve_reference(args.reference))  # a named one (fashion-mnist-test) is made once
    if not Path(args.reference).exists():
        raise FileNotFoundError(
            f"--reference {args.reference} does not exist: give an ADM reference .npz, a folder or .npz of real "
            f"images, or a named one (fashion-mnist-test, fashion-mnist-train)"
        )
    import_extractor_module(args.extractor_module)
    extractor = resolve_extractor(args.extractor, args.extractor_weights, args.device)
    options = ScoringOptions(
        args.batch_size, args.fp16_distances, not args.no_cache, args.reference_size, args.bootstrap
    )
    source = None
    if args.model:
        from moh_dit.evaluation.model_scores import sample_and_score
        from moh_dit.sampling.generation import GenerationSettings, open_for_sampling
        from moh_dit.sampling.sources import resolve_model_source

        source = resolve_model_source(args.model)
        sample_dir = Path(args.sample_dir) if args.sample_dir else default_sample_dir(args, spec, source)
        out = ensure_writable_file(args.out or metrics_path_for(sample_npz_path(sample_dir), args.extractor), "--out")
        settings = GenerationSettings.from_args(args, spec, batch_size=args.sample_batch_size)
        accelerator, pipe = open_for_sampling(args.model, settings, args.device, args.dtype)
        result = sample_and_score(
            pipe, sample_dir, settings, args.reference, extractor, options, accelerator, overwrite=args.overwrite
        )
        if not accelerator.is_main_process:
            return {}
    else:
        out = ensure_writable_file(args.out or metrics_path_for(args.samples, args.extractor), "--out")
        result = score_sample_set(args.samples, args.reference, extractor, options)
    # the numbers first: a failed write must not lose them
    print(format_table(result["metrics"]))
    try:
        write_metrics(out, result)
    except OSError as err:
        print(f"error: could not write {out} ({err.strerror or err}); the numbers are above", file=sys.stderr)
        raise SystemExit(2) from None
    print(f"wrote {out}")
    if args.model and source.kind == "pipeline":
        add_to_card(source.path, pipe, result)
    return result


def add_to_card(folder: Path, pipe, result: dict) -> None:
    """An evaluation of a pipeline folder's own weights (the same fingerprint: not another dtype) goes into
    its ``evaluations.json`` and model card."""
    from moh_dit.sampling.card import record_evaluation
    from moh_dit.sampling.pipeline import MoHDiTPipeline

    manifest = MoHDiTPipeline.manifest_of(folder)
    identity = (result["samples"]["manifest"] or {}).get("identity", {})
    if manifest and manifest.get("transformer_sha256") == identity.get("transformer_sha256"):
        record_evaluation(folder, pipe, manifest, result)
        print(f"added the metrics to the model card {folder / 'README.md'}")
