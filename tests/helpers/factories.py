"""Tiny models, pipelines, data and configs built in memory for tests (no downloads)."""

import torch
from diffusers import AutoencoderKL

from moh_dit import MoHDiT, create_model
from moh_dit.sampling.pipeline import MoHDiTPipeline

# a two-layer MoH-DiT: layer 0 routes (2 shared + top-1 of 2), layer 1 is dense (4 soft-weighted heads)
TINY_MODEL = dict(
    sample_size=8,
    patch_size=2,
    in_channels=1,
    hidden_size=32,
    depth=2,
    num_heads=4,
    head_dim=8,
    num_shared_heads=[2, 4],
    top_k=[1, 0],
    num_classes=3,
)
TINY_NAMES = {0: "cat", 1: "dog", 2: "Sneaker"}


def give_signal(module: torch.nn.Module, std: float, seed: int = 0, routers: bool = False, every_weight: bool = False):
    """Weights drawn from N(0, std): for the zero-initialised adaLN and output layers (and the routers, with
    ``routers``) so that every path of a fresh DiT carries signal, or for every trainable weight."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            chosen = "adaLN" in name or "final_layer.linear" in name or (routers and "router" in name)
            if p.requires_grad and (every_weight or chosen):
                p.copy_(torch.randn(p.shape, generator=g) * std)
    return module


def tiny_model(
    preset: str | None = None, *, signal: float = 0.0, routers: bool = False, seed: int = 0, **config
) -> MoHDiT:
    """The tests' model factory: ``preset`` with overrides, or :data:`TINY_MODEL` updated by ``config``;
    ``signal`` > 0 gives the zero-initialised layers weights (see :func:`give_signal`)."""
    torch.manual_seed(seed)
    model = create_model(preset, **config) if preset else MoHDiT(**(TINY_MODEL | config))
    return give_signal(model, signal, seed, routers) if signal else model


def tiny_pipeline(model: MoHDiT | None = None, vae=None, scheduler: str = "ddpm", id2label=None) -> MoHDiTPipeline:
    """A pipeline around ``model`` (default: a tiny one with signal) with the test class names."""
    model = model if model is not None else tiny_model(signal=0.1)
    pipe = MoHDiTPipeline.build(model, vae, TINY_NAMES if id2label is None else id2label, scheduler)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def tiny_vae(seed: int = 0, **config) -> AutoencoderKL:
    """A randomly initialised AutoencoderKL with a downsampling factor of 2 and 4 latent channels (``config``
    overrides its config)."""
    torch.manual_seed(seed)
    return AutoencoderKL(
        **{
            "in_channels": 3,
            "out_channels": 3,
            "latent_channels": 4,
            "down_block_types": ("DownEncoderBlock2D", "DownEncoderBlock2D"),
            "up_block_types": ("UpDecoderBlock2D", "UpDecoderBlock2D"),
            "block_out_channels": (8, 16),
            "layers_per_block": 1,
            "norm_num_groups": 4,
            "sample_size": 16,
            **config,
        }
    ).eval()


def tiny_sd3_vae(**config) -> AutoencoderKL:
    """A randomly initialised SD3/Flux-style AutoencoderKL: 16 latent channels, a scale and a shift (SD3's numbers),
    no quant convolutions; downsampling 2."""
    sd3 = dict(latent_channels=16, scaling_factor=1.5305, shift_factor=0.0609, use_quant_conv=False)
    return tiny_vae(1, **(sd3 | {"use_post_quant_conv": False} | config))


def tiny_stats_vae() -> AutoencoderKL:
    """:func:`tiny_vae` with per-channel latent statistics (``latents_mean`` / ``latents_std``, SDXL-style)."""
    return AutoencoderKL.from_config(
        tiny_vae().config, latents_mean=[0.1, -0.2, 0.3, 0.0], latents_std=[0.5, 1.5, 2.0, 1.0], scaling_factor=0.5
    ).eval()


def tiny_dc_ae(**config):
    """A randomly initialised deep-compression autoencoder (diffusers' ``AutoencoderDC``): deterministic, 8 latent
    channels, downsampling 2 (two encoder levels), scale 0.4."""
    from diffusers import AutoencoderDC

    torch.manual_seed(2)
    return AutoencoderDC(
        in_channels=3,
        latent_channels=8,
        attention_head_dim=4,
        encoder_block_types="ResBlock",
        decoder_block_types="ResBlock",
        encoder_block_out_channels=(8, 16),
        decoder_block_out_channels=(8, 16),
        encoder_layers_per_block=(1, 1),
        decoder_layers_per_block=(1, 1),
        encoder_qkv_multiscales=((), ()),
        decoder_qkv_multiscales=((), ()),
        scaling_factor=config.pop("scaling_factor", 0.4),
        **config,
    ).eval()


def make_image_folder(root) -> None:
    """Two classes of 8 noisy 16x16 RGB images: bright squares on dark, and dark squares on bright."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    for label, name in enumerate(["bright", "dark"]):
        (root / name).mkdir(parents=True)
        for i in range(8):
            img = np.full((16, 16, 3), 40 if label == 0 else 215, dtype=np.uint8)
            img[4:12, 4:12] = 215 if label == 0 else 40
            img = np.clip(img + rng.integers(-10, 10, img.shape), 0, 255).astype(np.uint8)
            Image.fromarray(img).save(root / name / f"{i}.png")


def tiny_train_config(out_dir, data_dir, image_size=8) -> dict:
    """A config (as a dict) for a tiny MoH-DiT trained for a few steps on ``make_image_folder`` data."""
    return {
        "model": {"preset": "MoH-DiT-Ti/4-75", "overrides": {"hidden_size": 32, "head_dim": 8, "patch_size": 2}},
        "data": {"name": "folder", "path": str(data_dir), "image_size": image_size, "channels": 3},
        "train": {"output_dir": str(out_dir), "global_batch_size": 4, "max_steps": 4, "checkpoint_every": 2},
        "log": {"log_every": 1, "trackers": []},
        "preview": {"per_class": 1, "num_steps": 3},
        "optim": {"lr": 1e-3},
        "ema": {"decay": 0.9},
    }


def as_overrides(config: dict, prefix: str = "") -> list[str]:
    """A config dict as ``section.key=value`` command-line overrides (one leaf each)."""
    out = []
    for key, value in config.items():
        if isinstance(value, dict):
            out += as_overrides(value, f"{prefix}{key}.")
        else:
            out.append(f"{prefix}{key}={str(value).lower() if isinstance(value, bool) else value}")
    return out


def tiny_train_overrides(out_dir, data_dir, *extra, image_size=8):
    """:func:`tiny_train_config` as command-line overrides, followed by ``extra`` ones."""
    return [*as_overrides(tiny_train_config(out_dir, data_dir, image_size)), *extra]


def train_tiny(out_dir, data_dir, *extra, image_size=8) -> dict:
    """Train :func:`tiny_train_config` in this process, with ``extra`` ``section.key=value`` overrides."""
    from moh_dit.training.config import load_config
    from moh_dit.training.trainer import train

    return train(load_config(tiny_train_config(out_dir, data_dir, image_size), list(extra)))


def torchrun(*args) -> list[str]:
    """The command line of two CPU processes running ``args`` (a script and its arguments)."""
    import sys

    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", *map(str, args)]


def run_command(cmd, timeout: int = 300, **kw):
    """Run a command line as a subprocess with the repository importable and one thread per process; it must
    succeed. Returns the completed process (text output)."""
    import os
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=str(root), OMP_NUM_THREADS="1")
    result = subprocess.run([str(c) for c in cmd], env=env, capture_output=True, text=True, timeout=timeout, **kw)
    assert result.returncode == 0, result.stderr[-4000:]
    return result


def generation_settings(**kw):
    """``GenerationSettings`` from flat keywords: the ``SamplingSpec`` fields (``scheduler`` None by default:
    the pipeline's own) go into its ``sampling``."""
    from moh_dit.sampling.generation import GenerationSettings
    from moh_dit.sampling.spec import SamplingSpec

    fields = ("num_inference_steps", "guidance_scale", "guidance_interval", "guidance_channels", "grid_averaging")
    spec = {k: kw.pop(k) for k in fields if k in kw}
    scheduler = kw.pop("scheduler", None)
    spec.setdefault("num_inference_steps", 250)
    spec.setdefault("guidance_scale", 1.5)
    return GenerationSettings(**kw, sampling=SamplingSpec.create(scheduler=scheduler, **spec))


def run_in_process(command: str, argv, caplog) -> str:
    """Run ``moh-dit <command>`` (its ``main``) in this process on one thread, as :func:`run_command`'s
    subprocesses and each rank of :func:`torchrun` run (so that results agree bit for bit), without paying a new
    interpreter's start-up; returns what it logged and printed to stderr (progress lines). A process boundary is
    tested where it is the claim (exit codes, several processes); elsewhere this is the same command."""
    import contextlib
    import importlib
    import io
    import logging

    main = importlib.import_module(f"moh_dit.cli.{command}").main
    threads, stderr = torch.get_num_threads(), io.StringIO()
    torch.set_num_threads(1)
    caplog.clear()
    try:
        with caplog.at_level(logging.INFO), contextlib.redirect_stderr(stderr):
            main([str(a) for a in argv])
    finally:
        torch.set_num_threads(threads)
    return caplog.text + stderr.getvalue()
