"""Train MoH-DiT or DiT.

Embedded default (Fashion-MNIST, pixel space, MoH-DiT-Ti/4-75, about 10 minutes on 2 CPU cores):
    python train.py --config configs/fashion_mnist_moh.yaml

Any config value can be overridden as section.key=value:
    python train.py --config configs/fashion_mnist_moh.yaml train.max_steps=200 train.output_dir=runs/try

ImageNet 256 on 8 GPUs (paper setting), or several nodes with an accelerate config:
    accelerate launch --multi_gpu --num_processes 8 train.py --config configs/imagenet256/moh-dit-xl-2-90.yaml \
        data.path=/data/imagenet/train
    accelerate launch --config_file configs/accelerate/multi_node.yaml train.py --config ...

Resume an interrupted run where it stopped:
    python train.py --config ... train.resume=latest

Continue training a converted model (e.g. a pretrained DiT turned into MoH-DiT by moh_dit.convert --to-moh):
    python train.py --config configs/imagenet256/dit-xl-2.yaml --init-from pipelines/moh-from-dit
"""
import argparse

from moh_dit.cli import run_cli
from moh_dit.config import load_config
from moh_dit.training import train


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="YAML config file (see configs/)")
    parser.add_argument("--init-from", default=None,
                        help="start from these weights (a pipeline or transformer folder, e.g. from moh_dit.convert)")
    parser.add_argument("overrides", nargs="*", help="section.key=value overrides, e.g. train.max_steps=100")
    args = parser.parse_args()
    overrides = list(args.overrides) + ([f"model.init_from={args.init_from}"] if args.init_from else [])
    train(load_config(args.config, overrides))


if __name__ == "__main__":
    run_cli(main)
