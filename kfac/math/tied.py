r"""One Kronecker product for a weight tied in transposed roles.

A weight tied in transposed roles (an `nn.Embedding` whose weight `E`,
shape `(V, d)`, is also the weight of a bias-free output head
`s = E h`) is preconditioned in the embedding's orientation, with the
gradient matrix `V = (∇E)ᵀ` of shape `(d, V)`. Each use brings its own
Kronecker term: the embedding `A_e ⊗ G_e` (`A_e` the diagonal `(V, V)`
token counts, `G_e` `(d, d)`), and the head, whose gradient matrix is
`Vᵀ`, `A_h ⊗ G_h` on `vec(Vᵀ)`, which is `G_h ⊗ A_h` on `vec(V)` (`G_h`
`(V, V)`, `A_h` `(d, d)`). Dropping the covariance between the two uses'
gradients (as K-FAC drops it between layers),

`F ≈ Σ_u X_u ⊗ Y_u` with `(X_e, Y_e) = (A_e, G_e)`, `(X_h, Y_h) = (G_h, A_h)`,

approximated by one Kronecker product `X̄ ⊗ Ȳ`
([`kronecker_sum_factors`][kfac.math.tied.kronecker_sum_factors]): with
`m(T) = tr T / dim T` (mean eigenvalue) and `C = Σ_u m(X_u) m(Y_u)`,

`X̄ = Σ_u m(Y_u) X_u / √C`,  `Ȳ = Σ_u m(X_u) Y_u / √C`.

Equivalently, each term is normalised to unit mean eigenvalue on both
sides and the normalised factors are averaged with weights
`m(X_u) m(Y_u) / C`, the product carrying the total `C`. So
`tr(X̄ ⊗ Ȳ) = tr F` always; it is exact when one use contributes (a use
with a zero factor drops out), when the uses are identical (`2 X ⊗ Y`),
and more generally when all `X_u` (or all `Y_u`) are proportional. A
plain sum `(Σ X_u) ⊗ (Σ Y_u)` is wrong in scale when the two uses differ
in scale; `((1/k) Σ s_u X_u) ⊗ (Σ Y_u / s_u)` (trace-balanced terms) is
exact for identical uses but not for one vanishing use. With `C = 0`
(no statistics) the factors are the plain sums. `X̄` is `(V, V)` and
dense, so with `max_factor_dim` it is split into diagonal blocks like
any factor; the rule is then applied to each block (tile) with that
block's traces.
"""

from __future__ import annotations

import torch

__all__ = ['kronecker_sum_factors']


def _mean_eigenvalue(factor: torch.Tensor) -> torch.Tensor:
    """`tr F / dim F` (0-d) of a matrix or of a diagonal given as a vector."""
    diagonal = factor if factor.dim() == 1 else torch.diagonal(factor)
    return diagonal.mean()


def _dense_sum(
    factors: list[torch.Tensor], coefs: list[torch.Tensor]
) -> torch.Tensor:
    """`Σ c F` as a dense matrix (a vector is a diagonal)."""
    dim = factors[0].shape[0]
    out = factors[0].new_zeros((dim, dim))
    for factor, coef in zip(factors, coefs):
        if factor.dim() == 1:
            out.diagonal().add_(factor * coef)
        else:
            out.add_(factor * coef)
    return out


def kronecker_sum_factors(
    terms: list[tuple[torch.Tensor, torch.Tensor]],
) -> tuple[torch.Tensor, torch.Tensor]:
    """One Kronecker product `X̄ ⊗ Ȳ` standing for `Σ_u X_u ⊗ Y_u`.

    `X̄ = Σ_u m(Y_u) X_u / √C`, `Ȳ = Σ_u m(X_u) Y_u / √C`, with
    `m(T) = tr T / dim T` and `C = Σ_u m(X_u) m(Y_u)`; the plain sums when
    `C` is not positive (see the module docstring for why). No host
    synchronisation.

    Args:
        terms: `(X_u, Y_u)` pairs of symmetric positive semi-definite
            factors, `X_u` of shape `(n, n)` and `Y_u` `(m, m)`, or either
            given as its diagonal, `(n,)` or `(m,)`.

    Returns:
        `X̄` `(n, n)` and `Ȳ` `(m, m)`, dense.

    Examples:
        >>> x, y = torch.diag(torch.tensor([1.0, 3.0])), torch.eye(1) * 8
        >>> xs, ys = kronecker_sum_factors([(x, y)])
        >>> torch.equal(torch.kron(xs, ys), torch.kron(x, y))
        True
        >>> xs, ys = kronecker_sum_factors([(x, y), (x, y)])
        >>> torch.allclose(torch.kron(xs, ys), 2 * torch.kron(x, y))
        True
    """
    if not terms:
        raise ValueError('terms must hold at least one (X, Y) pair; got []')
    mx = [_mean_eigenvalue(x) for x, _ in terms]
    my = [_mean_eigenvalue(y) for _, y in terms]
    total = torch.stack([a * b for a, b in zip(mx, my)]).sum()
    ok = (total > 0) & torch.isfinite(total)
    root = torch.where(ok, total, torch.ones_like(total)).sqrt()
    one = torch.ones_like(total)
    x_coefs = [torch.where(ok, m / root, one) for m in my]
    y_coefs = [torch.where(ok, m / root, one) for m in mx]
    return (
        _dense_sum([x for x, _ in terms], x_coefs),
        _dense_sum([y for _, y in terms], y_coefs),
    )
