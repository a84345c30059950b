"""EIGEN: exact damping through eigendecompositions of the factors.

`V' = Q_G [(Q_Gᵀ V Q_A) / (d_G d_Aᵀ + λ)] Q_Aᵀ = (A ⊗ G + λ I)⁻¹ vec V`.

A diagonal factor (the `A` of an embedding) is its own eigenvalues; its
eigenvectors are the identity and are neither stored nor sent.

A basis is refreshed by a full `eigh` or, with `basis_refresh='qr'`, by
[`WARM_START_STEPS`][kfac.layers.curvature.eigen.WARM_START_STEPS] steps of
orthogonal iteration from the previous basis
([`subspace_iteration`][kfac.math.ekfac.subspace_iteration]; the first
decomposition is a full `eigh`).

With `factor_rank=k`, a dense factor longer than `k` keeps its `k` largest
eigenpairs and the mean of the rest of its spectrum
([`kfac.math.lowrank`][kfac.math.lowrank]); a factor no longer than `k` is
kept whole. The decomposition is still a full `eigh` on the inverse worker
(or, with `'qr'`, orthogonal iteration of the `k` kept vectors); what
shrinks is what is broadcast (`n k + k + 1` numbers) and the cost of
preconditioning each gradient. `prediv_eigenvalues` does not apply then:
the outer product it precomputes is as large as the gradient, which the
low-rank form avoids.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from typing import TYPE_CHECKING
from typing import ClassVar

import torch

from kfac.enums import BasisRefresh
from kfac.enums import DampingMode
from kfac.layers.curvature.base import Curvature
from kfac.layers.curvature.base import CurvatureConfig
from kfac.layers.curvature.base import Decomposed
from kfac.layers.curvature.base import Layout
from kfac.layers.curvature.lowrank import LowRank
from kfac.layers.curvature.lowrank import check_factor_rank
from kfac.layers.curvature.lowrank import effective_damping
from kfac.layers.embedding import diagonal_eigen_precondition
from kfac.math import eigen_precondition
from kfac.math import eigenvalue_outer_product
from kfac.math import subspace_iteration
from kfac.math import symmetric_eigh
from kfac.math.lowrank import lowrank_eigen_precondition
from kfac.math.lowrank import lowrank_values
from kfac.math.lowrank import mean_eigenvalue
from kfac.math.lowrank import top_eigenpairs
from kfac.validation import check_bool

if TYPE_CHECKING:  # the layer holds its curvature and the curvature its layer
    from kfac.layers.base import KFACBaseLayer

__all__ = [
    'WARM_START_STEPS',
    'EigenConfig',
    'EigenCurvature',
]

WARM_START_STEPS = 2
"""QR steps of a warm-started basis refresh (`basis_refresh='qr'`)."""


@dataclasses.dataclass(frozen=True)
class EigenConfig(CurvatureConfig):
    """EIGEN and its options.

    Attributes:
        prediv_eigenvalues: precompute `1 / (d_G d_Aᵀ + λ)` on the inverse
            worker when `G` is decomposed (the original's
            `compute_eigenvalue_outer_product`), so gradient workers
            receive one `(out, in[+1])` matrix instead of both eigenvalue
            vectors. The damping is then the one in force at the last
            decomposition. Needs both factors decomposed on one rank
            (`colocate_factors`), `A` first.
        basis_refresh: `'eigh'` (a full eigendecomposition at every
            refresh) or `'qr'` (warm start from the previous basis).
        damping_mode: `'absolute'` (`λ` as given) or `'relative'` (`λ`
            times the layer's mean eigenvalue of `A ⊗ G`; see
            [`kfac.math.lowrank`][kfac.math.lowrank]).
        factor_rank: keep a dense factor longer than this as its top
            eigenpairs plus one value (None: whole).

    Raises:
        TypeError, ValueError: an option of the wrong type or value.
    """

    name: ClassVar[str] = 'eigen'
    enums: ClassVar[Mapping[str, type[enum.Enum]]] = {
        'basis_refresh': BasisRefresh,
        'damping_mode': DampingMode,
    }

    prediv_eigenvalues: bool = True
    basis_refresh: BasisRefresh | str = BasisRefresh.EIGH
    damping_mode: DampingMode | str = DampingMode.ABSOLUTE
    factor_rank: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        check_bool('prediv_eigenvalues', self.prediv_eigenvalues)
        check_factor_rank(self.factor_rank)

    def make(self, layer: KFACBaseLayer) -> EigenCurvature:
        """The EIGEN curvature of `layer`."""
        return EigenCurvature(layer, self)


class EigenCurvature(Curvature):
    """`(A ⊗ G + λ I)⁻¹` through `A = Q_A D_A Q_Aᵀ`, `G = Q_G D_G Q_Gᵀ`.

    Args:
        layer: the layer.
        config: the method's options.
    """

    def __init__(self, layer: KFACBaseLayer, config: EigenConfig) -> None:
        super().__init__(layer)
        self.config = config
        self.low_rank = LowRank(layer, config.factor_rank)
        self.prediv_eigenvalues = (
            config.prediv_eigenvalues and not self.low_rank
        )
        self.format = self._format()
        self._da: torch.Tensor | None = None
        self._a_tried = False
        """Whether factor `A` was ever decomposed on this rank."""

    def __repr__(self) -> str:
        return f'{type(self).__name__}({self.config})'

    def _format(self) -> str:
        if self.low_rank:
            return 'eigen_lowrank'
        return 'eigen_outer' if self.prediv_eigenvalues else 'eigen'

    def decompose(
        self,
        name: str,
        matrix: torch.Tensor,
        dtype: torch.dtype,
        damping: float,
    ) -> Decomposed:
        """`(Q, d)` of factor `name` (`(d,)` of a diagonal one); `(Q_k,
        (d_1, …, d_k, c))` of a low-rank one.
        """
        if name == 'A':
            self._a_tried = True
        factor = self.layer.factor(name)
        if factor.diagonal:  # Q = I: the eigenvalues alone
            return Decomposed((matrix.clamp(min=0.0),), None)
        previous = factor.decomposition
        if self.config.basis_refresh == 'qr' and previous is not None:
            q, d = subspace_iteration(matrix, previous[0], WARM_START_STEPS)
        else:  # eigh raises on failure: no flag of its own
            q, d = symmetric_eigh(matrix, dtype)
        k = self.low_rank.rank(name)
        if k is None:
            return Decomposed((q, d), None)
        qk, dk = top_eigenpairs(q, d, k)
        return Decomposed((qk, lowrank_values(matrix, dk)), None)

    def finalize(
        self,
        name: str,
        tensors: tuple[torch.Tensor, ...],
        damping: float,
    ) -> tuple[torch.Tensor, ...] | None:
        """With `prediv_eigenvalues`: keep `Q_A` (none for a diagonal `A`)
        and, for `G`, `(Q_G, 1 / (d_G d_Aᵀ + λ))`.
        """
        if not self.prediv_eigenvalues:
            return tensors
        if name == 'A':  # keep Q_A (none when A is diagonal), not d_A
            self._da = tensors[-1].to(self.layer.inv_dtype)
            return tensors[:-1]
        q, d = tensors
        if self._da is None:
            if self._a_tried:  # every attempt on A failed: no eigenvalues
                return None
            raise RuntimeError(
                f'{self.layer}: with compute_eigenvalue_outer_product the A '
                'factor must be decomposed on the same rank before G',
            )
        da = self._da.to(d.dtype)
        shift = effective_damping(
            damping, self.config.damping_mode, lambda: (da.mean(), d.mean())
        )
        return (q, eigenvalue_outer_product(d, da, shift))

    def layout(self, name: str) -> Layout:
        """`Q` then `d` (or `Q_A` / `Q_G`, `1/(d_G d_Aᵀ + λ)`); no `Q` for
        a diagonal factor; `Q_k` `(n, k)` and `(d_1, …, d_k, c)` for a
        low-rank one.
        """
        kept = self.low_rank.layout(name)
        if kept is not None:
            return kept
        factor = self.layer.factor(name)
        n = factor.dim
        d = ((n,), False)
        tensors = (d,) if factor.diagonal else (((n, n), False), d)
        if not self.prediv_eigenvalues:
            return tensors
        if name == 'A':
            return tensors[:-1]
        return (tensors[0], (self.layer.helper.grad_shape, False))

    def precondition(self, grad: torch.Tensor, damping: float) -> torch.Tensor:
        """`Q_G [(Q_Gᵀ V Q_A) / (d_G d_Aᵀ + λ)] Q_Aᵀ`."""
        a = self.layer.factor('A').decomposition
        g = self.layer.factor('G').decomposition
        assert a is not None and g is not None  # the layer checks
        if self.low_rank:
            return self._precondition_low_rank(grad, a, g, damping)
        if self.prediv_eigenvalues:
            scale = g[1]
        else:
            shift = effective_damping(
                damping,
                self.config.damping_mode,
                lambda: (a[-1].mean(), g[1].mean()),
            )
            scale = eigenvalue_outer_product(g[1], a[-1], shift)
        if self.layer.factor('A').diagonal:
            return diagonal_eigen_precondition(grad, g[0], scale)
        return eigen_precondition(grad, a[0], g[0], scale)

    def _precondition_low_rank(
        self,
        grad: torch.Tensor,
        a: tuple[torch.Tensor, ...],
        g: tuple[torch.Tensor, ...],
        damping: float,
    ) -> torch.Tensor:
        dims = self.low_rank.dims()
        side = (None, a[0]) if len(a) == 1 else (a[0], a[1])  # diagonal A

        def means() -> tuple[torch.Tensor, torch.Tensor]:
            rank = self.low_rank.rank
            mean_a = (
                side[1].mean()
                if side[0] is None
                else mean_eigenvalue(side[1], dims['A'], rank('A'))
            )
            return mean_a, mean_eigenvalue(g[1], dims['G'], rank('G'))

        shift = effective_damping(damping, self.config.damping_mode, means)
        return lowrank_eigen_precondition(grad, side, (g[0], g[1]), shift)
