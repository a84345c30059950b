"""kfac.math.lowrank: the low-rank-plus-constant preconditioners against
dense solves on the explicit damped matrices, and relative damping.
"""

from __future__ import annotations

import pytest
import torch

from kfac.math import eigen_precondition
from kfac.math import eigenvalue_outer_product
from kfac.math import lowrank
from testing.asserts import assert_rel_close
from testing.reference import eigen_reference
from testing.reference import inverse_reference
from testing.reference import lowrank_plus_constant
from testing.reference import mean_eigenvalue

F64 = torch.float64


def factor(n: int, rows: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, n, generator=gen, dtype=F64)
    return x.T @ x / rows


def side(f: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What the layers store: `(Q_k, (d_k, c))`, or `(Q, d)` whole."""
    d, q = torch.linalg.eigh(f)
    if rank >= f.shape[0]:
        return q, d
    qk, dk = lowrank.top_eigenpairs(q, d, rank)
    return qk, lowrank.lowrank_values(f, dk)


CASES = [(9, 7, 3, 2), (9, 7, 9, 2), (9, 7, 3, 7), (6, 5, 1, 1)]
"""(in, out, k_A, k_G): both low rank, A whole, G whole, rank 1."""


@pytest.mark.parametrize(('n_a', 'n_g', 'k_a', 'k_g'), CASES)
def test_eigen_equals_the_dense_solve(
    n_a: int, n_g: int, k_a: int, k_g: int
) -> None:
    a, g = factor(n_a, 20, 0), factor(n_g, 20, 1)
    v = torch.randn(n_g, n_a, dtype=F64)
    got = lowrank.lowrank_eigen_precondition(
        v, side(a, k_a), side(g, k_g), 0.03
    )
    want = eigen_reference(
        lowrank_plus_constant(a, k_a), lowrank_plus_constant(g, k_g), v, 0.03
    )
    assert_rel_close(got, want, rtol=1e-10, label='low-rank EIGEN')


@pytest.mark.parametrize(('n_a', 'n_g', 'k_a', 'k_g'), CASES)
def test_inverse_equals_the_dense_solve(
    n_a: int, n_g: int, k_a: int, k_g: int
) -> None:
    a, g = factor(n_a, 20, 2), factor(n_g, 20, 3)
    v = torch.randn(n_g, n_a, dtype=F64)
    damping = 0.05
    pi = (mean_eigenvalue(a) / mean_eigenvalue(g)) ** 0.5
    shifts = {'A': pi * damping**0.5, 'G': damping**0.5 / pi}

    def inverse(
        f: torch.Tensor, k: int, name: str
    ) -> tuple[torch.Tensor, ...]:
        if k >= f.shape[0]:
            eye = torch.eye(f.shape[0], dtype=F64)
            return (torch.linalg.inv(f + shifts[name] * eye),)
        q, values = side(f, k)
        return q, lowrank.lowrank_damped_inverse(values, shifts[name])

    got = lowrank.lowrank_inverse_precondition(
        v, inverse(a, k_a, 'A'), inverse(g, k_g, 'G')
    )
    # The low-rank factors keep the traces, hence π.
    want = inverse_reference(
        lowrank_plus_constant(a, k_a),
        lowrank_plus_constant(g, k_g),
        v,
        damping,
    )
    assert_rel_close(got, want, rtol=1e-10, label='low-rank INVERSE')


def test_full_rank_equals_eigen() -> None:
    """k = n on both sides: EIGEN's formula (no complement)."""
    a, g = factor(8, 20, 4), factor(5, 20, 5)
    v = torch.randn(5, 8, dtype=F64)
    (da, qa), (dg, qg) = torch.linalg.eigh(a), torch.linalg.eigh(g)
    got = lowrank.lowrank_eigen_precondition(v, (qa, da), (qg, dg), 0.01)
    want = eigen_precondition(
        v, qa, qg, eigenvalue_outer_product(dg, da, 0.01)
    )
    assert_rel_close(got, want, rtol=1e-12, label='k = n')


def test_values_keep_the_trace_and_clamp_the_rest() -> None:
    a = factor(6, 3, 6)  # rank 3: the rest of the spectrum is ~0
    d, q = torch.linalg.eigh(a)
    _, dk = lowrank.top_eigenpairs(q, d, 2)
    values = lowrank.lowrank_values(a, dk)
    mean = lowrank.mean_eigenvalue(values, 6, 2)
    assert_rel_close(
        mean, torch.tensor(mean_eigenvalue(a), dtype=F64), rtol=1e-12
    )
    whole = lowrank.mean_eigenvalue(d, 6)
    assert_rel_close(
        whole, torch.tensor(mean_eigenvalue(a), dtype=F64), rtol=1e-12
    )
    # tr F below Σ d_k (rounding): the rest is clamped at 0
    low = lowrank.lowrank_values(torch.diag(torch.tensor([1.0, 0.0])), dk[:1])
    assert float(low[-1]) == 0.0


def test_relative_damping_formula() -> None:
    a, g = factor(5, 9, 7), factor(3, 9, 8)
    m_a, m_g = mean_eigenvalue(a), mean_eigenvalue(g)
    got = lowrank.relative_damping(
        0.2, torch.tensor(m_a, dtype=F64), torch.tensor(m_g, dtype=F64)
    )
    assert_rel_close(got, torch.tensor(0.2 * m_a * m_g, dtype=F64))
    zero = torch.zeros((), dtype=F64)
    fallback = lowrank.relative_damping(0.2, zero, torch.ones((), dtype=F64))
    assert float(fallback) == pytest.approx(0.2)
