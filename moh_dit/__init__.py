"""moh-dit: class-conditional image generation with MoH-DiT, a Diffusion Transformer with Mixture-of-Head
attention. Train, sample and evaluate in one package."""

from .attention import AttentionAux, MoHAttention, load_balance_loss
from .model import MoHDiT, MoHDiTOutput
from .presets import PRESETS, create_model, list_presets, preset_config

__version__ = "0.1.0"

__all__ = [
    "AttentionAux",
    "MoHAttention",
    "MoHDiT",
    "MoHDiTOutput",
    "PRESETS",
    "create_model",
    "list_presets",
    "load_balance_loss",
    "preset_config",
]
