"""moh-dit: class-conditional image generation with MoH-DiT, a Diffusion Transformer with Mixture-of-Head
attention. Train, sample and evaluate in one package.

The names below are imported on first use, so that ``import moh_dit`` (and every command's ``--help``)
does not pay for torch and diffusers until they are needed.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.5.0.dev0"  # the one version number (pyproject.toml reads it from here)

_EXPORTS = {
    "AttentionAux": "model.attention",
    "MoHAttention": "model.attention",
    "load_balance_loss": "model.attention",
    "MoHDiT": "model.network",
    "MoHDiTOutput": "model.network",
    "PRESETS": "model.presets",
    "create_model": "model.presets",
    "list_presets": "model.presets",
    "preset_config": "model.presets",
    "MoHDiTPipeline": "sampling.pipeline",
    # the flow schedulers diffusers lacks: a saved pipeline names them as ("moh_dit", class) and loads them from here
    "FlowHeunScheduler": "objectives.flow_schedulers",
    "FlowSDEScheduler": "objectives.flow_schedulers",
    "MeanFlowScheduler": "objectives.flow_schedulers",
    "load_pipeline": "sampling.loading",
    "MohDitError": "errors",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'moh_dit' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(list(globals()) + list(_EXPORTS))
