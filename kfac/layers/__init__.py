"""Per-layer K-FAC: module helpers, registration and the two methods.

`import kfac.layers` imports its submodules (`attention`, `base`, `compat`,
`conv`,
`decomposition`, `eigen`, `embedding`, `factor`, `inverse`, `modules`,
`options`, `register`, `statistics`).
"""

from __future__ import annotations

from kfac.layers import attention
from kfac.layers import base
from kfac.layers import compat
from kfac.layers import conv
from kfac.layers import decomposition
from kfac.layers import eigen
from kfac.layers import embedding
from kfac.layers import factor
from kfac.layers import inverse
from kfac.layers import modules
from kfac.layers import options
from kfac.layers import register
from kfac.layers import statistics
from kfac.layers.base import KFACBaseLayer
from kfac.layers.eigen import KFACEigenLayer
from kfac.layers.inverse import KFACInverseLayer

__all__ = [
    'KFACBaseLayer',
    'KFACEigenLayer',
    'KFACInverseLayer',
    'attention',
    'base',
    'compat',
    'conv',
    'decomposition',
    'eigen',
    'embedding',
    'factor',
    'inverse',
    'modules',
    'options',
    'register',
    'statistics',
]
