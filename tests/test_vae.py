"""ImageSpace: pixel space and a VAE's latent space behind one interface, against the formulas."""

import torch

from moh_dit.manifests import fingerprint_module
from moh_dit.vae import ImageSpace

from .helpers.factories import tiny_vae


def test_pixel_space_is_the_identity():
    space, x = ImageSpace(None), torch.randn(2, 3, 8, 8)
    assert not space.is_latent and space.downsample_factor == 1 and space.fingerprint() is None
    assert space.encode(x, torch.Generator().manual_seed(0), torch.device("cpu")) is x and space.decode(x) is x


def test_latent_space_encodes_a_posterior_draw_and_decodes_through_the_vae():
    vae = tiny_vae().eval()
    space, images = ImageSpace(vae), torch.rand(2, 3, 16, 16) * 2 - 1
    sf = vae.config.scaling_factor
    assert space.is_latent and space.scaling_factor == sf and space.fingerprint() == fingerprint_module(vae)
    assert space.downsample_factor == 2 ** (len(vae.config.block_out_channels) - 1)
    with torch.no_grad():
        x0 = space.encode(images, torch.Generator().manual_seed(3), torch.device("cpu"))
        dist = vae.encode(images).latent_dist
        eps = torch.randn(dist.mean.shape, generator=torch.Generator().manual_seed(3))
        torch.testing.assert_close(x0, (dist.mean + dist.std * eps) * sf, rtol=0, atol=0)
        torch.testing.assert_close(space.decode(x0), vae.decode(x0 / sf).sample, rtol=0, atol=0)
