"""kfac.math.ekfac: each form of the scaling against a loop over the
examples, and the warm-started basis against ``eigh``.
"""

from __future__ import annotations

import pytest
import torch

from kfac.math import ekfac
from testing.asserts import assert_rel_close
from testing.reference import ekfac_scale_reference

F64 = torch.float64


def orthogonal(n: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    q: torch.Tensor = torch.linalg.qr(
        torch.randn(n, n, generator=gen, dtype=F64)
    ).Q
    return q


def rows(*shape: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen, dtype=F64)


def per_example(g: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """`Σ_t g_{n,t} a_{n,t}ᵀ` by a loop, `(N, out, in)`."""
    out = torch.zeros(g.shape[0], g.shape[2], a.shape[2], dtype=g.dtype)
    for n in range(g.shape[0]):
        for t in range(g.shape[1]):
            out[n] += torch.outer(g[n, t], a[n, t])
    return out


@pytest.mark.parametrize(
    ('positions', 'out', 'inp', 'form'),
    [
        (1, 4, 5, 'factored'),
        (3, 6, 5, 'rows first'),
        (40, 2, 3, 'gradient first'),
    ],
)
def test_each_form_equals_the_loop(
    positions: int, out: int, inp: int, form: str
) -> None:
    g = rows(6, positions, out, seed=0)
    a = rows(6, positions, inp, seed=1)
    qg, qa = orthogonal(out, 2), orthogonal(inp, 3)
    rows_first = ekfac._rows_first(positions, out, inp, True, True)
    assert rows_first == (form == 'rows first') or positions == 1
    expected = ekfac_scale_reference(per_example(g, a), qg, qa, 1)
    got = ekfac.eigenbasis_scale(g, a, qg, qa)
    assert_rel_close(got, expected, rtol=1e-12, label=f'EKFAC {form}')
    # in chunks of one example, and without a basis on one side
    chunked = ekfac.eigenbasis_scale(g, a, qg, qa, max_elements=1)
    assert_rel_close(chunked, expected, rtol=1e-12, label='EKFAC chunks')
    eye = torch.eye(inp, dtype=F64)
    plain = ekfac_scale_reference(per_example(g, a), qg, eye, 1)
    got = ekfac.eigenbasis_scale(g, a, qg, None)
    assert_rel_close(got, plain, rtol=1e-12, label='EKFAC Q_A = I')


def test_rows_must_pair_up() -> None:
    with pytest.raises(ValueError, match='same examples and positions'):
        ekfac.eigenbasis_scale(
            torch.zeros(2, 3, 4), torch.zeros(2, 2, 4), None, None
        )


@pytest.mark.parametrize('positions', [1, 6])
def test_onehot_equals_dense_one_hot_rows(positions: int) -> None:
    """Tokens (some repeated in an example, some `-1`) give the scaling of
    the dense one-hot rows with `Q_A = I`.
    """
    dim = 5
    gen = torch.Generator().manual_seed(4)
    tokens = torch.randint(-1, dim, (7, positions), generator=gen)
    g = rows(7, positions, 3, seed=5)
    qg = orthogonal(3, 6)
    hot = torch.zeros(7, positions, dim, dtype=F64)
    for (n, t), k in zip(
        torch.cartesian_prod(*map(torch.arange, tokens.shape)),
        tokens.reshape(-1),
    ):
        if k >= 0:
            hot[n, t, k] = 1.0
    expected = ekfac_scale_reference(
        per_example(g, hot), qg, torch.eye(dim, dtype=F64), 1
    )
    got = ekfac.onehot_scale(g, tokens, qg, dim)
    assert_rel_close(got, expected, rtol=1e-12, label='EKFAC one-hot')
    rotated = ekfac.rotate_onehot(tokens, orthogonal(dim, 7))
    assert_rel_close(
        rotated, hot @ orthogonal(dim, 7), rtol=1e-15, label='EKFAC rotate'
    )


def test_damped_reciprocal() -> None:
    s = rows(3, 4, seed=8).abs()
    got = ekfac.damped_reciprocal(s, 0.5)
    assert torch.equal(got, 1 / (s + 0.5))
    assert got.data_ptr() != s.data_ptr()


def spectrum_matrix(n: int, seed: int) -> torch.Tensor:
    """A PSD matrix with eigenvalues 1, 2, 4, ..., 2**(n-1): orthogonal
    iteration gains a factor 2 per step on each eigenvector.
    """
    q = orthogonal(n, seed)
    d = 2.0 ** torch.arange(n, dtype=F64)
    return q @ torch.diag(d) @ q.T


def test_warm_start_converges_to_the_eigh_subspaces() -> None:
    """Repeated refreshes of a fixed matrix from a random basis converge to
    its eigenvectors: every principal angle with `eigh`'s eigenvector of
    the same eigenvalue goes to zero, and so does `‖Q D Qᵀ - F‖`.
    """
    f = spectrum_matrix(8, 9)
    d_ref, q_ref = torch.linalg.eigh(f)
    q = orthogonal(8, 10)
    errors = []
    for _ in range(40):
        q, d = ekfac.subspace_iteration(f, q, 1)
        errors.append(float((q @ torch.diag(d) @ q.T - f).norm() / f.norm()))
    assert errors[-1] < 1e-9 < errors[0]
    order = torch.argsort(d)
    cosines = (q[:, order] * q_ref).sum(0).abs()
    assert_rel_close(cosines, torch.ones(8, dtype=F64), rtol=1e-9, label='QR')
    assert_rel_close(d[order], d_ref, rtol=1e-9, label='QR eigenvalues')
    assert torch.allclose(q.T @ q, torch.eye(8, dtype=F64), atol=1e-12)


def test_warm_start_from_the_eigenbasis_stays_there() -> None:
    f = spectrum_matrix(6, 11)
    _, q_ref = torch.linalg.eigh(f)
    q, d = ekfac.subspace_iteration(f, q_ref, 2)
    assert_rel_close(
        q @ torch.diag(d) @ q.T, f, rtol=1e-12, label='QR from eigh'
    )
    with pytest.raises(ValueError, match='steps must be at least 1'):
        ekfac.subspace_iteration(f, q_ref, 0)


def test_warm_start_clamps_rounding_below_zero() -> None:
    f = torch.zeros(3, 3, dtype=F64)
    f[0, 0] = 1.0
    _, d = ekfac.subspace_iteration(f - 1e-18, torch.eye(3, dtype=F64), 1)
    assert (d >= 0).all()
