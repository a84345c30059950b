"""Per-layer K-FAC: module helpers, registration and the two methods."""

from __future__ import annotations

from kfac.layers.base import KFACBaseLayer
from kfac.layers.eigen import KFACEigenLayer
from kfac.layers.inverse import KFACInverseLayer

__all__ = ['KFACBaseLayer', 'KFACEigenLayer', 'KFACInverseLayer']
