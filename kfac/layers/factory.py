"""Building the layer of one registered module from its options.

The method (`compute_method`) picks the layer class; a module whose
`factor_rank` leaves a dense factor longer than it gets the low-rank
form of that method ([`kfac.layers.lowrank`][kfac.layers.lowrank]).
"""

from __future__ import annotations

from typing import Any

from kfac.enums import ComputeMethod
from kfac.layers.base import KFACBaseLayer
from kfac.layers.eigen import KFACEigenLayer
from kfac.layers.ekfac import KFACEKFACLayer
from kfac.layers.helper import ModuleHelper
from kfac.layers.inverse import KFACInverseLayer
from kfac.layers.lowrank import KFACLowRankEigenLayer
from kfac.layers.lowrank import KFACLowRankInverseLayer
from kfac.layers.options import ModuleOptions
from kfac.layers.tied import KFACTiedEigenLayer
from kfac.layers.tied import KFACTiedEKFACLayer
from kfac.layers.tied import KFACTiedInverseLayer
from kfac.layers.tied import TiedHelper

_EIGENBASES = {
    ComputeMethod.EIGEN: (KFACEigenLayer, KFACTiedEigenLayer),
    ComputeMethod.EKFAC: (KFACEKFACLayer, KFACTiedEKFACLayer),
}


def _low_rank(name: str, helper: ModuleHelper, rank: int) -> bool:
    """Whether `factor_rank=rank` shortens a dense factor of `helper`."""
    dims = [helper.g_factor_shape[0]]
    if not helper.a_diagonal:
        dims.append(helper.a_factor_shape[0])
    if max(dims) <= rank:
        return False
    if isinstance(helper, TiedHelper) or helper.a_diagonal:
        raise ValueError(
            f'factor_rank={rank} for {name!r}: the low-rank form applies to '
            'layers with two dense factors, not to an embedding or a tied '
            'weight (set factor_rank=None for it with module_options)',
        )
    return True


def make_layer(
    name: str,
    helper: ModuleHelper,
    options: ModuleOptions,
    *,
    method: ComputeMethod,
    prediv_eigenvalues: bool,
    basis_refresh: str,
    **kwargs: Any,
) -> KFACBaseLayer:
    """The layer preconditioning module `name`.

    Args:
        name: the module's (or tile's) name, for messages.
        helper: its helper.
        options: its resolved per-module options.
        method: `compute_method`.
        prediv_eigenvalues: `compute_eigenvalue_outer_product` (EIGEN,
            EKFAC).
        basis_refresh: EIGEN's and EKFAC's basis refresh.
        **kwargs: `factor_dtype`, `inv_dtype`, `loss_average`,
            `damping_mode` (see
            [`KFACBaseLayer`][kfac.layers.base.KFACBaseLayer]).

    Raises:
        ValueError: a `factor_rank` for an EKFAC layer, an embedding or a
            tied weight.
    """
    tied = isinstance(helper, TiedHelper)
    rank = options.factor_rank
    if rank is not None and method is ComputeMethod.EKFAC:
        raise ValueError(
            f'factor_rank={rank} for {name!r}: EKFAC re-estimates its scaling '
            "in the full eigenbasis; use compute_method='eigen' or "
            "'inverse' with factor_rank, or leave factor_rank=None",
        )
    if rank is not None and _low_rank(name, helper, rank):
        if method is ComputeMethod.INVERSE:
            return KFACLowRankInverseLayer(helper, rank=rank, **kwargs)
        kwargs.update(basis_refresh=basis_refresh)
        return KFACLowRankEigenLayer(helper, rank=rank, **kwargs)
    if method is ComputeMethod.INVERSE:
        return (KFACTiedInverseLayer if tied else KFACInverseLayer)(
            helper, **kwargs
        )
    kwargs.update(
        prediv_eigenvalues=prediv_eigenvalues, basis_refresh=basis_refresh
    )
    return _EIGENBASES[method][tied](helper, **kwargs)
