"""K-FAC with factored Tikhonov damping through explicit inverses.

A diagonal factor (the `A` of an embedding) has a diagonal inverse, kept
as the vector `1 / (a + π √λ)`.
"""

from __future__ import annotations

import math

import torch

from kfac.layers.base import KFACBaseLayer
from kfac.layers.decomposition import Decomposed
from kfac.layers.decomposition import Layout
from kfac.layers.embedding import damped_diagonal_inverse
from kfac.layers.embedding import diagonal_inverse_precondition
from kfac.math import damped_inverse_ex
from kfac.math import inverse_precondition
from kfac.math import pi_correction


class KFACInverseLayer(KFACBaseLayer):
    """Precondition with `(G + (√λ/π) I)⁻¹ V (A + π √λ I)⁻¹`.

    `π` ([`pi_correction`][kfac.math.pi_correction]) needs the traces of
    both running factors, which every rank holds after the factor
    allreduce, so each factor's inverse can be computed on a different
    rank.
    """

    def shift(self, name: str, damping: float) -> float | torch.Tensor:
        """Factor `name`'s damping shift: `π √λ` for `A`, `√λ / π` for `G`
        (`λ` made relative first under `damping_mode='relative'`).
        """
        a, g = self.decomposition_input('A'), self.decomposition_input('G')
        if a is None or g is None:
            raise RuntimeError(f'{self} has no factors yet')
        if self.a.diagonal:  # a 1 x 1 factor with the same tr A / dim A
            a = a.mean().reshape(1, 1)
        pi = pi_correction(a, g)
        lam = self.effective_damping(
            damping,
            lambda: (torch.diagonal(a).mean(), torch.diagonal(g).mean()),
        )
        root = lam**0.5 if isinstance(lam, torch.Tensor) else math.sqrt(lam)
        return pi * root if name == 'A' else root / pi

    def _decompose(
        self,
        name: str,
        matrix: torch.Tensor,
        dtype: torch.dtype,
        damping: float,
    ) -> Decomposed:
        shift = self.shift(name, damping)
        if self.factor(name).diagonal:
            diagonal, ok = damped_diagonal_inverse(matrix, shift, dtype)
            return Decomposed((diagonal,), ok)
        inverse, info = damped_inverse_ex(matrix, shift, dtype)
        return Decomposed((inverse,), info == 0)

    @property
    def decomposition_format(self) -> str:
        """`'inverse'`."""
        return 'inverse'

    def decomposition_layout(self, name: str) -> Layout:
        """One symmetric `(n, n)` inverse, or the `(n,)` diagonal of a
        diagonal factor's.
        """
        factor = self.factor(name)
        if factor.diagonal:
            return (((factor.dim,), False),)
        return (((factor.dim, factor.dim), True),)

    def _precondition(
        self, grad: torch.Tensor, damping: float
    ) -> torch.Tensor:
        a, g = self.a.decomposition, self.g.decomposition
        assert (
            a is not None and g is not None
        )  # the caller checks has_decomposition
        if self.a.diagonal:
            return diagonal_inverse_precondition(grad, a[0], g[0])
        return inverse_precondition(grad, a[0], g[0])
