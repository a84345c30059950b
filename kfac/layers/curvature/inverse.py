"""INVERSE: factored Tikhonov damping through explicit inverses.

`V' = (G + (√λ/π) I)⁻¹ V (A + π √λ I)⁻¹`, with `π` from the traces of
both running factors ([`pi_correction`][kfac.math.pi_correction]), which
every rank holds after the factor allreduce, so each factor's inverse can
be computed on a different rank.

A diagonal factor (the `A` of an embedding) has a diagonal inverse, kept as
the vector `1 / (a + π √λ)`. With `factor_rank=k` a dense factor longer
than `k` is kept as its top `k` eigenpairs plus one value and inverted in
closed form ([`kfac.math.lowrank`][kfac.math.lowrank]).
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Mapping
from typing import TYPE_CHECKING
from typing import ClassVar

import torch

from kfac.enums import DampingMode
from kfac.layers.curvature.base import Curvature
from kfac.layers.curvature.base import CurvatureConfig
from kfac.layers.curvature.base import Decomposed
from kfac.layers.curvature.base import Layout
from kfac.layers.curvature.lowrank import LowRank
from kfac.layers.curvature.lowrank import check_factor_rank
from kfac.layers.curvature.lowrank import effective_damping
from kfac.layers.embedding import damped_diagonal_inverse
from kfac.layers.embedding import diagonal_inverse_precondition
from kfac.math import damped_inverse_ex
from kfac.math import inverse_precondition
from kfac.math import pi_correction
from kfac.math import symmetric_eigh
from kfac.math.lowrank import lowrank_damped_inverse
from kfac.math.lowrank import lowrank_inverse_precondition
from kfac.math.lowrank import lowrank_values
from kfac.math.lowrank import top_eigenpairs

if TYPE_CHECKING:  # the layer holds its curvature and the curvature its layer
    from kfac.layers.base import KFACBaseLayer

__all__ = ['InverseConfig', 'InverseCurvature']


@dataclasses.dataclass(frozen=True)
class InverseConfig(CurvatureConfig):
    """INVERSE and its options.

    Attributes:
        damping_mode: `'absolute'` (`λ` as given) or `'relative'` (`λ`
            times the layer's mean eigenvalue of `A ⊗ G`).
        factor_rank: keep a dense factor longer than this as its top
            eigenpairs plus one value (None: whole).

    Raises:
        TypeError, ValueError: an option of the wrong type or value.
    """

    name: ClassVar[str] = 'inverse'
    enums: ClassVar[Mapping[str, type[enum.Enum]]] = {
        'damping_mode': DampingMode
    }

    damping_mode: DampingMode | str = DampingMode.ABSOLUTE
    factor_rank: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        check_factor_rank(self.factor_rank)

    def make(self, layer: KFACBaseLayer) -> InverseCurvature:
        """The INVERSE curvature of `layer`."""
        return InverseCurvature(layer, self)


class InverseCurvature(Curvature):
    """`(G + (√λ/π) I)⁻¹ V (A + π √λ I)⁻¹`.

    Args:
        layer: the layer.
        config: the method's options.
    """

    def __init__(self, layer: KFACBaseLayer, config: InverseConfig) -> None:
        super().__init__(layer)
        self.config = config
        self.low_rank = LowRank(layer, config.factor_rank)
        self.format = 'inverse_lowrank' if self.low_rank else 'inverse'

    def __repr__(self) -> str:
        return f'{type(self).__name__}({self.config})'

    def shift(self, name: str, damping: float) -> float | torch.Tensor:
        """Factor `name`'s damping shift: `π √λ` for `A`, `√λ / π` for `G`
        (`λ` made relative first under `damping_mode='relative'`).
        """
        a = self.layer.decomposition_input('A')
        g = self.layer.decomposition_input('G')
        if a is None or g is None:
            raise RuntimeError(f'{self.layer} has no factors yet')
        if self.layer.factor('A').diagonal:  # 1 x 1, the same tr A / dim A
            a = a.mean().reshape(1, 1)
        pi = pi_correction(a, g)
        lam = effective_damping(
            damping,
            self.config.damping_mode,
            lambda: (torch.diagonal(a).mean(), torch.diagonal(g).mean()),
        )
        root = lam**0.5 if isinstance(lam, torch.Tensor) else math.sqrt(lam)
        return pi * root if name == 'A' else root / pi

    def decompose(
        self,
        name: str,
        matrix: torch.Tensor,
        dtype: torch.dtype,
        damping: float,
    ) -> Decomposed:
        """The damped inverse of factor `name` (its diagonal for a diagonal
        factor; `Q_k` and `k + 1` weights for a low-rank one).
        """
        shift = self.shift(name, damping)
        k = self.low_rank.rank(name)
        if k is not None:
            q, d = top_eigenpairs(*symmetric_eigh(matrix, dtype), k)
            weights = lowrank_damped_inverse(lowrank_values(matrix, d), shift)
            return Decomposed((q, weights), None)
        if self.layer.factor(name).diagonal:
            diagonal, ok = damped_diagonal_inverse(matrix, shift, dtype)
            return Decomposed((diagonal,), ok)
        inverse, info = damped_inverse_ex(matrix, shift, dtype)
        return Decomposed((inverse,), info == 0)

    def layout(self, name: str) -> Layout:
        """One symmetric `(n, n)` inverse, or the `(n,)` diagonal of a
        diagonal factor's; `Q_k` `(n, k)` and `k + 1` weights of a
        low-rank one.
        """
        kept = self.low_rank.layout(name)
        if kept is not None:
            return kept
        factor = self.layer.factor(name)
        if factor.diagonal:
            return (((factor.dim,), False),)
        return (((factor.dim, factor.dim), True),)

    def precondition(self, grad: torch.Tensor, damping: float) -> torch.Tensor:
        """`G⁻¹ V A⁻¹` with the damped inverses."""
        a = self.layer.factor('A').decomposition
        g = self.layer.factor('G').decomposition
        assert a is not None and g is not None  # the layer checks
        if self.low_rank:
            return lowrank_inverse_precondition(grad, a, g)
        if self.layer.factor('A').diagonal:
            return diagonal_inverse_precondition(grad, a[0], g[0])
        return inverse_precondition(grad, a[0], g[0])
