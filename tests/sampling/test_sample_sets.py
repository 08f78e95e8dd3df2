"""Sample folders refuse to mix samples of other settings: checked on bare manifests, no model needed."""

import pytest

from moh_dit.errors import ArtifactError
from moh_dit.manifests import read_manifest
from moh_dit.sampling.sample_sets import prepare_sample_folder, sample_npz_path


def manifest(seed=0):
    return {"identity": {"transformer_sha256": "ab" * 32, "seed": seed, "guidance_scale": 1.5}, "count": 4}


def test_a_folder_is_resumed_only_with_the_same_identity(tmp_path):
    folder = tmp_path / "s"
    prepare_sample_folder(folder, manifest(), overwrite=False, write=True)
    (folder / "000000.png").write_bytes(b"png")
    prepare_sample_folder(folder, manifest(), overwrite=False, write=True)  # the same settings: resumed
    assert (folder / "000000.png").exists()
    with pytest.raises(ArtifactError, match="seed"):
        prepare_sample_folder(folder, manifest(seed=1), overwrite=False, write=True)
    prepare_sample_folder(folder, manifest(seed=1), overwrite=True, write=True)
    assert not (folder / "000000.png").exists() and read_manifest(folder, "samples")["identity"]["seed"] == 1


def test_images_without_a_manifest_are_not_adopted(tmp_path):
    folder = tmp_path / "s"
    folder.mkdir()
    (folder / "000000.png").write_bytes(b"png")
    with pytest.raises(ArtifactError, match="without a moh-dit manifest"):
        prepare_sample_folder(folder, manifest(), overwrite=False, write=True)


def test_unfinished_images_of_a_killed_process_are_removed(tmp_path):
    folder = tmp_path / "s"
    prepare_sample_folder(folder, manifest(), overwrite=False, write=True)
    for name in (".000001.png.tmp-123", "000002.png.tmp"):  # this version's, and moh-dit 0.2's
        (folder / name).write_bytes(b"half")
    prepare_sample_folder(folder, manifest(), overwrite=False, write=True)
    assert sorted(p.name for p in folder.iterdir()) == ["manifest.json"]
    assert not sample_npz_path(folder).exists()


def test_a_folder_with_no_image_yet_takes_new_settings(tmp_path):
    folder = tmp_path / "s"
    prepare_sample_folder(folder, manifest(), overwrite=False, write=True)  # then its first block failed
    prepare_sample_folder(folder, manifest(seed=1), overwrite=False, write=True)  # the corrected command
    assert read_manifest(folder, "samples")["identity"]["seed"] == 1
    (folder / "000000.png").write_bytes(b"png")
    with pytest.raises(ArtifactError, match="seed"):  # once it holds an image, it is that image's set
        prepare_sample_folder(folder, manifest(), overwrite=False, write=True)
