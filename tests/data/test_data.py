"""Data sets: image folders (class mapping, corrupt files), IDX reading, ADM crop, the sharded sampler."""

import gzip
import logging
import struct

import numpy as np
import pytest
import torch
from PIL import Image

from moh_dit.data.batches import ShardedEpochBatchSampler, class_draws, subset_indices
from moh_dit.data.fashion_mnist import FashionMNIST, find_fashion_mnist, read_idx
from moh_dit.data.image_folder import ImageFolderDataset, center_crop_arr
from moh_dit.errors import DataError


def _write_images(root, classes, per_class=3, size=(20, 16), mode="RGB"):
    rng = np.random.default_rng(0)
    for name in classes:
        d = root / name / "nested"
        d.mkdir(parents=True)
        for i in range(per_class):
            shape = (size[1], size[0], 3) if mode == "RGB" else (size[1], size[0])
            Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8), mode=mode).save(d / f"{i}.png")


# ----------------------------------------------------------------------------------------------------
# Preprocessing
# ----------------------------------------------------------------------------------------------------
def test_center_crop_follows_adm_steps():
    rng = np.random.default_rng(1)
    img = Image.fromarray(rng.integers(0, 256, (100, 200, 3), dtype=np.uint8))
    out = center_crop_arr(img, 32)
    # by hand: 100 >= 64 -> box-halve to 100x50; 50 < 64 -> bicubic to 64x32; crop the middle 32 columns
    step = img.resize((100, 50), resample=Image.BOX).resize((64, 32), resample=Image.BICUBIC)
    expected = np.asarray(step)[:, 16:48]
    assert out.size == (32, 32)
    np.testing.assert_array_equal(np.asarray(out), expected)


def test_center_crop_keeps_an_image_of_the_right_size():
    arr = np.random.default_rng(2).integers(0, 256, (28, 28), dtype=np.uint8)
    np.testing.assert_array_equal(np.asarray(center_crop_arr(Image.fromarray(arr), 28)), arr)


# ----------------------------------------------------------------------------------------------------
# Image folder
# ----------------------------------------------------------------------------------------------------
def test_image_folder_class_mapping_and_range(tmp_path):
    _write_images(tmp_path, ["zebra", "apple", "mango"])
    (tmp_path / "notes.txt").write_text("ignored")
    ds = ImageFolderDataset(tmp_path, image_size=8)
    assert ds.classes == ["apple", "mango", "zebra"]
    assert ds.id2label == {0: "apple", 1: "mango", 2: "zebra"}
    assert len(ds) == 9 and ds.targets == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    x, y = ds[4]
    assert x.shape == (3, 8, 8) and x.dtype == torch.float32 and y == 1
    assert x.min() >= -1 and x.max() <= 1


def test_image_folder_grayscale(tmp_path):
    _write_images(tmp_path, ["a", "b"], mode="RGB")
    x, _ = ImageFolderDataset(tmp_path, image_size=8, channels=1)[0]
    assert x.shape == (1, 8, 8)


def test_corrupt_image_is_skipped_with_a_warning(tmp_path, caplog):
    _write_images(tmp_path, ["a", "b"], per_class=60)
    bad = tmp_path / "a" / "nested" / "0.png"
    bad.write_bytes(b"this is not a png")
    ds = ImageFolderDataset(tmp_path, image_size=8)
    with caplog.at_level(logging.WARNING):
        x, y = ds[0]
    assert x.shape == (3, 8, 8) and y == 0  # replaced by the next readable image
    assert str(bad) in ds.bad_files and "skipping unreadable image" in caplog.text
    assert ds.scan() == [str(bad)] and len(ds) == 119


def test_too_many_corrupt_images_give_a_clear_error(tmp_path):
    _write_images(tmp_path, ["a"], per_class=4)
    for i in range(3):
        (tmp_path / "a" / "nested" / f"{i}.png").write_bytes(b"garbage")
    ds = ImageFolderDataset(tmp_path, image_size=8)
    with pytest.raises(DataError, match="unreadable"):
        for i in range(4):
            ds[i]


def test_missing_or_empty_folder_errors(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        ImageFolderDataset(tmp_path / "nope", 8)
    with pytest.raises(DataError, match="no images .* or images directly in it"):
        ImageFolderDataset(tmp_path, 8)
    (tmp_path / "cls").mkdir()
    with pytest.raises(DataError, match="no images"):
        ImageFolderDataset(tmp_path, 8)


# ----------------------------------------------------------------------------------------------------
# IDX / Fashion-MNIST
# ----------------------------------------------------------------------------------------------------
def _write_idx(path, arr, compress=False):
    header = bytes([0, 0, 0x08, arr.ndim]) + struct.pack(f">{arr.ndim}I", *arr.shape)
    data = header + arr.astype(np.uint8).tobytes()
    (gzip.open if compress else open)(path, "wb").write(data)


@pytest.mark.parametrize("compress", [False, True])
def test_read_idx_round_trip(tmp_path, compress):
    arr = np.random.default_rng(0).integers(0, 256, (5, 4, 3), dtype=np.uint8)
    path = tmp_path / ("x.idx.gz" if compress else "x.idx")
    _write_idx(path, arr, compress)
    np.testing.assert_array_equal(read_idx(path), arr)


def test_read_idx_rejects_bad_files(tmp_path):
    (tmp_path / "bad").write_bytes(b"\x01\x02\x03\x04")
    with pytest.raises(DataError, match="magic"):
        read_idx(tmp_path / "bad")
    arr = np.zeros((5, 4), dtype=np.uint8)
    _write_idx(tmp_path / "short", arr)
    data = (tmp_path / "short").read_bytes()
    (tmp_path / "short").write_bytes(data[:-3])
    with pytest.raises(DataError, match="truncated"):
        read_idx(tmp_path / "short")


def test_fashion_mnist_from_a_folder_of_idx_files(tmp_path):
    images = np.random.default_rng(0).integers(0, 256, (12, 28, 28), dtype=np.uint8)
    labels = np.arange(12) % 10
    for prefix in ("train", "t10k"):
        _write_idx(tmp_path / f"{prefix}-images-idx3-ubyte.gz", images, compress=True)
        _write_idx(tmp_path / f"{prefix}-labels-idx1-ubyte", labels)
    ds = FashionMNIST(str(tmp_path), image_size=32, channels=3)
    x, y = ds[3]
    assert len(ds) == 12 and y == 3 and x.shape == (3, 32, 32)
    assert ds.id2label[9] == "Ankle boot"
    native = FashionMNIST(str(tmp_path))[5][0]
    torch.testing.assert_close(native[0], torch.from_numpy(images[5]).float() / 127.5 - 1)


def test_fashion_mnist_missing_files_give_install_hint(tmp_path, monkeypatch):
    monkeypatch.setattr("moh_dit.data.fashion_mnist.FASHION_MNIST_SEARCH_PATHS", ())
    monkeypatch.delenv("MOH_DIT_FASHION_MNIST", raising=False)
    with pytest.raises(DataError, match="dataset-fashion-mnist"):
        FashionMNIST(str(tmp_path))


@pytest.mark.skipif(find_fashion_mnist() is None, reason="Fashion-MNIST IDX files not installed")
def test_real_fashion_mnist_files():
    train, test = FashionMNIST(split="train"), FashionMNIST(split="test")
    assert len(train) == 60000 and len(test) == 10000
    assert sorted(set(train.targets)) == list(range(10))
    assert np.bincount(train.labels).tolist() == [6000] * 10


@pytest.mark.skipif(find_fashion_mnist() is None, reason="Fashion-MNIST IDX files not installed")
def test_flips_on_fashion_mnist_are_called_out(caplog):
    from moh_dit.data.training_data import load_training_data
    from moh_dit.training.config import DataSection

    with caplog.at_level(logging.WARNING, logger="moh_dit"):
        load_training_data(DataSection(name="fashion-mnist", subset_per_class=2, random_flip=False))
        assert "random_flip" not in caplog.text
        load_training_data(DataSection(name="fashion-mnist", subset_per_class=2))  # DiT's default: flips on
    assert "shoes all point one way" in caplog.text and "data.random_flip=false" in caplog.text


# ----------------------------------------------------------------------------------------------------
# Sampler
# ----------------------------------------------------------------------------------------------------
def test_sampler_shards_are_disjoint_and_deterministic():
    batches = [list(ShardedEpochBatchSampler(103, 5, num_replicas=2, rank=r, seed=3, epoch=1)) for r in range(2)]
    flat = [i for rank in batches for b in rank for i in b]
    assert len(batches[0]) == len(batches[1]) == 10
    assert len(flat) == len(set(flat)) == 100
    again = list(ShardedEpochBatchSampler(103, 5, num_replicas=2, rank=0, seed=3, epoch=1))
    assert again == batches[0]
    other_epoch = list(ShardedEpochBatchSampler(103, 5, num_replicas=2, rank=0, seed=3, epoch=2))
    assert other_epoch != batches[0]


def test_sampler_resumes_mid_epoch():
    full = list(ShardedEpochBatchSampler(50, 4, seed=0, epoch=0))
    tail = list(ShardedEpochBatchSampler(50, 4, seed=0, epoch=0, start_batch=5))
    assert tail == full[5:]


def test_sampler_rejects_too_small_dataset():
    with pytest.raises(DataError, match="smaller than one global micro-batch"):
        ShardedEpochBatchSampler(7, 4, num_replicas=2)


def test_subset_indices_balanced():
    labels = [0, 1, 0, 2, 1, 0, 2, 2]
    assert subset_indices(labels, 2) == [0, 1, 2, 3, 4, 6]


# ----------------------------------------------------------------------------------------------------
# Class weights
# ----------------------------------------------------------------------------------------------------
NAMES = {0: "T-shirt/top", 1: "Sandal", 2: "Bag"}


def test_class_draws_repeat_whole_weights_and_draw_a_fresh_exact_share_for_the_fraction():
    labels = [0] * 10 + [1] * 20 + [2] * 30
    draws = class_draws({"sandal": 2, 2: 1.5}, labels, NAMES)  # a name in any case, an id
    assert draws.weights == {0: 1.0, 1: 2.0, 2: 1.5}
    assert draws.epoch_size == 10 + 40 + 45
    epochs = [draws.epoch_items(torch.Generator().manual_seed(e)) for e in range(200)]
    for items in epochs:
        counts = torch.bincount(items, minlength=60)
        assert len(items) == 95
        assert counts[:10].tolist() == [1] * 10 and counts[10:30].tolist() == [2] * 20
        assert sorted(set(counts[30:].tolist())) == [1, 2] and int((counts[30:] == 2).sum()) == 15
    # the extra half of the bags changes from epoch to epoch, and every bag gets its share over many
    assert not torch.equal(epochs[0], epochs[1])
    mean = torch.stack([torch.bincount(e, minlength=60)[30:] for e in epochs]).float().mean(0)
    assert torch.allclose(mean, torch.full((30,), 1.5), atol=0.2)
    shares = draws.shares()
    assert shares == pytest.approx({0: 10 / 95, 1: 40 / 95, 2: 45 / 95}) and sum(shares.values()) == pytest.approx(1)


def test_balanced_class_draws_draw_every_class_equally_often():
    labels = [0] * 10 + [1] * 30 + [2] * 20
    draws = class_draws("balanced", labels, NAMES)
    assert draws.epoch_size == 60  # the data's size, split evenly
    counts = torch.bincount(torch.tensor(labels)[draws.epoch_items(torch.Generator().manual_seed(0))])
    assert counts.tolist() == [20, 20, 20]
    # on balanced data, and with every weight 1, an epoch is the plain one: no draws at all
    assert class_draws("balanced", [0, 1, 2] * 5, NAMES) is None
    assert class_draws({"Bag": 1}, labels, NAMES) is None and class_draws({}, labels, NAMES) is None


def test_class_weights_naming_a_class_the_data_lacks_are_refused_with_its_classes():
    with pytest.raises(DataError, match=r"names 'Sneaker'.*its classes: 0 \(T-shirt/top\), 1 \(Sandal\), 2 \(Bag\)"):
        class_draws({"Sneaker": 2}, [0, 1, 2], NAMES)
    with pytest.raises(DataError, match="names 7"):
        class_draws({7: 2}, [0, 1, 2], NAMES)


def test_weighted_sampler_batches_cover_the_epoch_draws_deterministically_and_resume():
    labels = [0] * 10 + [1] * 20 + [2] * 30
    draws = class_draws({"Sandal": 2, "Bag": 0.5}, labels, NAMES)  # 10 + 40 + 15 = 65 draws per epoch
    sampler = ShardedEpochBatchSampler(len(labels), 4, num_replicas=2, rank=0, seed=3, epoch=1, draws=draws)
    assert sampler.batches_per_epoch == 65 // 8
    ranks = [list(ShardedEpochBatchSampler(60, 4, 2, r, 3, 1, draws=draws)) for r in range(2)]
    assert ranks[0] == list(sampler)
    seen = torch.tensor([i for rank in ranks for b in rank for i in b])
    by_class = torch.bincount(torch.tensor(labels)[seen], minlength=3)
    assert by_class.sum() == 64 and (by_class - torch.tensor([10, 40, 15])).abs().sum() == 1  # one draw left off
    tail = list(ShardedEpochBatchSampler(60, 4, 2, 0, 3, 1, start_batch=3, draws=draws))
    assert tail == ranks[0][3:]
    assert list(ShardedEpochBatchSampler(60, 4, 2, 0, 3, 2, draws=draws)) != ranks[0]
