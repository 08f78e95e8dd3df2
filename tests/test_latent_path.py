"""The whole latent path at toy scale, as a user runs it: class folders with a corrupt image -> latents with a
locally saved random AutoencoderKL -> training on two processes -> sampling on two processes -> a reference
built from the image tree -> evaluation. Every artifact's manifest must point at the one before it, and
nothing may fall back silently. The one-process commands run in this process (the same commands without a new
interpreter's start-up); the two-process ones and the evaluation script run as a user starts them."""

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from moh_dit.sampling.demo import generate

from .helpers.factories import (
    make_image_folder,
    run_command,
    run_in_process,
    tiny_dc_ae,
    tiny_sd3_vae,
    tiny_train_overrides,
    tiny_vae,
    torchrun,
    train_tiny,
)
from .helpers.tiny_extractor import TINY

ROOT = Path(__file__).resolve().parents[1]


def test_latent_path_end_to_end_with_consistent_manifests(tmp_path, caplog):
    images = tmp_path / "images"
    make_image_folder(images)
    (images / "dark" / "broken.png").write_bytes(b"\x89PNG but not really")
    tiny_vae().save_pretrained(tmp_path / "vae")

    # 1. latents (the corrupt image is dropped and recorded)
    lat = tmp_path / "latents" / "train.npy"
    latents = ["--data-path", images, "--image-size", 16, "--vae", tmp_path / "vae", "--out", lat]
    run_in_process("latents", [*latents, "--num-workers", 0, "--batch-size", 4], caplog)
    lat_manifest = json.loads(Path(f"{lat}.json").read_text())
    assert lat_manifest["data"]["count"] == 16 and lat_manifest["data"]["skipped"] == [
        str(images / "dark" / "broken.png")
    ]

    # 2. training on two processes, from the latents' own VAE record
    run = tmp_path / "run"
    train = run_command(
        torchrun(
            ROOT / "train.py",
            *tiny_train_overrides(
                run, lat, "data.name=latents", "train.max_steps=4", "preview.per_class=1", image_size=16
            ),
        )
    )
    assert "2 process(es)" in train.stderr and "cannot be loaded" not in train.stderr
    run_manifest = json.loads((run / "manifest.json").read_text())
    assert run_manifest["identity"]["data"]["fingerprint"] == lat_manifest["file_sha256"]
    assert run_manifest["identity"]["data"]["vae_sha256"] == lat_manifest["vae"]["sha256"]
    assert run_manifest["events"][0]["world_size"] == 2
    pipe_manifest = json.loads((run / "pipeline" / "manifest.json").read_text())
    assert (run / "pipeline" / "vae" / "config.json").exists() and pipe_manifest["latent_space"]
    assert pipe_manifest["vae_sha256"] == lat_manifest["vae"]["sha256"] and pipe_manifest["source"]["step"] == 4
    assert (run / "samples" / "final.png").exists()

    # 3. sampling on two processes and on one: the same bits, and the record of what made them
    common = ["--num-samples", "10", "--batch-size", "4", "--num-steps", "3", "--cfg-scale", "1.5"]
    two = run_command(torchrun(ROOT / "sample.py", run, "--sample-dir", tmp_path / "s" / "cfg1.5", *common))
    assert "2 process(es)" in two.stderr
    run_in_process("sample", [run, "--sample-dir", tmp_path / "s1" / "cfg1.5", *common], caplog)
    a, b = np.load(tmp_path / "s" / "cfg1.5.npz"), np.load(tmp_path / "s1" / "cfg1.5.npz")
    assert a["arr_0"].shape == (10, 16, 16, 3) and np.array_equal(a["arr_0"], b["arr_0"])
    samples_manifest = json.loads(str(a["moh_dit_manifest"]))
    assert samples_manifest["identity"]["transformer_sha256"] == pipe_manifest["transformer_sha256"]
    assert samples_manifest["identity"]["vae_sha256"] == lat_manifest["vae"]["sha256"]
    assert samples_manifest["model"]["step"] == 4 and samples_manifest["world_size"] == 2

    # 4. a reference from the image tree, and the evaluation that records both sides
    ref = tmp_path / "ref.npz"
    run_in_process("reference", [images, "--image-size", 16, "--out", ref, "--max-bad-fraction", 0.1], caplog)
    out = tmp_path / "metrics.json"
    run_command(
        [
            sys.executable,
            ROOT / "evaluate_fid.py",
            "--samples",
            tmp_path / "s" / "cfg1.5.npz",
            "--reference",
            ref,
            "--extractor",
            "moh-dit-test-tiny",
            "--extractor-module",
            "tests.helpers.tiny_extractor",
            "--out",
            out,
        ],
        cwd=ROOT,
    )
    metrics = json.loads(out.read_text())
    assert metrics["samples"]["manifest"] == samples_manifest
    with np.load(ref) as data:
        ref_manifest = json.loads(str(data["moh_dit_manifest"]))
    assert ref_manifest["skipped"] == ["dark/broken.png"] and ref_manifest["num_source_images"] == 16
    assert metrics["reference"]["content_sha256"] and all(np.isfinite(v) for v in metrics["metrics"].values())


# both in the slow set: tests/test_vae.py holds each latent space to diffusers' autoencoders, and the test above
# runs the latent path end to end in the default suite
@pytest.mark.parametrize(
    "kind",
    [
        pytest.param("sd3-style AutoencoderKL", marks=pytest.mark.slow),
        pytest.param("AutoencoderDC", marks=pytest.mark.slow),
    ],
)
def test_newer_autoencoders_go_through_latents_training_and_sampling_on_one_and_two_processes(kind, tmp_path, caplog):
    """An SD3/Flux-style VAE (16 channels, scale and shift) and a deep-compression autoencoder (deterministic):
    latents on two processes and on one (the same file), training on both, sampling on both (the same images); every
    record holds the whole latent space, and a decoder of another latent space is refused."""
    from moh_dit.errors import ArtifactError
    from moh_dit.sampling.loading import load_pipeline
    from moh_dit.vae import LatentNormalization

    make = tiny_sd3_vae if kind.startswith("sd3") else tiny_dc_ae
    images, ae = tmp_path / "images", tmp_path / "ae"
    make_image_folder(images)
    make().save_pretrained(ae)
    args = ["--data-path", images, "--image-size", 16, "--vae", ae, "--num-workers", 0, "--batch-size", 4]
    run_command(torchrun("-m", "moh_dit", "latents", *args, "--out", tmp_path / "lat2.npy"), cwd=ROOT)
    lat = tmp_path / "lat.npy"
    run_in_process("latents", [*args, "--out", lat], caplog)
    assert np.array_equal(np.load(lat), np.load(tmp_path / "lat2.npy"))
    record = json.loads(Path(f"{lat}.json").read_text())
    space = {k: record["vae"][k] for k in ("kind", "scaling_factor", "shift_factor", "latents_mean", "latents_std")}
    channels = 16 if kind.startswith("sd3") else 8
    if kind.startswith("sd3"):
        assert space == dict(kind="AutoencoderKL", scaling_factor=1.5305, shift_factor=0.0609) | dict.fromkeys(
            ("latents_mean", "latents_std")
        )
        assert record["latent_shape"] == [16, 8, 8] and "moments_per_flip" not in record  # mean and std
    else:
        assert space == dict(kind="AutoencoderDC", scaling_factor=0.4) | dict.fromkeys(
            ("shift_factor", "latents_mean", "latents_std")
        )
        assert record["latent_shape"] == [8, 8, 8] and record["moments_per_flip"] == 1  # the latent alone

    overrides = tiny_train_overrides(
        tmp_path / "run2", lat, "data.name=latents", "train.max_steps=2", "train.checkpoint_every=2", image_size=16
    )
    two = run_command(torchrun(ROOT / "train.py", *overrides), cwd=ROOT)
    assert "2 process(es)" in two.stderr
    assert f"16 tokens per image: {channels} x 8 x 8 {record['vae']['kind']} latents in 2 x 2 patches" in two.stderr
    run = tmp_path / "run"
    evaluation = [  # training-time evaluation decodes through the autoencoder too
        "log.eval_every=2",
        "log.eval_samples=4",
        "log.eval_batch_size=4",
        f"log.eval_reference={images}",
        f"log.eval_extractor={TINY}",
        "log.eval_extractor_module=tests.helpers.tiny_extractor",
        "log.eval_sampling.num_steps=2",
    ]
    train_tiny(
        run, lat, "data.name=latents", "train.max_steps=2", "train.checkpoint_every=2", *evaluation, image_size=16
    )
    [scored] = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines() if '"evaluation"' in ln]
    assert scored["step"] == 2 and np.isfinite(scored["kid"])
    for folder in (run, tmp_path / "run2"):
        vae_config = json.loads((folder / "pipeline" / "vae" / "config.json").read_text())
        assert vae_config["_class_name"] == record["vae"]["kind"] and (folder / "samples" / "final.png").exists()

    common = ["--num-samples", "6", "--batch-size", "4", "--num-steps", "3", "--cfg-scale", "1.5"]
    run_command(torchrun(ROOT / "sample.py", run, "--sample-dir", tmp_path / "s2" / "x", *common), cwd=ROOT)
    run_in_process("sample", [run, "--sample-dir", tmp_path / "s1" / "x", *common], caplog)
    a, b = np.load(tmp_path / "s2" / "x.npz"), np.load(tmp_path / "s1" / "x.npz")
    assert a["arr_0"].shape == (6, 16, 16, 3) and np.array_equal(a["arr_0"], b["arr_0"])

    # the pipeline decodes with the autoencoder's inverse normalisation (the demo's too), and refuses a decoder of
    # another space
    pipe = load_pipeline(run, device="cpu")
    grid, _, info = generate(pipe, "bright", per_class=2, guidance=1.5, steps=2, scheduler="dpm-solver", seed=0)
    assert grid.size[0] >= 32 and info.startswith("2 images from")
    z = torch.randn(1, channels, 8, 8)
    with torch.no_grad():
        expected = pipe.vae.decode(LatentNormalization.of(record["vae"]).denormalize(z)).sample
        assert torch.equal(pipe.space.decode(z), expected)
    other = tmp_path / "other"
    (tiny_sd3_vae(shift_factor=0.2) if kind.startswith("sd3") else tiny_dc_ae(scaling_factor=0.5)).save_pretrained(
        other
    )
    changed = "shift_factor: 0.0609 -> 0.2" if kind.startswith("sd3") else "scaling_factor: 0.4 -> 0.5"
    with pytest.raises(ArtifactError, match=f"not in the latent space .*{changed}"):
        load_pipeline(run, device="cpu", vae=str(other))
