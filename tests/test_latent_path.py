"""The whole latent path at toy scale, as a user runs it: class folders with a corrupt image -> latents with a
locally saved random AutoencoderKL -> training on two processes -> sampling on two processes -> a reference
built from the image tree -> evaluation. Every artifact's manifest must point at the one before it, and
nothing may fall back silently. The one-process commands run in this process (the same commands without a new
interpreter's start-up); the two-process ones and the evaluation script run as a user starts them."""

import json
import sys
from pathlib import Path

import numpy as np

from .helpers.factories import (
    make_image_folder,
    run_command,
    run_in_process,
    tiny_train_overrides,
    tiny_vae,
    torchrun,
)

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
