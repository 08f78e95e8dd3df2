"""LightningDiT checkpoints and its VA-VAE against its own code's outputs (tests/reference_outputs/record_lightningdit.py):
a checkpoint (its ``ema`` entry, loaded strictly) becomes a flow model in its convention whose forward, guidance (3
channels, its interval) and shifted Euler sampler give its numbers; it exports back key for key; a checkpoint of
another resolution is refused; REPA checkpoints with QK-norm load; the cosine loss is LightningDiT's; the VA-VAE
layout goes through diffusers' LDM conversion (with its level attention) to the recorded encoder and decoder."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from moh_dit.errors import ConversionError
from moh_dit.interop.sit import load_flow_checkpoint, own_sampling, to_flow_state_dict

RECORDS = Path(__file__).resolve().parents[1] / "reference_outputs"
REC = load_file(RECORDS / "lightningdit_official.safetensors")
SETTINGS = json.loads((RECORDS / "lightningdit_official.json").read_text())


def recorded(prefix: str) -> dict[str, torch.Tensor]:
    return {k[len(prefix) :]: v.clone() for k, v in REC.items() if k.startswith(prefix)}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """The tiny "all options" LightningDiT saved as its train.py saves ({"model", "ema", "opt", "config"})."""
    path = tmp_path_factory.mktemp("ldit") / "0000100.pt"
    weights = recorded("net.all.weights.")
    torch.save({"model": {k: 0 * v for k, v in weights.items()}, "ema": weights, "opt": {}, "config": {}}, path)
    return path


def test_a_checkpoint_loads_its_ema_as_a_flow_model_in_its_convention(checkpoint):
    model, report = load_flow_checkpoint(checkpoint, "lightningdit")
    assert report["weights"] == "ema" and model.config.objective == {
        "name": "flow",
        "path": "linear",
        "convention": "sit",
    }
    assert model.block_options.describe() == "RMSNorm, SwiGLU, QK-norm (rmsnorm), 2-D RoPE"
    with torch.no_grad():
        out = model(REC["net.x"], REC["net.t"], REC["net.y"]).sample
    torch.testing.assert_close(out, REC["net.all.out"], rtol=1e-5, atol=1e-5)
    back = to_flow_state_dict(model, "lightningdit")
    assert back.keys() == recorded("net.all.weights.").keys()
    assert all(torch.equal(v, REC[f"net.all.weights.{k}"]) for k, v in back.items())
    with pytest.raises(ConversionError, match="SiT's code cannot build this model's block"):
        to_flow_state_dict(model, "sit")  # the same convention, but SiT has no RMSNorm, SwiGLU or RoPE


def test_its_guidance_on_three_channels_and_its_interval(checkpoint):
    from moh_dit.sampling.guidance import StepEvaluation, guided_output

    model, _ = load_flow_checkpoint(checkpoint, "lightningdit")
    half, labels = REC["net.x"][:3], torch.tensor([0, 1, 2])
    with torch.no_grad():
        t = REC["net.all.cfg_in.t"][:3]  # inside its interval: guided on the first 3 channels
        guided = guided_output(model, half, t, labels, StepEvaluation(scale=2.5, channels=3))
        torch.testing.assert_close(guided, REC["net.all.cfg_in.out"][:3], rtol=1e-5, atol=1e-5)
        t = REC["net.all.cfg_before.t"][:3]  # before its start (time 0.05 < 0.1, the noisy end): the conditional
        plain = guided_output(model, half, t, labels, StepEvaluation(scale=1.0))
        torch.testing.assert_close(plain, REC["net.all.cfg_before.out"][:3], rtol=1e-5, atol=1e-5)


def test_its_shifted_euler_sampler_with_guidance_in_its_interval(checkpoint):
    from moh_dit.sampling.pipeline import MoHDiTPipeline
    from moh_dit.sampling.spec import SamplingSpec

    model, _ = load_flow_checkpoint(checkpoint, "lightningdit")
    ode = SETTINGS["ode"]
    start, shift = ode["cfg_interval_start"], ode["timestep_shift"]
    pipe = MoHDiTPipeline.build(model, scheduler="euler")
    spec = SamplingSpec.create(
        "euler",
        ode["num_steps"] - 1,  # its grid has num_steps points, so num_steps - 1 Euler steps
        ode["cfg_scale"],
        guidance_channels=3,
        guidance_noise=(0.0, (1 - start) / start),  # its time >= start: noise levels up to (1 - start) / start
        time_shift=1 / shift,  # its shift counts time from noise; moh-dit's from data
    )
    z = REC["ode.noise"]
    guided = pipe([0, 1, 2], latents=z, sampling=spec, output_type="latent", progress=False).images
    torch.testing.assert_close(guided, REC["ode.x"], rtol=1e-4, atol=1e-4)
    plain = pipe([0, 1, 2], latents=z, sampling=spec.replace(guidance_scale=1.0), output_type="latent", progress=False)
    torch.testing.assert_close(plain.images, REC["ode.unguided"], rtol=1e-4, atol=1e-4)
    recorded_spec = own_sampling("lightningdit")  # its FID protocol, recorded with a converted pipeline
    assert (recorded_spec.sampler.num_steps, recorded_spec.guidance.channels) == (249, 3)
    assert recorded_spec.sampler.time_shift == pytest.approx(1 / 0.3) and recorded_spec.guidance.noise == (0.0, 7.0)


def test_the_cosine_loss_is_lightningdits(checkpoint):
    from moh_dit.objectives.flow import Flow

    model, _ = load_flow_checkpoint(checkpoint, "lightningdit")
    flow = Flow(convention="sit", cosine_loss=1.0)
    noised = flow.interpolate(REC["loss.data"], 1 - REC["loss.t"], REC["loss.noise"])  # its t = 1 - s
    with torch.no_grad():
        losses = flow.loss(model(noised.x_t, noised.time, REC["loss.y"]).sample, noised)
    torch.testing.assert_close(losses.mse, REC["loss.mse"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(losses.cos, REC["loss.cos"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(losses.loss, REC["loss.mse"] + REC["loss.cos"], rtol=1e-5, atol=1e-6)


def test_a_checkpoint_of_another_resolution_is_refused_and_says_so(checkpoint, tmp_path):
    with pytest.raises(ConversionError, match=r"another resolution: .* a 4 x 4 token grid, inputs of 8 x 8, not 16"):
        load_flow_checkpoint(checkpoint, "lightningdit", sample_size=16)
    from moh_dit.interop.official import strict_load
    from moh_dit.model.network import MoHDiT

    model, _ = load_flow_checkpoint(checkpoint, "lightningdit")
    bigger = MoHDiT(**{k: v for k, v in model.config.items() if not k.startswith("_")} | {"sample_size": 16})
    with pytest.raises(ConversionError, match=r"position tables \(pos_embed, feat_rope.freqs_cos\) are for 16 tokens"):
        strict_load(bigger, recorded("net.all.weights."), "the checkpoint")


def test_repa_checkpoints_trained_with_qk_norm_load(tmp_path):
    """REPA's and REPA-E's --qk-norm: timm's LayerNorm on each head's queries and keys (weight and bias)."""
    from moh_dit.model.network import MoHDiT

    torch.manual_seed(0)
    repa = MoHDiT(
        sample_size=8, patch_size=2, in_channels=4, hidden_size=32, depth=2, num_heads=4, attention_type="mha",
        num_classes=3, learn_sigma=False, block={"qk_norm": "layernorm"},
        objective={"name": "flow", "path": "linear", "convention": "repa"},
    )  # fmt: skip
    sd = to_flow_state_dict(repa, "repa")
    assert "blocks.0.attn.q_norm.bias" in sd
    sd["bn.running_mean"], sd["bn.running_var"] = torch.zeros(4), torch.ones(4)  # REPA-E's latent BatchNorm
    torch.save({"ema": sd}, tmp_path / "repa.pt")
    loaded, report = load_flow_checkpoint(tmp_path / "repa.pt", "repa")
    assert loaded.block_options.qk_norm == "layernorm" and any("BatchNorm" in d for d in report["dropped"])
    x, t, y = torch.randn(2, 4, 8, 8), torch.rand(2), torch.tensor([0, 1])
    torch.testing.assert_close(loaded(x, t, y).sample, repa(x, t, y).sample)


def test_the_va_vae_layout_converts_through_diffusers_to_the_recorded_encoder_and_decoder():
    from moh_dit.interop.ldm_vae import convert_ldm_autoencoder
    from moh_dit.vae import LatentNormalization, latent_space_of

    layout = SETTINGS["vae_layout"]
    shapes = SETTINGS["vae"]["shapes"]
    weights = seeded_weights(shapes, SETTINGS["vae"]["seed"])
    mean, std = [0.1 * i for i in range(32)], [1.0 + 0.01 * i for i in range(32)]
    vae = convert_ldm_autoencoder(weights, layout, latents_mean=mean, latents_std=std)
    assert vae.config.down_block_types[-1] == "AttnDownEncoderBlock2D" and vae.config.up_block_types[0] == (
        "AttnUpDecoderBlock2D"
    )
    with torch.no_grad():
        posterior = vae.encode(REC["vae.images"]).latent_dist
        decoded = vae.decode(REC["vae.z"]).sample
    torch.testing.assert_close(posterior.mean, REC["vae.mean"], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(posterior.logvar, REC["vae.logvar"], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(decoded, REC["vae.decoded"], rtol=1e-4, atol=1e-4)
    # its statistics normalise as LightningDiT's (latent - mean) / std * multiplier 1
    norm = LatentNormalization.of(latent_space_of(vae))
    z = torch.randn(1, 32, 2, 2)
    expected = (z - torch.tensor(mean).reshape(1, -1, 1, 1)) / torch.tensor(std).reshape(1, -1, 1, 1)
    torch.testing.assert_close(norm.normalize(z), expected)
    assert latent_space_of(vae)["downsample_factor"] == 16


def seeded_weights(shapes: dict, seed: int) -> dict[str, torch.Tensor]:
    """The recording's weights, drawn again from its seed in key order (its ``seeded_weights``)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for key in sorted(shapes):
        shape = shapes[key]
        fan_in = max(1, int(torch.tensor(shape[1:]).prod())) if len(shape) > 1 else 1
        value = torch.randn(shape, generator=g) / fan_in**0.5
        if key.endswith("norm.weight") or ".norm" in key and key.endswith("weight") and len(shape) == 1:
            value = 1.0 + 0.1 * value
        elif len(shape) == 1:
            value = 0.05 * value
        out[key] = value
    return out


def test_the_convert_command_writes_a_vae_folder_and_a_pipeline_that_samples_as_lightningdit(
    checkpoint, tmp_path, caplog
):
    """`moh-dit convert ... --format ldm-vae --latent-stats`, then `--format lightningdit --vae`, then `moh-dit sample`
    and `--to lightningdit`: the pipeline records its own protocol, and the weights come back key for key."""
    from safetensors.torch import save_file

    from moh_dit.interop.ldm_vae import infer_ldm_layout
    from moh_dit.sampling.loading import load_pipeline, recorded_sampling

    from ..helpers.factories import run_in_process

    weights = seeded_weights(SETTINGS["vae"]["shapes"], SETTINGS["vae"]["seed"])
    assert infer_ldm_layout(weights, resolution=32) == {
        k: tuple(v) if isinstance(v, list) else v for k, v in SETTINGS["vae_layout"].items()
    }
    torch.save({"state_dict": weights | {"loss.logvar": torch.zeros(())}}, tmp_path / "vavae.pt")  # LDM's nesting
    torch.save({"mean": torch.zeros(1, 32, 1, 1), "std": torch.full((1, 32, 1, 1), 2.0)}, tmp_path / "stats.pt")
    vae_dir = tmp_path / "vavae"
    run_in_process("convert", [tmp_path / "vavae.pt", vae_dir, "--format", "ldm-vae", "--latent-stats", tmp_path / "stats.pt"], caplog)  # fmt: skip
    assert json.loads((vae_dir / "config.json").read_text())["latents_std"] == [2.0] * 32
    # the tiny network works on 4 channels; its VA-VAE stand-in here has 32: a pipeline pairs them only if they match
    small = dict(SETTINGS["tiny"])
    save_file(recorded("net.all.weights."), tmp_path / "ldit.safetensors")
    with pytest.raises(Exception, match="channel"):
        run_in_process("convert", [tmp_path / "ldit.safetensors", tmp_path / "bad", "--format", "lightningdit", "--vae", vae_dir], caplog)  # fmt: skip
    from ..helpers.factories import tiny_vae

    tiny_vae().save_pretrained(tmp_path / "vae4")  # 4 latent channels, as the tiny network
    pipe_dir = tmp_path / "pipe"
    run_in_process("convert", [checkpoint, pipe_dir, "--format", "lightningdit", "--num-classes", str(small["num_classes"]), "--vae", tmp_path / "vae4"], caplog)  # fmt: skip
    spec = recorded_sampling(pipe_dir)
    assert (spec.sampler.scheduler, spec.sampler.num_steps, spec.guidance.channels) == ("euler", 249, 3)
    pipe = load_pipeline(pipe_dir, device="cpu")
    assert pipe.transformer.block_options.rope and "2-D RoPE" in (pipe_dir / "README.md").read_text()
    run_in_process(
        "sample", [pipe_dir, "--num-steps", "3", "--per-class", "1", "--out", tmp_path / "grid.png"], caplog
    )
    assert (tmp_path / "grid.png").is_file()
    run_in_process("convert", [pipe_dir, tmp_path / "back.pt", "--to", "lightningdit"], caplog)
    back = torch.load(tmp_path / "back.pt", weights_only=True)
    assert back.keys() == recorded("net.all.weights.").keys()
    assert all(torch.equal(v, REC[f"net.all.weights.{k}"]) for k, v in back.items())
