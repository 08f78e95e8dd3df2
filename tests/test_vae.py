"""The autoencoders of latent diffusion: loading any kind, the numbers of its latent space and their normalisation,
and ImageSpace (pixels or latents behind one interface), against the formulas."""

import pytest
import torch

from moh_dit.errors import ArtifactError, ConfigError, DataError
from moh_dit.manifests import fingerprint_module
from moh_dit.vae import (
    ImageSpace,
    LatentNormalization,
    encode_posterior,
    latent_space,
    latent_space_differences,
    load_vae,
    resolve_vae_spec,
    sample_posterior,
    vae_record,
)

from .helpers.factories import tiny_dc_ae, tiny_model, tiny_sd3_vae, tiny_stats_vae, tiny_vae


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


# ----------------------------------------------------------------------------------------------------
# The latent spaces of other autoencoders: scale and shift (SD3, Flux), per-channel statistics, DC-AE
# ----------------------------------------------------------------------------------------------------
def _encode(space, images, seed=3):
    with torch.no_grad():
        return space.encode(images, torch.Generator().manual_seed(seed), torch.device("cpu"))


def test_scale_and_shift_are_applied_and_inverted_as_sd3_defines_them():
    vae, images = tiny_sd3_vae(), torch.rand(2, 3, 16, 16) * 2 - 1
    space = ImageSpace(vae)
    assert space.space["kind"] == "AutoencoderKL" and space.space["latent_channels"] == 16
    assert (space.normalization.scale, space.normalization.shift) == (1.5305, 0.0609)
    with torch.no_grad():
        x0 = _encode(space, images)
        dist = vae.encode(images).latent_dist
        eps = torch.randn(dist.mean.shape, generator=torch.Generator().manual_seed(3))
        torch.testing.assert_close(x0, (dist.mean + dist.std * eps - 0.0609) * 1.5305, rtol=0, atol=1e-6)
        torch.testing.assert_close(space.decode(x0), vae.decode(x0 / 1.5305 + 0.0609).sample, rtol=0, atol=1e-6)


def test_a_wrong_shift_or_channel_statistic_moves_the_latents_by_exactly_the_expected_amount():
    latents = torch.randn(3, 4, 5, 5)
    right = LatentNormalization(scale=1.5, shift=0.25)
    wrong = LatentNormalization(scale=1.5, shift=0.25 + 0.1)
    torch.testing.assert_close(wrong.normalize(latents) - right.normalize(latents), torch.full_like(latents, -0.15))
    mean, std = (0.1, -0.2, 0.3, 0.0), (0.5, 1.5, 2.0, 1.0)
    right = LatentNormalization(scale=0.5, mean=mean, std=std)
    moved = LatentNormalization(scale=0.5, mean=(0.1, -0.2 + 0.3, 0.3, 0.0), std=std)  # channel 1's mean off by 0.3
    expected = torch.zeros_like(latents)
    expected[:, 1] = -0.3 * 0.5 / 1.5
    torch.testing.assert_close(moved.normalize(latents) - right.normalize(latents), expected)
    wider = LatentNormalization(scale=0.5, mean=mean, std=(0.5, 1.5, 4.0, 1.0))  # channel 2's std doubled
    ratio = wider.normalize(latents) / right.normalize(latents)
    torch.testing.assert_close(ratio[:, 2], torch.full_like(ratio[:, 2], 0.5))
    torch.testing.assert_close(ratio[:, [0, 1, 3]], torch.ones_like(ratio[:, [0, 1, 3]]))
    for norm in (right, LatentNormalization(scale=1.5, shift=0.25)):
        torch.testing.assert_close(norm.denormalize(norm.normalize(latents)), latents)


def test_per_channel_statistics_come_from_the_config_and_reach_encoding_and_decoding():
    vae, images = tiny_stats_vae(), torch.rand(2, 3, 16, 16) * 2 - 1
    space = ImageSpace(vae)
    mean = torch.tensor([0.1, -0.2, 0.3, 0.0]).reshape(1, 4, 1, 1)
    std = torch.tensor([0.5, 1.5, 2.0, 1.0]).reshape(1, 4, 1, 1)
    with torch.no_grad():
        x0 = _encode(space, images)
        dist = vae.encode(images).latent_dist
        eps = torch.randn(dist.mean.shape, generator=torch.Generator().manual_seed(3))
        torch.testing.assert_close(x0, (dist.mean + dist.std * eps - mean) * 0.5 / std)
        torch.testing.assert_close(space.decode(x0), vae.decode(x0 * std / 0.5 + mean).sample)


def test_the_scale_alone_is_computed_exactly_as_before_shifts_existed():
    latents = torch.randn(2, 4, 3, 3)
    norm = LatentNormalization(scale=0.18215)
    assert torch.equal(norm.normalize(latents), latents * 0.18215)
    assert torch.equal(norm.denormalize(latents), latents / 0.18215)


def test_a_deep_compression_autoencoder_is_deterministic_and_normalised_by_its_scale():
    dc, images = tiny_dc_ae(), torch.rand(2, 3, 16, 16) * 2 - 1
    mean, std = encode_posterior(dc, images)
    assert std is None and mean.shape == (2, 8, 8, 8)
    space = ImageSpace(dc)
    assert space.space == {
        "kind": "AutoencoderDC",
        "scaling_factor": 0.4,
        "shift_factor": None,
        "latents_mean": None,
        "latents_std": None,
        "downsample_factor": 2,
        "latent_channels": 8,
    }
    x0 = _encode(space, images)
    assert torch.equal(x0, _encode(space, images, seed=99))  # no posterior draw
    torch.testing.assert_close(x0, mean * 0.4)
    with torch.no_grad():
        torch.testing.assert_close(space.decode(x0), dc.decode(x0 / 0.4).sample)
    assert torch.equal(sample_posterior(mean, None, space.normalization), x0)


def test_latent_space_reads_every_kind_of_config():
    assert latent_space(
        {"_class_name": "AutoencoderKL", "block_out_channels": [1, 2, 3, 4], "latent_channels": 4}
    ) == {
        "kind": "AutoencoderKL",
        "scaling_factor": 0.18215,  # the class's default when a config predates the key
        "shift_factor": None,
        "latents_mean": None,
        "latents_std": None,
        "downsample_factor": 8,
        "latent_channels": 4,
    }
    dc = latent_space({"_class_name": "AutoencoderDC", "encoder_block_out_channels": [1] * 6, "latent_channels": 32})
    assert (dc["downsample_factor"], dc["scaling_factor"]) == (32, 1.0)  # DC-AE f32c32
    with pytest.raises(ArtifactError, match="no encoder levels"):
        latent_space({"latent_channels": 4})


@pytest.mark.parametrize(
    "numbers, message",
    [
        (dict(latents_mean=[0.0] * 4), "latents_mean without latents_std"),
        (dict(latents_mean=[0.0] * 4, latents_std=[1.0] * 4, shift_factor=0.1), "both shift_factor and latents_mean"),
        (dict(latents_mean=[0.0] * 3, latents_std=[1.0] * 3), "3 / 3 values for 4 channels"),
    ],
)
def test_an_autoencoder_whose_numbers_contradict_each_other_is_refused(numbers, message):
    with pytest.raises(ConfigError, match=message):
        latent_space({"block_out_channels": [1, 2], "latent_channels": 4, **numbers})


def test_records_of_older_versions_mean_the_scale_alone_and_match_an_sd_vae():
    old = {"spec": "x", "sha256": "s", "scaling_factor": 0.18215, "downsample_factor": 2, "latent_channels": 4}
    assert latent_space_differences(old, vae_record(tiny_vae(), None)) == []
    assert LatentNormalization.of(old) == LatentNormalization(0.18215)
    sd3 = vae_record(tiny_sd3_vae(), None)
    assert ("shift_factor", None, 0.0609) in latent_space_differences(dict(old, latent_channels=16), sd3)
    wrong = latent_space_differences(sd3, vae_record(tiny_sd3_vae(shift_factor=0.2), None))
    assert wrong == [("shift_factor", 0.0609, 0.2)]
    kinds = latent_space_differences(vae_record(tiny_vae(), None), vae_record(tiny_dc_ae(), None))
    assert ("kind", "AutoencoderKL", "AutoencoderDC") in kinds


def test_any_autoencoder_loads_from_its_folder_or_a_pipeline_folder_by_its_class(tmp_path):
    tiny_dc_ae().save_pretrained(tmp_path / "dc")
    tiny_sd3_vae().save_pretrained(tmp_path / "pipe" / "vae")
    assert type(load_vae(str(tmp_path / "dc"))).__name__ == "AutoencoderDC"
    sd3 = load_vae(str(tmp_path / "pipe"))
    assert type(sd3).__name__ == "AutoencoderKL" and sd3.config.shift_factor == 0.0609


def test_a_hub_autoencoder_inside_a_pipeline_repository_names_its_subfolder(monkeypatch):
    from diffusers import AutoModel

    calls = []

    def record(repo, **kwargs):
        calls.append((repo, kwargs.get("subfolder"), kwargs.get("local_files_only")))
        raise OSError("not cached")

    monkeypatch.setattr(AutoModel, "from_pretrained", record)
    with pytest.raises(DataError, match=r"not cached locally .*hf download stabilityai/stable-diffusion-3.5-medium"):
        load_vae("stabilityai/stable-diffusion-3.5-medium:vae", local_only=True)
    assert calls == [("stabilityai/stable-diffusion-3.5-medium", "vae", True)]
    assert resolve_vae_spec("mit-han-lab/dc-ae-f32c32-in-1.0-diffusers") == "mit-han-lab/dc-ae-f32c32-in-1.0-diffusers"


def test_a_module_that_is_not_an_autoencoder_is_refused(tmp_path):
    from diffusers import UNet2DModel

    blocks = dict(down_block_types=("DownBlock2D",) * 2, up_block_types=("UpBlock2D",) * 2)
    UNet2DModel(
        sample_size=8, block_out_channels=(4, 4), norm_num_groups=2, layers_per_block=1, **blocks
    ).save_pretrained(tmp_path / "unet")
    with pytest.raises(DataError, match="holds a UNet2DModel, not an autoencoder"):
        load_vae(str(tmp_path / "unet"))
    tiny_model().save_pretrained(tmp_path / "transformer")  # not a diffusers class at all
    with pytest.raises(DataError, match="not a readable diffusers autoencoder"):
        load_vae(str(tmp_path / "transformer"))
