"""ONE_SIDED: one factor's damped inverse, for an optimizer that whitens.

`V' = V (A + λ_A I)⁻¹` (`side='input'`) or `V' = (G + λ_G I)⁻¹ V`
(`side='output'`), with `λ_F = λ · tr F / dim F`: `damping` relative to
the factor's mean eigenvalue, as Newton-Muon (arXiv 2604.01472) damps
(math in [`kfac.math.eigenbasis`][kfac.math.eigenbasis]). The factor used
is decomposed by `eigh` on its inverse worker; the other is reduced to its
mean eigenvalue there (one number, kept and sent so that the layer holds
both decompositions as the engine expects), and KAISA weighs it as free.

The input side is meant for `torch.optim.Muon`: Muon keeps its momentum
before its Newton-Schulz step, so the composition is Muon on the momentum
of `V A⁻¹`, which equals Newton-Muon (Muon on `M A⁻¹`, the momentum `M`
of `V`) only while `A⁻¹` does not change. A registered bias is the last
column of `V` and a row of ones in `A`; it is kept: `V'`'s last column,
preconditioned with the whole `A`, goes back to the bias's `.grad`, which
the optimizer of the other parameters trains (Muon takes 2-D weights
only).

The factors' source is an option, as for EIGEN_ADAM (see
[`kfac.layers.curvature.source`][kfac.layers.curvature.source]). With
K-FAC's factors the unused factor is still captured and allreduced.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from typing import TYPE_CHECKING
from typing import ClassVar

import torch

from kfac.enums import AssignmentStrategy
from kfac.enums import FactorSource
from kfac.enums import Side
from kfac.layers.curvature.base import Curvature
from kfac.layers.curvature.base import CurvatureConfig
from kfac.layers.curvature.base import Decomposed
from kfac.layers.curvature.base import Layout
from kfac.layers.curvature.source import check_source
from kfac.math import symmetric_eigh
from kfac.math.eigenbasis import one_sided_precondition

if TYPE_CHECKING:  # the layer holds its curvature and the curvature its layer
    from kfac.layers.base import KFACBaseLayer

__all__ = ['OneSidedConfig', 'OneSidedCurvature']


@dataclasses.dataclass(frozen=True)
class OneSidedConfig(CurvatureConfig):
    """ONE_SIDED and its options.

    Attributes:
        side: `'input'` (`V (A + λ_A I)⁻¹`, for Muon) or `'output'`
            (`(G + λ_G I)⁻¹ V`, for comparison).
        source: `'kfac'` (K-FAC's `A` and `G`) or `'gradient'` (the
            gradient's own `Vᵀ V` and `V Vᵀ`).

    Raises:
        TypeError, ValueError: an option of the wrong type or value.
    """

    name: ClassVar[str] = 'one_sided'
    enums: ClassVar[Mapping[str, type[enum.Enum]]] = {
        'side': Side,
        'source': FactorSource,
    }

    side: Side | str = Side.INPUT
    source: FactorSource | str = FactorSource.KFAC

    def make(self, layer: KFACBaseLayer) -> OneSidedCurvature:
        """The ONE_SIDED curvature of `layer`.

        Raises:
            ValueError: `source='gradient'` for a layer it cannot serve.
        """
        return OneSidedCurvature(layer, self)


class OneSidedCurvature(Curvature):
    """`V (A + λ_A I)⁻¹` or `(G + λ_G I)⁻¹ V`.

    Args:
        layer: the layer.
        config: the method's options.
    """

    def __init__(self, layer: KFACBaseLayer, config: OneSidedConfig) -> None:
        super().__init__(layer)
        self.config = config
        self.used = 'A' if config.side is Side.INPUT else 'G'
        """The factor preconditioned with."""
        self.format = f'one_sided_{config.side}'
        self.gradient_factors = check_source(
            layer, FactorSource(config.source), config.name
        )

    def __repr__(self) -> str:
        return f'{type(self).__name__}({self.config})'

    def layout(self, name: str) -> Layout:
        """`(Q, d)` of the factor used (`(d,)` if diagonal); one number
        (the mean eigenvalue) of the other.
        """
        factor = self.layer.factor(name)
        n = factor.dim
        if name != self.used:
            return (((1,), False),)
        if factor.diagonal:
            return (((n,), False),)
        return (((n, n), False), ((n,), False))

    def decompose(
        self,
        name: str,
        matrix: torch.Tensor,
        dtype: torch.dtype,
        damping: float,
    ) -> Decomposed:
        """`eigh` of the factor used; the other's mean eigenvalue."""
        factor = self.layer.factor(name)
        if name != self.used:
            diagonal = matrix if factor.diagonal else matrix.diagonal()
            return Decomposed((diagonal.mean().reshape(1),), None)
        if factor.diagonal:
            return Decomposed((matrix.clamp(min=0.0),), None)
        return Decomposed(symmetric_eigh(matrix, dtype), None)

    def cost(self, name: str, strategy: AssignmentStrategy) -> float:
        """As the default for the factor used; 1 for the other."""
        if name != self.used:
            return 1.0
        return super().cost(name, strategy)

    def precondition(self, grad: torch.Tensor, damping: float) -> torch.Tensor:
        """`V (A + λ_A I)⁻¹` or `(G + λ_G I)⁻¹ V`."""
        held = self.layer.factor(self.used).decomposition
        assert held is not None  # the layer checks
        return one_sided_precondition(
            grad, held, damping, right=self.used == 'A'
        )
