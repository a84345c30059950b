"""The examples' IDX loader and its scikit-learn digits fallback."""

from __future__ import annotations

import gzip
import logging
import pathlib

import numpy as np
import pytest
import torch

from examples import data
from testing.data import write_idx
from testing.data import write_idx_dir


@pytest.mark.parametrize('name', ['x-idx3-ubyte', 'x-idx3-ubyte.gz'])
def test_read_idx_round_trip(tmp_path: pathlib.Path, name: str) -> None:
    array = np.arange(2 * 3 * 5, dtype=np.uint8).reshape(2, 3, 5)
    read = data.read_idx(write_idx(tmp_path / name, array))
    assert read.dtype == np.uint8
    np.testing.assert_array_equal(read, array)


def test_read_idx_big_endian_int32(tmp_path: pathlib.Path) -> None:
    values = np.array([1, -2, 70000], dtype='>i4')
    path = tmp_path / 'ints'
    path.write_bytes(bytes([0, 0, 0x0C, 1, 0, 0, 0, 3]) + values.tobytes())
    np.testing.assert_array_equal(data.read_idx(path), [1, -2, 70000])


@pytest.mark.parametrize(
    ('raw', 'message'),
    [
        (b'\x01\x00\x08\x01\x00\x00\x00\x01\x05', 'bad magic'),
        (b'\x00\x00\x07\x01\x00\x00\x00\x01\x05', 'type byte 0x07'),
        (b'\x00\x00\x08\x01\x00\x00\x00\x02\x05', 'needs 10'),
    ],
)
def test_read_idx_rejects_malformed_files(
    tmp_path: pathlib.Path, raw: bytes, message: str
) -> None:
    path = tmp_path / 'bad.gz'
    path.write_bytes(gzip.compress(raw))
    with pytest.raises(ValueError, match=message):
        data.read_idx(path)


@pytest.mark.parametrize('gz', [True, False])
def test_load_idx_dir(tmp_path: pathlib.Path, gz: bool) -> None:
    write_idx_dir(tmp_path, train=30, test=12, gz=gz)
    loaded = data.load_image_data(tmp_path, fallback=False)
    assert loaded.image_shape == (1, 28, 28)
    assert loaded.train_images.shape == (30, 1, 28, 28)
    assert loaded.test_labels.shape == (12,)
    assert loaded.train_labels.dtype == torch.int64
    # standardised with the training set's statistics
    mean = float(loaded.train_images.mean())
    std = float(loaded.train_images.std())
    assert mean == pytest.approx(0.0, abs=1e-5)
    assert std == pytest.approx(1.0, abs=1e-2)
    assert str(tmp_path) in loaded.source


def test_images_and_labels_must_match(tmp_path: pathlib.Path) -> None:
    write_idx_dir(tmp_path, train=6, test=4)
    write_idx(tmp_path / 't10k-labels-idx1-ubyte.gz', np.zeros(5, np.uint8))
    with pytest.raises(ValueError, match=r'test images \(4, 28, 28\)'):
        data.load_idx_dir(tmp_path)


def test_subset_is_random_and_seeded(tmp_path: pathlib.Path) -> None:
    loaded = data.load_idx_dir(write_idx_dir(tmp_path, train=40, test=4))
    small = loaded.subset(10, seed=1)
    assert small.train_images.shape[0] == 10
    assert torch.equal(
        small.train_images, loaded.subset(10, seed=1).train_images
    )
    assert not torch.equal(small.train_images, loaded.train_images[:10])
    assert 'random 10 of 40 training images' in small.source
    assert loaded.subset(None) is loaded and loaded.subset(40) is loaded
    with pytest.raises(ValueError, match='train_size'):
        loaded.subset(0)


def test_missing_files_fall_back_to_digits(
    tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING):
        loaded = data.load_image_data(tmp_path)
    assert 'load_digits' in loaded.source
    assert loaded.image_shape == (1, 8, 8)
    assert loaded.num_classes == 10
    assert len(loaded.train_labels) + len(loaded.test_labels) == 1797
    assert 'apt-get install -y dataset-fashion-mnist' in caplog.text


def test_missing_files_without_fallback_say_how_to_install(
    tmp_path: pathlib.Path,
) -> None:
    with pytest.raises(data.DataNotFoundError, match='dataset-fashion-mnist'):
        data.load_image_data(tmp_path, fallback=False)
