"""Whether the hardware is used well: model TFLOP/s, model FLOPs utilisation (MFU) and peak memory.

MFU is the model's useful FLOPs per second (``moh_dit.model.flops``: the heads each token uses, forward and
backward) over the peak the hardware could do. The peak comes from ``log.peak_tflops`` when set, else from
the table below for known GPUs (dense tensor-core numbers of the vendors' data sheets, by training
precision), else, on a CPU, from a matmul measured at the start of the run.
"""

from __future__ import annotations

import logging
import resource
import statistics
import sys
import time

import torch

__all__ = ["PEAK_TFLOPS", "peak_tflops", "measure_matmul_tflops", "peak_memory_gb", "training_cost"]

logger = logging.getLogger("moh_dit.train")

# Dense peak TFLOP/s per GPU from the vendors' data sheets: bf16/fp16 on tensor cores, and tf32 (what fp32
# training with TF32 matmuls gets). Matched by substring of torch.cuda.get_device_name(), first match wins.
PEAK_TFLOPS = {
    "H200": {"bf16": 989.0, "fp16": 989.0, "tf32": 494.0},
    "H100 PCIe": {"bf16": 756.0, "fp16": 756.0, "tf32": 378.0},
    "H100": {"bf16": 989.0, "fp16": 989.0, "tf32": 494.0},
    "A100": {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0},
    "L40S": {"bf16": 362.0, "fp16": 362.0, "tf32": 183.0},
    "A10G": {"bf16": 70.0, "fp16": 70.0, "tf32": 35.0},
    "V100": {"bf16": 125.0, "fp16": 125.0, "tf32": 15.7},  # V100 has no bf16 or tf32: fp16 and fp32 peaks
}


def measure_matmul_tflops(dtype: torch.dtype = torch.float32, size: int = 1024, rounds: int = 5) -> float:
    """The median TFLOP/s of ``size`` x ``size`` matrix products on the CPU (after one warm-up): the practical
    peak of this CPU with these threads, against which a CPU run's MFU is measured."""
    a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
    a @ b
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - start)
    return 2 * size**3 / statistics.median(times) / 1e12


def peak_tflops(device: torch.device, precision: str, configured: float = 0.0) -> tuple[float | None, str]:
    """Peak TFLOP/s of one device for ``precision`` (``no``, ``bf16``, ``fp16``: ``train.mixed_precision``) and
    where it comes from; ``(None, why)`` for a GPU this table does not know (set ``log.peak_tflops``)."""
    if configured > 0:
        return configured, "log.peak_tflops"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        kind = precision if precision in ("bf16", "fp16") else "tf32"
        for key, peaks in PEAK_TFLOPS.items():
            if key in name:
                return peaks[kind], f"{key} {kind} data sheet"
        return None, f"{name} is not in moh_dit.training.throughput.PEAK_TFLOPS: set log.peak_tflops for MFU"
    if device.type == "cpu":
        dtype = torch.bfloat16 if precision == "bf16" else torch.float32
        return measure_matmul_tflops(dtype), f"a {str(dtype).removeprefix('torch.')} matmul measured on this CPU"
    return None, f"no peak known for {device.type}: set log.peak_tflops for MFU"


def peak_memory_gb(device: torch.device) -> float:
    """Peak memory so far, in GB: CUDA's maximum allocated on ``device``, else this process's resident-set
    peak (which includes the Python interpreter and libraries)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 1e9 if sys.platform == "darwin" else peak * 1024 / 1e9  # bytes on macOS, KiB on Linux


def training_cost(
    model, forwards: float, device: torch.device, train, log, routed: tuple[tuple[int, int], int] | None = None
) -> tuple[float, float | None]:
    """``(model FLOPs of one image's training step, the device's peak TFLOP/s or None)`` for a run's MFU, logged: the
    forward FLOPs of the heads each token uses times ``forwards`` (3: a forward and a backward), and the peak of
    ``log.peak_tflops``, a known GPU or a matmul measured on this CPU (``train``, ``log``: the config's sections);
    ``routed``: TREAD's span and kept tokens, whose skipped tokens cost nothing in the span."""
    from moh_dit.model.flops import forward_flops

    flops = forward_flops(model, active_heads=True, routed=routed).training_step(forwards)
    peak, source = peak_tflops(device, train.mixed_precision, log.peak_tflops)
    shown = f"{peak:.3g} TFLOP/s per device ({source})" if peak else source
    logger.info(f"{flops / 1e9:.3g} GFLOP per image per training step; peak {shown}")
    return flops, peak
