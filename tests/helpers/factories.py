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
