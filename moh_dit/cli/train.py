r"""Train MoH-DiT or DiT.

Embedded default (Fashion-MNIST, pixel space, MoH-DiT-Ti/4-75, about 10 minutes on 2 CPU cores):
    python train.py --config configs/fashion_mnist_moh.yaml

Any config value can be overridden as section.key=value:
    python train.py --config configs/fashion_mnist_moh.yaml train.max_steps=200 train.output_dir=runs/try

ImageNet 256 on 8 GPUs (paper setting), or several nodes with an accelerate config:
    accelerate launch --multi_gpu --num_processes 8 train.py --config configs/imagenet256/moh-dit-xl-2-90.yaml \
        data.path=/data/imagenet/train
    accelerate launch --config_file configs/accelerate/multi_node.yaml train.py --config ...

Two processes on a CPU machine (accelerate's --cpu flag starts only one):
    torchrun --standalone --nproc_per_node 2 train.py --config configs/fashion_mnist_moh.yaml

Resume an interrupted run where it stopped (Ctrl-C or SIGTERM save a checkpoint first):
    python train.py --config ... train.resume=latest

Continue training a converted model (e.g. a pretrained DiT turned into MoH-DiT by moh-dit convert --to-moh):
    python train.py --config configs/imagenet256/dit-xl-2.yaml --init-from pipelines/moh-from-dit

Fine-tune on data with another number of classes, or train an unconditional model:
    python train.py --config ... data.path=/data/birds --init-from runs/in256 --init-classes resize
    python train.py --config ... model.overrides.num_classes=0
"""

import argparse
import signal
import sys


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", help="YAML config file (see configs/)")
    parser.add_argument(
        "--init-from",
        default=None,
        help="start from these weights (a run, checkpoint, pipeline or transformer folder)",
    )
    parser.add_argument(
        "--init-classes",
        choices=["strict", "resize", "reinit"],
        default=None,
        help="with --init-from and data of another class count: resize (keep the shared label rows) or reinit "
        "(a new label table); every other weight is kept (model.init_classes)",
    )
    parser.add_argument(
        "--print-config",
        action="store_true",
        help="print the resolved config (file, base files and overrides, checked) as YAML and exit",
    )
    parser.add_argument("overrides", nargs="*", help="section.key=value overrides, e.g. train.max_steps=100")
    return parser


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    # intermixed: flags and key=value overrides in any order (plain parsing stops collecting the overrides at the
    # first flag after them and refuses the rest as unrecognized)
    args = build_parser(prog).parse_intermixed_args(argv)

    from moh_dit.logs import launch_rank
    from moh_dit.training.config import config_to_dict, load_config, validate

    config = load_config(args.config, args.overrides)
    if args.init_from:
        config.model.init_from = args.init_from
    if args.init_classes:
        config.model.init_classes = args.init_classes
    if args.print_config:
        import yaml

        validate(config)
        print(yaml.safe_dump(config_to_dict(config), sort_keys=False), end="")
        return
    from moh_dit.training.trainer import train

    summary = train(config)
    if summary["stop_reason"] in ("SIGINT", "SIGTERM", "signal"):
        # stopped cleanly with a checkpoint; the conventional code of a run ended by that signal
        code = signal.Signals[summary["stop_reason"]].value if summary["stop_reason"] != "signal" else signal.SIGTERM
        if launch_rank()[0] == 0:
            print(
                f"stopped at step {summary['step']} by {summary['stop_reason']}; continue with train.resume=latest",
                file=sys.stderr,
            )
        raise SystemExit(128 + int(code))
