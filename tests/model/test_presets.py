"""Preset registry: exact parameter counts, head tables measured from a forward pass, overrides."""

import pytest
import torch

from moh_dit import PRESETS, create_model, list_presets, preset_config
from moh_dit.errors import ConfigError

# 256 px ImageNet (32 x 32 x 4 latents), 1000 classes, learned sigma, frozen positional embedding counted.
PARAM_COUNTS = {
    "DiT-S/2": 32_963_360,
    "DiT-B/2": 130_512_416,
    "DiT-L/2": 458_102_816,
    "DiT-XL/2": 675_129_632,
    "MoH-DiT-S/2-90": 32_997_152,
    "MoH-DiT-S/2-75": 32_998_688,
    "MoH-DiT-B/2-90": 130_638_368,
    "MoH-DiT-B/2-75": 130_638_368,
    "MoH-DiT-L/2-90": 458_512_416,
    "MoH-DiT-L/2-75": 458_528_800,
    "MoH-DiT-XL/2-90": 675_666_464,
    "MoH-DiT-XL/2-75": 675_689_504,
}
ACTIVE_HEADS = {
    "MoH-DiT-XL/2-90": (403, 448),
    "MoH-DiT-XL/2-75": (336, 448),
    "MoH-DiT-L/2-90": (344, 384),
    "MoH-DiT-L/2-75": (288, 384),
    "MoH-DiT-B/2-90": (129, 144),
    "MoH-DiT-B/2-75": (108, 144),
    "MoH-DiT-S/2-90": (64, 72),
    "MoH-DiT-S/2-75": (54, 72),
}


@pytest.mark.parametrize("name,count", PARAM_COUNTS.items())
def test_exact_parameter_counts(name, count):
    with torch.device("meta"):
        model = create_model(name)
    assert sum(p.numel() for p in model.parameters()) == count


@pytest.mark.parametrize("name,heads", ACTIVE_HEADS.items())
def test_active_heads_measured_from_forward(name, heads):
    """Same head tables at a narrow width: count the heads each token really used in a forward pass."""
    torch.manual_seed(0)
    model = create_model(name, hidden_size=32, head_dim=4, sample_size=8, num_classes=10).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "router" in n:
                p.normal_(0, 1.0)
    assert model.head_counts() == heads
    x = torch.randn(2, 4, 8, 8)
    out = model(x, torch.tensor([10, 500]), torch.tensor([1, 7]), return_head_masks=True)
    used = sum(m.float().sum(-1).mean().item() for m in out.head_masks)
    total = sum(m.shape[-1] for m in out.head_masks)
    assert (used, total) == heads
    assert used / total == pytest.approx(heads[0] / heads[1])


def test_every_dit_size_and_patch_is_registered():
    for size in ("S", "B", "L", "XL"):
        for patch in (2, 4, 8):
            assert f"DiT-{size}/{patch}" in PRESETS
    assert set(list_presets("MoH-DiT-S")) >= {"MoH-DiT-S/2-90", "MoH-DiT-S/2-75"}
    assert all(name.startswith("DiT-") for name in list_presets("DiT-"))


def test_small_cpu_presets_run_on_28px_images():
    for name in ["DiT-Ti/4", "MoH-DiT-Ti/4-90", "MoH-DiT-Ti/4-75", "MoH-DiT-Ti/4-50"]:
        model = create_model(name).eval()
        assert model.config.sample_size == 28 and model.config.num_classes == 10
        out = model(torch.randn(2, 1, 28, 28), torch.tensor([1, 2]), torch.tensor([3, 4]))
        assert out.sample.shape == (2, 2, 28, 28)
    assert create_model("MoH-DiT-Ti/4-75").head_counts() == (27, 36)
    assert create_model("MoH-DiT-Ti/4-50").head_counts() == (18, 36)


def test_overrides_apply_and_do_not_leak_into_registry():
    cfg = preset_config("MoH-DiT-S/2-90", num_classes=10, sample_size=16)
    assert cfg["num_classes"] == 10 and cfg["sample_size"] == 16
    cfg["num_shared_heads"][0] = 99
    assert PRESETS["MoH-DiT-S/2-90"]["num_shared_heads"][0] == 3
    assert PRESETS["MoH-DiT-S/2-90"]["num_classes"] == 1000


def test_unknown_preset_lists_known_names():
    with pytest.raises(ConfigError, match="MoH-DiT-XL/2-90"):
        create_model("MoH-DiT-XXL/2")


def test_unknown_override_key_rejected():
    with pytest.raises(ConfigError, match="num_head"):
        create_model("DiT-S/2", num_head=3)


def test_a_shallower_preset_names_every_per_layer_list_at_once():
    with pytest.raises(
        ConfigError,
        match=r"depth=4: num_heads \(12 entries\), num_shared_heads \(12 entries\), "
        r"top_k \(12 entries\)",
    ):
        preset_config("MoH-DiT-S/2-75", depth=4)
    model = create_model("MoH-DiT-S/2-75", depth=4, num_heads=6, num_shared_heads=2, top_k=1, hidden_size=96)
    assert [a.num_active_heads for a in model.attention_layers] == [3] * 4


def test_match_preset_names_the_architecture_of_a_config_whatever_its_data():
    from moh_dit.model.presets import match_preset

    for name in PRESETS:  # every preset is found from its own config, on other data too (no two presets alike)
        assert match_preset(preset_config(name)) == name
        assert match_preset(preset_config(name, num_classes=3, sample_size=12, in_channels=2)) == name
    # a per-layer value given once equals the same value for every layer
    uniform = dict(preset_config("MoH-DiT-Ti/4-50"), num_shared_heads=[2] * 6, top_k=[1] * 6)
    assert match_preset(uniform) == "MoH-DiT-Ti/4-50"
    assert match_preset(dict(create_model("DiT-Ti/4", num_classes=4).config)) == "DiT-Ti/4"
    assert match_preset(preset_config("MoH-DiT-Ti/4-50", top_k=2)) is None
    assert match_preset(preset_config("DiT-S/2", mlp_ratio=2.0)) is None
    # what the objective or REPA decide (the variance head, the record, alignment heads) is not the architecture
    flow = {"name": "flow", "path": "linear", "convention": "sit"}
    assert match_preset(preset_config("DiT-XL/2", learn_sigma=False, objective=flow)) == "DiT-XL/2"  # SiT-XL/2
    assert match_preset(preset_config("DiT-B/2", repa_depth=4, repa_dims=[768])) == "DiT-B/2"
    # MeanFlow's second time input: every preset (MoH included), with or without the 2025 block, is still itself
    meanflow = {"objective": {"name": "meanflow"}, "learn_sigma": False, "time_inputs": 2}
    modern = {"norm": "rmsnorm", "mlp": "swiglu", "qk_norm": "rmsnorm", "rope": True}
    for name in PRESETS:
        assert match_preset(preset_config(name, **meanflow)) == name
        assert match_preset(preset_config(name, **meanflow, block=modern)) == name


def test_architecture_compares_what_the_network_resolves():
    from moh_dit.model.presets import architecture

    recorded = {"block": {"norm": "layernorm", "mlp": "gelu", "qk_norm": "none", "rope": True, "rope_theta": 1e4}}
    assert architecture({"block": {"rope": True}}) == architecture(recorded)
    assert architecture({"block": {"rope": True, "rope_theta": 100}}) != architecture(recorded)
    assert architecture({"block": {}}) == architecture({"block": None})  # DiT's block either way
    assert architecture({"norm_eps": 1e-5}) == architecture({"norm_eps": 1e-5, "mlp_norm_eps": 1e-5})
    assert architecture({"mlp_norm_eps": 1e-5}) != architecture({})
