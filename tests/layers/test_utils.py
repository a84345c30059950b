"""The original's tensor helpers in `kfac.layers.utils`."""

from __future__ import annotations

import pytest
import torch

from kfac.layers.utils import append_bias_ones
from kfac.layers.utils import get_cov
from kfac.layers.utils import reshape_data


@pytest.mark.parametrize('shape', [(3,), (4, 2), (2, 3, 5)])
def test_append_bias_ones(shape: tuple[int, ...]) -> None:
    x = torch.randn(shape, dtype=torch.float64)
    out = append_bias_ones(x)
    assert out.shape == (*shape[:-1], shape[-1] + 1)
    assert torch.equal(out[..., :-1], x)
    assert torch.equal(out[..., -1], torch.ones(shape[:-1], dtype=x.dtype))


def _outer_mean(
    a: torch.Tensor, b: torch.Tensor, scale: float
) -> torch.Tensor:
    total = sum(torch.outer(a[i], b[i]) for i in range(a.shape[0]))
    assert isinstance(total, torch.Tensor)
    return total / scale


@pytest.mark.parametrize('scale', [None, 2.5])
def test_get_cov_equals_the_sum_of_outer_products(scale: float | None) -> None:
    torch.manual_seed(0)
    a = torch.randn(6, 3, dtype=torch.float64)
    b = torch.randn(6, 3, dtype=torch.float64)
    divisor = 6.0 if scale is None else scale
    cov = get_cov(a, scale=scale)
    torch.testing.assert_close(cov, _outer_mean(a, a, divisor))
    assert torch.equal(cov, cov.T)
    torch.testing.assert_close(
        get_cov(a, b, scale), _outer_mean(a, b, divisor)
    )


def test_get_cov_rejects_bad_shapes() -> None:
    with pytest.raises(ValueError, match=r'^a must be 2-D; got shape \(2,\)'):
        get_cov(torch.ones(2))
    with pytest.raises(ValueError, match=r'^b must have the shape of a'):
        get_cov(torch.ones(2, 2), torch.ones(2))


def test_reshape_data_concatenates_along_the_batch_dimension() -> None:
    first = torch.arange(12.0).reshape(2, 3, 2)
    second = torch.arange(12.0, 18.0).reshape(1, 3, 2)
    out = reshape_data([first, second])
    assert torch.equal(out, torch.cat([first, second]))
    flat = reshape_data([first, second], collapse_dims=True)
    assert torch.equal(flat, torch.arange(18.0).reshape(9, 2))
    seq_first = reshape_data(
        [first.transpose(0, 1), second.transpose(0, 1)], batch_first=False
    )
    assert torch.equal(seq_first, out.transpose(0, 1))
    matrix = reshape_data([torch.ones(2, 2)], collapse_dims=True)
    assert matrix.shape == (2, 2)
