"""Record what the official LightningDiT code computes on tiny seeded inputs, for the parity tests of moh-dit's block
options, its LightningDiT interop and its VA-VAE loading (tests/model/test_block.py, tests/interop/test_lightningdit.py).
The official code is read from a checkout given on the command line and never copied into this repository; only its
outputs are kept (``lightningdit_official.safetensors``, and the settings in ``lightningdit_official.json``).

    git clone https://github.com/hustvl/LightningDiT /tmp/LightningDiT      # (commit 2725fed was recorded)
    pip install --target /tmp/ldit_deps einops torchdiffeq                   # what the official code imports
    python tests/reference_outputs/record_lightningdit.py --repo /tmp/LightningDiT --deps /tmp/ldit_deps

``fairscale`` (imported by its RMSNorm module, unused by the class) is stubbed; ``torch.compile`` is disabled
(TORCHDYNAMO_DISABLE), so the decorated functions run as written. What is recorded:

- ``RMSNorm``, ``SwiGLUFFN`` and ``VisionRotaryEmbeddingFast`` (at two grid sizes) on random inputs;
- ``LightningDiTBlock`` with each option alone (QK-norm, SwiGLU, RMSNorm, RoPE), none and all: weights and outputs;
- a tiny ``LightningDiT`` with every option on and with none (patch 1 and 2): weights, ``forward`` and
  ``forward_with_cfg`` (3 channels, its guidance interval);
- ``Transport.training_losses`` with the cosine (velocity direction) loss, on fixed draws;
- ``Sampler.sample_ode`` (Euler, its time shift 0.3, guidance inside the interval);
- a tiny VA-VAE-layout autoencoder (``tokenizer/autoencoder.py``: 5 levels, f16, attention in the lowest level,
  32 latent channels) with weights drawn from a seed in its key order: its key/shape list, ``encode`` and ``decode``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import types
from pathlib import Path

os.environ["TORCHDYNAMO_DISABLE"] = "1"  # the official modules decorate forwards with torch.compile

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

HERE = Path(__file__).resolve().parent
TINY = dict(input_size=8, in_channels=4, hidden_size=32, depth=2, num_heads=4, num_classes=3)
VAE = dict(ch=32, ch_mult=(1, 1, 2, 2, 2), num_res_blocks=2, resolution=32, attn_resolutions=(2,), z_channels=32)
ALL = dict(use_qknorm=True, use_swiglu=True, use_rope=True, use_rmsnorm=True)


def commit(repo: Path) -> str:
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=repo, capture_output=True, text=True)
    return done.stdout.strip() or "unknown"


def stub_fairscale() -> None:
    """The official rmsnorm module imports fairscale's model-parallel layers for classes the RMSNorm does not use."""
    for name in ("fairscale", "fairscale.nn", "fairscale.nn.model_parallel"):
        sys.modules[name] = types.ModuleType(name)
    init = types.ModuleType("fairscale.nn.model_parallel.initialize")
    layers = types.ModuleType("fairscale.nn.model_parallel.layers")
    layers.ColumnParallelLinear = layers.ParallelEmbedding = layers.RowParallelLinear = object
    sys.modules[init.__name__], sys.modules[layers.__name__] = init, layers


def with_signal(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Every parameter redrawn from N(0, 0.1) (norm weights around 1), so that every path carries signal."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            around = 1.0 if name.endswith("norm.weight") or ".norm" in name and name.endswith("weight") else 0.0
            p.copy_(around + torch.randn(p.shape, generator=g) * 0.1)
    return model.eval()


def seeded_weights(shapes: dict[str, list[int]], seed: int) -> dict[str, torch.Tensor]:
    """Weights from a seed in key order: N(0, 1/fan_in) for kernels, GroupNorm weights around 1, small biases. The
    test rebuilds the same tensors from the recorded key/shape list."""
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


def record_parts(out: dict, g: torch.Generator) -> None:
    from models.pos_embed import VisionRotaryEmbeddingFast
    from models.rmsnorm import RMSNorm
    from models.swiglu_ffn import SwiGLUFFN

    norm = with_signal(RMSNorm(16), 1)
    x = torch.randn(3, 5, 16, generator=g)
    out["rmsnorm.weight"], out["rmsnorm.x"], out["rmsnorm.out"] = norm.weight.detach().clone(), x, norm(x)
    ffn = with_signal(SwiGLUFFN(16, 24), 2)
    out.update({f"swiglu.weights.{k}": v.clone() for k, v in ffn.state_dict().items()})
    out["swiglu.x"], out["swiglu.out"] = x, ffn(x)
    for grid in (4, 3):  # two grid sizes: the tables of another resolution differ in shape
        rope = VisionRotaryEmbeddingFast(dim=4, pt_seq_len=grid)  # head size 8, as the tiny networks
        q = torch.randn(2, 4, grid * grid, 8, generator=g)
        out[f"rope{grid}.cos"], out[f"rope{grid}.sin"] = rope.freqs_cos, rope.freqs_sin
        out[f"rope{grid}.x"], out[f"rope{grid}.out"] = q, rope(q)


def record_blocks(out: dict, g: torch.Generator, settings: dict) -> None:
    from models.lightningdit import LightningDiTBlock
    from models.pos_embed import VisionRotaryEmbeddingFast

    rope = VisionRotaryEmbeddingFast(dim=4, pt_seq_len=4)
    x, c = torch.randn(2, 16, 32, generator=g), torch.randn(2, 32, generator=g)
    out["block.x"], out["block.c"] = x, c
    cases = {
        "none": {},
        "qknorm": dict(use_qknorm=True),
        "swiglu": dict(use_swiglu=True),
        "rmsnorm": dict(use_rmsnorm=True),
        "rope": {},
        "all": dict(use_qknorm=True, use_swiglu=True, use_rmsnorm=True),
    }
    for i, (name, options) in enumerate(cases.items()):
        torch.manual_seed(i)
        block = with_signal(LightningDiTBlock(32, 4, **options), 10 + i)
        out.update({f"block.{name}.weights.{k}": v.clone() for k, v in block.state_dict().items()})
        with torch.no_grad():
            out[f"block.{name}.out"] = block(x, c, rope if name in ("rope", "all") else None)
    settings["blocks"] = {name: dict(options, use_rope=name in ("rope", "all")) for name, options in cases.items()}


def record_networks(out: dict, g: torch.Generator, settings: dict) -> None:
    from models.lightningdit import LightningDiT

    x, t, y = torch.randn(6, 4, 8, 8, generator=g), torch.rand(6, generator=g), torch.tensor([0, 1, 2, 0, 1, 3])
    out["net.x"], out["net.t"], out["net.y"] = x, t, y
    for name, options, patch in (("none", {}, 2), ("all", ALL, 2), ("all_p1", ALL, 1)):
        torch.manual_seed(0)
        net = with_signal(LightningDiT(patch_size=patch, **TINY, **options), 20)
        out.update({f"net.{name}.weights.{k}": v.clone() for k, v in net.state_dict().items()})
        with torch.no_grad():
            out[f"net.{name}.out"] = net(x, t, y)
            half = torch.cat([x[:3], x[:3]])
            tt = torch.tensor([0.05, 0.05, 0.05, 0.05, 0.05, 0.05])  # below the interval's start: unguided
            for label, times in (("in", t[[0, 1, 2, 0, 1, 2]].clamp_min(0.2)), ("before", tt)):
                out[f"net.{name}.cfg_{label}.t"] = times
                out[f"net.{name}.cfg_{label}.out"] = net.forward_with_cfg(
                    half, times, torch.tensor([0, 1, 2, 3, 3, 3]), 2.5, cfg_interval=True, cfg_interval_start=0.1
                )
        settings["networks"][name] = dict(options, patch_size=patch)


def record_transport(out: dict, g: torch.Generator, settings: dict) -> None:
    from models.lightningdit import LightningDiT
    from transport import Sampler, create_transport

    torch.manual_seed(0)
    net = with_signal(LightningDiT(patch_size=2, **TINY, **ALL), 20)  # the "all" network above
    transport = create_transport("Linear", "velocity", use_cosine_loss=True, use_lognorm=True)
    t, noise, data = (
        torch.rand(6, generator=g),
        torch.randn(6, 4, 8, 8, generator=g),
        torch.randn(6, 4, 8, 8, generator=g),
    )
    transport.sample = lambda x1, *args: (t, noise, x1)
    labels = torch.tensor([0, 1, 2, 0, 1, 2])
    with torch.no_grad():
        terms = transport.training_losses(net, data, dict(y=labels))
    out["loss.t"], out["loss.noise"], out["loss.data"], out["loss.y"] = t, noise, data, labels
    out["loss.mse"], out["loss.cos"] = terms["loss"], terms["cos_loss"]

    sampler, z = Sampler(transport), torch.randn(3, 4, 8, 8, generator=g)
    steps, shift, start, scale = settings["ode"]["num_steps"], 0.3, 0.3, 2.0
    ode = sampler.sample_ode(sampling_method="euler", num_steps=steps, timestep_shift=shift)
    with torch.no_grad():
        both = torch.cat([z, z])
        kwargs = dict(y=torch.tensor([0, 1, 2, 3, 3, 3]), cfg_scale=scale, cfg_interval=True, cfg_interval_start=start)
        out["ode.noise"], out["ode.x"] = z, ode(both, net.forward_with_cfg, **kwargs)[-1][:3]
        out["ode.unguided"] = ode(z, net.forward, y=torch.tensor([0, 1, 2]))[-1]
    settings["ode"].update(timestep_shift=shift, cfg_interval_start=start, cfg_scale=scale)


def record_vae(out: dict, g: torch.Generator, settings: dict) -> None:
    from tokenizer.autoencoder import Decoder, DiagonalGaussianDistribution, Encoder

    class TinyVAVAE(torch.nn.Module):  # the official AutoencoderKL's four parts, at a tiny width and resolution
        def __init__(self) -> None:
            super().__init__()
            self.encoder, self.decoder = Encoder(**VAE), Decoder(**VAE)
            self.quant_conv = torch.nn.Conv2d(2 * 32, 2 * 32, 1)
            self.post_quant_conv = torch.nn.Conv2d(32, 32, 1)

    vae = TinyVAVAE().eval()
    shapes = {k: list(v.shape) for k, v in vae.state_dict().items()}
    vae.load_state_dict(seeded_weights(shapes, settings["vae"]["seed"]))
    images = torch.rand(2, 3, 32, 32, generator=g) * 2 - 1
    z = torch.randn(2, 32, 2, 2, generator=g)
    with torch.no_grad():
        posterior = DiagonalGaussianDistribution(vae.quant_conv(vae.encoder(images)))
        out["vae.images"], out["vae.mean"], out["vae.logvar"] = images, posterior.mean, posterior.logvar
        out["vae.z"], out["vae.decoded"] = z, vae.decoder(vae.post_quant_conv(z))
    settings["vae"]["shapes"] = shapes


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repo", type=Path, required=True, help="a checkout of hustvl/LightningDiT")
    p.add_argument("--deps", type=Path, default=None, help="a folder with einops and torchdiffeq (pip --target)")
    args = p.parse_args()
    if args.deps:
        sys.path.insert(0, str(args.deps))
    sys.path.insert(0, str(args.repo))
    stub_fairscale()
    out: dict[str, torch.Tensor] = {}
    settings = {"tiny": TINY, "vae_layout": {k: list(v) if isinstance(v, tuple) else v for k, v in VAE.items()}}
    settings.update(networks={}, ode={"num_steps": 7}, vae={"seed": 5}, commit=commit(args.repo))
    settings["torch"] = torch.__version__
    g = torch.Generator().manual_seed(0)
    record_parts(out, g)
    record_blocks(out, g, settings)
    record_networks(out, g, settings)
    record_transport(out, g, settings)
    record_vae(out, g, settings)
    save_file({k: v.detach().clone().contiguous() for k, v in out.items()}, HERE / "lightningdit_official.safetensors")
    (HERE / "lightningdit_official.json").write_text(json.dumps(settings, indent=2) + "\n")
    print(f"recorded {len(out)} tensors of LightningDiT {settings['commit']}")


if __name__ == "__main__":
    main()
