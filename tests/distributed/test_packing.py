"""kfac.distributed._communicator: a symmetric matrix as its upper triangle."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st

from kfac.distributed import _communicator as packing
from kfac.distributed._communicator import NonSquareTensorError
from kfac.distributed._communicator import fill_triu
from kfac.distributed._communicator import get_triu

DTYPES = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
)


def integers(
    seed: int, n: int, dtype: torch.dtype, *, symmetric: bool = False
) -> torch.Tensor:
    """An (n, n) matrix of integers in [-16, 16] (exact in every dtype)."""
    generator = torch.Generator().manual_seed(seed)
    values = torch.randint(-8, 9, (n, n), generator=generator)
    if symmetric:
        values = values + values.T
    return values.to(dtype)


def assert_same(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype
    assert actual.shape == expected.shape
    assert torch.equal(actual, expected), (actual, expected)


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 40),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**16),
)
def test_triu_packing_matches_definition(
    n: int, dtype: torch.dtype, seed: int
) -> None:
    matrix = integers(seed, n, dtype)
    packed = get_triu(matrix)
    expected = [matrix[i, j] for i in range(n) for j in range(i, n)]
    assert_same(packed, torch.stack(expected))

    rebuilt = fill_triu((n, n), packed)
    for i, j in itertools.product(range(n), repeat=2):
        assert rebuilt[i, j] == matrix[min(i, j), max(i, j)]
    assert rebuilt.dtype == dtype

    symmetric = integers(seed + 1, n, dtype, symmetric=True)
    assert_same(fill_triu(symmetric.shape, get_triu(symmetric)), symmetric)


def test_triu_packing_of_large_matrix_bypasses_the_cache() -> None:
    n = packing.TRIU_CACHE_MAX_N + 7
    symmetric = integers(3, n, torch.float64, symmetric=True)
    packed = get_triu(symmetric)
    mask = torch.ones(n, n, dtype=torch.bool).triu()
    assert_same(packed, symmetric[mask])
    assert_same(fill_triu(torch.Size([n, n]), packed), symmetric)


@pytest.mark.parametrize('shape', [(3,), (2, 3), (3, 2), (2, 2, 2), ()])
def test_get_triu_rejects_non_square(shape: tuple[int, ...]) -> None:
    with pytest.raises(NonSquareTensorError, match='square 2-D') as info:
        get_triu(torch.zeros(shape))
    assert isinstance(info.value, ValueError)


def test_fill_triu_rejects_bad_shape_or_length() -> None:
    with pytest.raises(NonSquareTensorError, match=r'\(2, 3\)'):
        fill_triu((2, 3), torch.zeros(3))
    with pytest.raises(NonSquareTensorError):
        fill_triu((3,), torch.zeros(3))
    with pytest.raises(ValueError, match=r'6 elements.*\(5,\)') as info:
        fill_triu((3, 3), torch.zeros(5))
    assert not isinstance(info.value, NonSquareTensorError)
    with pytest.raises(ValueError, match=r'got shape \(2, 3\)'):
        fill_triu((3, 3), torch.zeros(2, 3))
