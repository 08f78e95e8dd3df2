"""The block's options against LightningDiT's own code (recorded by tests/reference_outputs/record_lightningdit.py):
RMSNorm, SwiGLU, each option alone and all of them in a block, and whole networks with every option on and with
none (patch 2 and patch 1); the options with MoH attention (dense and sparse execution agree, with RoPE and
QK-norm); the option table, its records and its errors."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from moh_dit.model.attention import MoHAttention
from moh_dit.model.block import MLPS, NORMS, QK_NORMS, BlockOptions, DiTBlock, SwiGLU
from moh_dit.model.network import MoHDiT
from moh_dit.model.rope import RotaryEmbedding2D

RECORDS = Path(__file__).resolve().parents[1] / "reference_outputs"
REC = load_file(RECORDS / "lightningdit_official.safetensors")
SETTINGS = json.loads((RECORDS / "lightningdit_official.json").read_text())


def options_of(flags: dict) -> BlockOptions:
    """LightningDiT's flags as block options (its QK-norm is RMSNorm with use_rmsnorm, else timm's LayerNorm)."""
    rms = flags.get("use_rmsnorm", False)
    return BlockOptions(
        norm="rmsnorm" if rms else "layernorm",
        mlp="swiglu" if flags.get("use_swiglu") else "gelu",
        qk_norm=("rmsnorm" if rms else "layernorm") if flags.get("use_qknorm") else "none",
        rope=bool(flags.get("use_rope")),
    )


def recorded(prefix: str) -> dict[str, torch.Tensor]:
    return {k[len(prefix) :]: v for k, v in REC.items() if k.startswith(prefix)}


def test_torchs_rmsnorm_is_lightningdits():
    norm = NORMS["rmsnorm"](16, 1e-6)
    norm.load_state_dict({"weight": REC["rmsnorm.weight"]})
    torch.testing.assert_close(norm(REC["rmsnorm.x"]), REC["rmsnorm.out"], rtol=1e-6, atol=1e-6)
    # in bfloat16 too: normalised in float32, back to the input's dtype, then the weight (Llama's order)
    x = REC["rmsnorm.x"].bfloat16()
    y = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)
    theirs = y.type_as(x) * REC["rmsnorm.weight"].bfloat16()
    torch.testing.assert_close(norm.bfloat16()(x), theirs, rtol=0, atol=0.02)


def test_swiglu_is_lightningdits_and_takes_two_thirds_of_the_width():
    ffn = SwiGLU(16, 24)
    ffn.load_state_dict(recorded("swiglu.weights."))
    torch.testing.assert_close(ffn(REC["swiglu.x"]), REC["swiglu.out"], rtol=1e-6, atol=1e-6)
    # LightningDiT-XL's width: int(2/3 * 4608) = 3072, with no rounding to a multiple
    assert MLPS["swiglu"](1152, 4.0).w3.in_features == 3072 and MLPS["swiglu"](1024, 4.0).w3.in_features == 2730


@pytest.mark.parametrize("name", ["none", "qknorm", "swiglu", "rmsnorm", "rope", "all"])
def test_a_block_with_each_option_equals_lightningdits(name):
    flags = SETTINGS["blocks"][name]
    options = options_of(flags)
    attn = MoHAttention(32, 4, attention_type="mha", qk_norm=options.qk_norm_layer())
    block = DiTBlock(32, attn, options=options).eval()
    block.load_state_dict(recorded(f"block.{name}.weights."))
    rope = RotaryEmbedding2D(8, 4) if flags["use_rope"] else None
    with torch.no_grad():
        out, _ = block(REC["block.x"], REC["block.c"], rope)
    torch.testing.assert_close(out, REC[f"block.{name}.out"], rtol=1e-5, atol=1e-5)


def lightningdit_model(name: str) -> MoHDiT:
    """The tiny recorded LightningDiT as a moh-dit model (multi-head, the options of its flags), its weights loaded
    strictly (the RoPE tables and the sin-cos table included)."""
    flags, tiny = SETTINGS["networks"][name], SETTINGS["tiny"]
    model = MoHDiT(
        sample_size=tiny["input_size"],
        patch_size=flags["patch_size"],
        in_channels=tiny["in_channels"],
        hidden_size=tiny["hidden_size"],
        depth=tiny["depth"],
        num_heads=tiny["num_heads"],
        attention_type="mha",
        num_classes=tiny["num_classes"],
        learn_sigma=False,
        block=options_of(flags).record(),
    ).eval()
    model.load_state_dict(recorded(f"net.{name}.weights."), strict=True)
    return model


@pytest.mark.parametrize("name", ["none", "all", "all_p1"])
def test_a_whole_network_equals_lightningdits_with_every_option_and_with_none(name):
    model = lightningdit_model(name)
    with torch.no_grad():
        out = model(REC["net.x"], REC["net.t"], REC["net.y"]).sample  # LightningDiT: raw time in [0, 1]
    torch.testing.assert_close(out, REC[f"net.{name}.out"], rtol=1e-5, atol=1e-5)
    assert (model.feat_rope is not None) == (name != "none")


def test_the_options_work_with_moh_attention_and_sparse_execution_agrees():
    torch.manual_seed(0)
    block = BlockOptions(norm="rmsnorm", mlp="swiglu", qk_norm="rmsnorm", rope=True).record()
    model = MoHDiT(
        sample_size=16, patch_size=2, in_channels=3, hidden_size=48, depth=2, num_heads=6, head_dim=8,
        num_shared_heads=[2, 6], top_k=[2, 0], num_classes=3, block=block,
    )  # fmt: skip
    with torch.no_grad():
        for p in model.parameters():  # every path carries signal (adaLN-Zero starts as the identity)
            p.add_(0.05 * torch.randn_like(p))
    x, t, y = torch.randn(3, 3, 16, 16), torch.tensor([10.0, 500.0, 900.0]), torch.tensor([0, 1, 2])
    outs = {}
    for mode in ("dense", "sparse"):
        model.set_attention_execution(mode)
        for attn in model.attention_layers:  # force both sparse variants: query rows and gathered queries
            if mode == "sparse":
                attn.processor.query_rows_max_share, attn.processor.query_rows_min_tokens_with_grad = 1.0, 0
        with torch.no_grad():
            outs[mode] = model(x, t, y).sample
    torch.testing.assert_close(outs["sparse"], outs["dense"], rtol=1e-5, atol=1e-5)
    model.set_attention_execution("sparse")
    for attn in model.attention_layers:
        attn.processor.query_rows_max_share = 0.0  # the other variant: gather rows of the dense queries
    with torch.no_grad():
        torch.testing.assert_close(model(x, t, y).sample, outs["dense"], rtol=1e-5, atol=1e-5)
    # the load-balance loss, gradients and gradient checkpointing go through every option
    model.train().set_attention_execution("dense")
    model.enable_gradient_checkpointing()
    out = model(x, t, y)
    (out.sample.square().mean() + out.aux_loss).backward()
    trained = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    assert out.aux_loss > 0 and all(p.grad is not None and p.grad.abs().sum() > 0 for _, p in trained), [
        n for n, p in trained if p.grad is None or not p.grad.abs().sum()
    ]


def test_options_are_recorded_in_full_and_dits_block_records_none():
    assert BlockOptions().record() is None and BlockOptions.from_config(None) == BlockOptions()
    assert BlockOptions.from_config({"norm": "rmsnorm"}).record() == {
        "norm": "rmsnorm", "mlp": "gelu", "qk_norm": "none", "rope": False, "rope_theta": 10000.0,
    }  # fmt: skip
    small = dict(sample_size=8, patch_size=2, in_channels=3, hidden_size=32, depth=1, num_heads=4, num_classes=2)
    assert MoHDiT(**small, block={"norm": "layernorm"}).config.block is None  # DiT's block spelt out
    assert MoHDiT(**small, block={"mlp": "swiglu"}).config.block["mlp"] == "swiglu"
    assert BlockOptions(norm="rmsnorm", mlp="swiglu", qk_norm="rmsnorm", rope=True).describe() == (
        "RMSNorm, SwiGLU, QK-norm (rmsnorm), 2-D RoPE"
    )
    assert set(NORMS) == {"layernorm", "rmsnorm"} and set(QK_NORMS) == {"none", "layernorm", "rmsnorm"}


@pytest.mark.parametrize(
    "block, message",
    [
        ({"norm": "batchnorm"}, "block norm must be one of layernorm, rmsnorm"),
        ({"mlp": "relu"}, "block mlp must be one of gelu, swiglu"),
        ({"rope": "yes"}, "block rope must be true or false"),
        ({"rope_theta": 0}, "rope_theta must be a finite number > 1"),
        ({"swiglu": True}, r"unknown block options \['swiglu'\]"),
    ],
)
def test_a_wrong_option_is_an_error_naming_what_exists(block, message):
    with pytest.raises(ValueError, match=message):
        MoHDiT(sample_size=8, patch_size=2, in_channels=3, hidden_size=32, depth=1, num_heads=4, block=block)


def test_rope_needs_one_head_size_divisible_by_four():
    with pytest.raises(ValueError, match="divisible by 4"):
        MoHDiT(sample_size=8, patch_size=2, in_channels=3, hidden_size=36, depth=1, num_heads=6, block={"rope": True})


def test_every_option_runs_in_bfloat16_close_to_float32():
    torch.manual_seed(0)
    block = BlockOptions(norm="rmsnorm", mlp="swiglu", qk_norm="rmsnorm", rope=True).record()
    model = MoHDiT(
        sample_size=8, patch_size=1, in_channels=4, hidden_size=32, depth=2, num_heads=4, num_shared_heads=2,
        top_k=1, num_classes=3, block=block,
    ).eval()  # fmt: skip
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    x, t, y = torch.randn(2, 4, 8, 8), torch.tensor([0.3, 0.9]), torch.tensor([0, 2])
    with torch.no_grad():
        exact = model(x, t, y).sample
        with torch.autocast("cpu", dtype=torch.bfloat16):
            low = model(x, t, y).sample.float()
    assert torch.isfinite(low).all() and (low - exact).abs().max() < 0.05 * exact.abs().max()


def test_lightningdit_xl_1_has_the_parameters_its_log_reports():
    """LightningDiT-XL/1 (DiT-XL/2's size with patch 1, SwiGLU, RMSNorm, RoPE; 32 VA-VAE channels): 675,256,736
    parameters with the sin-cos table, the 675.26M of its training log (its docs/log.txt)."""
    from moh_dit.model.presets import create_model

    with torch.device("meta"):
        model = create_model(
            "DiT-XL/2", patch_size=1, in_channels=32, sample_size=16, learn_sigma=False,
            block={"norm": "rmsnorm", "mlp": "swiglu", "rope": True},
        )  # fmt: skip
    assert sum(p.numel() for p in model.parameters()) == 675_256_736
