"""How every random stream in moh-dit is derived from the user's seed.

Streams are keyed by what they belong to, never by how much randomness was drawn before, which is what
makes results independent of batch size, process count and interruptions:

- sampling: image ``index`` -> its initial noise and every ancestral draw; its label comes from a second,
  independent stream;
- training: (seed, rank, step, micro-batch) -> flips, timesteps, noise, label dropout, posterior draws;
  (seed, epoch) -> the data order.

The constants are arbitrary primes; they are part of the reproducibility contract (changing them changes
every image and loss), so they live here once.
"""

from __future__ import annotations

import torch

__all__ = ["mix", "index_generator", "label_for_index", "step_generator", "epoch_seed"]

PRIME = 1_000_003
_MOD = 2**63
# The micro-batch index is folded in as ``* slots + micro``; 64 slots keep the historical streams, and
# more accumulation steps than that get as many slots as they need (no two micro-batches share a stream).
_MICRO_SLOTS = 64
_LABEL_SEED, _LABEL_INDEX, _LABEL_OFFSET = 7_919, 104_729, 17


def mix(*parts: int) -> int:
    """Fold integers into one seed: ``((p0 * P + p1) * P + p2) ...`` modulo 2**63."""
    value = 0
    for part in parts:
        value = value * PRIME + int(part)
    return value % _MOD


def index_generator(seed: int, index: int) -> torch.Generator:
    """The generator of sample ``index``: its initial noise and every ancestral noise draw."""
    return torch.Generator().manual_seed(mix(seed, index))


def label_for_index(seed: int, index: int, num_classes: int, mode: str) -> int:
    """The class of sample ``index``: uniform at random from a stream independent of the noise, or
    class-balanced (``index mod K``)."""
    if mode == "balanced":
        return index % num_classes
    if mode == "uniform":
        g = torch.Generator().manual_seed((seed * _LABEL_SEED + index * _LABEL_INDEX + _LABEL_OFFSET) % _MOD)
        return int(torch.randint(0, num_classes, (1,), generator=g))
    raise ValueError(f"label mode must be 'uniform' or 'balanced', got {mode!r}")


def step_generator(seed: int, rank: int, step: int, micro: int, accumulation_steps: int = 1) -> torch.Generator:
    """The generator of one training micro-batch."""
    slots = max(_MICRO_SLOTS, accumulation_steps)
    return torch.Generator().manual_seed((mix(seed, rank, step) * slots + micro) % _MOD)


def epoch_seed(seed: int, epoch: int) -> int:
    """The seed of the data order of one epoch."""
    return mix(seed, epoch)
