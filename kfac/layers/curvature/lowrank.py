"""Options EIGEN and INVERSE share: factors kept at low rank, and the
damping's scale.

A dense factor longer than `factor_rank` `k` keeps its `k` largest
eigenpairs and the mean of the rest of its spectrum (the math is in
[`kfac.math.lowrank`][kfac.math.lowrank]); `damping_mode='relative'`
multiplies `λ` by the layer's mean eigenvalue of `A ⊗ G`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from kfac.layers.curvature.base import Layout
from kfac.math.lowrank import relative_damping
from kfac.validation import validate_int

if TYPE_CHECKING:  # the layer holds its curvature and the curvature its layer
    from kfac.layers.base import KFACBaseLayer

__all__ = [
    'LowRank',
    'check_factor_rank',
    'effective_damping',
]


def check_factor_rank(rank: object) -> int | None:
    """`rank` if it is None or an int of at least 1.

    Raises:
        TypeError, ValueError: anything else.
    """
    return None if rank is None else validate_int('factor_rank', rank)


def effective_damping(
    damping: float,
    mode: str,
    means: Callable[[], tuple[torch.Tensor, torch.Tensor]],
) -> float | torch.Tensor:
    """The damping applied: `λ` (`mode='absolute'`), or `λ m(A) m(G)` from
    the factors' mean eigenvalues `means()` (`'relative'`; see
    [`relative_damping`][kfac.math.lowrank.relative_damping]).
    """
    if mode == 'absolute':
        return damping
    return relative_damping(damping, *means())


class LowRank:
    """Which of a layer's factors are kept at rank `k` (`factor_rank`).

    False (as a bool) when no factor is: `factor_rank` None, or every
    factor no longer than it.

    Args:
        layer: the layer.
        rank: `factor_rank`.

    A diagonal factor (an embedding's `A`) is kept whole: it is exact at
    `O(n)` already, and its eigenvectors are the identity.
    """

    def __init__(self, layer: KFACBaseLayer, rank: int | None) -> None:
        self._dims = {
            name: layer.factor(name).dim
            for name in ('A', 'G')
            if not layer.factor(name).diagonal
        }
        self.k = rank

    def __bool__(self) -> bool:
        k = self.k
        return k is not None and any(n > k for n in self._dims.values())

    def dims(self) -> dict[str, int]:
        """The sides of the dense factors, by name."""
        return self._dims

    def rank(self, name: str) -> int | None:
        """`k` if factor `name` is kept at rank `k`, else None (whole)."""
        k = self.k
        if k is None or self._dims.get(name, 0) <= k:
            return None
        return k

    def layout(self, name: str) -> Layout | None:
        """`Q_k` `(n, k)` and `(d_1, …, d_k, c)` of a low-rank factor, or
        None (whole).
        """
        k = self.rank(name)
        if k is None:
            return None
        return (((self._dims[name], k), False), ((k + 1,), False))
