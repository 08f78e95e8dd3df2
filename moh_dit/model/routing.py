"""MoH's top-k choice held fixed across forwards: the choices of one forward recorded, then replayed in others.

The router's top-k is piecewise constant in its input: a derivative taken by finite differences across a point where a
token's choice of heads flips measures the jump, not the slope (a difference of 1e-4 in time can flip a choice and
divide a jump by 1e-4). A distillation's finite-difference derivative therefore evaluates the shifted inputs with the
routing chosen at the primal input (:class:`RoutingTape`): the derivative of the network with its routing held, which
is what a JVP through the top-k computes (its indices carry no tangent).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

import torch

from moh_dit.model.attention import MoHAttention

__all__ = ["RoutingTape"]


class RoutingTape:
    """Within the context, every forward records each routed layer's top-k choice; after :meth:`replay`, forwards take
    the recorded choices instead of their own (their gate weights are recomputed from their own router probabilities on
    those heads). The batch and token layout of a replayed forward must be the recorded one's.

        with RoutingTape(model.attention_layers) as tape:
            out = model(x, t, y)                 # records
            tape.replay()
            shifted = model(x + dx, t + dt, y)   # the same heads per token
    """

    def __init__(self, layers: Sequence[MoHAttention]) -> None:
        self.layers = [a for a in layers if a.has_routed_heads]
        self.choices: list[torch.Tensor | None] = [None] * len(self.layers)
        self.replaying = False

    def __enter__(self) -> RoutingTape:
        for index, attn in enumerate(self.layers):
            attn.routing = partial(self._choose, index)
        return self

    def __exit__(self, *exc) -> None:
        for attn in self.layers:
            attn.routing = None

    def replay(self, rows: torch.Tensor | None = None) -> None:
        """From now on, forwards take the recorded choices (of the batch's ``rows`` only, when given: forwards of that
        part of the batch)."""
        if any(c is None for c in self.choices):
            raise RuntimeError("nothing recorded to replay: run a forward inside the tape first")
        if rows is not None:
            self.choices = [c[rows] for c in self.choices]
        self.replaying = True

    def _choose(self, index: int, top_i: torch.Tensor) -> torch.Tensor:
        if not self.replaying:
            self.choices[index] = top_i.detach()
            return top_i
        recorded = self.choices[index]
        if recorded.shape != top_i.shape:
            raise ValueError(
                f"a replayed forward must have the recorded shape {tuple(recorded.shape)}, got {tuple(top_i.shape)}"
            )
        return recorded
