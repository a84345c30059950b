"""EIGEN and INVERSE with wide factors kept at low rank plus a constant.

A dense factor longer than the module's `factor_rank` `k` (see
[`ModuleOptions`][kfac.layers.options.ModuleOptions]) keeps its `k`
largest eigenpairs and the mean of the rest of its spectrum
([`kfac.math.lowrank`][kfac.math.lowrank]); a factor no longer than `k`
is kept whole, as the plain layers keep it. The decomposition is still a
full `eigh` on the inverse worker (or, with `basis_refresh='qr'`, orthogonal
iteration of the `k` kept vectors from the previous ones); what shrinks is
what is broadcast to the gradient workers (`n k + k + 1` numbers) and the
cost of preconditioning each gradient.

EIGEN's `compute_eigenvalue_outer_product` does not apply to these layers:
the outer product it precomputes is as large as the gradient, which the
low-rank form avoids; the damping is the one in force at each step.
"""

from __future__ import annotations

from typing import Any

import torch

from kfac.layers.decomposition import Decomposed
from kfac.layers.decomposition import Layout
from kfac.layers.eigen import WARM_START_STEPS
from kfac.layers.eigen import KFACEigenLayer
from kfac.layers.helper import ModuleHelper
from kfac.layers.inverse import KFACInverseLayer
from kfac.math import subspace_iteration
from kfac.math import symmetric_eigh
from kfac.math.lowrank import lowrank_damped_inverse
from kfac.math.lowrank import lowrank_eigen_precondition
from kfac.math.lowrank import lowrank_inverse_precondition
from kfac.math.lowrank import lowrank_values
from kfac.math.lowrank import mean_eigenvalue
from kfac.math.lowrank import top_eigenpairs
from kfac.validation import validate_int


class _LowRank:
    """Which of a layer's factors are kept at low rank."""

    module: ModuleHelper
    rank: int

    def _dims(self) -> dict[str, int]:
        return {
            'A': self.module.a_factor_shape[0],
            'G': self.module.g_factor_shape[0],
        }

    def low_rank(self, name: str) -> int | None:
        """`k` if factor `name` is kept at rank `k`, else None (whole)."""
        return self.rank if self._dims()[name] > self.rank else None

    def _layout(self, name: str) -> Layout | None:
        """`Q_k` `(n, k)` and `(d_1, …, d_k, c)`, or None (whole)."""
        k = self.low_rank(name)
        if k is None:
            return None
        return (((self._dims()[name], k), False), ((k + 1,), False))


def _check(module: ModuleHelper, rank: object) -> int:
    checked = validate_int('factor_rank', rank)
    if module.a_diagonal:
        raise ValueError(
            f'factor_rank applies to dense factors; {module} has a diagonal '
            'A (an embedding): leave factor_rank=None for it',
        )
    return checked


class KFACLowRankEigenLayer(_LowRank, KFACEigenLayer):
    """EIGEN with `(Â ⊗ Ĝ + λ I)⁻¹`, a factor longer than `rank` kept as
    its top eigenpairs plus one value.

    Args:
        module: helper of the module (both factors dense).
        rank: `factor_rank`, `k ≥ 1`.
        **kwargs: see [`KFACEigenLayer`][kfac.layers.eigen.KFACEigenLayer]
            (`prediv_eigenvalues` is ignored: see the module docstring).
    """

    def __init__(
        self, module: ModuleHelper, *, rank: int, **kwargs: Any
    ) -> None:
        kwargs['prediv_eigenvalues'] = False
        super().__init__(module, **kwargs)
        self.rank = _check(module, rank)

    def _decompose(
        self,
        name: str,
        matrix: torch.Tensor,
        dtype: torch.dtype,
        damping: float,
    ) -> Decomposed:
        k = self.low_rank(name)
        if k is None:
            return super()._decompose(name, matrix, dtype, damping)
        previous = self.factor(name).decomposition
        if self.basis_refresh == 'qr' and previous is not None:
            q, d = subspace_iteration(matrix, previous[0], WARM_START_STEPS)
        else:
            q, d = symmetric_eigh(matrix, dtype)
        qk, dk = top_eigenpairs(q, d, k)
        return Decomposed((qk, lowrank_values(matrix, dk)), None)

    @property
    def decomposition_format(self) -> str:
        """`'eigen_lowrank'`."""
        return 'eigen_lowrank'

    def decomposition_layout(self, name: str) -> Layout:
        """`Q_k` `(n, k)` and `(d_1, …, d_k, c)` of a low-rank factor;
        `Q` and `d` of a whole one.
        """
        return self._layout(name) or super().decomposition_layout(name)

    def _precondition(
        self, grad: torch.Tensor, damping: float
    ) -> torch.Tensor:
        a, g = self.a.decomposition, self.g.decomposition
        assert a is not None and g is not None  # the caller checks
        dims = self._dims()
        shift = self.effective_damping(
            damping,
            lambda: (
                mean_eigenvalue(a[1], dims['A'], self.low_rank('A')),
                mean_eigenvalue(g[1], dims['G'], self.low_rank('G')),
            ),
        )
        return lowrank_eigen_precondition(
            grad, (a[0], a[1]), (g[0], g[1]), shift
        )


class KFACLowRankInverseLayer(_LowRank, KFACInverseLayer):
    """INVERSE with `(Ĝ + (√λ/π) I)⁻¹ V (Â + π√λ I)⁻¹`, a factor longer
    than `rank` kept as its top eigenpairs plus one value and inverted in
    closed form.

    Args:
        module: helper of the module (both factors dense).
        rank: `factor_rank`, `k ≥ 1`.
        **kwargs: see
            [`KFACInverseLayer`][kfac.layers.inverse.KFACInverseLayer].
    """

    def __init__(
        self, module: ModuleHelper, *, rank: int, **kwargs: Any
    ) -> None:
        super().__init__(module, **kwargs)
        self.rank = _check(module, rank)

    def _decompose(
        self,
        name: str,
        matrix: torch.Tensor,
        dtype: torch.dtype,
        damping: float,
    ) -> Decomposed:
        k = self.low_rank(name)
        if k is None:
            return super()._decompose(name, matrix, dtype, damping)
        q, d = top_eigenpairs(*symmetric_eigh(matrix, dtype), k)
        weights = lowrank_damped_inverse(
            lowrank_values(matrix, d), self.shift(name, damping)
        )
        return Decomposed((q, weights), None)

    @property
    def decomposition_format(self) -> str:
        """`'inverse_lowrank'`."""
        return 'inverse_lowrank'

    def decomposition_layout(self, name: str) -> Layout:
        """`Q_k` `(n, k)` and the `k + 1` weights of a low-rank factor's
        damped inverse; the `(n, n)` inverse of a whole one.
        """
        return self._layout(name) or super().decomposition_layout(name)

    def _precondition(
        self, grad: torch.Tensor, damping: float
    ) -> torch.Tensor:
        a, g = self.a.decomposition, self.g.decomposition
        assert a is not None and g is not None  # the caller checks
        return lowrank_inverse_precondition(grad, a, g)
