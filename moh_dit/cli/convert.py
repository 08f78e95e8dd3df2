r"""Convert checkpoints: facebookresearch/DiT and SkyworkAI/MoH (MoH-DiT) files, diffusers DiT folders and
moh-dit folders, both ways; and turn a pretrained multi-head DiT into a MoH-DiT to continue training.

    moh-dit convert DiT-XL-2-256x256.pt pipelines/dit-xl-2-256 --vae stabilityai/sd-vae-ft-ema
    moh-dit convert moh_dit_xl_90.pt pipelines/moh-dit-xl-90 --vae /models/sd-vae-ft-ema
    moh-dit convert /models/DiT-XL-2-256 pipelines/dit-diffusers       # a diffusers pipeline folder
    moh-dit convert runs/x/pipeline out.pt --to reference              # back to the reference layout
    moh-dit convert pipelines/dit-xl-2-256 pipelines/moh-from-dit --to-moh --shared 8 --moh-top-k 4
    moh-dit convert SiT-XL-2-256.pt pipelines/sit-xl-2 --format sit --vae stabilityai/sd-vae-ft-ema  # flow
    moh-dit convert repa-last.pt pipelines/repa-xl-2 --format repa --vae stabilityai/sd-vae-ft-mse
    moh-dit convert runs/sit-finetune back.pt --to sit                  # back to SiT's layout
    moh-dit convert vavae-imagenet256-f16d32-dinov2.pt vae/vavae --format ldm-vae --latent-stats latents_stats.pt
    moh-dit convert lightningdit-xl-imagenet256-800ep.pt pipelines/lightningdit-xl --format lightningdit --vae vae/vavae
    moh-dit convert runs/lightningdit-finetune back.pt --to lightningdit   # back to LightningDiT's layout

docs/interop.md describes the formats.
"""

import argparse
import json
from pathlib import Path

from moh_dit.logs import setup_logging


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("src", help="reference .pt/.safetensors, diffusers DiT folder, or a moh-dit folder")
    p.add_argument(
        "out", help="output: a pipeline folder (default), a .pt (--to reference) or a folder (--to diffusers)"
    )
    p.add_argument(
        "--to",
        choices=["pipeline", "reference", "reference-train", "diffusers", "sit", "repa", "lightningdit"],
        default="pipeline",
    )
    p.add_argument(
        "--format",
        choices=["dit", "sit", "repa", "lightningdit", "ldm-vae"],
        default="dit",
        help="what a checkpoint file is: dit (DiT / MoH-DiT reference, DDPM), sit, repa or lightningdit (flow "
        "matching; the keys are DiT's, so this cannot be guessed), ldm-vae (an LDM-layout autoencoder such as "
        "LightningDiT's VA-VAE, written as a diffusers AutoencoderKL folder)",
    )
    p.add_argument(
        "--path",
        choices=["linear", "gvp"],
        default="linear",
        help="with --format sit/repa: the path it was trained on",
    )
    p.add_argument(
        "--sample-size",
        type=int,
        default=None,
        help="with a flow format: the input side you expect (e.g. 16 for VA-VAE latents of 256 px); a checkpoint "
        "trained at another resolution is refused",
    )
    p.add_argument(
        "--latent-stats",
        default=None,
        help="with --format ldm-vae: LightningDiT's latents_stats.pt (per-channel mean and std of the latents)",
    )
    p.add_argument(
        "--repa-depth",
        type=int,
        default=None,
        help="with --format repa: keep REPA's projectors on this block (its --encoder-depth) to continue REPA training",
    )
    p.add_argument("--vae", default=None, help="VAE for the pipeline: hub id or local folder")
    p.add_argument("--preset", default=None, help="require this preset's shapes instead of inferring them")
    p.add_argument("--num-heads", type=int, default=None, help="heads of a plain DiT checkpoint (default: DiT's)")
    p.add_argument("--top-k", type=int, nargs="+", default=None, help="MoH top-k per layer if no preset matches")
    p.add_argument("--num-classes", type=int, default=None)
    p.add_argument(
        "--id2label",
        default=None,
        help="JSON file mapping class ids to names (1000-class checkpoints get ImageNet's names)",
    )
    p.add_argument("--model-weights", action="store_true", help="use 'model' instead of 'ema' from train.py dicts")
    p.add_argument(
        "--to-moh", action="store_true", help="convert a multi-head DiT into MoH-DiT for continued training"
    )
    p.add_argument(
        "--shared", type=int, nargs="+", default=None, help="with --to-moh: shared heads (one or per layer)"
    )
    p.add_argument(
        "--moh-top-k", type=int, nargs="+", default=None, help="with --to-moh: routed top-k (one or per layer)"
    )
    p.add_argument(
        "--push-to-hub",
        metavar="REPO_ID",
        default=None,
        help="also upload the pipeline folder (with its model card) to this Hugging Face Hub repository",
    )
    p.add_argument("--private", action="store_true", help="with --push-to-hub: create the repository as private")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output")
    return p


def _existing_output(out: Path) -> str | None:
    """What is at ``out`` already, in words, or ``None`` when nothing (or an empty folder) is."""
    if not out.exists() or (out.is_dir() and not any(out.iterdir())):
        return None
    if out.is_dir():
        from moh_dit.errors import ArtifactError
        from moh_dit.sampling.pipeline import MoHDiTPipeline

        try:
            made = MoHDiTPipeline.manifest_of(out)
        except ArtifactError:  # a damaged manifest is still something that would be lost
            made = None
        source = (made or {}).get("source") or {}
        origin = source.get("converted_from") or source.get("run")
        return f"a moh-dit pipeline of {origin}" if origin else "a folder that is not empty"
    return "a file"


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    p = build_parser(prog)
    args = p.parse_args(argv)
    setup_logging(with_time=False)
    from moh_dit.files import atomic_folder, atomic_path
    from moh_dit.interop.diffusers_dit import to_diffusers
    from moh_dit.interop.load import load_any
    from moh_dit.interop.official import check_ddpm_export, ours_to_reference

    hints = dict(
        preset=args.preset,
        num_heads=args.num_heads,
        top_k=args.top_k,
        num_classes=args.num_classes,
        prefer_ema=not args.model_weights,
    )
    out = _check_request(p, args)
    if args.format == "ldm-vae":
        _convert_ldm_vae(args, out)
        return
    if args.sample_size is not None:
        hints["sample_size"] = args.sample_size
    model, vae, id2label, report = load_any(args.src, args.format, args.path, args.repa_depth, **hints)
    if args.id2label:
        id2label = {int(k): v for k, v in json.loads(Path(args.id2label).read_text()).items()}
    elif not id2label and model.config.num_classes == 1000:
        from moh_dit.interop.official import imagenet_class_names

        id2label = imagenet_class_names()  # DiT / MoH-DiT checkpoints are ImageNet-1k models and carry no names
        report["class_names"] = "ImageNet-1k (torchvision's metadata)"
        print("attached the ImageNet-1k class names (e.g. 207 = 'golden retriever'); --id2label FILE to use others")
    if args.to_moh:
        model = _to_moh(p, args, model, report)
    if args.to == "pipeline":
        from moh_dit.sampling.pipeline import MoHDiTPipeline
        from moh_dit.vae import load_vae, vae_record

        # reference DiT/MoH-DiT checkpoints are latent-space models; a moh-dit source knows what it is
        latent = True if Path(args.src).is_file() else None
        pipe = MoHDiTPipeline.build(model, vae, id2label, latent_space=True if args.vae or vae else latent)
        if args.vae:
            pipe.replace_vae(load_vae(args.vae), args.vae)  # checked against the model and the source's VAE
            vae = pipe.vae
        source = {
            "converted_from": str(Path(args.src).resolve()),
            "format": report.get("format", report.get("weights")),
            "to_moh": bool(args.to_moh),
            "step": (report.get("provenance") or {}).get("step"),
            "vae": vae_record(vae, args.vae) if vae is not None else None,
        }
        from moh_dit.interop.sit import own_sampling

        pipe.save(out, source, sampling=own_sampling(args.format))  # sampled as its own code samples it
        (out / "conversion_report.json").write_text(json.dumps(report, indent=2, default=str))
        if args.push_to_hub:
            from moh_dit.sampling.card import push_folder

            push_folder(out, args.push_to_hub, private=args.private)
            print(f"uploaded {out} to https://huggingface.co/{args.push_to_hub}")
    elif args.to in ("reference", "reference-train"):
        import torch

        check_ddpm_export(model, "DiT's and MoH-DiT's code")
        sd = ours_to_reference(model)
        with atomic_path(out) as tmp:
            torch.save({"model": sd, "ema": sd} if args.to == "reference-train" else sd, tmp)
    elif args.to in ("sit", "repa", "lightningdit"):
        import torch

        from moh_dit.interop.sit import to_flow_state_dict

        with atomic_path(out) as tmp:  # an EMA state dict, as the projects' samplers load
            torch.save(to_flow_state_dict(model, args.to), tmp)
    else:
        check_ddpm_export(model, "diffusers' DiTPipeline")
        with atomic_folder(out, "the diffusers model") as tmp:
            to_diffusers(model).save_pretrained(tmp)
    print(f"wrote {out}")


def _check_request(p: argparse.ArgumentParser, args: argparse.Namespace) -> Path:
    """The options that contradict each other, and the output, checked before the (possibly long) load."""
    from moh_dit.errors import ConversionError
    from moh_dit.files import ensure_writable_dir, ensure_writable_file

    if args.format != "dit" and not Path(args.src).is_file():
        p.error(f"--format {args.format} reads a checkpoint file; {args.src} is not one")
    if args.latent_stats and args.format != "ldm-vae":
        p.error("--latent-stats goes with --format ldm-vae (the autoencoder's latent statistics)")
    if args.format == "ldm-vae" and (args.to != "pipeline" or args.vae):
        p.error("--format ldm-vae writes a diffusers autoencoder folder: give no --to or --vae")
    if args.sample_size is not None and args.format not in ("sit", "repa", "lightningdit"):
        p.error("--sample-size checks a flow checkpoint's resolution: use it with --format sit/repa/lightningdit")
    if args.repa_depth is not None and args.format != "repa":
        p.error("--repa-depth keeps the projectors of a REPA checkpoint: use it with --format repa")
    if args.format != "dit" and (args.preset or args.top_k):
        p.error("--preset and --top-k read DiT / MoH-DiT reference checkpoints; a SiT or REPA one is a DiT")
    out = Path(args.out)
    # the target is checked before the (possibly long) load and conversion
    if args.to == "pipeline" or args.to == "diffusers":
        ensure_writable_dir(out.parent if out.parent != Path("") else Path("."), "the folder of the output")
        if out.exists() and not out.is_dir():
            raise ConversionError(f"{out} exists and is not a folder")
    else:  # a file: reference, reference-train, sit, repa
        ensure_writable_file(out, "the output file")
    existing = _existing_output(out)
    if existing and not args.overwrite:
        raise ConversionError(f"{out} holds {existing}; pass --overwrite to replace it, or choose another output")
    if args.push_to_hub and args.to != "pipeline":
        p.error("--push-to-hub uploads pipeline folders: use it with --to pipeline")
    return out


def _convert_ldm_vae(args: argparse.Namespace, out: Path) -> None:
    """``--format ldm-vae``: the autoencoder as a diffusers ``AutoencoderKL`` folder, its latent statistics in its
    config (then ``--vae OUT`` for a pipeline, ``data.vae=OUT`` for latents)."""
    import torch

    from moh_dit.errors import ConversionError
    from moh_dit.files import atomic_folder, read_torch_file
    from moh_dit.interop.ldm_vae import convert_ldm_autoencoder, read_latent_stats
    from moh_dit.interop.official import read_checkpoint

    src = Path(args.src)
    if src.suffix == ".safetensors":
        sd, _ = read_checkpoint(src)
    else:  # LDM's training checkpoints nest the weights in "state_dict" (VA-VAE's release does)
        sd = read_torch_file(src, ConversionError, "plain tensor checkpoint")
        sd = sd.get("state_dict", sd) if isinstance(sd, dict) else sd
        if not isinstance(sd, dict) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
            raise ConversionError(f"{src} holds no state dict of tensors (nor a 'state_dict' of them)")
    mean, std = read_latent_stats(args.latent_stats) if args.latent_stats else (None, None)
    vae = convert_ldm_autoencoder(sd, latents_mean=mean, latents_std=std)
    with atomic_folder(out, "the autoencoder") as tmp:
        vae.save_pretrained(tmp, safe_serialization=True)
    stats = "with its per-channel latent statistics" if mean is not None else "without latent statistics"
    print(f"wrote {out}: a diffusers AutoencoderKL, {vae.config.latent_channels} channels, {stats}")


def _to_moh(p: argparse.ArgumentParser, args: argparse.Namespace, model, report: dict):
    """The DiT turned into MoH-DiT (--to-moh), with the deviation of each layer printed and reported."""
    from moh_dit.interop.dit_to_moh import dit_to_moh

    if not args.shared or not args.moh_top_k:
        p.error("--to-moh needs --shared and --moh-top-k")
    one = lambda v: v[0] if len(v) == 1 else v  # noqa: E731
    model, moh_report = dit_to_moh(model, one(args.shared), one(args.moh_top_k))
    report["to_moh"] = moh_report
    for layer in moh_report["layers"]:
        print(
            f"layer {layer['layer']:2d}: shared heads {layer['shared_heads']}, top-{layer['top_k']} of "
            f"{layer['routed']} routed, relative output deviation {layer['relative_deviation']:.4f}"
        )
    print(
        f"whole model: relative output deviation {moh_report['model_relative_deviation']:.4f}, "
        f"{moh_report['active_heads']} heads active"
    )
    return model
