"""Which images each process sees: a resumable, rank-sharded epoch sampler, and class-weighted draws."""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import Dataset, Subset

from moh_dit.errors import DataError
from moh_dit.seeding import epoch_seed

if TYPE_CHECKING:
    pass


# ----------------------------------------------------------------------------------------------------
# Sampling order
# ----------------------------------------------------------------------------------------------------
class ShardedEpochBatchSampler:
    """Batches of indices for one rank: a fresh permutation per epoch from ``(seed, epoch)``, split over
    ranks, with an optional start offset so a resumed run continues mid-epoch on exactly the batches an
    uninterrupted run would have seen.

    We write this instead of using accelerate's prepared data loader and ``skip_first_batches`` because
    the order must be a pure function of (seed, epoch, rank, position) for bit-exact resume, independent
    of any RNG state the loader consumed before the interruption.

    With ``draws`` (see :func:`class_draws`) an epoch holds each item as often as its class's weight says
    instead of once; the items of a fractional weight's extra share are drawn afresh every epoch.
    """

    def __init__(
        self,
        dataset_size: int,
        batch_size: int,
        num_replicas: int = 1,
        rank: int = 0,
        seed: int = 0,
        epoch: int = 0,
        start_batch: int = 0,
        draws: ClassDraws | None = None,
    ) -> None:
        epoch_size = dataset_size if draws is None else draws.epoch_size
        self.batches_per_epoch = epoch_size // (num_replicas * batch_size)
        if self.batches_per_epoch == 0:
            raise DataError(
                f"dataset of {epoch_size} items per epoch is smaller than one global micro-batch "
                f"({num_replicas} processes x {batch_size}); lower the batch size"
            )
        self.dataset_size, self.batch_size, self.draws = dataset_size, batch_size, draws
        self.num_replicas, self.rank = num_replicas, rank
        self.seed, self.epoch, self.start_batch = seed, epoch, start_batch

    def __len__(self) -> int:
        return self.batches_per_epoch - self.start_batch

    def __iter__(self) -> Iterator[list[int]]:
        g = torch.Generator().manual_seed(epoch_seed(self.seed, self.epoch))
        if self.draws is None:
            order = torch.randperm(self.dataset_size, generator=g)
        else:
            items = self.draws.epoch_items(g)
            order = items[torch.randperm(len(items), generator=g)]
        per_rank = self.batches_per_epoch * self.batch_size
        # interleave ranks batch by batch so that every global step sees a fresh, disjoint set of items
        mine = order[: per_rank * self.num_replicas].view(self.batches_per_epoch, self.num_replicas, self.batch_size)
        for b in range(self.start_batch, self.batches_per_epoch):
            yield mine[b, self.rank].tolist()


@dataclass(frozen=True)
class ClassDraws:
    """How often an epoch draws each class: item ``i`` of class ``c`` is drawn ``floor(w_c)`` times, and a
    fresh ``w_c - floor(w_c)`` share of the class's items once more, so every epoch has the same size and
    every item the same expected count.

    torch's ``WeightedRandomSampler`` draws with replacement, which repeats some images and skips others
    within an epoch and makes the epoch's length a separate choice; this keeps DiT's "every image once per
    epoch" for a weight of 1 and stays a pure function of (seed, epoch) for exact resume.

    Attributes:
        labels: the class of every item, ``(N,)``.
        weights: the weight of every class id that has items.
    """

    labels: torch.Tensor
    weights: dict[int, float]

    @functools.cached_property
    def _members(self) -> list[tuple[torch.Tensor, int, int]]:
        """``(items of the class, whole repeats, extra items)`` per class, found once (the sampler of every
        epoch asks for them)."""
        out = []
        for c, w in sorted(self.weights.items()):
            members = torch.nonzero(self.labels == c).flatten()
            whole = int(math.floor(w))
            out.append((members, whole, round((w - whole) * len(members))))
        return out

    @property
    def epoch_size(self) -> int:
        return sum(len(m) * whole + extra for m, whole, extra in self._members)

    def epoch_items(self, generator: torch.Generator) -> torch.Tensor:
        """The item indices of one epoch (a multiset, in class order; the caller shuffles it)."""
        parts = []
        for members, whole, extra in self._members:
            parts += [members] * whole
            if extra:
                parts.append(members[torch.randperm(len(members), generator=generator)[:extra]])
        return torch.cat(parts)

    def shares(self) -> dict[int, float]:
        """Each class's share of an epoch's draws."""
        size = self.epoch_size
        return {
            c: (len(m) * whole + extra) / size for c, (m, whole, extra) in zip(sorted(self.weights), self._members)
        }


def class_draws(spec: Any, labels: Sequence[int], id2label: dict[int, str]) -> ClassDraws | None:
    """The draws ``data.class_weights`` asks for, checked against the data's classes; ``None`` for ``{}``.

    ``spec`` maps class names (as the data names them, any case) or ids to weights; classes it does not
    name keep weight 1. ``"balanced"`` weighs every class by the inverse of its size, so each is drawn
    equally often and an epoch keeps the data's size.
    """
    if not spec:
        return None
    labels_t = torch.as_tensor(list(labels), dtype=torch.long)
    ids, counts = torch.unique(labels_t, return_counts=True)
    present = dict(zip(ids.tolist(), counts.tolist()))
    if spec == "balanced":
        weights = {c: len(labels_t) / (len(present) * n) for c, n in present.items()}
    else:
        by_name = {name.lower(): c for c, name in id2label.items()}
        weights = {c: 1.0 for c in present}
        for key, weight in spec.items():
            c = by_name.get(str(key).lower())
            if c is None and (isinstance(key, int) or str(key).isdigit()):
                c = int(key)
            if c not in present:
                known = ", ".join(f"{i} ({id2label[i]})" if i in id2label else str(i) for i in sorted(present))
                raise DataError(
                    f"data.class_weights names {key!r}, which is not a class of this data; its classes: {known}"
                )
            weights[c] = float(weight)
    # all 1 (named so, or "balanced" on balanced data): the plain epoch, the same run as without weights
    return None if all(w == 1 for w in weights.values()) else ClassDraws(labels_t, weights)


def dataset_labels(dataset: Dataset) -> list[int]:
    """The class of every item of a data set or of a ``Subset`` of one."""
    if isinstance(dataset, Subset):
        parent = dataset_labels(dataset.dataset)
        return [parent[i] for i in dataset.indices]
    return list(dataset.targets)


def subset_indices(labels: Sequence[int], per_class: int) -> list[int]:
    """The first ``per_class`` indices of every class (tiny, balanced subsets for tests and smoke runs)."""
    seen: dict[int, int] = {}
    out = []
    for i, label in enumerate(labels):
        if seen.get(label, 0) < per_class:
            seen[label] = seen.get(label, 0) + 1
            out.append(i)
    return out
