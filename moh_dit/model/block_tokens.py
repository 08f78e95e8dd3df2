"""The tokens a network's blocks put out in one pass, read by forward hooks (DMD2's discriminator head reads one block;
the teacher-feature distance of DMD's regression reads every block). The pass stops after the deepest block asked for:
nothing after it can change those tokens, and the rest of the network is never run."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

__all__ = ["tokens_after_blocks"]


class _ReachedDeepest(Exception):
    """Raised by a forward hook to end a pass once the deepest block asked for has run."""


def tokens_after_blocks(network: nn.Module, blocks: Sequence[int], run: Callable[[], Any]) -> list[torch.Tensor]:
    """The tokens (N, T, D) after each of ``blocks`` (from 1) of ``network.blocks``, in the pass ``run()`` makes of
    ``network`` (with its gradient where the pass has one), in the order given."""
    depth = len(network.blocks)
    if not blocks or not all(1 <= b <= depth for b in blocks):
        raise ValueError(f"blocks must be from 1 to {depth}, got {list(blocks)}")
    found: dict[int, torch.Tensor] = {}
    deepest = max(blocks)

    def hook_of(block: int):
        def keep(module, inputs, out):
            found[block] = out[0] if isinstance(out, tuple) else out  # (tokens, aux) in training
            if block == deepest:
                raise _ReachedDeepest

        return keep

    hooks = [network.blocks[b - 1].register_forward_hook(hook_of(b)) for b in sorted(set(blocks))]
    try:
        run()
    except _ReachedDeepest:
        pass
    finally:
        for hook in hooks:
            hook.remove()
    return [found[b] for b in blocks]
