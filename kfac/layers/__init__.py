"""Per-layer K-FAC: module helpers, statistics, curvatures, registration.

`import kfac.layers` imports its submodules (`attention`, `base`, `blocks`,
`conv`, `curvature`, `eigen`, `embedding`, `examples`, `factory`,
`helper`, `inverse`, `modules`, `options`, `register`, `sampling`,
`statistics`, `tied`, `utils`).
"""

from __future__ import annotations

from kfac.layers import attention
from kfac.layers import base
from kfac.layers import blocks
from kfac.layers import conv
from kfac.layers import curvature
from kfac.layers import eigen
from kfac.layers import embedding
from kfac.layers import examples
from kfac.layers import factory
from kfac.layers import helper
from kfac.layers import inverse
from kfac.layers import modules
from kfac.layers import options
from kfac.layers import register
from kfac.layers import sampling
from kfac.layers import statistics
from kfac.layers import tied
from kfac.layers import utils
from kfac.layers.base import KFACBaseLayer
from kfac.layers.eigen import KFACEigenLayer
from kfac.layers.inverse import KFACInverseLayer

__all__ = [
    'KFACBaseLayer',
    'KFACEigenLayer',
    'KFACInverseLayer',
    'attention',
    'base',
    'blocks',
    'conv',
    'curvature',
    'eigen',
    'embedding',
    'examples',
    'factory',
    'helper',
    'inverse',
    'modules',
    'options',
    'register',
    'sampling',
    'statistics',
    'tied',
    'utils',
]
