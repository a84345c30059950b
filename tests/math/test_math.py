from __future__ import annotations

import math

import pytest
import torch

from kfac import math as kmath
from testing.asserts import assert_rel_close
from testing.reference import eigen_reference
from testing.reference import inverse_reference

F64 = torch.float64


def random_psd(n: int, seed: int, rank: int | None = None) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, rank or n + 3, generator=gen, dtype=torch.float64)
    return x @ x.T / x.shape[1]


def random_matrix(rows: int, cols: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, cols, generator=gen, dtype=torch.float64)


def test_compute_dtype_is_at_least_float32() -> None:
    assert kmath.compute_dtype() == torch.float32
    assert kmath.compute_dtype(torch.float16) == torch.float32
    assert kmath.compute_dtype(torch.bfloat16) == torch.float32
    assert kmath.compute_dtype(torch.float64) == torch.float64


def test_append_bias_ones() -> None:
    rows = random_matrix(4, 3, 0)
    out = kmath.append_bias_ones(rows)
    assert out.shape == (4, 4)
    assert torch.equal(out[:, :3], rows)
    assert torch.equal(out[:, 3], torch.ones(4, dtype=F64))


def test_gram_is_scaled_sum_of_outer_products() -> None:
    rows = random_matrix(7, 3, 1)
    expected = sum(torch.outer(r * 2.5, r * 2.5) for r in rows)
    out = kmath.gram(rows.float(), torch.float64, scale=2.5)
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=0)
    assert_rel_close(
        kmath.gram(rows, torch.float64),
        rows.T @ rows,
        label='math.gram',
    )


def test_running_average() -> None:
    batch1, batch2 = random_psd(3, 1), random_psd(3, 2)
    expected = 0.9 * batch1 + 0.1 * batch2
    first = kmath.running_average(None, batch1.clone(), 0.9)
    assert torch.equal(first, batch1)
    buffer = batch2.clone()
    second = kmath.running_average(first, buffer, 0.9)
    assert second is buffer  # computed in the batch's memory
    assert_rel_close(second, expected, label='math.avg')
    assert kmath.running_average(first, batch2.clone(), 1.0) is first


def test_running_average_scales_the_batch_sum() -> None:
    total = torch.full((2, 2), 6.0, dtype=torch.float32)
    first = kmath.running_average(None, total.clone(), 0.5, scale=1 / 3)
    assert torch.equal(first, torch.full((2, 2), 2.0))
    current = torch.ones(2, 2, dtype=torch.float64)
    out = kmath.running_average(current, total, 0.5, scale=1 / 3)
    assert out.dtype == torch.float32  # the batch's dtype
    assert torch.equal(out, torch.full((2, 2), 1.5))


@pytest.mark.parametrize('current', [None, torch.ones(2, 2)])
def test_running_average_keep_zero_drops_the_batch(
    current: torch.Tensor | None,
) -> None:
    total = torch.full((2, 2), 6.0)
    keep = torch.tensor(0.0)
    out = kmath.running_average(current, total, 0.5, scale=1 / 3, keep=keep)
    expected = torch.zeros(2, 2) if current is None else 0.5 * current
    assert torch.equal(out, expected)
    kept = kmath.running_average(
        current, torch.full((2, 2), 6.0), 0.5, 1 / 3, torch.tensor(1.0)
    )
    plain = kmath.running_average(current, torch.full((2, 2), 6.0), 0.5, 1 / 3)
    assert torch.equal(kept, plain)


def test_symmetric_eigh_reconstructs_and_clamps() -> None:
    f = random_psd(5, 3, rank=2)  # rank 2: three (near-)zero eigenvalues
    q, d = kmath.symmetric_eigh(f, torch.float64)
    assert (d >= 0).all()
    assert_rel_close(q @ torch.diag(d) @ q.T, f, rtol=1e-12, label='eigh')
    assert_rel_close(
        q.T @ q, torch.eye(5, dtype=F64), rtol=1e-12, label='eigh'
    )


@pytest.mark.parametrize(('out', 'inp'), [(3, 4), (1, 6), (5, 1)])
@pytest.mark.parametrize('damping', [1e-4, 0.1, 3.0])
def test_eigen_precondition_equals_dense_solve(
    out: int,
    inp: int,
    damping: float,
) -> None:
    a, g = random_psd(inp, 10), random_psd(out, 11)
    v = random_matrix(out, inp, 12)
    qa, da = kmath.symmetric_eigh(a, torch.float64)
    qg, dg = kmath.symmetric_eigh(g, torch.float64)
    scale = kmath.eigenvalue_outer_product(dg, da, damping)
    got = kmath.eigen_precondition(v, qa, qg, scale)
    assert_rel_close(
        got,
        eigen_reference(a, g, v, damping),
        rtol=1e-9,
        label='eigen precondition vs solve',
    )


@pytest.mark.parametrize('damping', [1e-4, 0.1, 3.0])
def test_inverse_precondition_equals_dense_solve(damping: float) -> None:
    a, g = random_psd(4, 20), 7.0 * random_psd(3, 21)
    v = random_matrix(3, 4, 22)
    pi = kmath.pi_correction(a, g)
    root = math.sqrt(damping)
    a_inv = kmath.damped_inverse(a, pi * root, torch.float64)
    g_inv = kmath.damped_inverse(g, root / pi, torch.float64)
    assert torch.equal(a_inv, a_inv.T)
    got = kmath.inverse_precondition(v, a_inv, g_inv)
    assert_rel_close(
        got,
        inverse_reference(a, g, v, damping),
        rtol=1e-9,
        label='inverse precondition vs solve',
    )


def test_pi_correction_formula_and_fallback() -> None:
    a = torch.diag(torch.tensor([1.0, 3.0], dtype=F64))  # tr/dim = 2
    g = torch.diag(torch.tensor([8.0, 8.0, 8.0, 8.0], dtype=F64))  # tr/dim 8
    pi = kmath.pi_correction(a, g)
    assert pi.dim() == 0
    assert float(pi) == pytest.approx(0.5, rel=1e-15)
    zero = torch.zeros(2, 2, dtype=F64)
    assert float(kmath.pi_correction(zero, g)) == 1.0
    assert float(kmath.pi_correction(a, torch.zeros(3, 3, dtype=F64))) == 1.0
    inf = torch.diag(torch.tensor([math.inf, 1.0], dtype=F64))
    assert float(kmath.pi_correction(inf, g)) == 1.0
    assert float(kmath.pi_correction(-a, g)) == 1.0
    tiny = torch.diag(torch.tensor([1e-300, 1e-300], dtype=F64))
    huge = torch.diag(torch.tensor([1e300, 1e300], dtype=F64))
    assert float(kmath.pi_correction(tiny, huge)) == 1.0  # ratio underflows


def test_damped_inverse() -> None:
    f = random_psd(4, 30)
    inv = kmath.damped_inverse(f.float(), 0.5, torch.float64)
    assert inv.dtype == torch.float64
    torch.testing.assert_close(
        inv @ (f + 0.5 * torch.eye(4, dtype=F64)),
        torch.eye(4, dtype=F64),
        rtol=0,
        atol=1e-6,
    )


def test_gram_scales_rows_before_the_product() -> None:
    """A loss-scaled gradient (2**100) squared would overflow float32."""
    rows = torch.full((4, 2), 2.0**100, dtype=torch.float32)
    out = kmath.gram(rows, torch.float32, scale=2.0**-100)
    assert torch.equal(out, torch.full((2, 2), 4.0))


def test_damped_inverse_rejects_an_indefinite_matrix() -> None:
    from kfac.layers.base import LinAlgError

    bad = torch.diag(torch.tensor([1.0, -5.0], dtype=F64))
    with pytest.raises(LinAlgError, match='not positive definite'):
        kmath.damped_inverse(bad, 0.1, torch.float64)
    nan = torch.full((2, 2), math.nan, dtype=F64)
    with pytest.raises(LinAlgError):
        kmath.damped_inverse(nan, 0.1, torch.float64)
    _, info = kmath.damped_inverse_ex(bad, torch.tensor(0.1), torch.float64)
    assert int(info) == 2  # the second pivot is not positive
