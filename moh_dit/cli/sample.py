r"""Sample images from a trained MoH-DiT / DiT.

A labelled grid (default), from a run folder (its newest weights), checkpoint, pipeline or transformer folder:
    python sample.py runs/fashion_mnist_moh --class-labels Sneaker Bag 0 --per-class 8 --out grid.png

N images for evaluation (PNGs by index + ADM .npz beside the folder), on any number of processes, resumable:
    accelerate launch --num_processes 8 sample.py runs/imagenet256/moh-dit-xl-2-90 --num-samples 50000 \
        --sample-dir samples/xl90 --cfg-scale 1.5 --guidance-channels 3
    torchrun --standalone --nproc_per_node 2 sample.py runs/fashion_mnist_moh --num-samples 2000 --sample-dir s/f
"""

import argparse
from pathlib import Path

from moh_dit.cli.common import add_sampling_arguments, positive_int
from moh_dit.logs import setup_logging

# where a command writes when told nowhere: under runs/ (which git ignores), so that a checkout stays clean
DEFAULT_GRID = "runs/samples/grid.png"
DEFAULT_SAMPLE_DIR = "runs/samples/images"


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="run folder, checkpoint folder, pipeline folder or transformer folder")
    p.add_argument("--class-labels", nargs="*", default=None, help="class ids or names (default: every class)")
    p.add_argument("--per-class", type=positive_int, default=None, help="images per class in the grid (default 8)")
    p.add_argument(
        "--batch-size",
        type=positive_int,
        default=64,
        help="images per forward pass; with --num-samples also the block size (part of the samples' record)",
    )
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument(
        "--vae",
        default=None,
        help="decode with this VAE (hub id or folder) instead of the model's own; it must share the model's latent space",
    )
    p.add_argument("--out", default=None, help=f"grid image (default {DEFAULT_GRID}: under runs/, which git ignores)")
    p.add_argument("--save-images", default=None, help="also write each grid image into this folder")
    p.add_argument(
        "--sample-dir",
        default=None,
        help=f"folder for --num-samples PNGs (default {DEFAULT_SAMPLE_DIR}; the .npz goes beside it)",
    )
    # the grid is for looking at: the fast protocol, and the guidance the model's run drew its previews with
    add_sampling_arguments(p, guidance=None, protocol="fast", num_samples=None)
    return p


# a grid shows chosen classes; --num-samples draws N images over every class (--label-mode)
_GRID_ONLY = {
    "class_labels": "--class-labels",
    "per_class": "--per-class",
    "out": "--out",
    "save_images": "--save-images",
}


def _check_mode(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Options of the other mode are errors, not silently ignored; then the mode's defaults are filled in."""
    if args.num_samples is not None:
        given = [flag for key, flag in _GRID_ONLY.items() if getattr(args, key) is not None]
        if given:
            parser.error(
                f"{', '.join(given)} draw a grid; --num-samples draws N images over every class (--label-mode): "
                f"use one or the other"
            )
        args.sample_dir = args.sample_dir or DEFAULT_SAMPLE_DIR
        return
    if args.sample_dir is not None:
        parser.error("--sample-dir holds --num-samples images: give --num-samples too, or --out for a grid")
    args.per_class = args.per_class or 8
    args.out = args.out or DEFAULT_GRID
    from PIL import Image

    if Path(args.out).suffix.lower() not in Image.registered_extensions():
        parser.error(f"--out {args.out}: give an image file name (.png, .jpg, ...)")


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    _check_mode(parser, args)
    setup_logging()
    from moh_dit.files import ensure_writable_dir, ensure_writable_file
    from moh_dit.sampling.loading import load_pipeline, recorded_sampling
    from moh_dit.sampling.options import spec_from_args
    from moh_dit.sampling.sources import recorded_objective

    spec_from_args(args, log=False, objective=None)  # a bad option fails before the model is looked at
    spec = spec_from_args(args, recorded_sampling(args.model), objective=recorded_objective(args.model))

    if args.num_samples is not None:
        from moh_dit.sampling.generation import GenerationSettings, sample_to_folder

        settings = GenerationSettings.from_args(args, spec, batch_size=args.batch_size)
        _, npz, _ = sample_to_folder(
            args.model,
            args.sample_dir,
            settings,
            args.device,
            args.dtype,
            args.vae,
            args.overwrite,
        )
        if npz is not None:
            print(f"wrote {args.num_samples} samples to {args.sample_dir} and {npz}")
        return

    # outputs are checked before the work, not after minutes of sampling
    ensure_writable_file(args.out, "--out")
    if args.save_images:
        ensure_writable_dir(args.save_images, "--save-images")
    pipe = load_pipeline(args.model, args.device, args.dtype, spec.sampler.scheduler, args.vae)
    pipe.check_sampling(spec)  # before any image: a guide --guide-model names that cannot guide, ...
    classes = args.class_labels
    if not classes and pipe.transformer.config.num_classes:
        classes = list(range(pipe.transformer.config.num_classes))
    if classes:
        pipe.get_label_ids(classes)  # unknown names fail now
    from moh_dit.images import make_grid
    from moh_dit.sampling.grids import sample_grid

    images, names = sample_grid(pipe, classes or [], args.per_class, args.seed, spec, args.batch_size)

    make_grid(images, ncols=args.per_class, row_labels=names).save(args.out)
    if args.save_images:
        from PIL import Image

        folder = Path(args.save_images)
        for i, img in enumerate(images):
            name = f"{i:04d}_{names[i // args.per_class]}" if names else f"{i:04d}"
            Image.fromarray(img[:, :, 0] if img.shape[2] == 1 else img).save(folder / f"{name.replace('/', '-')}.png")
    print(f"wrote {args.out} ({len(images)} images)")
