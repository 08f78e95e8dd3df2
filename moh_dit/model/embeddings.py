"""Input embedders of the DiT family: image patches, diffusion timesteps and class labels.

Module and parameter names follow the public DiT checkpoints (``x_embedder.proj``, ``t_embedder.mlp``,
``y_embedder.embedding_table``) so that reference weights map onto ours one to one.
"""

from __future__ import annotations

import torch
from diffusers.models.embeddings import get_2d_sincos_pos_embed, get_timestep_embedding
from torch import nn

__all__ = ["PatchEmbedder", "TimestepEmbedder", "LabelEmbedder", "sincos_pos_embed_2d"]


def sincos_pos_embed_2d(embed_dim: int, grid_size: int) -> torch.Tensor:
    """Fixed 2D sin-cos positional embedding of a square ``grid_size`` grid: (grid_size**2, embed_dim).

    diffusers' helper reproduces DiT's layout (width coordinate first, half the channels each) when the
    base size equals the grid size and no interpolation is applied.
    """
    return get_2d_sincos_pos_embed(
        embed_dim, grid_size, base_size=grid_size, interpolation_scale=1.0, output_type="pt"
    )


class PatchEmbedder(nn.Module):
    """Non-overlapping ``p x p`` patches to tokens: (N, C, H, W) -> (N, H*W/p**2, D)."""

    def __init__(self, patch_size: int, in_channels: int, hidden_size: int) -> None:
        super().__init__()
        self.patch_size = patch_size
        self.proj = nn.Conv2d(in_channels, hidden_size, kernel_size=patch_size, stride=patch_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x).flatten(2).transpose(1, 2)  # (N, T, D)


class TimestepEmbedder(nn.Module):
    """Diffusion timestep -> vector: 256-d sinusoid of the raw step (cos half first), then an MLP."""

    def __init__(self, hidden_size: int, frequency_embedding_size: int = 256, freq_shift: float = 0.0) -> None:
        super().__init__()
        self.frequency_embedding_size = frequency_embedding_size
        self.freq_shift = freq_shift  # 0: DiT; 1: diffusers' DiT port
        self.mlp = nn.Sequential(
            nn.Linear(frequency_embedding_size, hidden_size),
            nn.SiLU(),
            nn.Linear(hidden_size, hidden_size),
        )

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        freq = get_timestep_embedding(
            t, self.frequency_embedding_size, flip_sin_to_cos=True, downscale_freq_shift=self.freq_shift
        )  # (N, 256) float32
        return self.mlp(freq.to(self.mlp[0].weight.dtype))  # (N, D)


class LabelEmbedder(nn.Module):
    """Class label -> vector, with a null class (index ``num_classes``) for classifier-free guidance.

    The table has ``num_classes + 1`` rows when labels are dropped during training (the last row is the
    null class) and ``num_classes`` rows otherwise, as in DiT.
    """

    def __init__(self, num_classes: int, hidden_size: int, dropout_prob: float) -> None:
        super().__init__()
        self.num_classes = num_classes
        self.dropout_prob = dropout_prob
        self.has_null_class = dropout_prob > 0
        self.embedding_table = nn.Embedding(num_classes + int(self.has_null_class), hidden_size)

    @property
    def num_embeddings(self) -> int:
        return self.embedding_table.num_embeddings

    def drop_labels(self, labels: torch.Tensor, force_drop_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Replace labels by the null class, at random with ``dropout_prob`` or where ``force_drop_ids`` is 1."""
        if force_drop_ids is None:
            drop = torch.rand(labels.shape[0], device=labels.device) < self.dropout_prob
        else:
            drop = force_drop_ids.to(labels.device) == 1
        return torch.where(drop, torch.full_like(labels, self.num_classes), labels)

    def forward(self, labels: torch.Tensor, train: bool, force_drop_ids: torch.Tensor | None = None) -> torch.Tensor:
        if (train and self.has_null_class) or force_drop_ids is not None:
            labels = self.drop_labels(labels, force_drop_ids)
        return self.embedding_table(labels)  # (N, D)
