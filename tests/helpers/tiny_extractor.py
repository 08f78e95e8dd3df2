"""A tiny feature extractor registered with torch-fidelity as ``moh-dit-test-tiny`` (importing this module
registers it, so ``--extractor-module tests.helpers.tiny_extractor`` works on the command line)."""

import torch
import torch.nn.functional as F
from torch_fidelity.feature_extractor_base import FeatureExtractorBase
from torch_fidelity.registry import FEATURE_EXTRACTORS_REGISTRY, register_feature_extractor

TINY = "moh-dit-test-tiny"


class TinyExtractor(FeatureExtractorBase):
    """Fixed random projections of 8x8 downsampled images: 'pool' (24), 'logits_unbiased' (5), 'spatial' (12)."""

    def __init__(self, name, features_list, **kwargs):
        super().__init__(name, features_list)
        g = torch.Generator().manual_seed(0)
        self.register_buffer("w_pool", torch.randn(192, 24, generator=g))
        self.register_buffer("w_logits", torch.randn(24, 5, generator=g))
        self.register_buffer("w_spatial", torch.randn(192, 12, generator=g))

    def forward(self, x):
        x = F.adaptive_avg_pool2d(x.float() / 255, 8).flatten(1)
        pool = torch.tanh(x @ self.w_pool)
        out = {"pool": pool, "logits_unbiased": pool @ self.w_logits, "spatial": x @ self.w_spatial}
        return tuple(out[f] for f in self.features_list)

    @staticmethod
    def get_provided_features_list():
        return "pool", "logits_unbiased", "spatial"

    @staticmethod
    def get_default_feature_layer_for_metric(metric):
        return "pool"

    @staticmethod
    def can_be_compiled():
        return False

    @staticmethod
    def get_dummy_input_for_compile():
        return torch.zeros(1, 3, 8, 8, dtype=torch.uint8)


if TINY not in FEATURE_EXTRACTORS_REGISTRY:
    register_feature_extractor(TINY, TinyExtractor)
