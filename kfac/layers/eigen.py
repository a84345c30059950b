"""K-FAC with exact damping through eigendecompositions of the factors.

A diagonal factor (the `A` of an embedding) is its own eigenvalues; its
eigenvectors are the identity and are neither stored nor sent.

A basis is refreshed by a full `eigh` or, with `basis_refresh='qr'`, by
[`WARM_START_STEPS`][kfac.layers.eigen.WARM_START_STEPS] steps of
orthogonal iteration from the previous basis
([`subspace_iteration`][kfac.math.ekfac.subspace_iteration]; the first
decomposition is a full `eigh`).
"""

from __future__ import annotations

from typing import Any

import torch

from kfac.layers.base import KFACBaseLayer
from kfac.layers.decomposition import Decomposed
from kfac.layers.decomposition import Layout
from kfac.layers.embedding import diagonal_eigen_precondition
from kfac.layers.helper import ModuleHelper
from kfac.math import eigen_precondition
from kfac.math import eigenvalue_outer_product
from kfac.math import subspace_iteration
from kfac.math import symmetric_eigh
from kfac.validation import check_bool
from kfac.validation import check_choice

BASIS_REFRESHES = ('eigh', 'qr')
"""Allowed values of `basis_refresh`."""

WARM_START_STEPS = 2
"""QR steps of a warm-started basis refresh (`basis_refresh='qr'`)."""


class KFACEigenLayer(KFACBaseLayer):
    """Precondition with `(A ⊗ G + λ I)⁻¹` via `A = Q_A D_A Q_Aᵀ`, ...

    Args:
        module: helper of the module.
        prediv_eigenvalues: precompute `1 / (d_G d_Aᵀ + λ)` on the inverse
            worker when `G` is decomposed
            (`compute_eigenvalue_outer_product`), so gradient workers
            receive one `(out, in[+1])` matrix instead of both eigenvalue
            vectors and skip that work each step. The damping is then the
            one in force at the last decomposition. Needs both factors
            decomposed on the same rank, `A` first. A diagonal `A` then
            leaves nothing to send (its eigenvectors are the identity).
        basis_refresh: `'eigh'` (a full eigendecomposition at every
            refresh) or `'qr'` (warm start from the previous basis; see the
            module docstring).
        **kwargs: see [`KFACBaseLayer`][kfac.layers.base.KFACBaseLayer].

    """

    def __init__(
        self,
        module: ModuleHelper,
        *,
        prediv_eigenvalues: bool = False,
        basis_refresh: str = 'eigh',
        **kwargs: Any,
    ) -> None:
        super().__init__(module, **kwargs)
        self.prediv_eigenvalues = check_bool(
            'prediv_eigenvalues',
            prediv_eigenvalues,
        )
        self.basis_refresh = check_choice(
            'basis_refresh', basis_refresh, BASIS_REFRESHES
        )
        self._da: torch.Tensor | None = None
        self._a_tried = False
        """Whether factor `A` was ever decomposed on this rank."""

    def _decompose(
        self,
        name: str,
        matrix: torch.Tensor,
        dtype: torch.dtype,
        damping: float,
    ) -> Decomposed:
        if name == 'A':
            self._a_tried = True
        factor = self.factor(name)
        if factor.diagonal:  # Q = I: the eigenvalues alone
            return Decomposed((matrix.clamp(min=0.0),), None)
        previous = factor.decomposition
        if self.basis_refresh == 'qr' and previous is not None:
            basis = previous[0]  # Q, with or without prediv_eigenvalues
            steps = WARM_START_STEPS
            return Decomposed(subspace_iteration(matrix, basis, steps), None)
        # eigh raises on failure: no flag of its own
        return Decomposed(symmetric_eigh(matrix, dtype), None)

    def _finalize(
        self,
        name: str,
        tensors: tuple[torch.Tensor, ...],
        damping: float,
    ) -> tuple[torch.Tensor, ...] | None:
        if not self.prediv_eigenvalues:
            return tensors
        if name == 'A':  # keep Q_A (none when A is diagonal), not d_A
            self._da = tensors[-1].to(self.inv_dtype)
            return tensors[:-1]
        q, d = tensors
        if self._da is None:
            if self._a_tried:  # every attempt on A failed: no eigenvalues
                return None
            raise RuntimeError(
                f'{self}: with compute_eigenvalue_outer_product the A '
                'factor must be decomposed on the same rank before G',
            )
        da = self._da.to(d.dtype)
        shift = self.effective_damping(damping, lambda: (da.mean(), d.mean()))
        return (q, eigenvalue_outer_product(d, da, shift))

    @property
    def decomposition_format(self) -> str:
        """`'eigen'`, or `'eigen_outer'` with `prediv_eigenvalues`."""
        return 'eigen_outer' if self.prediv_eigenvalues else 'eigen'

    def decomposition_layout(self, name: str) -> Layout:
        """`Q` then `d` (or `Q_A` / `Q_G`, `1/(d_G d_Aᵀ + λ)`); no `Q` for
        a diagonal factor.
        """
        factor = self.factor(name)
        n = factor.dim
        d = ((n,), False)
        tensors = (d,) if factor.diagonal else (((n, n), False), d)
        if not self.prediv_eigenvalues:
            return tensors
        if name == 'A':
            return tensors[:-1]
        return (tensors[0], (self.module.grad_shape, False))

    def _precondition(
        self, grad: torch.Tensor, damping: float
    ) -> torch.Tensor:
        a, g = self.a.decomposition, self.g.decomposition
        assert (
            a is not None and g is not None
        )  # the caller checks has_decomposition
        if self.prediv_eigenvalues:
            scale = g[1]
        else:
            shift = self.effective_damping(
                damping, lambda: (a[-1].mean(), g[1].mean())
            )
            scale = eigenvalue_outer_product(g[1], a[-1], shift)
        if self.a.diagonal:
            return diagonal_eigen_precondition(grad, g[0], scale)
        return eigen_precondition(grad, a[0], g[0], scale)
