"""Model-level benchmark: one guided sampling step (conditional + unconditional halves in one batch) of
MoH-DiT presets in dense / sparse / auto execution against the DiT of the same width, plus peak memory.

Reports, per model, the median step time over interleaved rounds, the ratio to the DiT of the same width
measured in the same run, sampling throughput in images/s for DiT's 250-step protocol
(batch / (250 x step time)), and peak memory (CUDA: max allocated; CPU: peak RSS growth of a separate
process running the same step).

    python benchmarks/model.py                          # CPU: S and B at 256 px, batch 2
    python benchmarks/model.py --sizes S,B,XL --batch 32 --dtype bf16   # a GPU
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

if not __package__:  # run as a file (python benchmarks/x.py): the repository root holds the benchmarks package
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from benchmarks.timing import DEFAULT_OUT, OUT_HELP, write_report
from moh_dit import create_model

STEPS = 250


def build(name, args, device):
    torch.manual_seed(0)
    overrides = dict(sample_size=args.image_size // 8)
    if args.hidden_size:
        overrides.update(hidden_size=args.hidden_size, head_dim=args.hidden_size // 6)
    return create_model(name, **overrides).to(device).eval()


def step_fn(model, args, device, dtype):
    n = args.batch
    x = torch.randn(2 * n, model.in_channels, model.config.sample_size, model.config.sample_size, device=device)
    t = torch.full((2 * n,), 500, device=device)
    y = torch.cat([torch.randint(0, 1000, (n,)), torch.full((n,), 1000)]).to(device)
    fn = torch.compile(model) if args.compile else model

    def step():
        with torch.no_grad(), torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            fn(x, t, y)

    return step


def peak_memory_child(name, mode, args) -> float:
    """Run one step in a fresh process; return its peak RSS growth over the model's own footprint (MB)."""
    cmd = [
        sys.executable,
        __file__,
        "--child",
        name,
        mode,
        "--image-size",
        str(args.image_size),
        "--batch",
        str(args.batch),
        "--hidden-size",
        str(args.hidden_size),
        "--dtype",
        args.dtype,
        "--device",
        "cpu",
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ), timeout=1800)
    if out.returncode != 0:
        return float("nan")
    return json.loads(out.stdout.strip().splitlines()[-1])["peak_mb"]


def child(name, mode, args):
    """Peak RSS growth during one step, sampled by a watcher thread (ru_maxrss would also count imports)."""
    import threading

    import psutil

    device = torch.device("cpu")
    model = build(name, args, device)
    if hasattr(model, "set_attention_execution"):
        model.set_attention_execution(mode)
    step = step_fn(model, args, device, torch.bfloat16 if args.dtype == "bf16" else torch.float32)
    step()  # first call allocates caches; measure the second
    proc = psutil.Process()
    base = proc.memory_info().rss
    peak, done = [base], threading.Event()

    def watch():
        while not done.is_set():
            peak[0] = max(peak[0], proc.memory_info().rss)
            time.sleep(0.0005)

    watcher = threading.Thread(target=watch)
    watcher.start()
    step()
    done.set()
    watcher.join()
    print(json.dumps({"peak_mb": max(0, peak[0] - base) / 2**20}))


def peak_activation_mb(model, name: str, mode: str, step, args, device: torch.device) -> float:
    """The activation memory of one step (MB): measured by CUDA, or in a child process on the CPU."""
    if args.no_memory:
        return float("nan")
    if device.type != "cuda":
        return peak_memory_child(name, mode, args)
    if hasattr(model, "set_attention_execution"):
        model.set_attention_execution(mode)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    step()
    return (torch.cuda.max_memory_allocated(device) - base) / 2**20


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--sizes", default="S,B")
    p.add_argument("--image-size", type=int, default=256)
    p.add_argument("--batch", type=int, default=0, help="images per step (x2 with guidance); default 32 CUDA / 2 CPU")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--compile", action="store_true")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--hidden-size", type=int, default=0, help="shrink the width (smoke tests)")
    p.add_argument("--no-memory", action="store_true")
    p.add_argument("--out", default=DEFAULT_OUT, help=OUT_HELP)
    p.add_argument("--tag", default="")
    p.add_argument("--child", nargs=2, metavar=("MODEL", "MODE"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    torch.set_flush_denormal(True)
    args.batch = args.batch or (32 if args.device.startswith("cuda") else 2)
    if args.child:
        return child(*args.child, args)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32

    runs = []  # (label, preset, mode)
    for size in args.sizes.split(","):
        runs.append((f"DiT-{size}/2", f"DiT-{size}/2", "dense"))
        for act in ("90", "75"):
            for mode in ("dense", "sparse", "auto"):
                runs.append((f"MoH-DiT-{size}/2-{act} [{mode}]", f"MoH-DiT-{size}/2-{act}", mode))
    models = {}
    steps = {}
    for label, name, mode in runs:
        if name not in models:
            models[name] = build(name, args, device)
        steps[label] = (name, mode, step_fn(models[name], args, device, dtype))
    times = {label: [] for label in steps}

    def timed(label):
        name, mode, step = steps[label]
        if hasattr(models[name], "set_attention_execution"):
            models[name].set_attention_execution(mode)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    for label in steps:  # warm-up
        timed(label)
        timed(label)
    for _ in range(args.rounds):
        for label in steps:
            times[label].append(timed(label))
    peaks = {
        label: peak_activation_mb(models[name], name, mode, step, args, device)
        for label, (name, mode, step) in steps.items()
    }

    rows = []
    for label, (name, mode, _) in steps.items():
        size = name.removeprefix("MoH-").removeprefix("DiT-").split("/")[0]  # S, B, L or XL
        base = statistics.median(times[f"DiT-{size}/2"])
        med = statistics.median(times[label])
        rows.append(
            {
                "model": label,
                "preset": name,
                "mode": mode,
                "step_seconds": med,
                "ratio_to_dit": med / base,
                "images_per_s_250_steps": args.batch / (STEPS * med),
                "peak_activation_mb": peaks[label],
                "round_seconds": times[label],
            }
        )
    dev_name = torch.cuda.get_device_name(device) if device.type == "cuda" else (platform.processor() or "cpu")
    result = {"device": dev_name, "torch": torch.__version__, "args": vars(args), "rows": rows}
    stem = f"model_{device.type}{('_' + args.tag) if args.tag else ''}"
    lines = [
        f"# Model-level sampling benchmark ({dev_name}, torch {torch.__version__}, {args.dtype}"
        f"{', torch.compile' if args.compile else ''})",
        "",
        f"{args.image_size} px ({args.image_size // 8}x{args.image_size // 8} latents), {args.batch} images per guided step "
        f"(batch {2 * args.batch}), median of {args.rounds} interleaved rounds; ratio to the DiT of the same width "
        f"measured in the same run; images/s for 250 steps; peak memory is the growth during one step.",
        "",
        "| model | step (s) | ratio to DiT | images/s (250 steps) | peak memory (MB) |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['step_seconds']:.4f} | {r['ratio_to_dit']:.3f} | "
            f"{r['images_per_s_250_steps']:.4f} | {r['peak_activation_mb']:.0f} |"
        )
    write_report(Path(args.out), stem, result, lines)
    return result


if __name__ == "__main__":
    from moh_dit.cli.common import run_cli

    run_cli(main)  # bad input: one line, as the commands say it
