"""A tiny REPA encoder registered with torch-fidelity as ``moh-dit-test-tokens`` (importing this module registers it, so
``repa.encoder_module=tests.helpers.tiny_encoder`` works in a config): 12-d patch tokens on a 4 x 4 grid, the
token grid of the tests' tiny models (8 px, patch 2)."""

import torch
import torch.nn.functional as F

from moh_dit.training.encoders import PatchTokenEncoder, register_encoder

TOKENS = "moh-dit-test-tokens"


class TinyTokens(PatchTokenEncoder):
    """Fixed random projections of 4 x 4 average-pooled patches: ``patch_tokens`` (N, 16, 12)."""

    dummy_input = (3, 8, 8)

    def __init__(self, name, features_list, resolution=None, **kwargs):
        super().__init__(name, features_list)
        self.register_buffer("w", torch.randn(3, 12, generator=torch.Generator().manual_seed(0)))

    def forward(self, x):
        x = x.float() / 255
        x = x.repeat(1, 3 // x.shape[1], 1, 1) if x.shape[1] == 1 else x
        pooled = F.adaptive_avg_pool2d(x, 4).flatten(2).transpose(1, 2)  # (N, 16, 3)
        return (torch.tanh(pooled @ self.w),)


register_encoder(TOKENS, TinyTokens)
