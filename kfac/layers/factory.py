"""Building the layer of one registered module from its options.

Every layer is a [`KFACBaseLayer`][kfac.layers.base.KFACBaseLayer]; the
method (a [`CurvatureConfig`][kfac.layers.curvature.base.CurvatureConfig])
builds its curvature, and a module's `factor_rank` (see
[`ModuleOptions`][kfac.layers.options.ModuleOptions]) becomes that
method's option.
"""

from __future__ import annotations

import dataclasses

import torch

from kfac.layers.base import KFACBaseLayer
from kfac.layers.curvature.base import CurvatureConfig
from kfac.layers.helper import ModuleHelper
from kfac.layers.options import ModuleOptions


def method_for(
    name: str, method: CurvatureConfig, options: ModuleOptions
) -> CurvatureConfig:
    """`method` with module `name`'s `factor_rank` (if set) as its option.

    Raises:
        ValueError: a `factor_rank` for a method without a low-rank form
            (EKFAC re-estimates its scaling in the full eigenbasis).
    """
    rank = options.factor_rank
    if rank is None:
        return method
    fields = {f.name for f in dataclasses.fields(method)}
    if 'factor_rank' not in fields:
        raise ValueError(
            f'factor_rank={rank} for {name!r}: compute_method '
            f'{method.name!r} has no low-rank form (EKFAC re-estimates its '
            "scaling in the full eigenbasis); use compute_method='eigen' or "
            "'inverse' with factor_rank, or leave factor_rank=None",
        )
    return dataclasses.replace(method, factor_rank=rank)  # type: ignore[call-arg]  # the field exists (checked above)


def make_layer(
    name: str,
    helper: ModuleHelper,
    options: ModuleOptions,
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
        options: its resolved per-module options.
        method: the method and its options.
        factor_dtype: see [`KFACBaseLayer`][kfac.layers.base.KFACBaseLayer].
        inv_dtype: see `KFACBaseLayer`.
        loss_average: see `KFACBaseLayer`.

    Raises:
        ValueError: a `factor_rank` the method or the module cannot take.
    """
    return KFACBaseLayer(
        helper,
        curvature=method_for(name, method, options),
        factor_dtype=factor_dtype,
        inv_dtype=inv_dtype,
        loss_average=loss_average,
    )
