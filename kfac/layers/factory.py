"""Building the layer of one registered module from its options.

Every layer is a [`KFACBaseLayer`][kfac.layers.base.KFACBaseLayer]; its
method (a [`CurvatureConfig`][kfac.layers.curvature.base.CurvatureConfig]:
the module's own `compute_method` from `module_options`, see
[`ModuleOptions`][kfac.layers.options.ModuleOptions], else the model-wide
one) builds its curvature.
"""

from __future__ import annotations

import torch

from kfac.layers.base import KFACBaseLayer
from kfac.layers.curvature.base import CurvatureConfig
from kfac.layers.helper import ModuleHelper


def make_layer(
    name: str,
    helper: ModuleHelper,
    *,
    method: CurvatureConfig,
    factor_dtype: torch.dtype | None = None,
    inv_dtype: torch.dtype | None = None,
    loss_average: str | None = 'batch',
) -> KFACBaseLayer:
    """The layer preconditioning module `name`.

    Args:
        name: the module's (or tile's) name, for messages.
        helper: its helper.
        method: the method and its options (its `compute_method` in
            `module_options`, else the model-wide one).
        factor_dtype: see [`KFACBaseLayer`][kfac.layers.base.KFACBaseLayer].
        inv_dtype: see `KFACBaseLayer`.
        loss_average: see `KFACBaseLayer`.

    Raises:
        ValueError: the method cannot precondition this module (a
            `factor_rank` for an embedding, say), the message naming it.
    """
    try:
        return KFACBaseLayer(
            helper,
            curvature=method,
            factor_dtype=factor_dtype,
            inv_dtype=inv_dtype,
            loss_average=loss_average,
        )
    except ValueError as error:
        raise ValueError(f'module {name!r}: {error}') from None
