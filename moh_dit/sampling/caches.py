"""Sampling caches: diffusers' hooks that skip part of the network at some sampler calls, reusing what earlier calls
computed. The names, options and defaults are checked without torch (``--help``, specs and configs read them first);
diffusers and torch load when a cache is applied.

- ``first-block`` (diffusers' ``FirstBlockCacheConfig``; the idea of TeaCache): the first block always runs; when its
  residual changed by less than ``threshold`` (relative mean absolute change) since the last full call, the other
  blocks are skipped and their last residual reused.
- ``magcache`` (Ma et al. 2025, ``MagCacheConfig``): every block is skipped at a call whose residual is predicted from
  the calibrated ratios of residual norms between calls to have changed by at most ``threshold`` (accumulated), at
  most ``max_skip_steps`` calls in a row, never in the first ``retention_ratio`` of the calls. Its ratios are the
  model's own: moh-dit calibrates them before sampling (an uncached run on ``calibration_images`` images of a fixed
  seed, the ratios computed as diffusers' calibration does; they are a pure function of the model and the settings).
- ``taylorseer`` (Liu et al. 2025, ``TaylorSeerCacheConfig``): every block's attention and MLP outputs are computed in
  full every ``cache_interval`` calls (and at the first ``warmup_steps``) and predicted by a Taylor expansion of order
  ``max_order`` in between.

Pyramid Attention Broadcast and FasterCache hook diffusers' own attention classes only (``Attention``,
``AttentionModuleMixin``): MoH's attention is not one of them, and diffusers would hook nothing without an error, so
they are not offered (docs/sampling.md#caches).

Each batch composition (CFG's conditional and unconditional halves in one forward, the conditional prediction alone
outside the guidance interval, the copies of grid averaging) is a separate sequence of calls to a cache: moh-dit runs
each through its own weight-sharing copy of the network with its own hooks (:class:`CachedNetwork`), so that a
cache never mixes tensors of two batch sizes and MagCache's ratios are calibrated per sequence.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Mapping
from typing import Any

from moh_dit.errors import ConfigError

__all__ = ["CACHE_OPTIONS", "CACHES", "check_cache_options", "describe_cache", "CachedNetwork"]

# every cache's options and their defaults (diffusers' defaults, except where said)
CACHE_OPTIONS: dict[str, dict[str, float | None]] = {
    "first-block": {"threshold": 0.05},
    "magcache": {"threshold": 0.06, "max_skip_steps": 3, "retention_ratio": 0.2, "calibration_images": 16},
    # TaylorSeer's attention and MLP outputs (diffusers' default hooks attention only; its paper caches both)
    "taylorseer": {"cache_interval": 5, "warmup_steps": 3, "max_order": 1},
}
CACHES = tuple(CACHE_OPTIONS)
CACHE_NAMES = {"first-block": "FirstBlockCache", "magcache": "MagCache", "taylorseer": "TaylorSeer"}
_COUNTS = ("max_skip_steps", "calibration_images", "cache_interval", "warmup_steps", "max_order")


def check_cache_options(cache: str | None, options: Mapping[str, Any] | None) -> dict[str, float]:
    """The cache's options with its defaults filled in (``{}`` without a cache); an unknown cache or option, or a bad
    value, is a :class:`ConfigError` naming what the cache takes."""
    given = dict(options or {})
    if cache is None:
        if given:
            raise ConfigError(f"cache_options {sorted(given)} need a cache (one of {', '.join(CACHES)})")
        return {}
    if cache not in CACHE_OPTIONS:
        raise ConfigError(f"cache must be one of {', '.join(CACHES)} (or none), got {cache!r}")
    known = CACHE_OPTIONS[cache]
    unknown = sorted(set(given) - set(known))
    if unknown:
        raise ConfigError(f"the {cache} cache takes {', '.join(known)}; got {unknown}")
    for key, value in given.items():
        number = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        counting = key in _COUNTS
        if not number or value < 0 or (counting and int(value) != value) or (key == "retention_ratio" and value > 1):
            kind = "a whole number >= 0" if counting else "a number >= 0" + (" and <= 1" * (key == "retention_ratio"))
            raise ConfigError(f"the {cache} cache's {key} must be {kind}, got {value!r}")
    if (
        cache == "taylorseer"
        and given.get("cache_interval", 1) < 1
        or cache == "magcache"
        and given.get("calibration_images", 1) < 1
    ):
        raise ConfigError(f"the {cache} cache needs cache_interval and calibration_images >= 1")
    return {**known, **{k: float(v) for k, v in given.items()}}


def describe_cache(cache: str | None, options: Mapping[str, Any]) -> str:
    """``MagCache (threshold 0.06, max skip steps 3, ...)`` or ``""`` without a cache."""
    if cache is None:
        return ""
    shown = ", ".join(f"{k.replace('_', ' ')} {v:g}" for k, v in options.items())
    return f"{CACHE_NAMES[cache]} ({shown})"


# ----------------------------------------------------------------------------------------------------
# Applying a cache
# ----------------------------------------------------------------------------------------------------
def _register_block() -> None:
    """Tell diffusers' block caches where a MoH-DiT block's tokens are: its first argument ``hidden_states``, and its
    output (one tensor in sampling)."""
    from diffusers.hooks._helpers import TransformerBlockMetadata, TransformerBlockRegistry

    from moh_dit.model.block import DiTBlock

    TransformerBlockRegistry.register(
        DiTBlock, TransformerBlockMetadata(return_hidden_states_index=0, return_encoder_hidden_states_index=None)
    )


def _diffusers_config(cache: str, options: Mapping[str, float], ratios: list[float] | None = None) -> Any:
    """The diffusers config of a cache (MagCache with the ratios calibrated for its sequence of calls)."""
    import torch
    from diffusers.hooks import FirstBlockCacheConfig, MagCacheConfig, TaylorSeerCacheConfig

    if cache == "first-block":
        return FirstBlockCacheConfig(threshold=options["threshold"])
    if cache == "magcache":
        return MagCacheConfig(
            threshold=options["threshold"],
            max_skip_steps=int(options["max_skip_steps"]),
            retention_ratio=options["retention_ratio"],
            num_inference_steps=len(ratios),
            mag_ratios=torch.tensor(ratios),
        )
    return TaylorSeerCacheConfig(
        cache_interval=int(options["cache_interval"]),
        disable_cache_before_step=int(options["warmup_steps"]),
        max_order=int(options["max_order"]),
        taylor_factors_dtype=torch.float32,  # the network's precision for its predictions (diffusers' default: bf16)
        cache_identifiers=[r"blocks\.\d+\.attn", r"blocks\.\d+\.mlp"],
    )


def _shared_copy(model: Any) -> Any:
    """A copy of ``model`` that shares its parameters and buffers (no memory for weights): hooks on it do not touch
    ``model``."""
    memo = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    return copy.deepcopy(model, memo)


class CachedNetwork:
    """Calls of the transformer during one sampling run, each batch composition (``role``) through its own
    weight-sharing copy carrying the cache's hooks, inside a cache context. Without a cache, the transformer itself.

    ``calibration``: MagCache's ratios by role (:meth:`calibrating` records them); a role without ratios runs uncached.
    """

    def __init__(
        self,
        transformer: Any,
        cache: str | None = None,
        options: Mapping[str, float] | None = None,
        calibration: Mapping[str, list[float]] | None = None,
    ) -> None:
        self.transformer, self.cache, self.options = transformer, cache, dict(options or {})
        self.calibration = dict(calibration or {})
        self._copies: dict[str, Any] = {}
        self._recorded: dict[str, list[float]] | None = None

    def __call__(self, role: str, *args: Any, **kwargs: Any) -> Any:
        network = self._network(role)
        if network is self.transformer:
            return network(*args, **kwargs)
        with network.cache_context(role):
            return network(*args, **kwargs)

    def _network(self, role: str) -> Any:
        if role in self._copies:
            return self._copies[role]
        if self._recorded is not None:
            network = self._copies[role] = _shared_copy(self.transformer)
            self._record_ratios(network, self._recorded.setdefault(role, []))
            return network
        if self.cache is None or (self.cache == "magcache" and role not in self.calibration):
            return self.transformer
        _register_block()
        network = _shared_copy(self.transformer)
        network.enable_cache(_diffusers_config(self.cache, self.options, self.calibration.get(role)))
        network._reset_stateful_cache()
        self._copies[role] = network
        return network

    # ------------------------------------------------------------------------------------------------
    # MagCache's calibration
    # ------------------------------------------------------------------------------------------------
    @classmethod
    def calibrating(cls, transformer: Any) -> CachedNetwork:
        """Uncached calls that record, per role, MagCache's ratios: at each call the mean over tokens of the norm of
        the blocks' residual (last block's output minus first block's input) over the previous call's, 1 at the
        first (diffusers' calibration formula; diffusers prints its result, moh-dit keeps it)."""
        network = cls(transformer)
        network._recorded = {}
        return network

    @property
    def recorded_ratios(self) -> dict[str, list[float]]:
        return dict(self._recorded or {})

    @staticmethod
    def _record_ratios(network: Any, ratios: list[float]) -> None:
        import torch

        state: dict[str, Any] = {}

        def keep_input(module, args, kwargs) -> None:
            state["input"] = args[0] if args else kwargs["hidden_states"]

        def ratio(module, args, kwargs, output) -> None:
            residual = (output[0] if isinstance(output, tuple) else output).float() - state["input"].float()
            previous = state.get("residual")
            if previous is None:
                ratios.append(1.0)
            else:
                now, before = torch.linalg.norm(residual, dim=-1), torch.linalg.norm(previous, dim=-1)
                ratios.append(float((now / (before + 1e-8)).mean()))
            state["residual"] = residual

        network.blocks[0].register_forward_pre_hook(keep_input, with_kwargs=True)
        network.blocks[-1].register_forward_hook(ratio, with_kwargs=True)


def calibrate_magcache(run: Callable[[CachedNetwork], None], transformer: Any) -> dict[str, list[float]]:
    """MagCache's ratios by role: ``run`` samples once through the recording network it is given."""
    network = CachedNetwork.calibrating(transformer)
    run(network)
    return network.recorded_ratios
