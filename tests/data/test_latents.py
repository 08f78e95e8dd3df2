"""VAE loading and pre-extracted latents, with a tiny randomly initialised AutoencoderKL."""

import json

import numpy as np
import pytest
import torch
from diffusers import AutoencoderKL
from torch.utils.data import Dataset

from moh_dit.data.latent_dataset import LatentDataset
from moh_dit.data.latents import extract_latents
from moh_dit.errors import ArtifactError, DataError
from moh_dit.vae import LatentNormalization, encode_posterior, load_vae, sample_posterior

from ..helpers.factories import generation_settings, tiny_vae


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
    z = sample_posterior(mean, std, LatentNormalization(0.1), torch.Generator().manual_seed(0))
    assert z.mean().item() == pytest.approx(0.2, abs=0.002)
    assert z.std().item() == pytest.approx(0.05, abs=0.002)


def test_extract_latents_round_trip_keeps_both_flips(tmp_path):
    vae = tiny_vae()
    ds = Images()
    path = extract_latents(
        ds, vae, tmp_path / "lat.npy", batch_size=2, dtype="float32", vae_name="tiny", id2label=ds.id2label
    )
    assert path.exists() and not (tmp_path / "lat.npy.partial.npy").exists()
    lat = LatentDataset(path)
    assert len(lat) == 5 and lat.latent_shape == (4, 8, 8)
    assert lat.vae["scaling_factor"] == pytest.approx(vae.config.scaling_factor)
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


# ----------------------------------------------------------------------------------------------------
# Integrity: the latent file's record of its VAE is authoritative
# ----------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def latent_setup(tmp_path_factory):
    """Class folders, a tiny VAE saved locally, and latents extracted by the command line with a relative
    --vae path."""
    import os

    from moh_dit.cli.latents import main

    from ..helpers.factories import make_image_folder

    root = tmp_path_factory.mktemp("latent-setup")
    make_image_folder(root / "images")
    tiny_vae().save_pretrained(root / "vae")
    cwd = os.getcwd()
    os.chdir(root)
    try:
        main(
            [
                "--data-path",
                "images",
                "--image-size",
                "16",
                "--vae",
                "vae",
                "--out",
                "lat/latents.npy",
                "--num-workers",
                "0",
                "--batch-size",
                "4",
            ]
        )
    finally:
        os.chdir(cwd)
    return root


def _latent_overrides(root, out, *extra):
    from ..helpers.factories import tiny_train_overrides

    return tiny_train_overrides(
        out,
        root / "lat" / "latents.npy",
        "data.name=latents",
        "train.max_steps=2",
        "preview.per_class=0",
        *extra,
        image_size=16,
    )


def test_latents_record_the_vae_by_absolute_path_and_fingerprint(latent_setup):
    import json

    from moh_dit.manifests import fingerprint_module

    manifest = json.loads((latent_setup / "lat" / "latents.npy.json").read_text())
    assert manifest["kind"] == "latents" and manifest["vae"]["spec"] == str((latent_setup / "vae").resolve())
    assert manifest["vae"]["sha256"] == fingerprint_module(load_vae(str(latent_setup / "vae")))
    assert manifest["vae"]["downsample_factor"] == 2 and manifest["data"]["count"] == 16
    assert manifest["file_sha256"] and manifest["data"]["fingerprint"]


def test_latent_training_uses_the_recorded_vae_and_exports_it(latent_setup, tmp_path):
    import json

    from moh_dit.sampling.pipeline import MoHDiTPipeline
    from moh_dit.training.config import load_config
    from moh_dit.training.trainer import train

    out = tmp_path / "run"
    train(load_config(None, _latent_overrides(latent_setup, out)))
    pipe = MoHDiTPipeline.from_pretrained(out / "pipeline")
    assert pipe.vae is not None and pipe.config.latent_space
    recorded = json.loads((latent_setup / "lat" / "latents.npy.json").read_text())["vae"]["sha256"]
    assert json.loads((out / "pipeline" / "manifest.json").read_text())["vae_sha256"] == recorded
    # a copy of the same VAE elsewhere is the same VAE
    import shutil

    shutil.copytree(latent_setup / "vae", tmp_path / "vae-copy")
    train(load_config(None, _latent_overrides(latent_setup, tmp_path / "run2", f"data.vae={tmp_path / 'vae-copy'}")))


def test_a_conflicting_vae_is_an_error(latent_setup, tmp_path):
    import json
    import shutil
    import time

    from moh_dit.training.config import load_config
    from moh_dit.training.trainer import Trainer

    other = tiny_vae()
    with torch.no_grad():
        next(other.parameters()).add_(1.0)
    other.save_pretrained(tmp_path / "other-vae")
    with pytest.raises(ArtifactError, match="is not the VAE .* made with .*sha256"):
        Trainer(
            load_config(None, _latent_overrides(latent_setup, tmp_path / "a", f"data.vae={tmp_path / 'other-vae'}"))
        )
    shutil.copytree(latent_setup / "vae", tmp_path / "rescaled")
    cfg = json.loads((tmp_path / "rescaled" / "config.json").read_text())
    (tmp_path / "rescaled" / "config.json").write_text(json.dumps(dict(cfg, scaling_factor=0.5)))
    with pytest.raises(ArtifactError, match="scaling_factor"):
        Trainer(
            load_config(None, _latent_overrides(latent_setup, tmp_path / "b", f"data.vae={tmp_path / 'rescaled'}"))
        )
    start = time.time()
    with pytest.raises(DataError, match="differs from the VAE recorded .* set data.vae=none"):
        Trainer(load_config(None, _latent_overrides(latent_setup, tmp_path / "c", "data.vae=someone/not-cached-vae")))
    assert time.time() - start < 10  # no network retries


def test_the_config_must_describe_the_images_the_latents_were_made_from(latent_setup, tmp_path):
    from moh_dit.training.config import load_config
    from moh_dit.training.trainer import Trainer

    for wrong, fix in (("data.image_size=32", "set data.image_size=16"), ("data.channels=1", "set data.channels=3")):
        with pytest.raises(DataError, match=f"extracted from 16 px images with 3 channels, not .*: {fix},"):
            Trainer(load_config(None, _latent_overrides(latent_setup, tmp_path / "r", wrong)))
    assert not any((tmp_path / "r").iterdir())  # refused before anything was written


def test_init_from_records_its_weights_and_must_share_the_latent_space(latent_setup, tmp_path, caplog):
    import logging

    from safetensors.torch import load_file, save_file

    from moh_dit.errors import ConfigError
    from moh_dit.training.config import load_config
    from moh_dit.training.trainer import Trainer, train

    source = tmp_path / "source"
    train(load_config(None, _latent_overrides(latent_setup, source)))
    recorded = json.loads((source / "pipeline" / "manifest.json").read_text())
    images = _folder_images(latent_setup)

    def latents_with(name, vae):
        vae.save_pretrained(tmp_path / name)
        extract_latents(images, vae, tmp_path / f"{name}.npy", batch_size=4, vae_name=str(tmp_path / name))
        return f"data.path={tmp_path / f'{name}.npy'}"

    rescaled = AutoencoderKL.from_config(tiny_vae().config, scaling_factor=0.5)
    rescaled.load_state_dict(tiny_vae().state_dict())
    with pytest.raises(ConfigError, match=r"another latent space .*\(scaling_factor: 0.18215 -> 0.5\)"):
        Trainer(
            load_config(
                None,
                _latent_overrides(
                    latent_setup, tmp_path / "a", latents_with("half", rescaled), f"model.init_from={source}"
                ),
            )
        )
    other = tiny_vae()
    with torch.no_grad():
        other.encoder.conv_in.bias.add_(0.1)  # the same numbers, another encoder
    with caplog.at_level(logging.WARNING, logger="moh_dit.train"):
        train(
            load_config(
                None,
                _latent_overrides(
                    latent_setup, tmp_path / "b", latents_with("other", other), f"model.init_from={source}"
                ),
            )
        )
    assert "was trained with another VAE" in caplog.text
    init = json.loads((tmp_path / "b" / "manifest.json").read_text())["events"][0]["init"]
    assert (
        init["transformer_sha256"] == recorded["transformer_sha256"] and init["vae_sha256"] == recorded["vae_sha256"]
    )
    weights = source / "pipeline" / "transformer" / "diffusion_pytorch_model.safetensors"
    tensors = load_file(weights)
    name = next(k for k in tensors if k.endswith("weight"))
    tensors[name] = tensors[name] + 1e-3
    save_file(tensors, weights)
    with pytest.raises(ArtifactError, match="not those its manifest records"):
        Trainer(
            load_config(
                None, _latent_overrides(latent_setup, tmp_path / "c", f"model.init_from={source / 'pipeline'}")
            )
        )


def test_a_missing_recorded_vae_stops_before_training(latent_setup, tmp_path):
    import shutil

    from moh_dit.training.config import load_config
    from moh_dit.training.trainer import Trainer

    shutil.copytree(latent_setup, tmp_path / "moved")
    manifest_path = tmp_path / "moved" / "lat" / "latents.npy.json"
    import json

    manifest = json.loads(manifest_path.read_text())
    manifest["vae"]["spec"] = str(tmp_path / "gone-vae")
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(DataError, match="VAE folder .*gone-vae does not exist .*pass it, or a copy, as data.vae"):
        Trainer(load_config(None, _latent_overrides(tmp_path / "moved", tmp_path / "r")))
    copy = f"data.vae={latent_setup / 'vae'}"  # the way out: the same weights elsewhere
    Trainer(load_config(None, _latent_overrides(tmp_path / "moved", tmp_path / "r2", copy)))


def test_a_latent_model_without_its_vae_does_not_write_images(latent_setup, tmp_path):
    from moh_dit.errors import ConfigError
    from moh_dit.sampling.generation import generate_samples
    from moh_dit.sampling.pipeline import MoHDiTPipeline
    from moh_dit.training.config import load_config
    from moh_dit.training.trainer import train

    out = tmp_path / "run"
    train(load_config(None, _latent_overrides(latent_setup, out)))
    pipe = MoHDiTPipeline.from_pretrained(out / "pipeline")
    no_vae = MoHDiTPipeline.build(pipe.transformer, None, pipe.id2label, latent_space=True)
    with pytest.raises(ConfigError, match="no VAE"):
        generate_samples(no_vae, tmp_path / "s", generation_settings(num_samples=2, num_inference_steps=2))
    with pytest.raises(ConfigError, match="no VAE"):
        no_vae([0], num_inference_steps=2, progress=False)
    latents = no_vae([0], num_inference_steps=2, output_type="latent", progress=False).images
    assert latents.shape == (1, 4, 8, 8)
    assert not (tmp_path / "s").exists()


# ----------------------------------------------------------------------------------------------------
# Fast extraction: processes, half precision, each image read once
# ----------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def corrupt_folder(tmp_path_factory):
    from ..helpers.factories import make_image_folder

    root = tmp_path_factory.mktemp("corrupt-folder")
    make_image_folder(root / "images")
    (root / "images" / "bright" / "3.png").write_bytes(b"not an image")
    tiny_vae().save_pretrained(root / "vae")
    return root


@pytest.mark.slow  # two processes also in the default suite: an extraction resumed on another process count
def test_two_processes_write_the_same_file_as_one(corrupt_folder, tmp_path, caplog):
    from ..helpers.factories import run_command, run_in_process, torchrun

    args = [
        "--data-path",
        corrupt_folder / "images",
        "--image-size",
        "16",
        "--vae",
        corrupt_folder / "vae",
        "--num-workers",
        "0",
        "--batch-size",
        "3",
        "--max-bad-fraction",
        "0.1",
    ]
    run_in_process("latents", [*args, "--out", tmp_path / "one.npy"], caplog)
    two = run_command(torchrun("-m", "moh_dit", "latents", *args, "--out", tmp_path / "two.npy"))
    assert "2 process(es)" in two.stderr
    a, b = np.load(tmp_path / "one.npy"), np.load(tmp_path / "two.npy")
    assert a.tobytes() == b.tobytes()  # bit-identical
    one_m, two_m = (json.loads((tmp_path / f"{n}.npy.json").read_text()) for n in ("one", "two"))
    assert (one_m["world_size"], two_m["world_size"]) == (1, 2) and one_m["file_sha256"] == two_m["file_sha256"]
    assert one_m["rows"] == 16 and one_m["count"] == 15 and one_m["data"]["skipped"][0].endswith("bright/3.png")
    lat = LatentDataset(tmp_path / "two.npy")
    assert len(lat) == 15 and -1 not in lat.targets and a["label"].tolist().count(-1) == 1


def test_each_image_is_read_once(corrupt_folder, tmp_path, monkeypatch):
    from moh_dit.data.image_folder import ImageFolderDataset

    calls = []
    original = ImageFolderDataset.load
    monkeypatch.setattr(ImageFolderDataset, "load", lambda self, i: calls.append(i) or original(self, i))
    ds = ImageFolderDataset(corrupt_folder / "images", 16)
    extract_latents(ds, tiny_vae(), tmp_path / "lat.npy", batch_size=4, max_bad_fraction=0.1)
    assert sorted(calls[1:]) == list(range(16))  # the first call finds the image shape


def test_half_precision_vae_records_its_deviation_from_fp32(corrupt_folder, tmp_path):
    from moh_dit.data.image_folder import ImageFolderDataset

    ds = ImageFolderDataset(corrupt_folder / "images", 16)
    fp32 = LatentDataset(
        extract_latents(ds, tiny_vae(), tmp_path / "fp32.npy", batch_size=4, dtype="float32", max_bad_fraction=0.1)
    )
    half = extract_latents(
        ds,
        tiny_vae().to(torch.bfloat16),
        tmp_path / "bf16.npy",
        batch_size=4,
        dtype="float32",
        max_bad_fraction=0.1,
        fp32_vae=tiny_vae(),
    )
    record = json.loads((tmp_path / "bf16.npy.json").read_text())["vae"]
    assert (
        record["dtype"] == "bfloat16" and record["deviation_from_fp32"]["images"] == 3
    )  # the first block: 3 readable images
    dev = record["deviation_from_fp32"]
    measured = np.abs(np.load(half)["moments"][:3, :, 0] - np.load(tmp_path / "fp32.npy")["moments"][:3, :, 0])
    assert dev["max_abs"] == pytest.approx(float(measured.max()), rel=0.05) and 0 < dev["rms_over_std"] < 0.05
    assert len(fp32) == 15


# ----------------------------------------------------------------------------------------------------
# Integrity of the extraction itself: interrupted runs resume, finished files are reused, nothing is replaced
# without --overwrite, and a file changed after extraction is refused
# ----------------------------------------------------------------------------------------------------
def _interrupt_after(monkeypatch, calls: int) -> list:
    """Make the VAE fail on its ``calls``-th encoding (the first call finds the latent shape); returns the
    list of batch sizes it encoded."""
    import moh_dit.data.latents as latents

    seen, original = [], latents.encode_posterior

    def encode(vae, x):
        seen.append(len(x))
        if len(seen) == calls:
            raise KeyboardInterrupt
        return original(vae, x)

    monkeypatch.setattr(latents, "encode_posterior", encode)
    return seen


def _folder_images(root):
    from moh_dit.data.image_folder import ImageFolderDataset

    return ImageFolderDataset(root / "images", 16)


def test_an_interrupted_extraction_resumes_with_the_blocks_not_done(corrupt_folder, tmp_path, monkeypatch):
    from moh_dit.errors import OutputError

    ds, kw = _folder_images(corrupt_folder), dict(batch_size=3, max_bad_fraction=0.1)
    whole = extract_latents(ds, tiny_vae(), tmp_path / "whole.npy", **kw)
    seen = _interrupt_after(monkeypatch, 4)  # the shape, blocks 0 and 1 (with the corrupt image), then stop
    with pytest.raises(KeyboardInterrupt):
        extract_latents(ds, tiny_vae(), tmp_path / "lat.npy", commit_every_s=0, **kw)
    with pytest.raises(DataError, match="unfinished extraction left a .partial file"):
        LatentDataset(tmp_path / "lat.npy")
    seen = _interrupt_after(monkeypatch, 0)
    with pytest.raises(OutputError, match="pass --batch-size 3 to finish it"):
        extract_latents(ds, tiny_vae(), tmp_path / "lat.npy", batch_size=4, max_bad_fraction=0.1)
    other = tiny_vae()
    with torch.no_grad():
        other.encoder.conv_in.bias.add_(0.1)
    with pytest.raises(OutputError, match=r"unfinished extraction of other latents \(vae.sha256"):
        extract_latents(ds, other, tmp_path / "lat.npy", **kw)
    seen.clear()
    extract_latents(ds, tiny_vae(), tmp_path / "lat.npy", **kw)
    assert seen == [1, 6, 6, 6, 2]  # the shape, then blocks 2..5 only (both flips of 3, 3, 3 and 1 images)
    assert np.load(whole).tobytes() == np.load(tmp_path / "lat.npy").tobytes()
    a, b = (json.loads((tmp_path / f"{n}.npy.json").read_text()) for n in ("whole", "lat"))
    assert a["file_sha256"] == b["file_sha256"] and b["attempts"] == 2 and a["attempts"] == 1
    assert b["data"]["skipped"] == a["data"]["skipped"] and b["data"]["skipped"][0].endswith("bright/3.png")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lat.npy", "lat.npy.json", "whole.npy", "whole.npy.json"]
    assert len(LatentDataset(tmp_path / "lat.npy")) == 15


def test_an_extraction_resumes_on_another_number_of_processes(corrupt_folder, tmp_path, monkeypatch, caplog):
    from ..helpers.factories import run_command, run_in_process, torchrun

    args = ["--data-path", corrupt_folder / "images", "--image-size", "16", "--vae", corrupt_folder / "vae"]
    args += ["--num-workers", "0", "--batch-size", "3", "--max-bad-fraction", "0.1", "--out"]
    run_in_process("latents", [*args, tmp_path / "whole.npy"], caplog)
    _interrupt_after(monkeypatch, 3)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the subprocesses run, so that the blocks agree bit for bit
    try:
        with pytest.raises(KeyboardInterrupt):
            extract_latents(
                _folder_images(corrupt_folder),
                tiny_vae(),
                tmp_path / "lat.npy",
                batch_size=3,
                max_bad_fraction=0.1,
                commit_every_s=0,
            )
    finally:
        torch.set_num_threads(threads)
    args[-1:] = ["--out", tmp_path / "lat.npy"]
    two = run_command(torchrun("-m", "moh_dit", "latents", *args))
    assert "1 of 6 blocks done" in two.stderr and "2 process(es)" in two.stderr
    assert np.load(tmp_path / "whole.npy").tobytes() == np.load(tmp_path / "lat.npy").tobytes()
    again = run_in_process("latents", args, caplog)
    assert "already holds these latents" in again and "encoding" not in again


def test_finished_latents_are_reused_and_others_replaced_only_with_overwrite(corrupt_folder, tmp_path):
    from moh_dit.errors import OutputError

    ds, kw, out = _folder_images(corrupt_folder), dict(batch_size=4, max_bad_fraction=0.1), tmp_path / "lat.npy"
    extract_latents(ds, tiny_vae(), out, **kw)
    before = (out.stat().st_mtime_ns, (tmp_path / "lat.npy.json").read_text())
    assert extract_latents(ds, tiny_vae(), out, **kw) == out  # the same latents: nothing is redone
    assert (out.stat().st_mtime_ns, (tmp_path / "lat.npy.json").read_text()) == before
    with pytest.raises(OutputError, match=r"holds other latents \(dtype: 'float16' -> 'float32'\); pass --overwrite"):
        extract_latents(ds, tiny_vae(), out, dtype="float32", **kw)
    assert (tmp_path / "lat.npy.json").read_text() == before[1]
    extract_latents(ds, tiny_vae(), out, dtype="float32", overwrite=True, **kw)
    assert LatentDataset(out).meta["dtype"] == "float32"
    np.save(tmp_path / "bare.npy", np.zeros(3))
    with pytest.raises(OutputError, match="exists without a latent manifest; pass --overwrite"):
        extract_latents(ds, tiny_vae(), tmp_path / "bare.npy", **kw)


def test_a_crash_between_manifest_and_rename_is_finished_by_the_next_run(corrupt_folder, tmp_path, monkeypatch):
    import os

    ds, kw, out = _folder_images(corrupt_folder), dict(batch_size=4, max_bad_fraction=0.1), tmp_path / "lat.npy"

    replace = os.replace

    def crash(src, dst):  # the manifest is written (itself through a rename), then the power goes
        if str(src).endswith(".partial.npy"):
            raise OSError("power cut")
        replace(src, dst)

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="power cut"):
        extract_latents(ds, tiny_vae(), out, **kw)
    monkeypatch.undo()
    assert not out.exists() and (tmp_path / "lat.npy.json").exists()
    seen = _interrupt_after(monkeypatch, 0)
    extract_latents(ds, tiny_vae(), out, **kw)
    assert seen == [1] and len(LatentDataset(out)) == 15  # every block was recorded: only renamed


def test_a_latent_file_changed_after_extraction_is_refused(corrupt_folder, tmp_path, caplog):
    import logging
    import os

    out = extract_latents(_folder_images(corrupt_folder), tiny_vae(), tmp_path / "lat.npy", max_bad_fraction=0.1)
    stat = out.stat()
    os.utime(out, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # a copy without its time: hashed, accepted
    with caplog.at_level(logging.INFO, logger="moh_dit"):
        assert len(LatentDataset(out)) == 15
    assert "its time differs from the record, so its SHA-256 was checked" in caplog.text
    manifest = json.loads((tmp_path / "lat.npy.json").read_text())
    del manifest["file_mtime_ns"]  # as written by moh-dit before it recorded the time
    (tmp_path / "lat.npy.json").write_text(json.dumps(manifest))
    assert len(LatentDataset(out)) == 15
    table = np.load(out, mmap_mode="r+")
    table["moments"][0, 0, 0, 0, 0, 0] += 1  # the same size, other numbers
    table.flush()
    del table
    with pytest.raises(ArtifactError, match="was changed after extraction"):
        LatentDataset(out)


def test_images_the_vae_cannot_take_stop_before_any_work(corrupt_folder, tmp_path):
    from moh_dit.data.image_folder import ImageFolderDataset

    gray = ImageFolderDataset(corrupt_folder / "images", 16, channels=1)
    with pytest.raises(
        DataError, match="VAE takes 3-channel images but the data gives 1-channel ones: use --channels 3"
    ):
        extract_latents(gray, tiny_vae(), tmp_path / "a.npy")
    odd = ImageFolderDataset(corrupt_folder / "images", 15)
    with pytest.raises(DataError, match="image size 15 is not divisible by the VAE's downsampling factor 2"):
        extract_latents(odd, tiny_vae(), tmp_path / "b.npy")
    assert not list(tmp_path.iterdir())


def test_training_through_a_vae_checks_the_images_it_takes(latent_setup, tmp_path):
    from moh_dit.training.config import load_config
    from moh_dit.training.trainer import Trainer

    from ..helpers.factories import tiny_train_overrides

    def trainer(*extra, image_size=16):
        vae = f"data.vae={latent_setup / 'vae'}"
        return Trainer(
            load_config(
                None, tiny_train_overrides(tmp_path / "r", latent_setup / "images", vae, *extra, image_size=image_size)
            )
        )

    with pytest.raises(DataError, match="takes 3-channel images but data.channels=1: set data.channels=3"):
        trainer("data.channels=1")
    with pytest.raises(DataError, match="data.image_size=15 is not divisible by the VAE's downsampling factor 2"):
        trainer(image_size=15)


def test_a_checkpoint_whose_vae_moved_samples_with_a_vae_given_and_checked(latent_setup, tmp_path, caplog):
    import logging
    import shutil

    from moh_dit.sampling.loading import load_pipeline
    from moh_dit.training.config import load_config
    from moh_dit.training.trainer import train

    from ..helpers.factories import tiny_train_overrides

    shutil.copytree(latent_setup / "vae", tmp_path / "vae")
    lat = extract_latents(_folder_images(latent_setup), tiny_vae(), tmp_path / "l.npy", vae_name=str(tmp_path / "vae"))
    overrides = tiny_train_overrides(tmp_path / "run", lat, "data.name=latents", "preview.per_class=0", image_size=16)
    train(load_config(None, overrides))
    checkpoint = tmp_path / "run" / "checkpoints" / "step-00000004"
    shutil.rmtree(tmp_path / "vae")
    with pytest.raises(
        DataError, match="does not exist \\(the VAE checkpoint .* was trained with\\): pass it, or a copy"
    ):
        load_pipeline(checkpoint, device="cpu")
    assert load_pipeline(checkpoint, device="cpu", vae=str(latent_setup / "vae")).vae is not None  # a copy
    rescaled = AutoencoderKL.from_config(tiny_vae().config, scaling_factor=0.5)
    rescaled.save_pretrained(tmp_path / "rescaled")
    with pytest.raises(ArtifactError, match="not in the latent space .*scaling_factor: 0.18215 -> 0.5"):
        load_pipeline(checkpoint, device="cpu", vae=str(tmp_path / "rescaled"))
    other = tiny_vae()
    with torch.no_grad():
        other.decoder.conv_out.bias.add_(0.1)
    other.save_pretrained(tmp_path / "other")
    with caplog.at_level(logging.INFO, logger="moh_dit"):
        load_pipeline(checkpoint, device="cpu", vae=str(tmp_path / "other"))
    assert "instead of the one the model was trained with" in caplog.text


def test_an_extraction_that_cannot_fit_on_the_disk_stops_before_any_work(corrupt_folder, tmp_path, monkeypatch):
    import collections
    import shutil

    from moh_dit.errors import OutputError

    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**9, 10**9 - 1000, 1000))
    # 16 rows of 2 flips x (mean, std) x 4 x 8 x 8 float16 values and an int64 label: 16 x 2056 bytes
    with pytest.raises(
        OutputError, match=r"not enough space for lat.npy in .*: it needs about 32.9 kB and 1.0 kB is free; make room"
    ):
        extract_latents(_folder_images(corrupt_folder), tiny_vae(), tmp_path / "lat.npy", max_bad_fraction=0.1)
    assert not list(tmp_path.iterdir())
