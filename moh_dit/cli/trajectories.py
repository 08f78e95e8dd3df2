r"""Record a teacher's own sampling trajectories for trajectory distillation (``distill.method: trajectory``): its
sampler run from noise with its guidance, every state kept on a grid that holds the student's sampling times, in
sharded safetensors files with a manifest of the teacher's identity and the cost. Resumable (run the same command
again), on any number of processes; a folder of another teacher or other settings is refused.

Give it the distillation's own config (and its overrides), so that one set of settings makes both sides: the set is
recorded as that run would record it, and the run trains on it:

    moh-dit trajectories --config configs/fashion_mnist_moh_distill_trajectory.yaml \
        distill.teacher=runs/fashion_mnist_moh_flow --out trajectories/flow
    python train.py --config configs/fashion_mnist_moh_distill_trajectory.yaml \
        distill.teacher=runs/fashion_mnist_moh_flow distill.trajectories=trajectories/flow
    torchrun --standalone --nproc_per_node 2 -m moh_dit trajectories --config CONFIG distill.teacher=RUN --out DIR

Without --config the options say everything (--teacher is then required); with it, an option given overrides the
config's value. A run refuses a set of another teacher, guidance, or without its grid's times (distill.grid_steps); a
set recorded at another seed than the run's train.seed trains it, and the run says so (the seeds then share the
teacher's samples: not independent seeds of a study).
"""

from __future__ import annotations

import argparse

from moh_dit.cli.common import finite_float, positive_int
from moh_dit.logs import setup_logging

# the options' own defaults, where neither they nor a config say otherwise
DEFAULTS = {"count": 2048, "grid_steps": [1, 2], "seed": 0, "shard_size": 256}


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=None, help="the distillation's config: its distill section and train.seed")
    p.add_argument("overrides", nargs="*", help="the config's overrides, section.key=value (with --config)")
    p.add_argument("--teacher", default=None, help="a run, checkpoint, pipeline or transformer folder, or a file")
    p.add_argument("--out", required=True, help="the set's folder (made, or finished where a stopped call left it)")
    p.add_argument("--count", type=positive_int, default=None, help="trajectories in the set (default 2048)")
    p.add_argument("--sampler", choices=("euler", "heun", "unipc"), default=None,
                   help="the teacher's sampler (default: the one it records, where it is one of these, else unipc)")  # fmt: skip
    p.add_argument("--steps", type=positive_int, default=None, help="its steps (default: its recorded protocol's)")
    p.add_argument("--grid-steps", type=positive_int, nargs="+", default=None,
                   help="the student's sampling step counts, whose times the grid holds (default 1 2)")  # fmt: skip
    p.add_argument("--guidance-scale", type=finite_float, default=None, help="default: the teacher's recorded one")
    p.add_argument("--guidance-times", type=finite_float, nargs=2, default=None, metavar=("FIRST", "LAST"),
                   help="the flow times guided (default: the teacher's recorded interval)")  # fmt: skip
    p.add_argument("--seed", type=int, default=None, help="the distillation's train.seed (default 0)")
    p.add_argument("--shard-size", type=positive_int, default=None, help="trajectories per file (default 256)")
    p.add_argument("--format", default=None, help="a checkpoint file's format, as convert's (dit, sit, repa, ...)")
    p.add_argument("--precision", choices=("no", "bf16", "fp16"), default=None,
                   help="the teacher's precision (default: the config's train.mixed_precision, else no)")  # fmt: skip
    p.add_argument("--device", default=None, help="default: CUDA when available (each process its own), else CPU")
    return p


def resolve(args: argparse.Namespace):
    """The distill section, seed and precision the set is recorded with: the config's (with its overrides) where one
    is given, each option given on top; a :class:`~moh_dit.errors.ConfigError` in one line otherwise."""
    import dataclasses

    from moh_dit.errors import ConfigError
    from moh_dit.training.config_sections import DistillSection

    if args.config is None and args.overrides:
        raise ConfigError(f"{args.overrides[0]}: a config override needs --config (the distillation's config)")
    if args.config is not None:
        from moh_dit.training.config import load_config

        config = load_config(args.config, list(args.overrides))
        section, seed, precision = config.distill, config.train.seed, config.train.mixed_precision
    else:
        if args.teacher is None:
            raise ConfigError("name the teacher: --teacher RUN, or --config CONFIG with its distill.teacher")
        section, seed, precision = DistillSection(**{"trajectory_count": DEFAULTS["count"]}), DEFAULTS["seed"], "no"
        section = dataclasses.replace(section, grid_steps=tuple(DEFAULTS["grid_steps"]))
    given = {
        "teacher": args.teacher,
        "teacher_format": args.format,
        "guidance_scale": args.guidance_scale,
        "guidance_times": list(args.guidance_times) if args.guidance_times else None,
        "grid_steps": tuple(args.grid_steps) if args.grid_steps else None,
        "trajectory_count": args.count,
        "trajectory_sampler": args.sampler,
        "trajectory_steps": args.steps,
        "trajectory_shard_size": args.shard_size,
    }
    section = dataclasses.replace(section, method="trajectory", **{k: v for k, v in given.items() if v is not None})
    if section.teacher is None:
        raise ConfigError(f"{args.config} names no teacher: distill.teacher=RUN (or --teacher RUN)")
    return section, seed if args.seed is None else args.seed, args.precision or precision


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    args = build_parser(prog).parse_args(argv)
    setup_logging()
    import torch
    from accelerate import PartialState

    from moh_dit.training.distill import Teacher, plan_of, record_set

    section, seed, precision = resolve(args)
    # the processes a launcher started see each other on CPU too (torchrun sets the world; as train.py does)
    state = PartialState(cpu=args.device == "cpu" or (args.device is None and not torch.cuda.is_available()))
    device = torch.device(args.device) if args.device not in (None, "cpu") else state.device
    teacher = Teacher.load(section, None, device)
    teacher.freeze(device)
    manifest = record_set(args.out, plan_of(section, teacher, seed), teacher, precision, device)
    if state.is_main_process:
        cost = manifest["cost"]
        print(
            f"{args.out}: {cost['images']} trajectories, {cost['evaluations']} network evaluations of the teacher, "
            f"{cost['seconds'] / 60:.1f} process-minutes ({state.num_processes} process(es))"
        )
