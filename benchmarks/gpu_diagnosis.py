"""What the GPU proof's throughput rows do not say, as two more sections of ``benchmarks/gpu_proof.py``:

    profile     where a training step's time goes, moh-dit's DiT-XL/2 against diffusers' DiT of the same size in
                the proof's own loop: torch.profiler's device time per kernel, summed into kinds (matrix products,
                attention, normalisation, element-wise, optimizer, copies and casts) per step, side by side
    calibrate   ``benchmarks/attention.py --calibrate`` on this device (bf16, as training runs): the fitted cost
                model ``auto`` needs before it will pick the sparse path here (without one it runs dense)

Both run in the proof's process, after its other sections, and respect its ``--budget``.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import torch

from benchmarks import gpu_proof

# (kind, pattern on a kernel's or an operator's name); the first that matches names it, else "other"
KINDS = (
    ("attention", r"flash|fmha|attention|sdpa|efficient_attention|softmax"),
    ("matrix products", r"gemm|matmul|\bmm\b|addmm|bmm|linear|cutlass|xmma|nvjet|cublas|sm\d+_"),
    ("optimizer", r"adam|foreach|multi_tensor|fused_adam"),
    ("normalisation", r"norm"),
    ("convolution (patch embedding)", r"conv"),
    ("copies and casts", r"copy|(?<!no)cast|contiguous|cat\b|memcpy|memset"),  # gpu_kernel_impl_nocast: any op
    (
        "element-wise",
        r"elementwise|vectorized|unrolled|reduce|silu|gelu|tanh|sigmoid|mul|add|sub|div|sqrt|lerp|neg|sum|mean|pow|exp|"
        r"where|fill",
    ),
)
PROFILED = ("diffusers DiT-XL/2, plain loop", "moh-dit DiT-XL/2")


def kind_of(name: str) -> str:
    """The kind of a profiled kernel or operator, by its name (``KINDS``)."""
    low = name.lower()
    return next((kind for kind, pattern in KINDS if re.search(pattern, low)), "other")


def profile_rows(events, steps: int, on_device: bool, top: int = 12) -> dict:
    """Per step: total milliseconds, milliseconds by kind, and the ``top`` most expensive names, from
    ``profiler.key_averages()``: the kernels' device time on a GPU, the operators' self CPU time otherwise (so that
    nothing is counted twice)."""
    from torch.autograd import DeviceType

    spent = []
    for e in events:
        if on_device:  # the kernels only: an operator's device time is its kernels', which are listed too, and a
            # user annotation (Optimizer.step) is mirrored on the device's timeline, spanning kernels listed too
            kernel = e.device_type != DeviceType.CPU and not getattr(e, "is_user_annotation", False)
            us = e.self_device_time_total if kernel else 0
        else:
            us = e.self_cpu_time_total
        if us > 0:
            spent.append(dict(name=e.key[:160], kind=kind_of(e.key), ms=us / 1e3 / steps, calls=e.count / steps))
    by_kind: dict[str, float] = {}
    for entry in spent:
        by_kind[entry["kind"]] = by_kind.get(entry["kind"], 0.0) + entry["ms"]
    spent.sort(key=lambda entry: -entry["ms"])
    return {
        "ms_per_step": sum(entry["ms"] for entry in spent),
        "calls_per_step": sum(entry["calls"] for entry in spent),  # kernel launches on a GPU (each costs host time)
        "by_kind_ms": dict(sorted(by_kind.items(), key=lambda kv: -kv[1])),
        "top": spent[:top],
    }


def measure_profile(scale, device: torch.device, dtype: torch.dtype, deadline: float) -> list[dict]:
    """One row per arm of ``PROFILED``: the profile of ``scale.per_round`` training steps after the warm-up."""
    from torch.profiler import ProfilerActivity, profile

    arms = [arm for arm in gpu_proof.TRAIN_ARMS if arm[0] in PROFILED]
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    rows = []
    for row, preset, execution, _compiled, diffusers_model in arms:
        if time.perf_counter() > deadline:
            rows.append(gpu_proof.skipped(f"profile: {row}", "ms_per_step"))
            continue
        model = gpu_proof.arm_network(gpu_proof.build(preset, scale, device, execution), diffusers_model, device)
        step = gpu_proof.training_step(model.train(), scale, device, dtype, scale.batch, diffusers_model)
        for _ in range(scale.warmup):
            step()
        gpu_proof.sync(device)
        with profile(activities=activities) as prof:
            for _ in range(scale.per_round):
                step()
            gpu_proof.sync(device)
        rows.append(
            {"arm": f"profile: {row}", **profile_rows(prof.key_averages(), scale.per_round, device.type == "cuda")}
        )
        print(f"profile: {row}: {rows[-1]['ms_per_step']:.1f} ms a step", flush=True)
        del model, step, prof
        gpu_proof.release(device)
    return rows


def profile_table(rows: list[dict]) -> list[str]:
    """Milliseconds a step by kind, one column per profiled arm, and each arm's most expensive names."""
    done = [r for r in rows if r.get("ms_per_step") is not None]
    if not done:
        return [f"- {r['arm']}: {r.get('skipped', 'not run')}" for r in rows] or ["(not run)"]
    kinds = list(dict.fromkeys(k for r in done for k in r["by_kind_ms"]))
    names = [r["arm"].removeprefix("profile: ") for r in done]
    lines = [f"| kind | {' | '.join(names)} |", "|---" * (len(done) + 1) + "|"]
    for kind in kinds + ["total"]:
        cells = [r["ms_per_step"] if kind == "total" else r["by_kind_ms"].get(kind, 0.0) for r in done]
        lines.append(f"| {kind} | {' | '.join(f'{c:.2f} ms' for c in cells)} |")
    for r, name in zip(done, names):
        lines += ["", f"Most expensive in {name} (ms a step, calls a step):", ""]
        lines += [f"- {t['ms']:.2f} ms, {t['calls']:g}x: `{t['name']}` ({t['kind']})" for t in r["top"]]
    return lines


def measure_calibration(out: Path, device: torch.device, dry_run: bool, deadline: float) -> dict:
    """``benchmarks/attention.py --calibrate`` on this device into ``out`` (its tiny grid on a dry run, which has
    too few points to fit: the code path only). The calibration file is ``out/calibration_<device type>.json``, to be
    committed as ``moh_dit/calibrations/<device type>.json`` once read."""
    from benchmarks import attention

    if time.perf_counter() > deadline:
        print("skipped (past the time budget): calibrate", flush=True)
        return {"skipped": "past the time budget"}
    started = time.perf_counter()
    file = out / f"calibration_{device.type}.json"
    argv = ["--device", device.type, "--calibrate", "--calibration-file", str(file), "--out", str(out)]
    argv += ["--quick", "--rounds", "1"] if dry_run else ["--dtype", "bf16", "--rounds", "3"]
    result = attention.main(argv)
    return {
        "file": file.name if file.exists() else None,
        "shapes": len(result["rows"]),
        "calibration": result.get("calibration", {}),
        "seconds": time.perf_counter() - started,
    }


def calibration_lines(result: dict) -> list[str]:
    if "skipped" in result:
        return [f"(skipped: {result['skipped']})"]
    fits = result["calibration"]
    lines = [f"{result['shapes']} shapes timed; written to `{result['file']}`." if fits else
             f"{result['shapes']} shapes timed: too few with routed heads to fit (the dry run's grid)."]  # fmt: skip
    for key, fit in fits.items():
        lines.append(f"- {key}: {fit['points']} points, rms residual {fit['rms_residual']:.3f}")
    return lines
