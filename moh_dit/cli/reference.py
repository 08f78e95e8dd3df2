r"""Build an ADM-style reference batch (``arr_0`` images, and with an extractor ``mu``/``sigma``/``mu_s``/
``sigma_s`` over all images) from a folder or class-per-folder tree of real images, center-cropped as ADM
prepares ImageNet.

    moh-dit reference /data/imagenet/train --image-size 256 --out refs/imagenet256.npz
    moh-dit reference /data/faces --image-size 64 --out refs/faces64.npz --extractor inception \
        --extractor-weights weights-inception-2015-12-05-6726825d.pth

Without --extractor only the images are stored; evaluation then computes the statistics from them.
"""

import argparse

from moh_dit.cli.common import positive_int
from moh_dit.logs import setup_logging


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("source", help="folder of real images (sub-folders, e.g. one per class, are read too)")
    p.add_argument("--image-size", type=positive_int, required=True, help="center-crop size, as the samples")
    p.add_argument("--out", required=True, help="output .npz")
    p.add_argument("--batch-images", type=positive_int, default=10_000, help="images kept in arr_0")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--extractor", default=None, help="also store statistics: 'inception' or a registered extractor")
    p.add_argument("--extractor-weights", default=None)
    p.add_argument("--extractor-module", default=None, help="python module to import first (may register extractors)")
    p.add_argument("--batch-size", type=positive_int, default=100)
    p.add_argument("--max-bad-fraction", type=float, default=0.01, help="share of unreadable images tolerated")
    p.add_argument("--device", default=None)
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out file")
    return p


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    args = build_parser(prog).parse_args(argv)
    setup_logging()
    from moh_dit.evaluation.reference import build_reference

    extractor = None
    if args.extractor:
        from moh_dit.evaluation.features import import_extractor_module, resolve_extractor

        import_extractor_module(args.extractor_module)
        extractor = resolve_extractor(args.extractor, args.extractor_weights, args.device)
    out = build_reference(
        args.source,
        args.image_size,
        args.out,
        extractor,
        args.batch_images,
        args.seed,
        args.batch_size,
        args.max_bad_fraction,
        args.overwrite,
    )
    print(f"wrote {out}")
