r"""Record a teacher's own sampling trajectories for trajectory distillation (``distill.method: trajectory``): its
sampler run from noise with its guidance, every state kept on a grid that holds the student's sampling times, in
sharded safetensors files with a manifest of the teacher's identity and the cost. Resumable (run the same command
again), on any number of processes; a folder of another teacher or other settings is refused.

    moh-dit trajectories --teacher runs/fashion_mnist_moh_flow --out trajectories/flow --count 2048
    torchrun --standalone --nproc_per_node 2 -m moh_dit trajectories --teacher RUN --out DIR --count 8192
    python train.py --config configs/fashion_mnist_moh_distill_trajectory.yaml distill.trajectories=trajectories/flow

The set's settings are the distillation's (docs/objective.md#trajectory-distillation): train with the same guidance,
grid steps and seed, or the run refuses the set.
"""

from __future__ import annotations

import argparse

from moh_dit.cli.common import finite_float, positive_int
from moh_dit.logs import setup_logging


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--teacher", required=True, help="a run, checkpoint, pipeline or transformer folder, or a file")
    p.add_argument("--out", required=True, help="the set's folder (made, or finished where a stopped call left it)")
    p.add_argument("--count", type=positive_int, default=2048, help="trajectories in the set (default 2048)")
    p.add_argument("--sampler", choices=("euler", "heun", "unipc"), default=None,
                   help="the teacher's sampler (default: the one it records, where it is one of these, else unipc)")  # fmt: skip
    p.add_argument("--steps", type=positive_int, default=None, help="its steps (default: its recorded protocol's)")
    p.add_argument("--grid-steps", type=positive_int, nargs="+", default=[1, 2],
                   help="the student's sampling step counts, whose times the grid holds (default 1 2)")  # fmt: skip
    p.add_argument("--guidance-scale", type=finite_float, default=None, help="default: the teacher's recorded one")
    p.add_argument("--guidance-times", type=finite_float, nargs=2, default=None, metavar=("FIRST", "LAST"),
                   help="the flow times guided (default: the teacher's recorded interval)")  # fmt: skip
    p.add_argument("--seed", type=int, default=0, help="the distillation's train.seed (default 0)")
    p.add_argument("--shard-size", type=positive_int, default=256, help="trajectories per file (default 256)")
    p.add_argument("--format", default="dit", help="a checkpoint file's format, as convert's (dit, sit, repa, ...)")
    p.add_argument("--precision", choices=("no", "bf16", "fp16"), default="no", help="the teacher's precision")
    p.add_argument("--device", default=None, help="default: CUDA when available (each process its own), else CPU")
    return p


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    args = build_parser(prog).parse_args(argv)
    setup_logging()
    import torch
    from accelerate import PartialState

    from moh_dit.training.config_sections import DistillSection
    from moh_dit.training.teacher import Teacher
    from moh_dit.training.trajectory_sources import plan_of, record_set

    state = PartialState(cpu=args.device == "cpu")
    device = torch.device(args.device) if args.device not in (None, "cpu") else state.device
    section = DistillSection(
        teacher=args.teacher,
        teacher_format=args.format,
        guidance_scale=args.guidance_scale,
        guidance_times=list(args.guidance_times) if args.guidance_times else None,
        method="trajectory",
        grid_steps=tuple(args.grid_steps),
        trajectory_count=args.count,
        trajectory_sampler=args.sampler,
        trajectory_steps=args.steps,
        trajectory_shard_size=args.shard_size,
    )
    teacher = Teacher.load(section, None, device)
    teacher.freeze(device)
    manifest = record_set(args.out, plan_of(section, teacher, args.seed), teacher, args.precision, device)
    if state.is_main_process:
        cost = manifest["cost"]
        print(
            f"{args.out}: {cost['images']} trajectories, {cost['evaluations']} network evaluations of the teacher, "
            f"{cost['seconds'] / 60:.1f} process-minutes"
        )
