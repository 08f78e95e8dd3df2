"""VAE loading and pre-extracted latents, with a tiny randomly initialised AutoencoderKL."""
import numpy as np
import pytest
import torch
from diffusers import AutoencoderKL
from torch.utils.data import Dataset

from moh_dit.errors import ArtifactError, DataError
from moh_dit.latents import LatentDataset, encode_posterior, extract_latents, load_vae, sample_posterior

from .helpers.factories import tiny_vae


class Images(Dataset):
    def __init__(self, n=5, size=16):
        g = torch.Generator().manual_seed(1)
        self.x = torch.rand(n, 3, size, size, generator=g) * 2 - 1
        self.id2label = {0: "a", 1: "b"}

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], i % 2


@pytest.fixture
def vae_dir(tmp_path):
    tiny_vae().save_pretrained(tmp_path / "vae")
    return tmp_path / "vae"


def test_load_vae_from_folder_and_pipeline_folder(vae_dir, tmp_path):
    vae = load_vae(str(vae_dir))
    assert isinstance(vae, AutoencoderKL) and not vae.training
    assert not any(p.requires_grad for p in vae.parameters())
    pipeline_like = tmp_path / "pipe"
    (pipeline_like).mkdir()
    vae_dir.rename(pipeline_like / "vae")
    assert isinstance(load_vae(str(pipeline_like)), AutoencoderKL)
    assert load_vae("none") is None and load_vae(None) is None


def test_load_vae_offline_hub_id_gives_clear_error(monkeypatch):
    import huggingface_hub

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(DataError, match="could not load VAE"):
        load_vae("someone/no-such-vae-here")


def test_sample_posterior_statistics():
    mean, std = torch.full((20000,), 2.0), torch.full((20000,), 0.5)
    z = sample_posterior(mean, std, 0.1, torch.Generator().manual_seed(0))
    assert z.mean().item() == pytest.approx(0.2, abs=0.002)
    assert z.std().item() == pytest.approx(0.05, abs=0.002)


def test_extract_latents_round_trip_keeps_both_flips(tmp_path):
    vae = tiny_vae()
    ds = Images()
    path = extract_latents(ds, vae, tmp_path / "lat.npy", batch_size=2, dtype="float32", vae_name="tiny",
                           id2label=ds.id2label)  # fmt: skip
    assert path.exists() and not (tmp_path / "lat.npy.partial.npy").exists()
    lat = LatentDataset(path)
    assert len(lat) == 5 and lat.latent_shape == (4, 8, 8)
    assert lat.scaling_factor == pytest.approx(vae.config.scaling_factor)
    assert lat.id2label == {0: "a", 1: "b"} and lat.targets == [0, 1, 0, 1, 0]
    moments, label = lat[3]
    assert moments.shape == (2, 2, 4, 8, 8) and label == 1
    mean, std = encode_posterior(vae, ds.x[3:4])
    torch.testing.assert_close(moments[0, 0], mean[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(moments[0, 1], std[0], rtol=1e-5, atol=1e-5)
    mean_f, std_f = encode_posterior(vae, ds.x[3:4].flip(-1))
    torch.testing.assert_close(moments[1, 0], mean_f[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(moments[1, 1], std_f[0], rtol=1e-5, atol=1e-5)


def test_latent_dataset_errors(tmp_path):
    with pytest.raises(DataError, match="not found"):
        LatentDataset(tmp_path / "missing.npy")
    np.save(tmp_path / "x.npy", np.zeros(3))
    with pytest.raises(ArtifactError, match="manifest of x.npy"):
        LatentDataset(tmp_path / "x.npy")
