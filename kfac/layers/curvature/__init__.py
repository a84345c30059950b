"""Curvatures: what a layer's method does with its factors.

The interface is [`kfac.layers.curvature.base`][kfac.layers.curvature.base];
the library's methods are EIGEN
([`EigenConfig`][kfac.layers.curvature.eigen.EigenConfig]), INVERSE
([`InverseConfig`][kfac.layers.curvature.inverse.InverseConfig]) and EKFAC
([`EKFACConfig`][kfac.layers.curvature.ekfac.EKFACConfig]).
"""

from __future__ import annotations

from kfac.layers.curvature.base import Curvature
from kfac.layers.curvature.base import CurvatureConfig
from kfac.layers.curvature.base import Decomposed
from kfac.layers.curvature.base import Layout
from kfac.layers.curvature.eigen import EigenConfig
from kfac.layers.curvature.eigen import EigenCurvature
from kfac.layers.curvature.ekfac import EKFACConfig
from kfac.layers.curvature.ekfac import EKFACCurvature
from kfac.layers.curvature.inverse import InverseConfig
from kfac.layers.curvature.inverse import InverseCurvature

__all__ = [
    'Curvature',
    'CurvatureConfig',
    'Decomposed',
    'EKFACConfig',
    'EKFACCurvature',
    'EigenConfig',
    'EigenCurvature',
    'InverseConfig',
    'InverseCurvature',
    'Layout',
]
