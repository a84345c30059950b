"""Small MNIST-format IDX files for the tests of ``examples.data``.

:func:`write_idx` writes any unsigned-byte array in the IDX format (two
zero bytes, the type byte ``0x08``, the number of dimensions, big-endian
32-bit sizes, the values), independently of the reader under test, and
:func:`write_idx_dir` a directory of the four files of a tiny random
MNIST look-alike.
"""

from __future__ import annotations

import gzip
import pathlib
import struct

import numpy as np


def write_idx(path: pathlib.Path, array: np.ndarray) -> pathlib.Path:
    """Write ``array`` (uint8) to ``path``; gzipped when it ends in .gz."""
    data = np.ascontiguousarray(array, dtype=np.uint8)
    header = struct.pack('>BBBB', 0, 0, 0x08, data.ndim)
    header += struct.pack(f'>{data.ndim}I', *data.shape)
    raw = header + data.tobytes()
    path.write_bytes(gzip.compress(raw) if path.suffix == '.gz' else raw)
    return path


def write_idx_dir(
    directory: pathlib.Path,
    *,
    train: int,
    test: int,
    size: int = 28,
    gz: bool = True,
    seed: int = 0,
) -> pathlib.Path:
    """The four IDX files of random ``size``x``size`` images, 10 classes.

    Names follow MNIST (``train-images-idx3-ubyte.gz`` ...); with ``gz``
    False they are uncompressed and spelled ``train-images.idx3-ubyte``,
    as some MNIST copies are.
    """
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    sep, ext = ('-', '.gz') if gz else ('.', '')
    for prefix, n in (('train', train), ('t10k', test)):
        images = rng.integers(0, 256, size=(n, size, size), dtype=np.uint8)
        labels = rng.integers(0, 10, size=n, dtype=np.uint8)
        write_idx(directory / f'{prefix}-images{sep}idx3-ubyte{ext}', images)
        write_idx(directory / f'{prefix}-labels{sep}idx1-ubyte{ext}', labels)
    return directory
