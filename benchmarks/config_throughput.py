"""Training throughput of whole training configs: the trainer's own steps (data, noising, forward, loss,
backward, clipping, AdamW, EMA) for each config file, timed in interleaved rounds in one process, reported
as the median images/s and the ratio to the first config measured in the same run, with model TFLOP/s and
MFU: the useful FLOPs of a training step (moh_dit.model.flops, the heads each token uses) per second, over a
float32 matmul peak measured on the same device in the same run (on a CUDA GPU, the data-sheet peak).

This is how the embedded default's recipes are compared for the "same 10 minutes" budget: a recipe that
trains at 0.8x the images/s gets 0.8x the steps.

    python benchmarks/config_throughput.py experiments/configs/fashion_mnist_moh_v4.yaml configs/fashion_mnist_moh.yaml
    python benchmarks/config_throughput.py configs/fashion_mnist_moh.yaml --set "depth8=model.overrides.depth=8;model.overrides.num_shared_heads=[2,2,2,2,2,3,3,6];model.overrides.top_k=[2,2,2,2,2,2,2,0]"

``--set NAME=KEY=VALUE[;KEY=VALUE]`` adds the first config with overrides as one more row, ``--set
NAME@CONFIG=KEY=VALUE[;...]`` another config with overrides (for example DiT's with MoH's block options). A preset of
per-layer head tables (the embedded default's) takes another depth with a list of that many values per key (the
error of a depth alone shows the preset's pattern stretched). ``--dry-run`` reads every config and its overrides,
says the rows it would time, and stops. Writes
``runs/benchmarks/config_throughput_<cpu|cuda>.{json,md}`` (``--out benchmarks/results`` publishes) (``--tag`` names other files).
"""

from __future__ import annotations

import argparse
import logging
import platform
import statistics
import sys
import tempfile
from pathlib import Path

if not __package__:  # run as a file (python benchmarks/x.py): the repository root holds the benchmarks package
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from benchmarks.timing import DEFAULT_OUT, OUT_HELP, interleaved_rounds, write_report
from moh_dit.model.flops import forward_flops
from moh_dit.training.config import load_config
from moh_dit.training.throughput import peak_tflops
from moh_dit.training.trainer import Trainer


class TimedRun:
    """One config's trainer, stepped outside its ``run()`` loop so that configs can take turns."""

    def __init__(self, name: str, config_path: str, overrides: list[str], folder: Path) -> None:
        config = load_config(config_path, [*overrides, f"train.output_dir={folder}", "log.trackers=[]"])
        if config.train.grad_accum_steps != 1:
            raise SystemExit(f"{name}: gradient accumulation is not timed by this benchmark")
        self.name, self.path, self.config, self.overrides = name, config_path, config, overrides
        self.trainer = Trainer(config)
        self.batches = self.trainer._batches()
        self.batch_size = config.train.global_batch_size
        model = self.trainer.unwrapped
        self.parameters = sum(p.numel() for p in model.parameters())
        self.heads = model.head_counts()
        # as the trainer counts it: the heads each token uses, the objective's passes, a routed span's kept tokens
        t = self.trainer
        routed = None if t.route_span is None else (t.route_span, model.num_tokens - t.routed_count)
        forwards = t.objective.training_forwards()
        self.flops_per_image = forward_flops(model, active_heads=True, routed=routed).training_step(forwards)

    def step(self) -> None:
        """One optimizer step, by the trainer's own methods as ``Trainer.run`` calls them (without its
        logging, stop checks and checkpoints)."""
        t = self.trainer
        _, x, y = next(self.batches)
        t.set_learning_rate()
        with t.accelerator.accumulate(t.model):
            loss, *_ = t._micro_step(x, y, 0, False)
            t.apply_gradients(loss, measure_norm=False)
        t.finish_step()


def table_row(row: dict) -> str:
    """One config's line of the markdown table."""
    model = row["preset"] + "".join(f", {k} {v}" for k, v in row["model_overrides"].items())
    cells = [row["name"], model, f"{row['parameters'] / 1e6:.2f}M", row["batch_size"]]
    cells += [f"{row['images_per_s']:.1f}", f"{row['ratio_to_baseline']:.3f}", f"{row['tflops']:.4f}"]
    cells += [f"{100 * row['mfu']:.1f}%" if row.get("mfu") is not None else "-"]
    return "| " + " | ".join(map(str, cells)) + " |"


def parse_set(text: str) -> tuple[str, str | None, list[str]]:
    """``NAME[@CONFIG]=KEY=VALUE[;KEY=VALUE]`` -> (NAME, CONFIG or None for the first config, [KEY=VALUE, ...]);
    ``;`` because values may hold commas."""
    head, _, rest = text.partition("=")
    name, _, config = head.partition("@")
    if not name or "=" not in rest:
        raise SystemExit(f"--set wants NAME[@CONFIG]=KEY=VALUE[;KEY=VALUE], got {text!r}")
    return name, config or None, [o for o in rest.split(";") if o]


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("configs", nargs="+", help="training config files; the first is the baseline")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        help="NAME[@CONFIG]=KEY=VALUE[;KEY=VALUE]: the first config (or CONFIG), changed",
    )
    p.add_argument("--steps", type=int, default=50, help="timed optimizer steps per config per round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--warmup", type=int, default=20, help="untimed steps per config first")
    p.add_argument("--out", default=DEFAULT_OUT, help=OUT_HELP)
    p.add_argument("--tag", default="", help="file name suffix, e.g. the recipes compared")
    p.add_argument("--dry-run", action="store_true", help="read every config and its overrides, list the rows, stop")
    args = p.parse_args(argv)
    torch.set_flush_denormal(True)  # near-zero gates make denormals that slow CPU matmuls many times over
    entries = [(Path(c).stem, c, []) for c in args.configs]
    entries += [(name, config or args.configs[0], overrides) for name, config, overrides in map(parse_set, args.set)]
    if args.dry_run:  # every config and override read (a wrong one fails here, in one line), nothing trained
        for name, path, overrides in entries:
            config = load_config(path, [*overrides, "train.output_dir=runs/unused", "log.trackers=[]"])
            print(
                f"{name}: {path} {' '.join(overrides)} ({config.model.preset}, batch {config.train.global_batch_size})"
            )
        return {"rows": [], "dry_run": True}
    package_logger = logging.getLogger("moh_dit")
    level = package_logger.level
    package_logger.setLevel(logging.WARNING)  # every trainer's start-up lines would bury the table
    try:
        with tempfile.TemporaryDirectory() as tmp:
            runs = [TimedRun(name, path, o, Path(tmp) / str(i)) for i, (name, path, o) in enumerate(entries)]
            device = runs[0].trainer.accelerator.device
            steps = {run.name: run.step for run in runs}
            seconds = interleaved_rounds(steps, device, args.warmup, args.rounds, args.steps)
            peak, peak_source = peak_tflops(device, runs[0].config.train.mixed_precision)
    finally:
        package_logger.setLevel(level)  # the caller's logging as it was
    rows = []
    for run in runs:
        images_per_s = run.batch_size * args.steps / statistics.median(seconds[run.name])
        rows.append(
            dict(
                name=run.name,
                config=str(run.path),
                overrides=run.overrides,
                preset=run.config.model.preset,
                model_overrides=run.config.model.overrides,
                parameters=run.parameters,
                active_heads=list(run.heads),
                batch_size=run.batch_size,
                optimizer_steps=run.trainer.step,  # warm-up and timed steps the trainer really took
                images_per_s=images_per_s,
                gflops_per_image=run.flops_per_image / 1e9,
                tflops=images_per_s * run.flops_per_image / 1e12,
                mfu=images_per_s * run.flops_per_image / 1e12 / peak if peak else None,
                round_seconds=seconds[run.name],
            )
        )
    for row in rows:
        row["ratio_to_baseline"] = row["images_per_s"] / rows[0]["images_per_s"]
    result = dict(
        device=torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        threads=torch.get_num_threads(),
        torch=torch.__version__,
        args=vars(args),
        baseline=rows[0]["name"],
        peak_tflops=peak,
        peak_source=peak_source,
        rows=rows,
    )
    stem = f"config_throughput_{device.type}" + (f"_{args.tag}" if args.tag else "")
    lines = [
        f"# Training throughput per config ({result['device']}, {result['threads']} threads, torch {torch.__version__})",
        "",
        f"The trainer's own steps; median of {args.rounds} interleaved rounds of {args.steps} steps after "
        f"{args.warmup} warm-up steps; ratio to {rows[0]['name']} measured in the same run. Model TFLOP/s: the "
        f"useful FLOPs of a training step (the heads each token uses; forward and backward) per second; MFU "
        + (f"against a peak of {peak:.3g} TFLOP/s ({peak_source})." if peak else f"not measured: {peak_source}."),
        "",
        "| config | model | parameters | batch | images/s | ratio | model TFLOP/s | MFU |",
        "|---|---|---|---|---|---|---|---|",
    ]
    lines += [table_row(r) for r in rows]
    write_report(Path(args.out), stem, result, lines)
    return result


if __name__ == "__main__":
    from moh_dit.cli.common import run_cli

    run_cli(main)  # bad input: one line, as the commands say it
