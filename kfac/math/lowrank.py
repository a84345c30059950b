r"""Low-rank-plus-constant factors, and damping relative to the curvature.

## A factor kept as its top eigenpairs plus one value

A dense factor `F` (`(n, n)`, symmetric positive semi-definite) with
eigenpairs `F = Q diag(d) Qᵀ`, `d_1 ≥ … ≥ d_n`, is replaced, for a rank
`k < n` (`factor_rank`), by

`F̂ = Q_k diag(d_k) Q_kᵀ + c (I - Q_k Q_kᵀ)`,
`c = max(0, (tr F - Σ_{i ≤ k} d_i) / (n - k))`:

its `k` largest eigenpairs (`Q_k` of shape `(n, k)`) kept and the rest of
its spectrum replaced by its mean `c`. `F̂` has `F`'s eigenvectors, the
eigenvalues `(d_1, …, d_k, c, …, c)` and `F`'s trace (so `π` of the
factored damping below and the mean eigenvalue are unchanged). Only `Q_k`
and the `k + 1` values `(d_1, …, d_k, c)` are stored and broadcast:
`n k + k + 1` numbers instead of `n² + n`.

**EIGEN** applies `(Â ⊗ Ĝ + λ I)⁻¹` exactly. On each side `F̂` acts as
`c` on the complement of `span(Q_k)`, projected on by
`P⊥ = I - Q_k Q_kᵀ`, so with `V = V (Q_A Q_Aᵀ + P⊥_A)` and likewise for
`G` (`Q_A`, `Q_G` the kept bases; `d_A`, `d_G` their eigenvalues),

```
V' = Q_G [(Q_Gᵀ V Q_A) / (d_G d_Aᵀ + λ)] Q_Aᵀ
   + Q_G diag(1 / (d_G c_A + λ)) Q_Gᵀ V P⊥_A
   + P⊥_G V Q_A diag(1 / (c_G d_A + λ)) Q_Aᵀ
   + P⊥_G V P⊥_A / (c_G c_A + λ).
```

A side kept whole (`k = n`, or a factor not longer than `k`) has no
complement: its `P⊥` terms vanish, and with both sides whole this is
EIGEN's `Q_G [(Q_Gᵀ V Q_A) / (d_G d_Aᵀ + λ)] Q_Aᵀ`. Applying it costs
`O(out · in · (k_A + k_G))` per gradient instead of
`O(out · in · (in + out))`.

**INVERSE** keeps its factored Tikhonov damping,
`V' = (Ĝ + (√λ/π) I)⁻¹ V (Â + π√λ I)⁻¹`, with each damped low-rank
factor inverted in closed form (Woodbury):

`(F̂ + s I)⁻¹ = I / (c + s) + Q_k diag(1 / (d_k + s) - 1 / (c + s)) Q_kᵀ`,

stored as `Q_k` and the `k + 1` weights
`w = (1 / (d_k + s) - 1 / (c + s), 1 / (c + s))`.

EKFAC re-estimates its scaling in the full eigenbasis, which a low-rank
factor does not keep: the two are not combined.

## Relative damping

`damping_mode='relative'` reads `λ` as a fraction of the curvature's
scale. With `m(F) = tr F / dim F` (a factor's mean eigenvalue), the
Kronecker product's mean eigenvalue is `m(A) m(G)`, and the damping
applied is

`λ_eff = λ · m(A) m(G)`

(`λ` itself when `m(A) m(G)` is not a positive finite number, e.g. a
factor of zeros). EIGEN adds `λ_eff` to `d_G d_Aᵀ`; INVERSE splits it with
the π correction, which gives each factor `√λ` times its own mean
eigenvalue: `π √λ_eff = √λ m(A)` and `√λ_eff / π = √λ m(G)`. Scaling the
inputs of a layer by `α` scales `A` by `α²` and its curvature `A ⊗ G` by
`α²`; `λ_eff` follows, so the preconditioned direction does not change,
whereas a fixed `λ` damps relatively more the smaller the curvature.
"""

from __future__ import annotations

import torch

__all__ = [
    'lowrank_damped_inverse',
    'lowrank_eigen_precondition',
    'lowrank_inverse_precondition',
    'lowrank_values',
    'mean_eigenvalue',
    'relative_damping',
    'top_eigenpairs',
]


def top_eigenpairs(
    q: torch.Tensor, d: torch.Tensor, rank: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The `rank` largest eigenpairs, largest first.

    Args:
        q: `(n, m)` eigenvectors as columns (`m ≥ rank`).
        d: `(m,)` their eigenvalues.
        rank: `k`, how many to keep.

    Returns:
        `Q_k` `(n, k)` (row-major) and `d_k` `(k,)`.

    Examples:
        >>> d = torch.tensor([1.0, 3.0, 2.0])
        >>> top_eigenpairs(torch.eye(3), d, 2)[1]
        tensor([3., 2.])
    """
    order = torch.argsort(d, descending=True)[:rank]
    return q[:, order].contiguous(), d[order]


def lowrank_values(factor: torch.Tensor, top: torch.Tensor) -> torch.Tensor:
    """`(d_1, …, d_k, c)`: the kept eigenvalues and the rest's mean.

    `c = max(0, (tr F - Σ d_k) / (n - k))` (see the module docstring).

    Args:
        factor: `F`, `(n, n)`.
        top: `d_k`, `(k,)` with `k < n`.
    """
    n, k = factor.shape[0], top.shape[0]
    rest = (torch.diagonal(factor).sum() - top.sum()) / (n - k)
    return torch.cat([top, rest.clamp(min=0.0).reshape(1).to(top.dtype)])


def mean_eigenvalue(
    values: torch.Tensor, dim: int, rank: int | None = None
) -> torch.Tensor:
    """`m(F) = tr F / dim F` from a factor's stored eigenvalues.

    Args:
        values: all `dim` eigenvalues (`rank=None`), or
            `(d_1, …, d_k, c)` of a low-rank factor (`rank=k`).
        dim: `n`, the factor's side.
        rank: `k` of a low-rank factor, or None.

    Returns:
        A 0-d tensor (no host synchronisation).
    """
    if rank is None:
        return values.sum() / dim
    return (values[:rank].sum() + (dim - rank) * values[rank]) / dim


def relative_damping(
    damping: float | torch.Tensor,
    mean_a: torch.Tensor,
    mean_g: torch.Tensor,
) -> torch.Tensor:
    """`λ_eff = λ · m(A) m(G)`, or `λ` where `m(A) m(G)` is not a positive
    finite number (see the module docstring); a 0-d tensor, without a host
    synchronisation.
    """
    scale = mean_a * mean_g
    ok = (scale > 0) & torch.isfinite(scale)
    return torch.where(ok, scale, torch.ones_like(scale)) * damping


def _side(
    q: torch.Tensor, values: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`(d_k, c)` of a low-rank side; `(d, None)` of a whole one."""
    k = q.shape[1]
    if k == q.shape[0]:
        return values, None
    return values[:k], values[k]


def lowrank_eigen_precondition(
    grad: torch.Tensor,
    a: tuple[torch.Tensor | None, torch.Tensor],
    g: tuple[torch.Tensor, torch.Tensor],
    damping: float | torch.Tensor,
) -> torch.Tensor:
    """`(Â ⊗ Ĝ + λ I)⁻¹ vec(V)`, reshaped to `V`'s shape.

    Args:
        grad: `V`, `(out, in[+1])`.
        a: `(Q_A, values)` of `A`: `Q_A` `(n, k)` with the `k + 1` values
            `(d_1, …, d_k, c)` (low rank, `k < n`), or `(n, n)` with its
            `n` eigenvalues (whole); `Q_A` None for a diagonal `A` (its
            eigenvectors the identity, its values its diagonal).
        g: the same for `G` (never diagonal).
        damping: `λ` (a float or a 0-d tensor).

    Returns:
        `V'` of `grad`'s shape (see the module docstring).
    """
    qa, qg = a[0], g[0]
    da, ca = (a[1], None) if qa is None else _side(qa, a[1])
    dg, cg = _side(qg, g[1])
    y = grad if qa is None else grad @ qa  # (out, k_A)
    yk = qg.T @ y  # (k_G, k_A)
    left = qg @ (yk / (torch.outer(dg, da) + damping))
    if cg is not None:  # P⊥_G V Q_A, scaled per column
        left = left + (y - qg @ yk) / (cg * da + damping)
    if qa is None:
        return left
    out = left @ qa.T
    if ca is None:
        return out
    rest = grad - y @ qa.T  # V P⊥_A
    rk = qg.T @ rest  # (k_G, in)
    out = out + qg @ (rk / (dg * ca + damping).unsqueeze(1))
    if cg is not None:
        out = out + (rest - qg @ rk) / (cg * ca + damping)
    return out


def lowrank_damped_inverse(
    values: torch.Tensor, shift: float | torch.Tensor
) -> torch.Tensor:
    """The weights `w = (1/(d_k + s) - 1/(c + s), 1/(c + s))` of
    `(F̂ + s I)⁻¹ = w_c I + Q_k diag(w_k) Q_kᵀ`.

    Args:
        values: `(d_1, …, d_k, c)`.
        shift: `s > 0` (a float or a 0-d tensor).
    """
    inverse = (values + shift).reciprocal()
    return torch.cat([inverse[:-1] - inverse[-1], inverse[-1:]])


def _apply_inverse(
    grad: torch.Tensor, side: tuple[torch.Tensor, ...], left: bool
) -> torch.Tensor:
    """`F⁻¹ V` (`left`) or `V F⁻¹` for a whole inverse `(F⁻¹,)` (on the
    `A` side its diagonal `(n,)` for a diagonal factor) or a low-rank one
    `(Q_k, w)`.
    """
    if len(side) == 1:
        inverse = side[0]
        if inverse.dim() == 1:  # a diagonal factor's, on the A side
            return grad * inverse
        return inverse @ grad if left else grad @ inverse
    q, w = side
    if left:
        return grad * w[-1] + q @ ((q.T @ grad) * w[:-1].unsqueeze(1))
    return grad * w[-1] + ((grad @ q) * w[:-1]) @ q.T


def lowrank_inverse_precondition(
    grad: torch.Tensor,
    a: tuple[torch.Tensor, ...],
    g: tuple[torch.Tensor, ...],
) -> torch.Tensor:
    """`(Ĝ + s_G I)⁻¹ V (Â + s_A I)⁻¹`, each damped inverse given whole as
    `(F⁻¹,)` or low rank as `(Q_k, w)`
    ([`lowrank_damped_inverse`][kfac.math.lowrank.lowrank_damped_inverse]).
    """
    return _apply_inverse(_apply_inverse(grad, g, left=True), a, left=False)
