"""The network's architecture arguments: the checks no layer makes itself, and the per-layer head tables expanded into
each block's attention (a preset's ``num_heads``, ``num_shared_heads`` and ``top_k``, an int or one value per layer)."""

from __future__ import annotations

from collections.abc import Sequence

from moh_dit.model.attention import MoHAttention
from moh_dit.model.block import BlockOptions

__all__ = ["IntOrList", "per_layer", "attention_of", "check_architecture"]

IntOrList = int | Sequence[int]


def per_layer(name: str, value: IntOrList | None, depth: int) -> list[int | None]:
    """Expand an int (or None) to one value per layer; check a list has exactly ``depth`` entries."""
    if value is None or isinstance(value, int):
        return [value] * depth
    values = list(value)
    if len(values) != depth:
        raise ValueError(f"{name} has {len(values)} entries but depth is {depth}: give one value per layer")
    if not all(isinstance(v, int) for v in values):
        raise ValueError(f"{name} must contain integers, got {values}")
    return values


def attention_of(
    layer: int,
    dim: int,
    heads: int,
    shared: int | None,
    top_k: int | None,
    head_dim: int | None,
    qkv_bias: bool,
    attention_type: str,
    options: BlockOptions,
) -> MoHAttention:
    """The attention of one block (its heads from the per-layer tables); an impossible table names the layer."""
    try:
        return MoHAttention(
            dim,
            heads,
            head_dim=head_dim,
            num_shared_heads=shared,
            top_k=top_k or 0,
            qkv_bias=qkv_bias,
            attention_type=attention_type,
            qk_norm=options.qk_norm_layer(),
        )
    except ValueError as err:
        raise ValueError(f"layer {layer}: {err}") from None


def check_architecture(config: dict) -> None:
    """The architecture's values that no layer checks itself."""
    depth, repa_depth = config["depth"], config["repa_depth"]
    if (repa_depth is None) != (not config["repa_dims"]):
        raise ValueError("repa_depth and repa_dims go together: the block to align and the encoders' widths")
    if repa_depth is not None and not 1 <= repa_depth <= depth:
        raise ValueError(f"repa_depth counts blocks from 1 to {depth}, got {repa_depth}")
    objective = config["objective"]
    if objective is not None and not (isinstance(objective, dict) and isinstance(objective.get("name"), str)):
        raise ValueError(f"objective must be None or a record such as {{'name': 'flow', ...}}, got {objective!r}")
    if config["attention_type"] not in ("moh", "mha"):
        raise ValueError(f"attention_type must be 'moh' or 'mha', got {config['attention_type']!r}")
    if depth < 1:
        raise ValueError(f"depth must be >= 1, got {depth}")
    size, patch = config["sample_size"], config["patch_size"]
    if patch < 1 or size % patch:
        raise ValueError(f"sample_size={size} is not divisible by patch_size={patch}")
    if config["hidden_size"] % 4:
        raise ValueError(f"hidden_size={config['hidden_size']} must be divisible by 4 (2D sin-cos position embedding)")
    if config["num_classes"] < 0:
        raise ValueError(f"num_classes must be >= 0, got {config['num_classes']}")
    if not 0.0 <= config["class_dropout_prob"] < 1.0:
        raise ValueError(f"class_dropout_prob must be in [0, 1), got {config['class_dropout_prob']}")
    if config["time_inputs"] not in (1, 2):
        raise ValueError(f"time_inputs must be 1 or 2 (MeanFlow's time and interval), got {config['time_inputs']}")
    split = config.get("end_time_blocks", 0)
    # spelled out, not moh_dit.argtypes.is_whole: the model imports nothing of the package but its errors
    if not isinstance(split, int) or isinstance(split, bool) or not 0 <= split <= depth:
        raise ValueError(f"end_time_blocks must be a number of blocks between 0 and {depth}, got {split!r}")
    if split and config["time_inputs"] != 2:
        raise ValueError("end_time_blocks splits the blocks between two times: it needs time_inputs=2")
