r"""EKFAC's eigenvalue correction, and eigenbases refreshed from a warm start.

## The eigenvalue correction

EIGEN applies `(Q (D + λ I) Qᵀ)⁻¹` with the Kronecker eigenbasis
`Q = Q_A ⊗ Q_G` and the eigenvalues `D = diag vec(d_G d_Aᵀ)`. EKFAC
(George et al., NeurIPS 2018) keeps the basis and replaces `D` by the second
moment of the per-example gradients in it (elementwise square):

`S = (1/Z) Σ_n (Q_Gᵀ ∇W_n Q_A)²`, shape `(out, in[+1])`, with
`∇W_n = Σ_t g_{n,t} ã_{n,t}ᵀ`,

the gradient of example `n` (its output gradients `g` and inputs `ã` at
each weight-sharing position `t`, every call of the module in one backward
pass included, under expand and reduce alike). `g` and `Z` are those of
`G` (see [`kfac.math`][kfac.math]): `g = Z ∂L/∂s` with `Z = N` for
`loss_average='batch'`, `N T` for `'batch+sequence'`, and `Z = 1`,
`g = ∂L/∂s` for a summed loss. `Q diag(vec S) Qᵀ` is the matrix of that
basis closest in Frobenius norm to the empirical Fisher
`(1/Z) Σ_n vec(∇W_n) vec(∇W_n)ᵀ`, and

`V' = Q_G [(Q_Gᵀ V Q_A) / (S + λ)] Q_Aᵀ`

([`eigen_precondition`][kfac.math.eigen_precondition] with the scale
[`damped_reciprocal`][kfac.math.ekfac.damped_reciprocal]). With one example
and no weight sharing, `ã ãᵀ` and `g gᵀ` have rank one, `S = d_G d_Aᵀ`, and
`V'` is the exact damped inverse of the empirical Fisher block applied to
`V`.

The forms below compute the sum `Σ_n (Q_Gᵀ ∇W_n Q_A)²`; each is exact, and
[`eigenbasis_scale`][kfac.math.ekfac.eigenbasis_scale] picks the cheapest.
Per example, with `T` positions, `o = out` and `i = in[+1]`:

* *factored*, without weight sharing (`T = 1`):
  `((g Q_G)²)ᵀ ((ã Q_A)²)` summed over the examples, `o² + i² + o i`, no
  per-example gradient at all;
* *rows first*: rotate the rows, then each example's `(g Q_G)ᵀ (ã Q_A)`,
  `T (o² + i²) + T o i`;
* *gradient first*: each example's `gᵀ ã`, then `Q_Gᵀ (gᵀ ã) Q_A`,
  `T o i + o i (o + i)`; used when `T (o² + i²) > o i (o + i)` (many
  positions: a convolution over a large image).

An embedding's inputs are one-hot and its `Q_A = I`
([`onehot_scale`][kfac.math.ekfac.onehot_scale]): column `k` of the rotated
per-example gradient is the sum of `Q_Gᵀ g_{n,t}` over the positions of
example `n` holding token `k`, so `S` is formed from the `R = N T` rotated
rows, summed per (example, token) after a sort, squared and added by
token: `O(R o + R log R)`, never an `(o, V)` matrix per example.

## Warm-started bases

A basis refresh by
[`subspace_iteration`][kfac.math.ekfac.subspace_iteration] starts from the
previous eigenbasis, ordered by its Rayleigh quotients (largest first), and
takes a few steps of orthogonal (QR) iteration, `Q ← qr(F Q)`, instead of a
full `eigh`: one `n × n` product and one QR per step (and one more product
for the Rayleigh quotients), which converges to
the eigenvectors of `F` when started anywhere (at the rate of the ratios of
neighbouring eigenvalues) and in a few steps from the basis of a factor
that changed a little. The eigenvalues are re-estimated in the new basis as
its Rayleigh quotients `diag(Qᵀ F Q)`.
"""

from __future__ import annotations

import torch

__all__ = [
    'PER_EXAMPLE_ELEMENTS',
    'damped_reciprocal',
    'eigenbasis_scale',
    'onehot_scale',
    'rotate_onehot',
    'subspace_iteration',
]

PER_EXAMPLE_ELEMENTS = 2**24
"""Largest number of per-example gradient entries formed at once (64 MiB
in float32): examples are taken in chunks of `⌊this / (o i)⌋` (at least
one)."""


def damped_reciprocal(scale: torch.Tensor, damping: float) -> torch.Tensor:
    """Return `1 / (S + λ)`, a new tensor of `S`'s shape.

    Examples:
        >>> damped_reciprocal(torch.tensor([[1.0, 3.0]]), 1.0)
        tensor([[0.5000, 0.2500]])
    """
    return torch.add(scale, damping).reciprocal_()


def _rotate(rows: torch.Tensor, basis: torch.Tensor | None) -> torch.Tensor:
    """`rows @ basis` (the rows in the basis), or `rows` for `Q = I`."""
    return rows if basis is None else rows @ basis.to(rows.dtype)


def _rows_first(
    positions: int, out: int, inp: int, rotate_g: bool, rotate_a: bool
) -> bool:
    """Whether rotating the rows costs no more than rotating the
    per-example gradients (see the module docstring).
    """
    rows = positions * (out * out * rotate_g + inp * inp * rotate_a)
    grads = out * inp * (out * rotate_g + inp * rotate_a)
    return rows <= grads


def _square_sum(
    g_rows: torch.Tensor,
    a_rows: torch.Tensor,
    qg: torch.Tensor | None,
    qa: torch.Tensor | None,
    max_elements: int,
) -> torch.Tensor:
    """`Σ_n (Q_Gᵀ g_nᵀ a_n Q_A)²` forming the per-example gradients in
    chunks of examples.
    """
    n, _, out = g_rows.shape
    inp = a_rows.shape[-1]
    total = g_rows.new_zeros((out, inp))
    chunk = max(1, max_elements // max(1, out * inp))
    for start in range(0, n, chunk):
        grads = (
            g_rows[start : start + chunk].mT @ a_rows[start : start + chunk]
        )
        if qg is not None:
            grads = qg.to(grads.dtype).T @ grads
        if qa is not None:
            grads = grads @ qa.to(grads.dtype)
        total.add_(grads.square_().sum(dim=0))
    return total


def eigenbasis_scale(
    g_rows: torch.Tensor,
    a_rows: torch.Tensor,
    qg: torch.Tensor | None,
    qa: torch.Tensor | None,
    *,
    max_elements: int = PER_EXAMPLE_ELEMENTS,
) -> torch.Tensor:
    """Return `Σ_n (Q_Gᵀ (Σ_t g_{n,t} a_{n,t}ᵀ) Q_A)²` in the cheapest exact
    form (see the module docstring).

    Args:
        g_rows: `(N, T, out)`: the output gradients `g` (already scaled).
        a_rows: `(N, T, in)`: the inputs `ã` (bias column included).
        qg: `Q_G`, `(out, out)`, or None for the identity (rows already
            rotated).
        qa: `Q_A`, `(in, in)`, or None for the identity.
        max_elements: largest number of per-example gradient entries
            formed at once.

    Returns:
        `(out, in)`, in the rows' dtype.

    Examples:
        >>> g = torch.tensor([[[1.0], [2.0]]])  # one example, two positions
        >>> a = torch.tensor([[[3.0], [4.0]]])
        >>> eigenbasis_scale(g, a, None, None)  # (1*3 + 2*4)**2
        tensor([[121.]])
    """
    n, positions, out = g_rows.shape
    inp = a_rows.shape[-1]
    if a_rows.shape[:2] != (n, positions):
        raise ValueError(
            'g_rows and a_rows must hold the same examples and positions; '
            f'got {tuple(g_rows.shape)} and {tuple(a_rows.shape)}'
        )
    if positions == 1:
        g = _rotate(g_rows[:, 0], qg).square()
        a = _rotate(a_rows[:, 0], qa).square()
        return g.T @ a
    if _rows_first(positions, out, inp, qg is not None, qa is not None):
        return _square_sum(
            _rotate(g_rows, qg), _rotate(a_rows, qa), None, None, max_elements
        )
    return _square_sum(g_rows, a_rows, qg, qa, max_elements)


def rotate_onehot(tokens: torch.Tensor, qa: torch.Tensor) -> torch.Tensor:
    """Return the one-hot rows `e_k` in the basis `Q_A`: `Q_Aᵀ e_k`, row
    `k` of `Q_A`, and zeros for the tokens `-1` (none).

    Args:
        tokens: `(N, T)` integer tokens in `[-1, dim)`.
        qa: `Q_A`, `(dim, dim)`.

    Returns:
        `(N, T, dim)`.
    """
    rows = qa[tokens.clamp(min=0)]
    return rows * (tokens >= 0).unsqueeze(-1).to(rows.dtype)


def onehot_scale(
    g_rows: torch.Tensor,
    tokens: torch.Tensor,
    qg: torch.Tensor | None,
    dim: int,
) -> torch.Tensor:
    """Return `Σ_n (Q_Gᵀ (Σ_t g_{n,t} e_{k_{n,t}}ᵀ))²` for one-hot inputs
    (`Q_A = I`), without a per-example `(out, dim)` matrix and without a
    host synchronisation.

    Args:
        g_rows: `(N, T, out)`: the output gradients (already scaled).
        tokens: `(N, T)`: the token of each position in `[-1, dim)`; `-1`
            contributes nothing (a token outside a tile's range).
        qg: `Q_G`, `(out, out)`, or None for the identity.
        dim: the number of tokens (columns of the result).

    Returns:
        `(out, dim)`.

    Examples:
        >>> g = torch.tensor([[[1.0], [2.0], [5.0]]])
        >>> onehot_scale(g, torch.tensor([[0, 0, 2]]), None, 3)
        tensor([[ 9.,  0., 25.]])
    """
    n, positions, out = g_rows.shape
    rows = _rotate(g_rows, qg).reshape(n * positions, out)
    flat = tokens.reshape(-1)
    valid = flat >= 0
    rows = rows * valid.unsqueeze(-1).to(rows.dtype)
    flat = flat.clamp(min=0)
    total = rows.new_zeros((dim, out))
    if positions == 1:  # one token per example: nothing to sum first
        return total.index_add_(0, flat, rows.square()).T
    example = torch.arange(n, device=flat.device).repeat_interleave(positions)
    keys, order = torch.sort(example * dim + flat, stable=True)
    starts = torch.ones_like(keys, dtype=torch.bool)
    starts[1:] = keys[1:] != keys[:-1]
    segment = torch.cumsum(starts, dim=0) - 1
    sums = rows.new_zeros(rows.shape).index_add_(0, segment, rows[order])
    token = torch.zeros_like(flat).scatter_(0, segment, flat[order])
    return total.index_add_(0, token, sums.square_()).T


def subspace_iteration(
    factor: torch.Tensor,
    basis: torch.Tensor,
    steps: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Refresh an eigenbasis of `factor` by orthogonal iteration from
    `basis`.

    The columns of `basis` are ordered by their Rayleigh quotients
    (largest first), then `steps` times `Q ← qr(F Q)`; the eigenvalues are
    the Rayleigh quotients of the result, clamped at 0 like
    [`symmetric_eigh`][kfac.math.symmetric_eigh]'s.

    Args:
        factor: `F`, `(n, n)`, symmetric positive semi-definite, in the
            dtype to compute in.
        basis: the previous eigenvectors as columns, `(n, n)`, orthonormal.
        steps: QR steps, at least 1.

    Returns:
        `Q` `(n, n)` (orthonormal columns, row-major) and `d` `(n,)`.

    Examples:
        >>> f = torch.diag(torch.tensor([1.0, 4.0]))
        >>> q, d = subspace_iteration(f, torch.eye(2), 1)
        >>> d
        tensor([4., 1.])
    """
    if steps < 1:
        raise ValueError(f'steps must be at least 1; got {steps}')
    q = basis.to(factor.dtype)
    product = factor @ q  # the quotients' product is the first step's
    quotients = (q * product).sum(dim=0)
    product = product[:, torch.argsort(quotients, descending=True)]
    for step in range(steps):
        if step:
            product = factor @ q
        q, _ = torch.linalg.qr(product)
    d = (q * (factor @ q)).sum(dim=0)
    return q.contiguous(), d.clamp_(min=0.0)
