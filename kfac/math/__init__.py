r"""The tensor mathematics of K-FAC, written once.

Pure functions on local tensors: nothing here communicates or knows about
modules, hooks or ranks, and everything is tested in float64 against dense
computations.

## Conventions

A supported layer computes `s = W a + b` with `W` of shape `(out, in)`.
When the layer has a (trainable) bias, `a` is extended with a constant 1
(`ã`, length `in + 1`) and the *gradient matrix* is
`V = [∇W, ∇b]` of shape `(out, in + 1)`; without a bias `V = ∇W`.

`vec` stacks columns, so for `V` of shape `(out, in + 1)`
`vec(V) = V.T.reshape(-1)` in PyTorch terms, and the Kronecker identity
`(A ⊗ G) vec(V) = vec(G V A)` holds for symmetric `A` and `G`.

Statistics, for a loss `L = (1/N) Σ_n ℓ_n` over the `N` examples of the
(global) batch (PyTorch's default `'mean'` reduction):

* the per-example output gradient is `g_n = ∂ℓ_n/∂s_n = N ∂L/∂s_n`;
* `A = (1/N) Σ_n ã_n ã_nᵀ` of shape `(in + 1, in + 1)`;
* `G = (1/N) Σ_n g_n g_nᵀ` of shape `(out, out)`.

How the loss averages is stated with `loss_average` (as in curvlinops),
not guessed. With `Z` the number of terms the loss averages over and
`g = Z ∂L/∂s` (the gradient of one term), `G = (1/Z) Σ g gᵀ`:

| `loss_average` | loss | `Z` |
| --- | --- | --- |
| `'batch'` (default) | `(1/N) Σ_n ℓ_n` | `N` |
| `'batch+sequence'` | `(1/(N T)) Σ_{n,t} ℓ_{n,t}` (tokens) | `N T` |
| `None` | `Σ_n ℓ_n` (summed) | 1, and `G` is the sum `Σ g gᵀ` |

Here `T` is the layer's number of weight-sharing positions (the sequence
length of a language model's layers). The sums below run over what each
approximation makes a row; `A` is always the mean of its rows.

For batch size 1 without weight sharing, `A ⊗ G` equals the layer's
empirical Fisher block `vec(∇ℓ) vec(∇ℓ)ᵀ` exactly.

Weight sharing (the `T` positions of a Linear applied to `(N, T, in)`
inputs, or the `T` spatial output positions of a 1-, 2- or 3-D
convolution, unfolded into patches) follows Eschenhagen et al. (NeurIPS
2023), chosen per module with `kfac_approx`:

* *expand* (default): each position is a further row,
  `A = (1/(N T)) Σ_{n,t} ã_{n,t} ã_{n,t}ᵀ` and
  `G = (1/Z) Σ_n Σ_t g_{n,t} g_{n,t}ᵀ` (`Z = N` for `'batch'`:
  `G = (1/N) Σ_n Σ_t g gᵀ`);
* *reduce*: one row per example, the inputs averaged and the output
  gradients summed over its positions first,
  `ā_n = (1/T) Σ_t ã_{n,t}`, `ĝ_n = Σ_t g_{n,t}`,
  `A = (1/N) Σ_n ā_n ā_nᵀ`, `G = (1/Z) Σ_n ĝ_n ĝ_nᵀ` (`T` times fewer
  rows).

Both factors are kept as a *sum* and a *count* (rows for `A`, `Z` terms
for `G`) so that micro-batches and ranks combine exactly. Without
sharing (`T = 1`) the two approximations coincide.

Several calls of one module before one backward pass (a shared module,
siamese or contrastive passes, `loss = Σ_c L_c` with `L_c` the mean over
the `N` examples of call `c`) are further positions of the same examples:
with `C` calls of `T` positions each,
`A = (1/(N C T)) Σ_{n,c,t} ã ãᵀ` and `G = (1/N) Σ_n Σ_{c,t} g gᵀ`, where
`g = N ∂L/∂s` (`L = (1/N) Σ_n ℓ_n` with `ℓ_n = Σ_c ℓ_{n,c}`). A call
counts only once its output's gradient arrives; each backward pass is one
micro-batch (`N` counted once per pass, the largest `N` of its calls).
The number of examples `N` is read from the layout of the input
(`batch_first`), never assumed to be `shape[0]`.

Running average: `F ← ξ F + (1 - ξ) F_batch` with `ξ = factor_decay`; the
first update sets `F = F_batch`.

Damping `λ`:

* EIGEN applies `(A ⊗ G + λ I)⁻¹` exactly through the eigendecompositions
  `A = Q_A diag(d_A) Q_Aᵀ` and `G = Q_G diag(d_G) Q_Gᵀ`:
  `V' = Q_G [(Q_Gᵀ V Q_A) / (d_G d_Aᵀ + λ)] Q_Aᵀ`.
* INVERSE uses factored Tikhonov damping (Martens & Grosse 2015, §6.3):
  `V' = (G + (√λ / π) I)⁻¹ V (A + π √λ I)⁻¹` with
  `π = sqrt((tr A / dim A) / (tr G / dim G))`. The damped Kronecker
  product has eigenvalues `d_A d_G + λ + √λ (d_A / π + π d_G)`, so the
  same `λ` damps at least as much as with EIGEN.
* EKFAC keeps EIGEN's eigenbases and replaces `d_G d_Aᵀ` by the
  per-example second moment `S` in them:
  `V' = Q_G [(Q_Gᵀ V Q_A) / (S + λ)] Q_Aᵀ`
  (see [`kfac.math.ekfac`][kfac.math.ekfac], which also refreshes
  eigenbases from a warm start).
* EIGEN_ADAM keeps the eigenbases and divides by the root of Adam's
  second moments kept in them, `ε` its own (no `λ`); ONE_SIDED applies
  one factor's inverse damped by `λ` times its mean eigenvalue (see
  [`kfac.math.eigenbasis`][kfac.math.eigenbasis]).

With `damping_mode='relative'` the `λ` above is `λ · m(A) m(G)`, the
mean eigenvalues `m(F) = tr F / dim F` (see
[`kfac.math.lowrank`][kfac.math.lowrank], which also defines the
low-rank-plus-constant factors of `factor_rank`).

A weight tied in transposed roles (an embedding and its output head) is
preconditioned with one Kronecker product combining both uses (see
[`kfac.math.tied`][kfac.math.tied]).

## Clipping the step

A clip scales every preconditioned gradient `V'` by one factor `ν ≤ 1`,
the smaller of two bounds (each 1 when it is off):

* `kl_clip` (the original KAISA clip): `ν_KL = min(1, sqrt(κ / |Σ_l lr_l²
  V'_l ⊙ V_l|))`, bounding the step's KL divergence `½ Σ_l lr_l² V'_lᵀ F V'_l ≈
  ½ Σ_l lr_l² V'_l ⊙ V_l` by `κ / 2` (`lr_l`: the learning rate of layer
  `l`'s param group, or the one `lr`). Once it is active the step
  `lr ν V'` no longer depends on `lr`.
* `relative_clip` (the default, at 1): `ν_rel = min(1, ρ sqrt(Σ_l ‖V_l‖²
  / Σ_l ‖V'_l‖²))`, the preconditioned gradient at most `ρ` times as long
  as the raw one (norms over all preconditioned layers). `ν_rel` does not
  involve `lr`, so the step `lr ν V'` is proportional to the learning rate
  whether the clip is active or not, and an optimizer tuned for raw
  gradients never takes a step more than `ρ` times longer than it would
  have.

`ν = min(ν_KL, ν_rel)`: with both set, both bounds hold.
"""

from __future__ import annotations

import torch

from kfac.math.clip import kl_clip_scale
from kfac.math.clip import relative_clip_scale
from kfac.math.ekfac import damped_reciprocal
from kfac.math.ekfac import eigenbasis_scale
from kfac.math.ekfac import onehot_scale
from kfac.math.ekfac import rotate_onehot
from kfac.math.ekfac import subspace_iteration
from kfac.math.tied import kronecker_sum_factors

__all__ = [
    'append_bias_ones',
    'compute_dtype',
    'damped_inverse',
    'damped_inverse_ex',
    'damped_reciprocal',
    'eigen_precondition',
    'eigenbasis_scale',
    'eigenvalue_outer_product',
    'gram',
    'inverse_precondition',
    'kl_clip_scale',
    'kronecker_sum_factors',
    'onehot_scale',
    'pi_correction',
    'relative_clip_scale',
    'rotate_onehot',
    'running_average',
    'subspace_iteration',
    'symmetric_eigh',
]


def compute_dtype(*dtypes: torch.dtype) -> torch.dtype:
    """Return the widest of `dtypes` and float32.

    Statistics and decompositions are never computed in a half-precision type:
    bfloat16 or float16 second moments break eigenvectors.

    Examples:
        >>> compute_dtype(torch.bfloat16)
        torch.float32
        >>> compute_dtype(torch.float32, torch.float64)
        torch.float64
    """
    result = torch.float32
    for dtype in dtypes:
        result = torch.promote_types(result, dtype)
    return result


def append_bias_ones(rows: torch.Tensor) -> torch.Tensor:
    """Append a column of ones: `(R, in)` to `(R, in + 1)`."""
    ones = rows.new_ones((rows.shape[0], 1))
    return torch.cat([rows, ones], dim=1)


def gram(
    rows: torch.Tensor,
    dtype: torch.dtype,
    scale: float = 1.0,
) -> torch.Tensor:
    """Return `scale² · rowsᵀ rows` computed in `dtype`.

    Args:
        rows: `(R, n)` matrix, one statistic vector per row.
        dtype: the floating type to compute in (at least float32).
        scale: factor applied to every row before the product.

    Returns:
        `(n, n)` sum of outer products of the (scaled) rows.

    """
    rows = rows.to(dtype)
    if scale != 1.0:
        # Scale the rows, not the product: the rows of a loss-scaled
        # gradient squared could overflow before the scale is divided out.
        rows = rows * scale
    out: torch.Tensor = rows.T @ rows
    return out


def running_average(
    current: torch.Tensor | None,
    batch: torch.Tensor,
    decay: float,
    scale: float = 1.0,
    keep: torch.Tensor | None = None,
) -> torch.Tensor:
    """Return `decay · current + (1 - decay) · scale · keep · batch`.

    Computed in `batch`'s memory (`batch` is overwritten and returned,
    in its own dtype): no new matrix per update. The first update
    (`current is None`) returns `scale · keep · batch`: no identity bias
    is mixed in. `decay == 1` returns `current` unchanged.

    Args:
        current: the running average, or None before the first update.
        batch: the batch factor (or a sum to be multiplied by `scale`).
        decay: weight of `current`.
        scale: multiplier of `batch`.
        keep: optional 0-d tensor, 1 or 0 in `batch`'s dtype: 0 drops the
            batch (`batch` must then be finite) without a host
            synchronisation.
    """
    if current is not None and decay == 1.0:
        return current
    coef = scale if current is None else (1.0 - decay) * scale
    if keep is not None:
        batch.mul_(keep * coef)
    elif coef != 1.0:
        batch.mul_(coef)
    if current is None:
        return batch
    return batch.add_(current.to(batch.dtype), alpha=decay)


def symmetric_eigh(
    factor: torch.Tensor,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Eigendecomposition of a symmetric positive semi-definite factor.

    Args:
        factor: `(n, n)` symmetric matrix.
        dtype: the dtype to compute in.

    Returns:
        Q: `(n, n)`, the orthonormal eigenvectors as columns (row-major).
        d: `(n,)`, the eigenvalues clamped at 0 (a PSD factor's negative
            eigenvalues are rounding error).

    """
    d, q = torch.linalg.eigh(factor.to(dtype))
    # eigh returns Q column-major; a row-major copy is what a rank that
    # receives Q (or loads it from a checkpoint) holds, so products with Q
    # round the same on every rank and after a resume.
    return q.contiguous(), d.clamp_(min=0.0)


def eigenvalue_outer_product(
    dg: torch.Tensor,
    da: torch.Tensor,
    damping: float | torch.Tensor,
) -> torch.Tensor:
    """Return `1 / (d_G d_Aᵀ + λ)` of shape `(out, in[+1])`."""
    return torch.outer(dg, da).add_(damping).reciprocal_()


def eigen_precondition(
    grad: torch.Tensor,
    qa: torch.Tensor,
    qg: torch.Tensor,
    scale: torch.Tensor,
) -> torch.Tensor:
    """Return `Q_G [(Q_Gᵀ V Q_A) ⊙ scale] Q_Aᵀ`.

    With `scale = 1 / (d_G d_Aᵀ + λ)`
    ([`eigenvalue_outer_product`][kfac.math.eigenvalue_outer_product]) this is
    `(A ⊗ G + λ I)⁻¹ vec(V)` reshaped to `V`'s shape.

    Args:
        grad: `V`, shape `(out, in[+1])`.
        qa: `Q_A`, shape `(in[+1], in[+1])`.
        qg: `Q_G`, shape `(out, out)`.
        scale: shape `(out, in[+1])`.

    """
    v = qg.T @ grad @ qa
    v.mul_(scale)
    return qg @ v @ qa.T


def pi_correction(a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """Return `π = sqrt((tr A / dim A) / (tr G / dim G))` as a 0-d tensor.

    Falls back to `π = 1` (plain Tikhonov split) when either normalised
    trace or their ratio is not a positive finite number, e.g. for an
    all-zero factor. Computed on the factors' device without a host
    synchronisation.
    """
    ta = torch.diagonal(a).sum() / a.shape[0]
    tg = torch.diagonal(g).sum() / g.shape[0]
    ratio = ta / tg
    ok = (ta > 0) & (tg > 0) & (ratio > 0) & torch.isfinite(ratio)
    return torch.where(ok, ratio.sqrt(), torch.ones_like(ratio))


def damped_inverse_ex(
    factor: torch.Tensor,
    shift: float | torch.Tensor,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return `((F + shift · I)⁻¹, info)` without a host synchronisation.

    `info` (0-d int tensor) is 0 when the damped factor was positive
    definite; otherwise the inverse is meaningless. See
    [`damped_inverse`][kfac.math.damped_inverse].
    """
    damped = factor.to(dtype=dtype, copy=True)
    damped.diagonal().add_(shift)
    lower, info = torch.linalg.cholesky_ex(damped)
    # Row-major, as a received or loaded inverse is (see symmetric_eigh).
    inverse: torch.Tensor = torch.cholesky_inverse(lower).contiguous()
    return inverse, info


def damped_inverse(
    factor: torch.Tensor,
    shift: float | torch.Tensor,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Return `(F + shift · I)⁻¹` computed in `dtype`, symmetric.

    Uses the Cholesky factorisation of the (positive definite) damped
    factor; `cholesky_inverse` returns an exactly symmetric matrix.

    Args:
        factor: `(n, n)` symmetric positive semi-definite matrix.
        shift: positive diagonal shift (a float or a 0-d tensor).
        dtype: the dtype to compute in.

    Raises:
        torch.linalg.LinAlgError: the damped factor is not positive
            definite (or not finite).
    """
    inverse, info = damped_inverse_ex(factor, shift, dtype)
    if int(info) != 0:
        raise torch.linalg.LinAlgError(  # type: ignore[attr-defined]
            f'damped factor is not positive definite (info={int(info)})',
        )
    return inverse


def inverse_precondition(
    grad: torch.Tensor,
    a_inv: torch.Tensor,
    g_inv: torch.Tensor,
) -> torch.Tensor:
    """Return `G⁻¹ V A⁻¹` for `V` of shape `(out, in[+1])`."""
    return g_inv @ grad @ a_inv
