"""Deprecated collective methods of the layers, kept for one release.

The collectives of a step moved to [`kfac.exchange`][kfac.exchange]
(layers expose tensors; the communication side moves them). These methods
warn and forward there.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING
from typing import Any
from typing import cast

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from kfac.layers.base import KFACBaseLayer
    from kfac.layers.factor import KroneckerFactor


def _deprecated(old: str, new: str) -> None:
    warnings.warn(
        f'KFACBaseLayer.{old} is deprecated and will be removed in the next '
        f'release; use kfac.exchange.{new}',
        DeprecationWarning,
        stacklevel=3,
    )


def _layer(obj: object) -> KFACBaseLayer:
    return cast('KFACBaseLayer', obj)  # the mixin of KFACBaseLayer alone


class DeprecatedCollectives:
    """The collective methods `KFACBaseLayer` had before 0.2."""

    def reduce_factors(
        self,
        comm: Any,
        group: ProcessGroup | None,
        *,
        bucketed: bool,
    ) -> Iterator[tuple[KroneckerFactor, Any]]:
        """Deprecated: use
        [`start_factor_allreduce`][kfac.exchange.start_factor_allreduce].
        """
        from kfac import exchange  # exchange imports layers

        _deprecated('reduce_factors', 'start_factor_allreduce')
        handles = exchange.start_factor_allreduce(
            comm, _layer(self), group=group, bucketed=bucketed
        )
        return zip(_layer(self).factors, handles)

    def broadcast_decomposition(
        self,
        name: str,
        comm: Any,
        *,
        src: int,
        group: ProcessGroup | None,
    ) -> list[Any]:
        """Deprecated: use
        [`start_decomposition_broadcast`][kfac.exchange.start_decomposition_broadcast].
        """
        from kfac import exchange  # exchange imports layers

        _deprecated('broadcast_decomposition', 'start_decomposition_broadcast')
        return exchange.start_decomposition_broadcast(
            comm, _layer(self), name, src=src, group=group
        )

    def broadcast_grad(
        self,
        comm: Any,
        *,
        src: int,
        group: ProcessGroup | None,
    ) -> Any:
        """Deprecated: use
        [`start_grad_broadcast`][kfac.exchange.start_grad_broadcast].
        """
        from kfac import exchange  # exchange imports layers

        _deprecated('broadcast_grad', 'start_grad_broadcast')
        return exchange.start_grad_broadcast(
            comm, _layer(self), src=src, group=group
        )
