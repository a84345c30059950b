"""The original's `KFACInverseLayer`: a layer whose curvature is INVERSE.

The method itself is
[`kfac.layers.curvature.inverse`][kfac.layers.curvature.inverse].
"""

from __future__ import annotations

import torch

from kfac.layers.base import KFACBaseLayer
from kfac.layers.curvature.inverse import InverseConfig
from kfac.layers.helper import ModuleHelper

__all__ = ['KFACInverseLayer']


class KFACInverseLayer(KFACBaseLayer):
    """A [`KFACBaseLayer`][kfac.layers.base.KFACBaseLayer] preconditioning
    with `(G + (√λ/π) I)⁻¹ V (A + π √λ I)⁻¹`.

    Args:
        module: helper of the module.
        damping_mode: `'absolute'` or `'relative'` (see
            [`InverseConfig`][kfac.layers.curvature.inverse.InverseConfig]).
        factor_rank: keep dense factors longer than this at low rank.
        factor_dtype: see [`KFACBaseLayer`][kfac.layers.base.KFACBaseLayer].
        inv_dtype: see `KFACBaseLayer`.
        loss_average: see `KFACBaseLayer`.
    """

    def __init__(
        self,
        module: ModuleHelper,
        *,
        damping_mode: str = 'absolute',
        factor_rank: int | None = None,
        factor_dtype: torch.dtype | None = None,
        inv_dtype: torch.dtype | None = None,
        loss_average: str | None = 'batch',
    ) -> None:
        super().__init__(
            module,
            curvature=InverseConfig(
                damping_mode=damping_mode, factor_rank=factor_rank
            ),
            factor_dtype=factor_dtype,
            inv_dtype=inv_dtype,
            loss_average=loss_average,
        )
