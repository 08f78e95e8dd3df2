"""Token routing in training (TREAD: Krause et al., ICCV 2025, arXiv:2501.04765): a random share of each image's
tokens skips a span of blocks and rejoins the sequence, unchanged, after it; the other tokens go through the span
alone. No parameter is added and sampling uses every token in every block: only training steps are cheaper, by what
the skipped tokens would have cost in the span. MoH routes heads within a block; this routes tokens past blocks, so
the two compose.

Written here from the paper's description (its code is CC BY-NC-SA): diffusers and torch have no such routing.

- The route is drawn per sample from the training step's generator (:func:`draw_route`), so a resumed run draws the
  same routes.
- Positions: the tokens carry the sin-cos table from the patch embedding; with 2-D RoPE the kept tokens rotate at their
  own grid positions (:class:`KeptRotary`), in the dense and the sparse MoH execution alike.
- REPA: when the aligned block's output lies inside the span (:meth:`TokenRoute.aligns_kept_tokens`), only the kept
  tokens are projected, and the trainer compares them with the encoder's tokens at the same places; REPA's loss is a
  mean over tokens, so a random subset estimates it without bias.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

__all__ = ["TokenRoute", "draw_route", "resolve_span", "KeptRotary", "rows_of_route"]


def resolve_span(first: int, last: int, depth: int) -> tuple[int, int]:
    """The blocks ``[start, stop)`` a routed token skips, from ``first`` and ``last`` (block indices from 0, both
    included; negative ones count from the end, -1 the last block). A ``ValueError`` names what is wrong."""
    start, end = first + depth if first < 0 else first, last + depth if last < 0 else last
    if not (0 <= start <= end < depth):
        raise ValueError(
            f"the routed span must be blocks first <= last within the model's {depth} (negative: from the end), got "
            f"first={first}, last={last}"
        )
    return start, end + 1


@dataclass(frozen=True)
class TokenRoute:
    """One micro-batch's route: ``kept`` (N, T_kept) are the token indices (ascending) that go through the blocks
    ``[start, stop)``; the others skip them."""

    kept: torch.Tensor
    start: int
    stop: int

    def rows(self, index: torch.Tensor) -> TokenRoute:
        """The route of a pass over the batch's samples ``index`` (a guidance prediction, a finite difference's
        shifted pass): each sample keeps its own tokens."""
        return TokenRoute(self.kept[index.to(self.kept.device)], self.start, self.stop)

    def gather(self, h: torch.Tensor) -> torch.Tensor:
        """The kept tokens of ``h`` (N, T, D): (N, T_kept, D)."""
        return torch.gather(h, 1, self.kept.unsqueeze(-1).expand(-1, -1, h.shape[-1]))

    def aligns_kept_tokens(self, depth: int) -> bool:
        """Whether the output of block ``depth`` (counted from 1, as REPA's) holds the kept tokens only: a block of
        the span other than its last (after the last, the skipped tokens have rejoined)."""
        return self.start <= depth - 1 < self.stop - 1

    def scatter(self, full: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
        """``full`` (N, T, D) with the kept tokens replaced by ``kept`` (N, T_kept, D): the skipped tokens rejoin."""
        index = self.kept.unsqueeze(-1).expand(-1, -1, full.shape[-1])
        return full.scatter(1, index, kept.to(full.dtype))


def draw_route(
    n: int, tokens: int, share: float, span: tuple[int, int], generator: torch.Generator, device: torch.device
) -> TokenRoute:
    """A route for ``n`` images of ``tokens`` tokens: ``round(share * tokens)`` tokens of each, chosen uniformly at
    random (drawn on the CPU from ``generator``), skip the blocks of ``span``."""
    routed = round(share * tokens)
    order = torch.rand(n, tokens, generator=generator).argsort(dim=1)
    kept = order[:, routed:].sort(dim=1).values
    return TokenRoute(kept.to(device), *span)


class KeptRotary:
    """A network's 2-D RoPE seen by the kept tokens of a route: each rotates at its own grid position. Called as the
    table is (``rope(x)`` on (N, H, T_kept, d), or with ``positions`` into the kept tokens, as the sparse MoH execution
    gathers query rows)."""

    def __init__(self, rope, kept: torch.Tensor) -> None:
        self.rope, self.kept = rope, kept

    def __call__(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        if positions is None:
            return self.rope(x, self.kept[:, None, :])  # (N, 1, T_kept): every head alike
        flat = torch.gather(self.kept, 1, positions.reshape(positions.shape[0], -1))
        return self.rope(x, flat.reshape(positions.shape))


def rows_of_route(net, index: torch.Tensor) -> contextlib.AbstractContextManager:
    """``net.routed_rows(index)`` for a network that routes tokens (:class:`~moh_dit.model.network.MoHDiT`); nothing
    for another (a test's closed-form network)."""
    routed = getattr(net, "routed_rows", None)
    return routed(index) if routed is not None else contextlib.nullcontext()
