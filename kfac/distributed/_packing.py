"""Symmetric matrices packed as their upper triangle.

A symmetric `n x n` matrix (a K-FAC factor) is determined by its upper
triangle, `n (n + 1) / 2` numbers instead of `n ** 2`; the communicator
sends that when asked to be symmetry-aware. Pure tensor functions: nothing
here needs `torch.distributed`.

Examples:
    >>> import torch
    >>> matrix = torch.tensor([[1.0, 2.0], [2.0, 3.0]])
    >>> get_triu(matrix)
    tensor([1., 2., 3.])
    >>> torch.equal(fill_triu(matrix.shape, get_triu(matrix)), matrix)
    True

"""

from __future__ import annotations

import functools

import torch

__all__ = ['NonSquareTensorError', 'fill_triu', 'get_triu']

TRIU_CACHE_MAX_N = 512
"""Matrices up to this size keep their triangle indices in a cache."""


class NonSquareTensorError(ValueError):
    """A symmetric-matrix operation got a tensor that is not square 2-D."""


def check_square(shape: torch.Size | tuple[int, ...], what: str) -> int:
    """Return `n` if `shape` is `(n, n)`.

    Args:
        shape: the shape to check.
        what: how the message names the tensor.

    Raises:
        NonSquareTensorError: `shape` is not `(n, n)`.

    """
    if len(shape) != 2 or shape[0] != shape[1]:
        raise NonSquareTensorError(
            f'{what} must be a square 2-D matrix; got shape {tuple(shape)}',
        )
    return int(shape[0])


@functools.lru_cache(maxsize=64)
def _cached_triu_indices(n: int, device: torch.device) -> torch.Tensor:
    return torch.triu_indices(n, n, device=device)


def _triu_indices(n: int, device: torch.device) -> torch.Tensor:
    """Return `torch.triu_indices(n, n)`: rows and columns, shape (2, m)."""
    if n <= TRIU_CACHE_MAX_N:
        return _cached_triu_indices(n, device)
    return torch.triu_indices(n, n, device=device)


def get_triu(tensor: torch.Tensor) -> torch.Tensor:
    """Return the upper triangle of a square matrix, diagonal included.

    Args:
        tensor: a matrix of shape (n, n).

    Returns:
        A new 1-D tensor of `n (n + 1) / 2` elements, the entries
        `tensor[i, j]` with `i <= j` in row-major order.

    Raises:
        NonSquareTensorError: `tensor` is not a square 2-D tensor.

    """
    n = check_square(tensor.shape, 'tensor')
    rows, cols = _triu_indices(n, tensor.device)
    return tensor[rows, cols]


def fill_triu(
    shape: torch.Size | tuple[int, ...],
    packed: torch.Tensor,
) -> torch.Tensor:
    """Rebuild a symmetric matrix from its packed upper triangle.

    The inverse of `get_triu` on symmetric
    matrices: entry `(i, j)` and entry `(j, i)` are both the packed value of
    `(min(i, j), max(i, j))`.

    Args:
        shape: the matrix shape, (n, n).
        packed: 1-D tensor of `n (n + 1) / 2` elements as from
            `get_triu`.

    Returns:
        A new (n, n) tensor with the dtype and device of `packed`.

    Raises:
        NonSquareTensorError: `shape` is not square 2-D.
        ValueError: `packed` is not 1-D of `n (n + 1) / 2` elements.

    """
    n = check_square(tuple(shape), 'shape')
    if packed.dim() != 1 or packed.numel() != n * (n + 1) // 2:
        raise ValueError(
            f'packed must be 1-D with n * (n + 1) / 2 = {n * (n + 1) // 2} '
            f'elements for shape {tuple(shape)}; got shape '
            f'{tuple(packed.shape)}',
        )
    rows, cols = _triu_indices(n, packed.device)
    matrix = packed.new_empty((n, n))
    matrix[rows, cols] = packed
    matrix[cols, rows] = packed
    return matrix
