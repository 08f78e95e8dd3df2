"""Tiny models built in memory for tests (no downloads)."""
import torch
from diffusers import AutoencoderKL


def tiny_vae() -> AutoencoderKL:
    """A randomly initialised AutoencoderKL with a downsampling factor of 2 and 4 latent channels."""
    torch.manual_seed(0)
    return AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=4,
        down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
        up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
        block_out_channels=(8, 16), layers_per_block=1, norm_num_groups=4, sample_size=16,
    ).eval()  # fmt: skip


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


def tiny_train_overrides(out_dir, data_dir, *extra, image_size=8):
    """Config overrides for a tiny MoH-DiT trained for a few steps on ``make_image_folder`` data."""
    return [
        f"train.output_dir={out_dir}", "data.name=folder", f"data.path={data_dir}", f"data.image_size={image_size}",
        "data.channels=3", "model.preset=MoH-DiT-Ti/4-75", "model.overrides={hidden_size: 32, head_dim: 8, patch_size: 2}",
        "train.global_batch_size=4", "train.max_steps=4", "train.checkpoint_every=2", "log.log_every=1",
        "log.tensorboard=false", "log.sample_per_class=1", "log.sample_steps=3", "optim.lr=1e-3", "ema.decay=0.9",
        *extra,
    ]  # fmt: skip
