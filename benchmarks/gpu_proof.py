"""The GPU proof's measurements, in one process and one run (scripts/gpu_proof.sh runs the tests first, then this).

On a GPU, at 256 px latents (4 x 32 x 32), bf16 autocast, AdamW:

    training    images/s and MFU of a training step at batch 32: diffusers' own ``DiTTransformer2DModel`` at
                DiT-XL/2's size trained by a plain loop (the baseline: the library's DiT), moh-dit's DiT-XL/2
                eager and compiled, MoH-DiT-XL/2-90 dense, auto, and auto compiled; every arm the same loop (noise-
                prediction MSE, plus MoH's load-balance loss where the model returns one)
    sampling    images/s of MoH-DiT-XL/2-90 (a flow model) drawing Euler 25 with CFG 4 at batch 64, auto against
                dense, through the pipeline (latents out: the VAE is not the question)
    memory      peak GPU memory of a MoH-DiT-XL/2-90 training step at batch 32 and 64, with and without gradient
                checkpointing, against batch 32 without

Each figure is a ratio against its baseline measured in the same run; medians of several rounds. ``--dry-run`` runs
every step at toy size on the CPU (a model of width 64, depth 2 and 16 heads of 4, batch 2, one round, compilation by torch's eager
backend), in well under two minutes. A plan with each step's seconds on an H200 is printed first. ``--budget``
starts no measurement past a number of seconds (the compiled arms run last).

    python benchmarks/gpu_proof.py --out runs/gpu-proof           # on the GPU machine (scripts/gpu_proof.sh)
    python benchmarks/gpu_proof.py --out /tmp/proof --dry-run     # anywhere: every step at toy size

Writes ``gpu_proof_<device>.{json,md}`` under ``--out``.
"""

from __future__ import annotations

import argparse
import gc
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

if not __package__:  # run as a file (python benchmarks/x.py): the repository root holds the benchmarks package
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from benchmarks.timing import sync, write_report


@dataclass(frozen=True)
class Scale:
    """The sizes one run measures at: the real ones, or the dry run's toy ones."""

    overrides: dict  # model overrides (the dry run's width and depth)
    latent: int  # latent side (256 px / 8)
    batch: int  # training batch
    sample_batch: int  # sampling batch
    memory_batches: tuple[int, int]
    warmup: int
    rounds: int
    per_round: int
    sample_steps: int
    compile_backend: str  # inductor on a GPU; eager in the dry run (the code path, without a compiler)


REAL = Scale({}, 32, 32, 64, (32, 64), warmup=3, rounds=5, per_round=5, sample_steps=25, compile_backend="inductor")
TOY = Scale(
    dict(hidden_size=64, depth=2, head_dim=4), 8, 2, 2, (2, 4), warmup=1, rounds=1, per_round=1, sample_steps=2,
    compile_backend="eager",
)  # fmt: skip
MOH, DIT = "MoH-DiT-XL/2-90", "DiT-XL/2"
# (row, preset, execution, compiled, diffusers' class): the training arms, the baseline first
TRAIN_ARMS = [
    ("diffusers DiT-XL/2, plain loop", DIT, None, False, True),
    ("moh-dit DiT-XL/2", DIT, None, False, False),
    ("moh-dit DiT-XL/2, compiled", DIT, None, True, False),
    ("MoH-DiT-XL/2-90, dense", MOH, "dense", False, False),
    ("MoH-DiT-XL/2-90, auto", MOH, "auto", False, False),
    ("MoH-DiT-XL/2-90, auto, compiled", MOH, "auto", True, False),
]
# --sections: the proof's own four by default; profile and calibrate on demand (benchmarks/gpu_diagnosis.py)
SECTIONS = ("training", "sampling", "memory", "compiled", "profile", "calibrate")
DEFAULT_SECTIONS = SECTIONS[:4]
# step: (the section that runs it, None for every run; seconds on one H200 as measured there on 2026-12-04, each
# including its build: benchmarks/results/gpu/), the default sections' whole under 8 minutes
PLAN = {
    "install the carried wheels": (None, 12),
    "CUDA-marked tests and a short selection of the suite": (None, 56),
    **{f"train: {row}": ("compiled", 100) if compiled else ("training", 20) for row, _, _, compiled, _ in TRAIN_ARMS},
    "sample: MoH-DiT-XL/2-90 Euler 25 + CFG, auto and dense": ("sampling", 40),
    "memory: batch 32 and 64, with and without gradient checkpointing": ("memory", 50),
    "profile: diffusers' DiT-XL/2 and moh-dit's, one training step each": ("profile", 75),
    "calibrate: benchmarks/attention.py --calibrate, bf16": ("calibrate", 155),
}


def plan_steps(sections: tuple[str, ...]) -> dict[str, int]:
    """The plan's steps that the chosen sections run (install and tests always), with their seconds."""
    return {step: seconds for step, (section, seconds) in PLAN.items() if section in (None, *sections)}


def print_plan(dry_run: bool, sections: tuple[str, ...] = DEFAULT_SECTIONS) -> None:
    steps = plan_steps(sections)
    total = sum(steps.values())
    print(f"GPU proof plan ({'dry run at toy size on this machine' if dry_run else 'on this GPU'}):", flush=True)
    for step, seconds in steps.items():
        print(f"  {step:<68} ~{seconds:>4d} s on an H200", flush=True)
    print(f"  {'total':<68} ~{total:>4d} s ({total / 60:.1f} min)", flush=True)


def build(preset: str, scale: Scale, device: torch.device, execution: str | None = None, **extra):
    """A preset at the scale's size with random weights, its zero-initialised layers drawn too (so that every block
    computes and MoH's routers see varied tokens)."""
    from moh_dit import create_model
    from moh_dit.model.presets import PER_LAYER_KEYS, preset_config

    overrides = dict(scale.overrides)
    if "depth" in overrides:  # a shallower toy keeps the head tables of the preset's last layers (MoH's routed ones)
        full = preset_config(preset)
        for key in PER_LAYER_KEYS:
            if isinstance(full.get(key), (list, tuple)):
                overrides[key] = list(full[key])[-overrides["depth"] :]
    torch.manual_seed(0)
    model = create_model(preset, sample_size=scale.latent, **overrides, **extra)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "adaLN" in name or "final_layer.linear" in name:
                p.normal_(0, 0.02)
    if execution is not None:
        model.set_attention_execution(execution)
    return model.to(device)


def arm_network(model: torch.nn.Module, diffusers_model: bool, device: torch.device) -> torch.nn.Module:
    """``model``, or on diffusers' arm its weights in diffusers' own DiT (converted on the CPU)."""
    if not diffusers_model:
        return model
    from moh_dit.interop.diffusers_dit import to_diffusers

    return to_diffusers(model.cpu()).to(device)


def training_step(model, scale: Scale, device: torch.device, dtype: torch.dtype, batch: int, diffusers_model: bool):
    """One step of the plain loop every arm shares: noised latents, noise-prediction MSE on the first 4 channels
    (plus MoH's load-balance loss), backward, AdamW."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(batch, 4, scale.latent, scale.latent, generator=gen).to(device)
    noise = torch.randn(x.shape, generator=gen).to(device)
    t = torch.randint(0, 1000, (batch,), generator=gen).to(device)
    y = torch.randint(0, 1000, (batch,), generator=gen).to(device)
    noised = 0.7 * x + 0.7 * noise

    def step() -> None:
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            if diffusers_model:
                out, aux = model(noised, timestep=t, class_labels=y).sample, 0.0
            else:
                result = model(noised, t, y)
                out, aux = result.sample, result.aux_loss
            loss = torch.nn.functional.mse_loss(out[:, :4].float(), noise) + 0.01 * aux
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def median_rate(step: Callable[[], None], images: int, scale: Scale, device: torch.device) -> float:
    """Images/s: the median of the scale's rounds after its warm-up steps."""
    for _ in range(scale.warmup):
        step()
    rates = []
    for _ in range(scale.rounds):
        sync(device)
        start = time.perf_counter()
        for _ in range(scale.per_round):
            step()
        sync(device)
        rates.append(images * scale.per_round / (time.perf_counter() - start))
    return statistics.median(rates)


def release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def measure_training(
    scale: Scale, device: torch.device, dtype: torch.dtype, peak: float | None, arms: list[tuple], deadline: float
) -> list[dict]:
    """The given training arms' rows; an arm that would start after ``deadline`` (perf_counter seconds) is recorded
    as skipped rather than run, so that a lent machine's time limit cuts the proof short without losing it."""
    from moh_dit.model.flops import forward_flops

    rows = []
    for row, preset, execution, compiled, diffusers_model in arms:
        if time.perf_counter() > deadline:
            rows.append(skipped(row, "images_per_s"))
            continue
        started = time.perf_counter()
        model = build(preset, scale, device, execution)
        flops = forward_flops(model, active_heads=True).training_step(3)
        model = arm_network(model, diffusers_model, device).train()
        net = torch.compile(model, backend=scale.compile_backend) if compiled else model
        rate = median_rate(
            training_step(net, scale, device, dtype, scale.batch, diffusers_model), scale.batch, scale, device
        )
        tflops = rate * flops / 1e12
        rows.append(
            dict(arm=row, images_per_s=rate, model_tflops=tflops, mfu=tflops / peak if peak else None,
                 seconds=time.perf_counter() - started)
        )  # fmt: skip
        print(f"train: {row}: {rate:.1f} images/s ({rows[-1]['seconds']:.0f} s)", flush=True)
        del model, net
        release(device)
    return rows


def skipped(arm: str, value: str) -> dict:
    print(f"skipped (past the time budget): {arm}", flush=True)
    return {"arm": arm, value: None, "skipped": "past the time budget"}


def against_first(rows: list[dict], value: str) -> list[dict]:
    """Each row's ``vs_baseline``: its value over the first row's (None where either was not measured)."""
    base = rows[0][value] if rows else None
    for r in rows:
        r["vs_baseline"] = r[value] / base if base and r[value] is not None else None
    return rows


def measure_sampling(scale: Scale, device: torch.device, dtype: torch.dtype, deadline: float) -> list[dict]:
    from moh_dit.sampling.pipeline import MoHDiTPipeline
    from moh_dit.sampling.spec import SamplingSpec

    flow = {"name": "flow", "path": "linear", "convention": "moh-dit"}
    model = build(MOH, scale, device, "dense", learn_sigma=False, objective=flow).to(dtype).eval()
    pipe = MoHDiTPipeline.build(model, None, {i: str(i) for i in range(1000)}, "euler")
    spec = SamplingSpec.create(scheduler="euler", num_inference_steps=scale.sample_steps, guidance_scale=4.0)
    labels = [i % 1000 for i in range(scale.sample_batch)]
    noise = torch.randn(scale.sample_batch, 4, scale.latent, scale.latent, generator=torch.Generator().manual_seed(0))
    noise = noise.to(device, dtype)
    timing = replace(scale, warmup=1, per_round=1)  # a draw of 25 steps at batch 64 is seconds long: one a round
    rows = []
    for execution in ("dense", "auto"):
        arm = f"{MOH}, Euler {scale.sample_steps} + CFG 4, {execution}"
        if time.perf_counter() > deadline:
            rows.append(skipped(arm, "images_per_s"))
            continue
        model.set_attention_execution(execution)

        def draw() -> None:
            with torch.no_grad():
                pipe(class_labels=labels, sampling=spec, latents=noise, output_type="latent", progress=False)

        rate = median_rate(draw, scale.sample_batch, timing, device)
        rows.append(dict(arm=arm, images_per_s=rate))
        print(f"sample: {execution}: {rate:.2f} images/s", flush=True)
    return against_first(rows, "images_per_s")


def peak_bytes(step: Callable[[], None], device: torch.device) -> float | None:
    """Peak memory of one step after a first one: CUDA's maximum allocated; None on a CPU (the dry run runs the
    step and records no number)."""
    step()
    if device.type != "cuda":
        step()
        return None
    torch.cuda.reset_peak_memory_stats(device)
    step()
    return float(torch.cuda.max_memory_allocated(device))


def measure_memory(scale: Scale, device: torch.device, dtype: torch.dtype, deadline: float) -> list[dict]:
    rows = []
    for batch in scale.memory_batches:
        for checkpointing in (False, True):
            arm = f"{MOH}, batch {batch}" + (", checkpointing" if checkpointing else "")
            if time.perf_counter() > deadline:
                rows.append(skipped(arm, "peak_gb"))
                continue
            model = build(MOH, scale, device, "auto").train()
            if checkpointing:
                model.enable_gradient_checkpointing()
            peak = peak_bytes(training_step(model, scale, device, dtype, batch, False), device)
            rows.append(dict(arm=arm, peak_gb=None if peak is None else peak / 1e9))
            print(f"memory: {rows[-1]['arm']}: {rows[-1]['peak_gb']}", flush=True)
            del model
            release(device)
    return against_first(rows, "peak_gb")


def table(rows: list[dict], value: str, unit: str) -> list[str]:
    lines = [f"| arm | {unit} | vs the first row |", "|---|---|---|"]
    for r in rows:
        shown = r.get("skipped", "n/a") if r[value] is None else f"{r[value]:.3g}"
        ratio = "n/a" if r.get("vs_baseline") is None else f"{r['vs_baseline']:.2f}x"
        extra = f" (MFU {r['mfu']:.1%})" if r.get("mfu") is not None else ""
        lines.append(f"| {r['arm']} | {shown}{extra} | {ratio} |")
    return lines


def report(out: Path, scale: Scale, result: dict, echo: bool = True) -> None:
    """Write what has been measured so far (each section rewrites it: a run cut short still leaves its numbers);
    ``echo``: print the tables too."""
    title = "dry run at toy size" if result["dry_run"] else f"{result['device']}, torch {result['torch']}"
    lines = [
        f"# GPU proof ({title})",
        "",
        f"Training step at batch {scale.batch}, {result['dtype']}, latents 4 x {scale.latent}^2; MFU against "
        f"{result['peak_source']}:",
        "",
        *table(result.get("training", []), "images_per_s", "images/s"),
        "",
        f"Sampling, batch {scale.sample_batch}:",
        "",
        *table(result.get("sampling", []), "images_per_s", "images/s"),
        "",
        "Peak memory of a training step:",
        "",
        *table(result.get("memory", []), "peak_gb", "GB"),
        "",
    ]
    if "profile" in result or "calibration" in result:
        from benchmarks.gpu_diagnosis import calibration_lines, profile_table

        if "profile" in result:
            lines += ["Where a training step's time goes (device time per step, by kind):", ""]
            lines += [*profile_table(result["profile"]), ""]
        if "calibration" in result:
            lines += ["Calibration of `auto` (benchmarks/attention.py --calibrate):", ""]
            lines += [*calibration_lines(result["calibration"]), ""]
    lines += [
        f"Measured in {result['seconds']:.0f} s" + ("." if result["complete"] else " so far (not finished)."),
    ]
    device_tag = "dry_run" if result["dry_run"] else result["device"].lower().replace(" ", "_")
    write_report(out, f"gpu_proof_{device_tag}", result, lines, echo)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="folder of gpu_proof_<device>.{json,md}")
    p.add_argument("--dry-run", action="store_true", help="every step at toy size on this machine's device")
    p.add_argument("--budget", type=float, default=None, metavar="SECONDS",
                   help="start no measurement after this many seconds (the rest is recorded as skipped); "
                        "the compiled training arms run last, so a short budget drops them first")  # fmt: skip
    p.add_argument("--sections", default=",".join(DEFAULT_SECTIONS), metavar="LIST",
                   help=f"comma-separated, run in this order: {', '.join(SECTIONS)} (default: "
                        f"{','.join(DEFAULT_SECTIONS)}; 'compiled' is the training table's compiled arms, measured "
                        "beside its eager ones only with 'training')")  # fmt: skip
    args = p.parse_args(argv)
    if args.budget is not None and args.budget <= 0:
        raise SystemExit(f"--budget must be a positive number of seconds, got {args.budget:g}")
    sections = tuple(s for s in args.sections.split(",") if s)
    unknown = [s for s in sections if s not in SECTIONS]
    if unknown or not sections:
        raise SystemExit(f"--sections: unknown section(s) {', '.join(unknown) or '(none given)'}; "
                         f"choose from {', '.join(SECTIONS)}")  # fmt: skip
    print_plan(args.dry_run, sections)
    from moh_dit.training.throughput import peak_tflops

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if not args.dry_run and device.type != "cuda":
        raise SystemExit("no CUDA device: the real proof measures a GPU (pass --dry-run to rehearse it here)")
    scale = TOY if args.dry_run else REAL
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    peak, peak_source = peak_tflops(device, "bf16" if dtype == torch.bfloat16 else "no")
    started = time.perf_counter()
    deadline = started + (args.budget if args.budget is not None else float("inf"))
    result = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "dry_run": args.dry_run,
        "dtype": str(dtype).removeprefix("torch."),
        "peak_tflops": peak,
        "peak_source": peak_source,
        "budget_s": args.budget,
        "complete": False,
    }
    eager, compiled = ([arm for arm in TRAIN_ARMS if arm[3] == c] for c in (False, True))
    order = [arm[0] for arm in TRAIN_ARMS]  # the table's, the baseline first
    from benchmarks.gpu_diagnosis import measure_calibration, measure_profile  # it imports this module

    measures = {  # section: (result key, measure); the default order puts the compilations (the slow part) last
        "training": ("training", lambda: measure_training(scale, device, dtype, peak, eager, deadline)),
        "sampling": ("sampling", lambda: measure_sampling(scale, device, dtype, deadline)),
        "memory": ("memory", lambda: measure_memory(scale, device, dtype, deadline)),
        "compiled": ("training", lambda: measure_training(scale, device, dtype, peak, compiled, deadline)),
        "profile": ("profile", lambda: measure_profile(scale, device, dtype, deadline)),
        "calibrate": ("calibration", lambda: measure_calibration(args.out, device, args.dry_run, deadline)),
    }
    result["sections"] = list(sections)
    for key, measure in (measures[s] for s in sections):
        measured = measure()
        if key == "training":
            measured = sorted(result.get(key, []) + measured, key=lambda r: order.index(r["arm"]))
            against_first(measured, "images_per_s")
        result[key] = measured
        result["seconds"] = time.perf_counter() - started
        report(args.out, scale, result, echo=False)  # the files only: the rows were printed as they came
    result["complete"] = True
    report(args.out, scale, result)
    return result


if __name__ == "__main__":
    from moh_dit.cli.common import run_cli

    run_cli(main)  # bad input: one line, as the commands say it
