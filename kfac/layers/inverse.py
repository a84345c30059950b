"""K-FAC with factored Tikhonov damping through explicit inverses."""

from __future__ import annotations

import math

import torch

from kfac.layers.base import KFACBaseLayer
from kfac.layers.decomposition import Decomposed
from kfac.layers.decomposition import Layout
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

    def _decompose(
        self,
        name: str,
        matrix: torch.Tensor,
        dtype: torch.dtype,
        damping: float,
    ) -> Decomposed:
        a, g = self.a.value, self.g.value
        if a is None or g is None:
            raise RuntimeError(f'{self} has no factors yet')
        pi = pi_correction(a, g)
        root = math.sqrt(damping)
        shift = pi * root if name == 'A' else root / pi
        inverse, info = damped_inverse_ex(matrix, shift, dtype)
        return Decomposed((inverse,), info == 0)

    @property
    def decomposition_format(self) -> str:
        """`'inverse'`."""
        return 'inverse'

    def decomposition_layout(self, name: str) -> Layout:
        """One symmetric `(n, n)` inverse."""
        n = self.factor(name).dim
        return (((n, n), True),)

    def _precondition(
        self, grad: torch.Tensor, damping: float
    ) -> torch.Tensor:
        a, g = self.a.decomposition, self.g.decomposition
        assert (
            a is not None and g is not None
        )  # the caller checks has_decomposition
        return inverse_precondition(grad, a[0], g[0])
