"""Curvatures: what a layer's method does with its factors.

The interface is [`kfac.layers.curvature.base`][kfac.layers.curvature.base];
the library's methods are EIGEN
([`EigenConfig`][kfac.layers.curvature.eigen.EigenConfig]), INVERSE
([`InverseConfig`][kfac.layers.curvature.inverse.InverseConfig]), EKFAC
([`EKFACConfig`][kfac.layers.curvature.ekfac.EKFACConfig]), EIGEN_ADAM
([`EigenAdamConfig`][kfac.layers.curvature.eigen_adam.EigenAdamConfig])
and ONE_SIDED
([`OneSidedConfig`][kfac.layers.curvature.one_sided.OneSidedConfig]).
"""

from __future__ import annotations

from typing import Any

from kfac.enums import ComputeMethod
from kfac.enums import parse_enum
from kfac.layers.curvature.base import Curvature
from kfac.layers.curvature.base import CurvatureConfig
from kfac.layers.curvature.base import Decomposed
from kfac.layers.curvature.base import Layout
from kfac.layers.curvature.eigen import EigenConfig
from kfac.layers.curvature.eigen import EigenCurvature
from kfac.layers.curvature.eigen_adam import EigenAdamConfig
from kfac.layers.curvature.eigen_adam import EigenAdamCurvature
from kfac.layers.curvature.ekfac import EKFACConfig
from kfac.layers.curvature.ekfac import EKFACCurvature
from kfac.layers.curvature.inverse import InverseConfig
from kfac.layers.curvature.inverse import InverseCurvature
from kfac.layers.curvature.one_sided import OneSidedConfig
from kfac.layers.curvature.one_sided import OneSidedCurvature

__all__ = [
    'Curvature',
    'CurvatureConfig',
    'Decomposed',
    'EKFACConfig',
    'EKFACCurvature',
    'EigenAdamConfig',
    'EigenAdamCurvature',
    'EigenConfig',
    'EigenCurvature',
    'InverseConfig',
    'InverseCurvature',
    'Layout',
    'OneSidedConfig',
    'OneSidedCurvature',
    'method_config',
]


def method_config(
    method: ComputeMethod | str, **options: Any
) -> CurvatureConfig:
    """The config of the method named `method` with `options` (a command
    line's or a config file's spelling), options set to None left at their
    defaults.

    Raises:
        TypeError, ValueError: an unknown method, or an option it does not
            take or of a wrong value.

    Examples:
        >>> method_config('eigen', basis_refresh='qr', factor_rank=None)
        ... # doctest: +ELLIPSIS
        EigenConfig(..., basis_refresh=<BasisRefresh.QR: 'qr'>, ...)
    """
    kinds: dict[ComputeMethod, type[CurvatureConfig]] = {
        ComputeMethod.EIGEN: EigenConfig,
        ComputeMethod.INVERSE: InverseConfig,
        ComputeMethod.EKFAC: EKFACConfig,
        ComputeMethod.EIGEN_ADAM: EigenAdamConfig,
        ComputeMethod.ONE_SIDED: OneSidedConfig,
    }
    kind = kinds[parse_enum(ComputeMethod, method, 'compute_method')]
    given = {k: v for k, v in options.items() if v is not None}
    return kind(**given)
