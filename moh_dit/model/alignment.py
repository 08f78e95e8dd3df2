"""REPA's alignment head (Yu et al., "Representation Alignment for Generation", ICLR 2025, arXiv:2410.06940): a
token-wise MLP from the residual stream after one block to a frozen vision encoder's feature space. It is trained
with the network (its loss pulls the block's tokens toward the encoder's patch features) and used only in training:
sampling never runs it, and exported pipelines leave it out."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["AlignmentProjector"]


class AlignmentProjector(nn.Module):
    """Linear(D, P) - SiLU - Linear(P, P) - SiLU - Linear(P, Z), applied to every token: (N, T, D) -> (N, T, Z).
    REPA's ``build_mlp`` with its defaults P = 2048; ``layers`` holds the three linears as ``layers.0``, ``.2``,
    ``.4`` (REPA's ``projectors.i.0``, ``.2``, ``.4``)."""

    def __init__(self, hidden_size: int, projector_dim: int, feature_dim: int) -> None:
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(hidden_size, projector_dim),
            nn.SiLU(),
            nn.Linear(projector_dim, projector_dim),
            nn.SiLU(),
            nn.Linear(projector_dim, feature_dim),
        )

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.layers(tokens)
