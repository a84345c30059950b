"""kfac.math.tied: one Kronecker product for a sum of Kronecker products."""

from __future__ import annotations

import pytest
import torch

from kfac import math as kmath
from testing.asserts import assert_rel_close


def _psd(n: int, seed: int) -> torch.Tensor:
    m = torch.randn(n, n, dtype=torch.float64, generator=_gen(seed))
    return m @ m.T / n


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _kron_sum(terms: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    return torch.stack([torch.kron(x, y) for x, y in terms]).sum(0)


def test_kronecker_sum_factors_is_exact_where_documented() -> None:
    x1, y1, x2, y2 = _psd(4, 1), _psd(3, 2), _psd(4, 3), _psd(3, 4)
    for terms in (
        [(x1, y1)],  # one use
        [(x1, y1), (x1, y1)],  # identical uses: 2 X ⊗ Y
        [(x1, y1), (x2, 0 * y2)],  # a vanishing use drops out
        [(x1, y1), (5 * x1, y2)],  # proportional X: exact
        [(x1, 3 * y1), (x2, y1)],  # proportional Y: exact
    ):
        xs, ys = kmath.kronecker_sum_factors(terms)
        assert_rel_close(torch.kron(xs, ys), _kron_sum(terms), label='ksum')
    # In general an approximation that keeps the trace.
    terms = [(x1, y1), (x2, 7 * y2)]
    xs, ys = kmath.kronecker_sum_factors(terms)
    product = torch.kron(xs, ys)
    assert_rel_close(product.trace(), _kron_sum(terms).trace(), label='ksum')
    assert (product - _kron_sum(terms)).norm() > 1e-3 * product.norm()
    # The formula, written out.
    m = [(x.trace() / 4, y.trace() / 3) for x, y in terms]
    c = torch.stack([a * b for a, b in m]).sum()
    assert_rel_close(xs, (m[0][1] * x1 + m[1][1] * x2) / c.sqrt())
    assert_rel_close(ys, (m[0][0] * y1 + m[1][0] * 7 * y2) / c.sqrt())


def test_kronecker_sum_factors_diagonal_inputs_and_no_statistics() -> None:
    d, y, g = (
        torch.tensor([1.0, 0.0, 2.0], dtype=torch.float64),
        _psd(2, 5),
        _psd(3, 6),
    )
    xs, ys = kmath.kronecker_sum_factors([(d, y), (g, _psd(2, 7))])
    dense, _ = kmath.kronecker_sum_factors(
        [(torch.diag(d), y), (g, _psd(2, 7))]
    )
    assert_rel_close(xs, dense, label='ksum')
    zero = torch.zeros(2, 2, dtype=torch.float64)
    xs, ys = kmath.kronecker_sum_factors([(zero, zero), (zero, zero)])
    assert torch.equal(xs, zero) and torch.equal(ys, zero)
    with pytest.raises(ValueError, match='at least one'):
        kmath.kronecker_sum_factors([])
