"""Sampling caches: diffusers' hooks that skip part of the network at some sampler calls, reusing what earlier calls
computed. One class per cache, one entry each in :data:`CACHES`; names, options and defaults are checked without torch
(``--help``, specs and configs read them first); diffusers and torch load when a cache is applied.

- ``first-block`` (diffusers' ``FirstBlockCacheConfig``; the idea of TeaCache): the first block always runs; when its
  residual changed by less than ``threshold`` (relative mean absolute change) since the last full call, the other
  blocks are skipped and their last residual reused.
- ``magcache`` (Ma et al. 2025, ``MagCacheConfig``): every block is skipped at a call whose residual is predicted from
  the calibrated ratios of residual norms between calls to have changed by at most ``threshold`` (accumulated), at
  most ``max_skip_steps`` calls in a row, never in the first ``retention_ratio`` of the calls. Its ratios are the
  model's own: the cache calibrates them before sampling (:meth:`MagCache.prepare`: an uncached run on
  ``calibration_images`` images of a fixed seed, the ratios computed as diffusers' calibration does; a pure function
  of the model and the settings).
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

A new cache is a subclass of :class:`SamplingCache` and an entry in :data:`CACHES` (docs/development.md#add-a-cache).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping
from typing import Any, ClassVar

from moh_dit.argtypes import is_number
from moh_dit.errors import ConfigError

__all__ = [
    "SamplingCache",
    "FirstBlockCache",
    "MagCache",
    "TaylorSeer",
    "CACHES",
    "cache_class",
    "prepared_cache",
    "check_cache_options",
    "describe_cache",
    "CachedNetwork",
]


class SamplingCache:
    """A sampling cache: its name, options, defaults and checks (class attributes), and for one pipeline and one spec
    (an instance) what it needs before sampling (:meth:`prepare`: MagCache's calibration) and the diffusers config of
    the hooks each batch composition (``role``) runs with (:meth:`config_for`; ``None``: that role runs uncached)."""

    name: ClassVar[str]
    title: ClassVar[str]
    defaults: ClassVar[dict[str, float]] = {}
    counts: ClassVar[tuple[str, ...]] = ()  # options that count (whole numbers)
    at_least_one: ClassVar[tuple[str, ...]] = ()
    at_most_one: ClassVar[tuple[str, ...]] = ()  # shares

    def __init__(self, options: Mapping[str, Any] | None = None) -> None:
        self.settings = self.check(options)

    @classmethod
    def check(cls, options: Mapping[str, Any] | None) -> dict[str, float]:
        """The cache's options with its defaults filled in; an unknown option or a bad value is a :class:`ConfigError`
        naming what the cache takes."""
        given = dict(options or {})
        unknown = sorted(set(given) - set(cls.defaults))
        if unknown:
            raise ConfigError(f"the {cls.name} cache takes {', '.join(cls.defaults)}; got {unknown}")
        for key, value in given.items():
            number = is_number(value) and math.isfinite(value)
            counting, share = key in cls.counts, key in cls.at_most_one
            if not number or value < 0 or (counting and int(value) != value) or (share and value > 1):
                kind = "a whole number >= 0" if counting else "a number >= 0" + (" and <= 1" * share)
                raise ConfigError(f"the {cls.name} cache's {key} must be {kind}, got {value!r}")
            if key in cls.at_least_one and value < 1:
                raise ConfigError(f"the {cls.name} cache needs {key} >= 1, got {value!r}")
        return {**cls.defaults, **{k: float(v) for k, v in given.items()}}

    @classmethod
    def describe(cls, options: Mapping[str, Any]) -> str:
        """``MagCache (threshold 0.06, max skip steps 3, ...)``."""
        shown = ", ".join(f"{k.replace('_', ' ')} {v:g}" for k, v in options.items())
        return f"{cls.title} ({shown})"

    def prepare(self, pipe: Any, sampling: Any, guide: Any = None) -> None:
        """What the cache needs of the model before it samples with ``sampling`` (nothing, for most caches)."""

    def config_for(self, role: str) -> Any | None:
        """The diffusers config of the hooks for the calls of ``role`` (``None``: uncached)."""
        raise NotImplementedError


class FirstBlockCache(SamplingCache):
    name, title = "first-block", "FirstBlockCache"
    defaults = {"threshold": 0.05}

    def config_for(self, role: str) -> Any:
        from diffusers.hooks import FirstBlockCacheConfig

        return FirstBlockCacheConfig(threshold=self.settings["threshold"])


class MagCache(SamplingCache):
    """MagCache with the ratios of this model, calibrated per role by :meth:`prepare` (once per instance: the pipeline
    keeps one instance per model and spec)."""

    name, title = "magcache", "MagCache"
    defaults = {"threshold": 0.06, "max_skip_steps": 3, "retention_ratio": 0.2, "calibration_images": 16}
    counts = ("max_skip_steps", "calibration_images")
    at_least_one = ("calibration_images",)
    at_most_one = ("retention_ratio",)

    def __init__(self, options: Mapping[str, Any] | None = None) -> None:
        super().__init__(options)
        self.ratios: dict[str, list[float]] | None = None

    def prepare(self, pipe: Any, sampling: Any, guide: Any = None) -> None:
        """Calibrate the ratios on ``pipe``'s model: one uncached run of ``sampling`` on ``calibration_images`` images of
        seed 0 (classes in turn), so that every batch and every process samples with the same ratios."""
        if self.ratios is not None:
            return
        import logging

        import torch

        count, transformer = int(self.settings["calibration_images"]), pipe.transformer
        device, size = pipe._execution_device, transformer.config.sample_size
        num_classes = transformer.config.num_classes
        labels = torch.arange(count, device=device) % num_classes if num_classes > 0 else None
        noise = torch.randn((count, transformer.in_channels, size, size), generator=torch.Generator().manual_seed(0))
        recording = CachedNetwork.calibrating(transformer)
        uncached = sampling.replace(cache=None)
        pipe.denoise(noise.to(device), labels, uncached, torch.Generator().manual_seed(1), False, recording, guide)
        self.ratios = recording.recorded_ratios
        shown = {k: len(v) for k, v in self.ratios.items()}
        logging.getLogger("moh_dit.sampling").info("MagCache calibrated on %d images: %s", count, shown)

    def config_for(self, role: str) -> Any | None:
        import torch
        from diffusers.hooks import MagCacheConfig

        ratios = (self.ratios or {}).get(role)
        if ratios is None:
            return None
        return MagCacheConfig(
            threshold=self.settings["threshold"],
            max_skip_steps=int(self.settings["max_skip_steps"]),
            retention_ratio=self.settings["retention_ratio"],
            num_inference_steps=len(ratios),
            mag_ratios=torch.tensor(ratios),
        )


class TaylorSeer(SamplingCache):
    """TaylorSeer on every block's attention and MLP outputs (diffusers' default hooks attention only; its paper caches
    both)."""

    name, title = "taylorseer", "TaylorSeer"
    defaults = {"cache_interval": 5, "warmup_steps": 3, "max_order": 1}
    counts = ("cache_interval", "warmup_steps", "max_order")
    at_least_one = ("cache_interval",)

    def config_for(self, role: str) -> Any:
        import torch
        from diffusers.hooks import TaylorSeerCacheConfig

        return TaylorSeerCacheConfig(
            cache_interval=int(self.settings["cache_interval"]),
            disable_cache_before_step=int(self.settings["warmup_steps"]),
            max_order=int(self.settings["max_order"]),
            taylor_factors_dtype=torch.float32,  # the network's precision for its predictions (diffusers' default: bf16)
            cache_identifiers=[r"blocks\.\d+\.attn", r"blocks\.\d+\.mlp"],
        )


CACHES: dict[str, type[SamplingCache]] = {cache.name: cache for cache in (FirstBlockCache, MagCache, TaylorSeer)}


def prepared_cache(pipe: Any, sampling: Any, guide: Any = None) -> SamplingCache:
    """The cache ``sampling`` names, prepared for ``pipe``'s model (:meth:`SamplingCache.prepare`)."""
    cache = cache_class(sampling.cache.name)(sampling.cache.settings)
    cache.prepare(pipe, sampling, guide)
    return cache


def cache_class(name: str) -> type[SamplingCache]:
    """The class of cache ``name``; an unknown name is a :class:`ConfigError` listing the caches."""
    if name not in CACHES:
        raise ConfigError(f"cache must be one of {', '.join(CACHES)} (or none), got {name!r}")
    return CACHES[name]


def check_cache_options(cache: str | None, options: Mapping[str, Any] | None) -> dict[str, float]:
    """The cache's options with its defaults filled in (``{}`` without a cache; options without one are an error)."""
    if cache is None:
        if options:
            raise ConfigError(f"cache_options {sorted(options)} need a cache (one of {', '.join(CACHES)})")
        return {}
    return cache_class(cache).check(options)


def describe_cache(cache: str | None, options: Mapping[str, Any]) -> str:
    """``MagCache (threshold 0.06, ...)`` or ``""`` without a cache."""
    return "" if cache is None else cache_class(cache).describe(options)


def options_help() -> str:
    """Every cache's options, for ``--cache-option``'s help."""
    return "; ".join(f"{name}: {', '.join(cache.defaults)}" for name, cache in CACHES.items())


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


def _shared_copy(model: Any) -> Any:
    """A copy of ``model`` that shares its parameters and buffers (no memory for weights): hooks on it do not touch
    ``model``."""
    memo = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    return copy.deepcopy(model, memo)


class CachedNetwork:
    """Calls of the transformer during one sampling run, each batch composition (``role``) through its own
    weight-sharing copy carrying ``cache``'s hooks, inside a cache context. Without a cache, the transformer itself."""

    def __init__(self, transformer: Any, cache: SamplingCache | None = None) -> None:
        self.transformer, self.cache = transformer, cache
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
        config = self.cache.config_for(role) if self.cache is not None else None
        if config is None:
            return self.transformer
        _register_block()
        network = _shared_copy(self.transformer)
        network.enable_cache(config)
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
