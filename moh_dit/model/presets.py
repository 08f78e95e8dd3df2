"""Named model presets: the DiT family, the MoH-DiT paper's variants, and small CPU-sized models.

    >>> from moh_dit import create_model, list_presets
    >>> model = create_model("MoH-DiT-S/2-90", num_classes=10)  # any config field can be overridden
    >>> list_presets("MoH-DiT")

Per-layer head tables are from the MoH paper's released configurations (docs/moh_attention.md). The
defaults describe ImageNet 256 x 256 through the SD VAE: 32 x 32 x 4 latents, 1000 classes, learned sigma.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Mapping
from typing import Any

from moh_dit.errors import ConfigError
from moh_dit.model.block import BlockOptions
from moh_dit.model.network import MoHDiT

__all__ = [
    "CUSTOM",
    "PRESETS",
    "config_keys",
    "create_model",
    "architecture",
    "check_config_keys",
    "list_presets",
    "match_preset",
    "preset_config",
]

# Width, depth and heads of the DiT sizes (head size 64, 72 for XL).
_DIT_SIZES = {
    "S": dict(hidden_size=384, depth=12, num_heads=6),
    "B": dict(hidden_size=768, depth=12, num_heads=12),
    "L": dict(hidden_size=1024, depth=24, num_heads=16),
    "XL": dict(hidden_size=1152, depth=28, num_heads=16),
}
_IMAGENET_LATENT = dict(sample_size=32, in_channels=4, num_classes=1000, learn_sigma=True, class_dropout_prob=0.1)
# The embedded default: 28 x 28 single-channel images (Fashion-MNIST) in pixel space, 10 classes.
_SMALL_IMAGES = dict(sample_size=28, in_channels=1, num_classes=10, learn_sigma=True, class_dropout_prob=0.1)


def _runs(*runs: tuple[int, int]) -> list[int]:
    """Run-length table: ``_runs((8, 9), (16, 10))`` is 8 for 9 layers then 16 for 10 layers."""
    return [value for value, count in runs for _ in range(count)]


def _moh(size: str, head_dim: int, heads: list[int], shared: list[int], top_k: list[int]) -> dict[str, Any]:
    base = _DIT_SIZES[size]
    return dict(
        _IMAGENET_LATENT,
        hidden_size=base["hidden_size"],
        depth=base["depth"],
        patch_size=2,
        num_heads=heads,
        head_dim=head_dim,
        num_shared_heads=shared,
        top_k=top_k,
        attention_type="moh",
    )


def _build_registry() -> dict[str, dict[str, Any]]:
    presets: dict[str, dict[str, Any]] = {}
    for size, dims in _DIT_SIZES.items():
        for patch in (2, 4, 8):
            presets[f"DiT-{size}/{patch}"] = dict(_IMAGENET_LATENT, **dims, patch_size=patch, attention_type="mha")

    # MoH-DiT (MoH paper). Lists: heads per layer, shared heads per layer, top-k per layer (0 = dense).
    presets["MoH-DiT-XL/2-90"] = _moh(
        "XL",
        72,
        heads=_runs((8, 9), (16, 10), (24, 9)),
        shared=_runs((8, 9), (16, 10), (16, 9)),
        top_k=_runs((0, 19), (3, 9)),
    )
    presets["MoH-DiT-XL/2-75"] = _moh(
        "XL",
        72,
        heads=_runs((8, 9), (16, 10), (24, 9)),
        shared=_runs((8, 9), (10, 10), (14, 9)),
        top_k=_runs((0, 9), (2, 10), (2, 9)),
    )
    presets["MoH-DiT-L/2-90"] = _moh(
        "L",
        64,
        heads=_runs((8, 8), (16, 8), (24, 8)),
        shared=_runs((8, 8), (16, 8), (16, 8)),
        top_k=_runs((0, 16), (3, 8)),
    )
    presets["MoH-DiT-L/2-75"] = _moh(
        "L",
        64,
        heads=_runs((8, 8), (16, 8), (24, 8)),
        shared=_runs((8, 8), (8, 8), (12, 8)),
        top_k=_runs((0, 8), (4, 8), (4, 8)),
    )
    presets["MoH-DiT-B/2-90"] = _moh(
        "B",
        64,
        heads=_runs((12, 12)),
        shared=_runs((6, 5), (7, 5), (12, 2)),
        top_k=_runs((4, 10), (0, 2)),
    )
    presets["MoH-DiT-B/2-75"] = _moh(
        "B",
        64,
        heads=_runs((12, 12)),
        shared=_runs((4, 2), (6, 8), (12, 2)),
        top_k=_runs((2, 2), (3, 8), (0, 2)),
    )
    presets["MoH-DiT-S/2-90"] = _moh(
        "S",
        64,
        heads=_runs((6, 12)),
        shared=_runs((3, 8), (6, 4)),
        top_k=_runs((2, 8), (0, 4)),
    )
    presets["MoH-DiT-S/2-75"] = _moh(
        "S",
        64,
        heads=_runs((6, 12)),
        shared=_runs((2, 2), (3, 8), (6, 2)),
        top_k=_runs((1, 2), (1, 4), (2, 4), (0, 2)),
    )

    # Small CPU presets for 28-32 px images in pixel space ("Ti": width 192, depth 6, 6 heads of 32,
    # patch 4 -> 49 tokens at 28 px). The MoH twins follow the S/2 pattern: routed early layers, dense
    # last layers. Active heads: -90 32/36 (0.89, like S/2-90), -75 27/36, -50 18/36.
    tiny = dict(_SMALL_IMAGES, hidden_size=192, depth=6, num_heads=6, head_dim=32, patch_size=4)
    presets["DiT-Ti/4"] = dict(tiny, attention_type="mha")
    presets["MoH-DiT-Ti/4-90"] = dict(
        tiny, attention_type="moh", num_shared_heads=_runs((3, 4), (6, 2)), top_k=_runs((2, 4), (0, 2))
    )
    presets["MoH-DiT-Ti/4-75"] = dict(
        tiny, attention_type="moh", num_shared_heads=_runs((2, 4), (3, 1), (6, 1)), top_k=_runs((2, 5), (0, 1))
    )
    presets["MoH-DiT-Ti/4-50"] = dict(tiny, attention_type="moh", num_shared_heads=2, top_k=1)
    return presets


PRESETS: dict[str, dict[str, Any]] = _build_registry()


def list_presets(prefix: str | None = None) -> list[str]:
    """Names of the registered presets, optionally only those starting with ``prefix``."""
    return [name for name in PRESETS if prefix is None or name.startswith(prefix)]


def model_config_defaults() -> dict[str, Any]:
    """Every architecture argument of :class:`MoHDiT` with its default."""
    return {k: p.default for k, p in inspect.signature(MoHDiT.__init__).parameters.items() if k != "self"}


def config_keys() -> set[str]:
    """Every architecture argument of :class:`MoHDiT` (the keys a preset or an override may set)."""
    return set(model_config_defaults())


PER_LAYER_KEYS = ("num_heads", "num_shared_heads", "top_k")


def check_config_keys(keys: Iterable[str]) -> None:
    """An error naming every key that is not a :class:`MoHDiT` config key."""
    allowed = config_keys()
    unknown = sorted(set(keys) - allowed)
    if unknown:
        raise ConfigError(f"unknown MoHDiT config keys {unknown}; valid keys: {sorted(allowed)}")


def preset_config(name: str, **overrides: Any) -> dict[str, Any]:
    """The :class:`MoHDiT` config of preset ``name`` with ``overrides`` applied. Unknown presets and keys,
    and per-layer lists whose length is not the depth, are rejected (all such lists in one message)."""
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; known presets: {', '.join(PRESETS)}")
    check_config_keys(overrides)
    config = {k: (list(v) if isinstance(v, list) else v) for k, v in PRESETS[name].items()}
    config.update(overrides)
    depth = config.get("depth", 1)
    wrong = [k for k in PER_LAYER_KEYS if isinstance(config.get(k), (list, tuple)) and len(config[k]) != depth]
    if wrong:
        # the preset's pattern stretched over the new depth (each layer takes the value at its share of the depth)
        stretched = [f"model.overrides.{k}=[{','.join(map(str, stretch(config[k], depth)))}]" for k in wrong]
        entries = ", ".join(f"{k} ({len(config[k])} entries)" for k in wrong)
        raise ConfigError(
            f"{name} with depth={depth}: {entries} give one value per layer of another depth; give one list per key of "
            f"{depth} values, for example the preset's pattern stretched: {' '.join(stretched)} (or one int for every "
            f"layer)"
        )
    return config


def stretch(values: list, depth: int) -> list:
    """A per-layer list over ``depth`` layers: layer ``i`` takes the value at the same share of the list's depth."""
    n = len(values)
    return [values[min(n - 1, round(i * (n - 1) / max(depth - 1, 1)))] for i in range(depth)]


# The keys a data set fills in: a preset trained on other data is still that preset.
DATA_KEYS = ("sample_size", "in_channels", "num_classes")
# The keys the training objective fills in (a flow model has no variance head), REPA's training-only alignment
# heads, the block's options and MeanFlow's second time input: a preset trained with another objective, with REPA or
# with LightningDiT's block is still that preset's size and head table (DiT-XL/2 trained by flow matching is
# SiT-XL/2's architecture); cards and logs name the block beside the preset.
OBJECTIVE_KEYS = (
    "learn_sigma",
    "objective",
    "repa_depth",
    "repa_dims",
    "repa_projector_dim",
    "block",
    "time_inputs",
    "end_time_blocks",
)


def architecture(config: Mapping[str, Any]) -> dict[str, Any]:
    """Every architecture argument of ``config`` as the network resolves it, so that two configs that build the
    same network compare equal: defaults filled in (at the top level and inside ``block``: ``{rope: true}`` is
    ``{rope: true, rope_theta: 10000.0}``), ``mlp_norm_eps`` unset as ``norm_eps``, per-layer values as one
    tuple per layer (``top_k=2`` and ``top_k=[2, 2, ...]``)."""
    full = {k: config.get(k, default) for k, default in model_config_defaults().items()}
    full["block"] = BlockOptions.from_config(full["block"]).record()
    if full["mlp_norm_eps"] is None:
        full["mlp_norm_eps"] = full["norm_eps"]
    for key in PER_LAYER_KEYS:
        value = full[key]
        full[key] = tuple(value) if isinstance(value, (list, tuple)) else (value,) * full["depth"]
    return full


# model.preset of a run whose architecture came from weights (init_from, a teacher) that match no preset: its saved
# config names no preset, and the weights it names again build the model
CUSTOM = "custom"


def match_preset(config: Mapping[str, Any]) -> str | None:
    """The name of the preset with the architecture of ``config`` (a :class:`MoHDiT` config; image size,
    channels and class count may differ, see ``DATA_KEYS``, and the objective, ``OBJECTIVE_KEYS``), or None when
    no preset has it."""
    wanted = architecture(config)
    for name in PRESETS:
        if architecture(preset_config(name, **{k: wanted[k] for k in (*DATA_KEYS, *OBJECTIVE_KEYS)})) == wanted:
            return name
    return None


def create_model(name: str, **overrides: Any) -> MoHDiT:
    """Build preset ``name`` (see :func:`list_presets`), with any config field overridden."""
    return MoHDiT(**preset_config(name, **overrides))
