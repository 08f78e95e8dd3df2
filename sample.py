"""Sample images from a trained MoH-DiT / DiT.

A labelled grid (default), from a run folder, checkpoint, pipeline or transformer folder:
    python sample.py runs/fashion_mnist_moh --class-labels Sneaker Bag 0 --per-class 8 --out grid.png

N images for evaluation (PNGs by index + ADM .npz), on any number of processes, resumable:
    accelerate launch --num_processes 8 sample.py runs/imagenet256/moh-dit-xl-2-90 --num-samples 50000 \
        --sample-dir samples/xl90 --cfg-scale 1.5 --guidance-channels 3
"""
import argparse
import logging

from moh_dit.cli import run_cli
from moh_dit.generate import GenerationSettings, generate_samples, load_pipeline, sample_grid
from moh_dit.images import make_grid
from moh_dit.pipeline import SCHEDULERS


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="run folder, checkpoint folder, pipeline folder or transformer folder")
    p.add_argument("--class-labels", nargs="*", default=None, help="class ids or names (default: every class)")
    p.add_argument("--per-class", type=int, default=8, help="images per class in the grid")
    p.add_argument("--cfg-scale", type=float, default=4.0, help="classifier-free guidance scale (1 = off)")
    p.add_argument("--guidance-channels", type=int, default=None,
                   help="guide only the first N channels (3 reproduces the DiT/MoH-DiT papers' FIDs)")
    p.add_argument("--num-steps", type=int, default=250)
    p.add_argument("--scheduler", choices=SCHEDULERS, default=None, help="default: the one saved (DDPM)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32")
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--vae", default=None, help="replace/add the VAE (hub id or folder)")
    p.add_argument("--out", default="samples.png", help="grid PNG")
    p.add_argument("--save-images", default=None, help="also write each grid image into this folder")
    p.add_argument("--num-samples", type=int, default=0, help="> 0: generate this many images for evaluation")
    p.add_argument("--sample-dir", default="samples", help="folder for --num-samples PNGs (npz written beside it)")
    p.add_argument("--label-mode", choices=["uniform", "balanced"], default="uniform")
    return p


def main() -> None:
    args = build_parser().parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.num_samples > 0:
        from accelerate import Accelerator
        import torch

        accelerator = Accelerator(cpu=not torch.cuda.is_available())
        pipe = load_pipeline(args.model, accelerator.device, args.dtype, args.scheduler, args.vae)
        settings = GenerationSettings(
            num_samples=args.num_samples, seed=args.seed, batch_size=args.batch_size, guidance_scale=args.cfg_scale,
            num_inference_steps=args.num_steps, guidance_channels=args.guidance_channels, label_mode=args.label_mode,
        )  # fmt: skip
        npz = generate_samples(pipe, args.sample_dir, settings, accelerator)
        if npz is not None:
            print(f"wrote {args.num_samples} samples to {args.sample_dir} and {npz}")
        return

    pipe = load_pipeline(args.model, args.device, args.dtype, args.scheduler, args.vae)
    classes = args.class_labels
    if not classes and pipe.transformer.config.num_classes:
        classes = list(range(pipe.transformer.config.num_classes))
    images, names = sample_grid(pipe, classes or [], args.per_class, args.seed, args.cfg_scale, args.num_steps,
                                args.guidance_channels, args.batch_size)  # fmt: skip
    make_grid(images, ncols=args.per_class, row_labels=names).save(args.out)
    if args.save_images:
        from pathlib import Path

        from PIL import Image

        folder = Path(args.save_images)
        folder.mkdir(parents=True, exist_ok=True)
        for i, img in enumerate(images):
            name = f"{i:04d}_{names[i // args.per_class]}" if names else f"{i:04d}"
            Image.fromarray(img[:, :, 0] if img.shape[2] == 1 else img).save(folder / f"{name.replace('/', '-')}.png")
    print(f"wrote {args.out} ({len(images)} images)")


if __name__ == "__main__":
    run_cli(main)
