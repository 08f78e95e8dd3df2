"""Sampling caches (moh_dit/sampling/caches.py): each of diffusers' caches hooks MoH-DiT's blocks and skips what it
says it skips (counted attention calls), a cache that never skips draws exactly the uncached images, MagCache's
calibration equals diffusers' own, every batch composition keeps its own cache, and a cache is part of a sample set's
identity and of `moh-dit sample`'s options."""

import json

import numpy as np
import pytest
import torch

from moh_dit.errors import ConfigError
from moh_dit.sampling.caches import CachedNetwork, FirstBlockCache, check_cache_options, describe_cache
from moh_dit.sampling.spec import SamplingSpec

from ..helpers.factories import tiny_model, tiny_pipeline

STEPS = 12
LABELS = [0, 1, 2, 0]


@pytest.fixture(scope="module")
def pipe():
    # every layer dense and a few of them, so that the first block and the rest are distinct
    model = tiny_model(signal=0.1, depth=3, num_shared_heads=4, top_k=0).eval()
    return tiny_pipeline(model, scheduler="dpm-solver")


def attention_calls(pipe) -> list[int]:
    """Per block, how often its attention computed (its qkv projection ran: a predicted attention module is called
    but computes nothing); hooks on the model's modules reach the weight-sharing copies."""
    counts = [0] * len(pipe.transformer.blocks)
    for index, block in enumerate(pipe.transformer.blocks):
        block.attn.qkv.register_forward_hook(lambda *_, i=index: counts.__setitem__(i, counts[i] + 1))
    return counts


def sample(pipe, cache=None, options=None, **spec):
    sampling = SamplingSpec.create(
        "dpm-solver", STEPS, spec.pop("guidance", 3.0), cache=cache, cache_options=options, **spec
    )
    gens = [torch.Generator().manual_seed(i) for i in range(len(LABELS))]
    return pipe(LABELS, sampling=sampling, generator=gens, output_type="pt", progress=False).images


def without_hooks(pipe):
    for block in pipe.transformer.blocks:
        block.attn.qkv._forward_hooks.clear()


@pytest.mark.parametrize(
    "cache, options",
    [("first-block", {"threshold": 0.0}), ("magcache", {"threshold": 0.0}), ("taylorseer", {"warmup_steps": 100})],
)
def test_a_cache_that_never_skips_draws_exactly_the_uncached_images(pipe, cache, options):
    plain = sample(pipe)
    torch.testing.assert_close(sample(pipe, cache, options), plain, rtol=0, atol=1e-6)


def test_first_block_cache_runs_the_first_block_always_and_the_rest_only_when_it_changed(pipe):
    counts = attention_calls(pipe)
    try:
        sample(pipe, "first-block", {"threshold": 1e9})  # every call after the first reuses the rest
        assert counts == [STEPS, 1, 1]
        counts[:] = [0, 0, 0]
        sample(pipe, "first-block", {"threshold": 0.05})
        assert counts[0] == STEPS and counts[1] == counts[2] < STEPS  # some calls skipped, the same ones
    finally:
        without_hooks(pipe)


def test_magcache_skips_after_its_retention_and_at_most_max_skip_steps_in_a_row(pipe):
    counts = attention_calls(pipe)
    try:
        options = {"threshold": 1e9, "max_skip_steps": 2, "retention_ratio": 0.25, "calibration_images": 2}
        sample(pipe, "magcache", options)
        calibration = STEPS  # the calibration run: every call, every block
        # after 3 calls in full (a quarter of 12), each full call is followed by at most 2 skipped ones
        full = 3 + (STEPS - 3 + 2) // 3
        assert counts == [calibration + full] * 3
    finally:
        without_hooks(pipe)


def test_magcache_calibration_equals_diffusers_own(pipe):
    from diffusers.hooks import HookRegistry, MagCacheConfig
    from diffusers.hooks.hooks import CacheContext

    from moh_dit.sampling.caches import _register_block, _shared_copy

    spec = SamplingSpec.create("dpm-solver", STEPS, 3.0)
    noise = torch.randn(4, 1, 8, 8, generator=torch.Generator().manual_seed(0))
    labels = torch.tensor(LABELS)
    recording = CachedNetwork.calibrating(pipe.transformer)
    pipe.denoise(noise, labels, spec, None, False, recording)
    ours = recording.recorded_ratios
    assert list(ours) == ["guided"] and len(ours["guided"]) == STEPS and ours["guided"][0] == 1.0

    _register_block()
    copy = _shared_copy(pipe.transformer)  # diffusers' calibration mode; one call more, so that it keeps its list
    copy.enable_cache(MagCacheConfig(calibrate=True, num_inference_steps=STEPS + 1))

    def theirs(role, *inputs):
        with copy.cache_context("inference"):
            return copy(*inputs)

    pipe.denoise(noise, labels, spec, None, False, theirs)
    hook = HookRegistry.check_if_exists_or_initialize(copy.blocks[-1]).get_hook("mag_cache_block_hook")
    hook.state_manager.set_context(CacheContext(name="inference"))
    recorded = hook.state_manager.get_state().calibration_ratios
    assert recorded == pytest.approx(ours["guided"], rel=1e-6)


def test_taylorseer_predicts_attention_and_mlp_between_full_calls(pipe):
    counts = attention_calls(pipe)
    try:
        out = sample(pipe, "taylorseer", {"cache_interval": 4, "warmup_steps": 2})
        # full calls: the first 2, then every 4th: calls 3, 7, 11 (from 0) -> 5 of 12
        assert counts == [5, 5, 5]
        assert torch.isfinite(out).all()
    finally:
        without_hooks(pipe)


def test_each_batch_composition_has_its_own_cache_and_the_images_stay_close(pipe):
    counts = attention_calls(pipe)
    try:
        # guidance on the steps at timesteps 300..999 only: CFG's batched calls and then the conditional calls
        # alone (a batch half the size), each a sequence of its own
        interval = dict(guidance_interval=(300, 999))
        cached = sample(pipe, "first-block", {"threshold": 1e9}, **interval)
        assert counts[1] == 2  # the first call of each composition ran in full
        plain = sample(pipe, **interval)
        assert cached.shape == plain.shape and torch.isfinite(cached).all()
    finally:
        without_hooks(pipe)
    network = CachedNetwork(pipe.transformer, FirstBlockCache())
    x, t, y = torch.randn(2, 1, 8, 8), torch.tensor([500, 500]), torch.tensor([0, 1])
    network("plain", x, t, y)
    network("guided", torch.cat([x, x]), torch.cat([t, t]), torch.cat([y, y]))
    assert set(network._copies) == {"plain", "guided"}
    assert all(p is q for p, q in zip(network._copies["plain"].parameters(), pipe.transformer.parameters()))
    assert not hasattr(pipe.transformer, "_diffusers_hook") or not pipe.transformer.is_cache_enabled


def test_cache_options_are_checked_described_and_recorded():
    assert check_cache_options("magcache", {"threshold": 0.1})["max_skip_steps"] == 3
    with pytest.raises(ConfigError, match="the first-block cache takes threshold"):
        check_cache_options("first-block", {"cache_interval": 2})
    with pytest.raises(ConfigError, match="cache must be one of first-block, magcache, taylorseer"):
        check_cache_options("pab", None)
    with pytest.raises(ConfigError, match="need a cache"):
        SamplingSpec.create(cache_options={"threshold": 0.1})
    with pytest.raises(ConfigError, match="cache_interval must be a whole number"):
        check_cache_options("taylorseer", {"cache_interval": 1.5})
    spec = SamplingSpec.create("euler", 25, cache="taylorseer", cache_options={"cache_interval": 3})
    assert "TaylorSeer (cache interval 3, max order 1, warmup steps 3)" in spec.describe()
    assert SamplingSpec.from_record(spec.record()) == spec and spec.tag().startswith("-taylorseer-")
    assert describe_cache(None, {}) == ""


def test_a_cached_sample_set_is_its_own_and_sample_py_records_the_cache(tmp_path, caplog):
    from moh_dit.errors import ArtifactError
    from moh_dit.sampling.generation import GenerationSettings, generate_samples

    from ..helpers.factories import run_in_process

    pipe = tiny_pipeline(tiny_model(signal=0.1), scheduler="dpm-solver")
    spec = SamplingSpec.create("dpm-solver", 4, 2.0, cache="first-block", cache_options={"threshold": 0.2})
    settings = GenerationSettings(4, seed=0, batch_size=2, label_mode="balanced", sampling=spec)
    npz = generate_samples(pipe, tmp_path / "cached", settings)
    identity = json.loads(str(np.load(npz)["moh_dit_manifest"]))["identity"]
    assert identity["cache"] == "first-block" and identity["cache_options"] == {"threshold": 0.2}
    uncached = GenerationSettings(
        4, seed=0, batch_size=2, label_mode="balanced", sampling=spec.replace(cache=None, cache_options=None)
    )
    with pytest.raises(ArtifactError, match="other settings"):
        generate_samples(pipe, tmp_path / "cached", uncached)

    pipe.save_pretrained(tmp_path / "pipeline")
    args = [tmp_path / "pipeline", "--num-steps", "4", "--per-class", "2", "--out", tmp_path / "grid.png"]
    logged = run_in_process("sample", [*args, "--cache", "magcache", "--cache-option", "calibration_images=2"], caplog)
    assert "MagCache (calibration images 2" in logged and (tmp_path / "grid.png").is_file()
    with pytest.raises(SystemExit):
        run_in_process("sample", [*args, "--cache", "pab"], caplog)


def test_a_new_cache_is_one_class_and_one_table_entry(pipe, monkeypatch):
    """docs/development.md#add-a-cache: a subclass with its options, its diffusers config per batch composition and,
    where it needs one, its preparation on the model; and its entry in CACHES."""
    from diffusers.hooks import FirstBlockCacheConfig

    from moh_dit.sampling import caches

    prepared = []

    class GuidedOnly(caches.SamplingCache):  # FirstBlockCache on CFG's batched calls only
        name, title = "guided-only", "GuidedOnly"
        defaults = {"threshold": 0.05}

        def prepare(self, pipe, sampling, guide=None):
            prepared.append(sampling.cache.name)

        def config_for(self, role):
            return FirstBlockCacheConfig(threshold=self.settings["threshold"]) if role == "guided" else None

    monkeypatch.setitem(caches.CACHES, GuidedOnly.name, GuidedOnly)
    counts = attention_calls(pipe)
    try:
        sample(pipe, "guided-only", {"threshold": 1e9})
        assert counts == [STEPS, 1, 1] and prepared == ["guided-only"]  # the guided calls cached, prepared once
        sample(pipe, "guided-only", {"threshold": 1e9})
        assert prepared == ["guided-only"]  # the pipeline keeps it for this model and spec
    finally:
        without_hooks(pipe)
    spec = SamplingSpec.create("euler", 25, cache="guided-only")
    assert "GuidedOnly (threshold 0.05)" in spec.describe() and caches.CACHES["guided-only"] is GuidedOnly
