"""The original's `KFACEigenLayer`: a layer whose curvature is EIGEN.

The method itself is
[`kfac.layers.curvature.eigen`][kfac.layers.curvature.eigen].
"""

from __future__ import annotations

import torch

from kfac.layers.base import KFACBaseLayer
from kfac.layers.curvature.eigen import EigenConfig
from kfac.layers.helper import ModuleHelper

__all__ = ['KFACEigenLayer']


class KFACEigenLayer(KFACBaseLayer):
    """A [`KFACBaseLayer`][kfac.layers.base.KFACBaseLayer] preconditioning
    with `(A ⊗ G + λ I)⁻¹` via eigendecompositions of the factors.

    Args:
        module: helper of the module.
        prediv_eigenvalues: precompute `1 / (d_G d_Aᵀ + λ)` on the inverse
            worker (see
            [`EigenConfig`][kfac.layers.curvature.eigen.EigenConfig]);
            off by default here, as in the original's layer, where
            `EigenConfig` (and the preconditioner) default to it.
        basis_refresh: `'eigh'` or `'qr'` (see `EigenConfig`).
        damping_mode: `'absolute'` or `'relative'` (see `EigenConfig`).
        factor_rank: keep dense factors longer than this at low rank.
        factor_dtype: see [`KFACBaseLayer`][kfac.layers.base.KFACBaseLayer].
        inv_dtype: see `KFACBaseLayer`.
        loss_average: see `KFACBaseLayer`.
    """

    def __init__(
        self,
        module: ModuleHelper,
        *,
        prediv_eigenvalues: bool = False,
        basis_refresh: str = 'eigh',
        damping_mode: str = 'absolute',
        factor_rank: int | None = None,
        factor_dtype: torch.dtype | None = None,
        inv_dtype: torch.dtype | None = None,
        loss_average: str | None = 'batch',
    ) -> None:
        super().__init__(
            module,
            curvature=EigenConfig(
                prediv_eigenvalues=prediv_eigenvalues,
                basis_refresh=basis_refresh,
                damping_mode=damping_mode,
                factor_rank=factor_rank,
            ),
            factor_dtype=factor_dtype,
            inv_dtype=inv_dtype,
            loss_average=loss_average,
        )
