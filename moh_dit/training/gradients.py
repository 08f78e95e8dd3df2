"""Averaging gradients over processes by hand, for the objectives whose forward pass cannot run through
``DistributedDataParallel``: ``torch.func.jvp`` (MeanFlow) needs the bare module, and DDP then neither errors nor
synchronises (its reducer only hooks a backward that follows its own forward). The gradients are flattened into
buckets and all-reduced in one call each, as DDP's own buckets, instead of one call per parameter.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist

__all__ = ["average_gradients"]

BUCKET_ELEMENTS = 2**24  # 64 MB of float32 per all-reduce (DDP's default buckets are 25 MB)


def average_gradients(parameters: Iterable[torch.nn.Parameter]) -> None:
    """Replace every parameter's gradient by its mean over the processes of the default group (a parameter without
    a gradient on one process must have none on all: MoH's routers and the trainer's models always do)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    world = dist.get_world_size()
    grads = [p.grad for p in parameters if p.grad is not None]
    by_kind: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for grad in grads:
        by_kind.setdefault((grad.dtype, grad.device), []).append(grad)
    for group in by_kind.values():
        bucket: list[torch.Tensor] = []
        size = 0
        for grad in [*group, None]:
            if grad is not None and (size + grad.numel() <= BUCKET_ELEMENTS or not bucket):
                bucket.append(grad)
                size += grad.numel()
                continue
            flat = torch.cat([g.reshape(-1) for g in bucket])
            dist.all_reduce(flat)
            flat /= world
            offset = 0
            for g in bucket:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()
            bucket, size = ([grad], grad.numel()) if grad is not None else ([], 0)
