r"""Adam's second moments in a Kronecker eigenbasis, and one-sided forms.

## Second moments in the eigenbasis (EIGEN_ADAM)

With `Q_A`, `Q_G` the eigenbases of a layer's factors (`(i, i)` and
`(o, o)`, `i = in[+1]`, `o = out`), the gradient `V` (`(o, i)`) is rotated
into the basis, `R = Q_Gᵀ V Q_A`
([`rotate`][kfac.math.eigenbasis.rotate]); an exponential average of its
elementwise square is kept there,

`E ← β₂ E + (1 - β₂) R ⊙ R`,

`E` starting at zero, and the gradient is divided by the root of `E`
elementwise and rotated back
([`normalized_step`][kfac.math.eigenbasis.normalized_step]):

`V' = Q_G (R ⊘ (√(E / c) + ε)) Q_Aᵀ`,

with `c = 1 - β₂ᵗ` after `t` updates (Adam's bias correction) or `c = 1`
(none). `Q diag(vec E) Qᵀ` (`Q = Q_A ⊗ Q_G`) is a diagonal second moment
in the Kronecker eigenbasis, as SOAP (Vyas et al., ICLR 2025) keeps
Adam's in Shampoo's; with identity bases this is RMSprop (`c = 1`) or
Adam without a first moment.

When the bases are refreshed, `E` is either restarted (zero, `t = 0`) or
carried into the new bases
([`carry_second_moment`][kfac.math.eigenbasis.carry_second_moment]): with
`P_G = Q_G,newᵀ Q_G,old` and `P_A = Q_A,newᵀ Q_A,old`, the diagonal of the
old second moment seen in the new basis is

`E_new = (P_G ⊙ P_G) E (P_A ⊙ P_A)ᵀ`,

exact when the second moment was diagonal in the old basis; `E_new = E`
when the bases did not move, and `t` is kept.

## One side only (ONE_SIDED)

`V' = V (A + λ_A I)⁻¹` (the input side) or `V' = (G + λ_G I)⁻¹ V` (the
output side) through `F = Q diag(d) Qᵀ`
([`one_sided_precondition`][kfac.math.eigenbasis.one_sided_precondition]),
with `λ_F = λ · tr F / dim F` (the damping relative to the factor's mean
eigenvalue, as Newton-Muon damps).
"""

from __future__ import annotations

import torch

__all__ = [
    'carry_second_moment',
    'normalized_step',
    'one_sided_precondition',
    'rotate',
    'unrotate',
]


def rotate(
    grad: torch.Tensor, qa: torch.Tensor | None, qg: torch.Tensor
) -> torch.Tensor:
    """`R = Q_Gᵀ V Q_A` (`Q_A = I` when `qa` is None: a diagonal `A`).

    Args:
        grad: `V`, `(out, in[+1])`.
        qa: `Q_A`, `(in[+1], in[+1])`, or None.
        qg: `Q_G`, `(out, out)`.
    """
    rotated = qg.T @ grad
    return rotated if qa is None else rotated @ qa


def unrotate(
    rotated: torch.Tensor, qa: torch.Tensor | None, qg: torch.Tensor
) -> torch.Tensor:
    """`Q_G R Q_Aᵀ`, the inverse of [`rotate`][kfac.math.eigenbasis.rotate]."""
    back = qg @ rotated
    return back if qa is None else back @ qa.T


def normalized_step(
    rotated: torch.Tensor,
    moment: torch.Tensor,
    eps: float,
    correction: torch.Tensor | float = 1.0,
) -> torch.Tensor:
    """`R ⊘ (√(E / c) + ε)`.

    Args:
        rotated: `R`, `(out, in[+1])`.
        moment: `E`, shaped like `R`.
        eps: `ε`.
        correction: `c` (`1 - β₂ᵗ`, or 1 without bias correction).

    Examples:
        >>> r = torch.tensor([[3.0, -4.0]])
        >>> normalized_step(r, r * r, 0.0)
        tensor([[ 1., -1.]])
    """
    denominator = (moment / correction).sqrt_().add_(eps)
    return rotated / denominator


def carry_second_moment(
    moment: torch.Tensor,
    pa: torch.Tensor | None,
    pg: torch.Tensor,
) -> torch.Tensor:
    """`(P_G ⊙ P_G) E (P_A ⊙ P_A)ᵀ`: the diagonal second moment `E` of the
    old bases, seen in the new ones.

    Args:
        moment: `E`, `(out, in[+1])`.
        pa: `P_A = Q_A,newᵀ Q_A,old`, `(in[+1], in[+1])`, or None (`Q_A = I`
            throughout).
        pg: `P_G = Q_G,newᵀ Q_G,old`, `(out, out)`.

    Examples:
        >>> swap = torch.tensor([[0.0, 1.0], [1.0, 0.0]])
        >>> carry_second_moment(torch.tensor([[1.0, 2.0]]), swap,
        ...                     torch.ones(1, 1))
        tensor([[2., 1.]])
    """
    carried = (pg * pg) @ moment
    return carried if pa is None else carried @ (pa * pa).T


def one_sided_precondition(
    grad: torch.Tensor,
    decomposition: tuple[torch.Tensor, ...],
    damping: float,
    *,
    right: bool,
) -> torch.Tensor:
    """`V (F + λ_F I)⁻¹` (`right`) or `(F + λ_F I)⁻¹ V`, with
    `λ_F = λ · mean(d)`.

    Args:
        grad: `V`, `(out, in[+1])`.
        decomposition: `(Q, d)` of `F = Q diag(d) Qᵀ`, or `(d,)` of a
            diagonal `F`.
        damping: `λ`, relative to `F`'s mean eigenvalue.
        right: `F` is the input factor `A` (else the output factor `G`).

    Examples:
        >>> v = torch.ones(1, 2)
        >>> one_sided_precondition(v, (torch.tensor([1.0, 3.0]),), 0.5,
        ...                        right=True)
        tensor([[0.5000, 0.2500]])
    """
    d = decomposition[-1]
    scale = 1.0 / (d + damping * d.mean())
    if len(decomposition) == 1:  # diagonal: Q = I
        return grad * (scale if right else scale[:, None])
    q = decomposition[0]
    if right:
        return ((grad @ q) * scale) @ q.T
    return q @ ((q.T @ grad) * scale[:, None])
