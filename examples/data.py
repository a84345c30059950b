"""Image classification data for the examples: MNIST-format IDX files.

:func:`load_image_data` reads the four IDX files of MNIST or Fashion-MNIST
(``train-images-idx3-ubyte``, ``train-labels-idx1-ubyte``,
``t10k-images-idx3-ubyte``, ``t10k-labels-idx1-ubyte``, each optionally
gzipped, and the ``train-images.idx3-ubyte`` spelling of some MNIST
copies) from a directory, by default :data:`FASHION_MNIST_DIR`, where
Debian's ``dataset-fashion-mnist`` package installs them::

    apt-get install dataset-fashion-mnist

When the directory holds no such files, it falls back to scikit-learn's
bundled ``load_digits`` (1,797 8x8 images) and says so in
:attr:`ImageData.source`; ``fallback=False`` raises instead.

The IDX format (LeCun et al.): two zero bytes, a type byte (``0x08``:
unsigned byte), a byte giving the number of dimensions ``d``, ``d``
big-endian 32-bit sizes, then the values in C order.
"""

from __future__ import annotations

import dataclasses
import gzip
import logging
import pathlib
from typing import Any

import numpy as np
import torch

logger = logging.getLogger(__name__)

#: Where ``apt-get install dataset-fashion-mnist`` puts the IDX files.
FASHION_MNIST_DIR = pathlib.Path('/usr/share/datasets/fashion-mnist')
#: How to get Fashion-MNIST on a Debian machine.
INSTALL_HINT = (
    'apt-get install -y dataset-fashion-mnist (after apt-get update), '
    f'which installs it in {FASHION_MNIST_DIR}'
)

_IDX_DTYPES: dict[int, np.dtype[Any]] = {
    0x08: np.dtype('>u1'),
    0x09: np.dtype('>i1'),
    0x0B: np.dtype('>i2'),
    0x0C: np.dtype('>i4'),
    0x0D: np.dtype('>f4'),
    0x0E: np.dtype('>f8'),
}
_SPLITS = {'train': 'train', 'test': 't10k'}


class DataNotFoundError(FileNotFoundError):
    """A directory lacks the IDX files of MNIST or Fashion-MNIST."""


@dataclasses.dataclass(frozen=True)
class ImageData:
    """A classification data set held in memory.

    Images are float32 of shape ``(N, 1, H, W)``, standardised with the
    training set's mean and standard deviation; labels are int64 ``(N,)``.
    """

    train_images: torch.Tensor
    train_labels: torch.Tensor
    test_images: torch.Tensor
    test_labels: torch.Tensor
    num_classes: int
    #: Where the data came from, for the user.
    source: str

    @property
    def image_shape(self) -> tuple[int, int, int]:
        """``(channels, height, width)`` of one image."""
        c, h, w = self.train_images.shape[1:]
        return int(c), int(h), int(w)

    def subset(self, train_size: int | None, seed: int = 0) -> ImageData:
        """The same data with a random ``train_size`` training examples.

        None (or a size not below the training set's) keeps them all.
        """
        n = len(self.train_labels)
        if train_size is None or train_size >= n:
            return self
        if train_size < 1:
            raise ValueError(f'train_size must be >= 1; got {train_size}')
        gen = torch.Generator().manual_seed(seed)
        keep = torch.randperm(n, generator=gen)[:train_size]
        return dataclasses.replace(
            self,
            train_images=self.train_images[keep],
            train_labels=self.train_labels[keep],
            source=f'{self.source}, random {train_size:,} of {n:,} '
            'training images',
        )


def read_idx(path: pathlib.Path) -> np.ndarray:
    """The array stored in an IDX file (gzipped when named ``*.gz``).

    Raises:
        ValueError: the file is not a well-formed IDX file.

    """
    opener = gzip.open if path.suffix == '.gz' else open
    with opener(path, 'rb') as f:
        raw = f.read()
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0:
        raise ValueError(f'{path} is not an IDX file (bad magic number)')
    dtype = _IDX_DTYPES.get(raw[2])
    if dtype is None:
        raise ValueError(f'{path}: unknown IDX type byte {raw[2]:#04x}')
    ndim = raw[3]
    header = 4 + 4 * ndim
    shape = tuple(
        int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], 'big') for i in range(ndim)
    )
    expected = header + int(np.prod(shape)) * dtype.itemsize
    if len(raw) != expected:
        raise ValueError(
            f'{path}: {len(raw)} bytes, but its header {shape} needs '
            f'{expected}',
        )
    data = np.frombuffer(raw, dtype=dtype, offset=header).reshape(shape)
    native: np.ndarray = data.astype(dtype.newbyteorder('='))
    return native


def find_idx(directory: pathlib.Path, split: str, kind: str) -> pathlib.Path:
    """The IDX file of ``split`` (train/test) and ``kind`` (images/labels).

    Raises:
        DataNotFoundError: no such file in ``directory``.

    """
    prefix, ndim = _SPLITS[split], 3 if kind == 'images' else 1
    names = [
        f'{prefix}-{kind}{sep}idx{ndim}-ubyte{ext}'
        for sep in ('-', '.')
        for ext in ('', '.gz')
    ]
    for name in names:
        if (directory / name).is_file():
            return directory / name
    raise DataNotFoundError(
        f'no {names[0]} (or {", ".join(names[1:])}) in {directory}',
    )


def load_idx_dir(directory: pathlib.Path) -> ImageData:
    """MNIST or Fashion-MNIST from the four IDX files in ``directory``.

    Raises:
        DataNotFoundError: a file is missing.
        ValueError: a file is malformed, or images and labels disagree.

    """
    arrays = {
        (split, kind): read_idx(find_idx(directory, split, kind))
        for split in _SPLITS
        for kind in ('images', 'labels')
    }
    for split in _SPLITS:
        images, labels = arrays[split, 'images'], arrays[split, 'labels']
        if images.ndim != 3 or labels.shape != images.shape[:1]:
            raise ValueError(
                f'{directory}: {split} images {images.shape} and labels '
                f'{labels.shape} do not match',
            )
    return _standardised(
        arrays['train', 'images'].astype(np.float32) / 255.0,
        arrays['train', 'labels'],
        arrays['test', 'images'].astype(np.float32) / 255.0,
        arrays['test', 'labels'],
        source=f'IDX files in {directory}',
    )


def load_digits_data(test_size: int = 300, seed: int = 0) -> ImageData:
    """scikit-learn's 8x8 digits, split at random into train and test."""
    from sklearn.datasets import load_digits  # type: ignore[import-untyped]  # scikit-learn ships no type information

    bunch = load_digits()
    images = np.asarray(bunch.images, dtype=np.float32) / 16.0
    labels = np.asarray(bunch.target, dtype=np.int64)
    order = np.random.default_rng(seed).permutation(len(labels))
    test, train = order[:test_size], order[test_size:]
    return _standardised(
        images[train],
        labels[train],
        images[test],
        labels[test],
        source=f"scikit-learn's load_digits ({len(labels):,} 8x8 images)",
    )


def load_image_data(
    data_dir: pathlib.Path | str | None = None,
    *,
    fallback: bool = True,
) -> ImageData:
    """IDX files from ``data_dir`` (default: Fashion-MNIST), else digits.

    Args:
        data_dir: a directory with MNIST or Fashion-MNIST IDX files; None
            looks in :data:`FASHION_MNIST_DIR`.
        fallback: when the files are missing, return scikit-learn's digits
            (with a warning) instead of raising.

    Raises:
        DataNotFoundError: the files are missing and ``fallback`` is False.

    """
    directory = pathlib.Path(data_dir or FASHION_MNIST_DIR)
    try:
        return load_idx_dir(directory)
    except DataNotFoundError as error:
        if not fallback:
            hint = f'; install Fashion-MNIST with {INSTALL_HINT}'
            raise DataNotFoundError(f'{error}{hint}') from error
        logger.warning(
            '%s; falling back to scikit-learn digits (install '
            'Fashion-MNIST with %s)',
            error,
            INSTALL_HINT,
        )
    return load_digits_data()


def _standardised(
    train_images: np.ndarray,
    train_labels: np.ndarray,
    test_images: np.ndarray,
    test_labels: np.ndarray,
    source: str,
) -> ImageData:
    """Tensors of shape (N, 1, H, W), standardised by training statistics."""
    mean, std = float(train_images.mean()), float(train_images.std())

    def images(x: np.ndarray) -> torch.Tensor:
        return torch.from_numpy((x - mean) / std).float().unsqueeze(1)

    def labels(y: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(y.astype(np.int64))

    return ImageData(
        train_images=images(train_images),
        train_labels=labels(train_labels),
        test_images=images(test_images),
        test_labels=labels(test_labels),
        num_classes=int(max(train_labels.max(), test_labels.max())) + 1,
        source=source,
    )
