"""Where a method's factors come from: K-FAC's, or the gradient's own.

With `source='kfac'` the factors are K-FAC's `A` and `G`, formed from the
layer's inputs and output gradients captured by hooks (sampled positions
and every statistics option apply) and allreduced over the data-parallel
ranks. With `source='gradient'` they are the gradient's own, Shampoo's and
SOAP's `G = E[V Vᵀ]` (`(out, out)`) and `A = E[Vᵀ V]` (`(in[+1], in[+1])`),
formed with
[`Curvature.update_gradient_factors`][kfac.layers.curvature.base.Curvature.update_gradient_factors]
from the averaged gradient `V` after the data-parallel reduction, so every
rank forms the same factors: no hooks, no factor allreduce, `out² in +
in² out` per layer instead of `tokens (in² + out²)`. The running average
and its `factor_decay` are the same; the statistics options (positions,
`kfac_approx`, `loss_average`, the Fisher) do not apply.

The gradient's own factors need the whole gradient on every rank, so they
are not available for a model sharded with FSDP2 (a `ValueError` when the
preconditioner is built), nor for a diagonal factor (an embedding, whose
`Vᵀ V` would be dense over the vocabulary) or a weight tied in two roles.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kfac.enums import FactorSource

if TYPE_CHECKING:  # the layer holds its curvature and the curvature its layer
    from kfac.layers.base import KFACBaseLayer

__all__ = ['check_source']


def check_source(
    layer: KFACBaseLayer, source: FactorSource, method: str
) -> bool:
    """Whether `layer`'s factors are the gradient's own under `source`.

    Raises:
        ValueError: `source='gradient'` for a layer with a diagonal factor
            or factors per use (the message names the module and
            `method`).
    """
    if source is FactorSource.KFAC:
        return False
    names = tuple(f.name for f in layer.factors)
    if names != ('A', 'G') or any(f.diagonal for f in layer.factors):
        raise ValueError(
            f"{method}: source='gradient' needs one dense pair of factors, "
            f'but {layer.helper.module!r} has factors {names} (diagonal: '
            f'{[f.name for f in layer.factors if f.diagonal]}); use '
            "source='kfac' for it (module_options)",
        )
    return True
