"""The gradient's-own-factors phase of a factor-update step.

A layer whose curvature sets
[`gradient_factors`][kfac.layers.curvature.base.Curvature.gradient_factors]
forms its factors from the averaged gradient, `G = E[V Vᵀ]` and
`A = E[Vᵀ V]` (see
[`kfac.layers.curvature.source`][kfac.layers.curvature.source]): every
rank holds the same `V` after the data-parallel reduction, so every rank
forms the same factors, and neither hooks nor an allreduce are needed. The
engine registers no hooks for these layers and leaves them out of the
factor allreduce; on each factor-update step, after the other layers'
factors, this phase folds each one's `V` into its running factors.
"""

from __future__ import annotations

from collections.abc import Mapping

from kfac.layers.base import KFACBaseLayer
from kfac.tracing import Phase

__all__ = ['GradientFactors', 'split_by_source']


def split_by_source(
    layers: Mapping[str, KFACBaseLayer],
) -> tuple[dict[str, KFACBaseLayer], dict[str, KFACBaseLayer]]:
    """The layers whose factors come from hooks, and those whose factors
    are the gradient's own.
    """
    hooked = {
        n: x for n, x in layers.items() if not x.curvature.gradient_factors
    }
    own = {n: x for n, x in layers.items() if x.curvature.gradient_factors}
    return hooked, own


class GradientFactors:
    """The running factors of the layers whose factors are the gradient's
    own.

    Args:
        layers: those layers (see `split_by_source`).
        phase: times a phase of the step.
    """

    def __init__(
        self, layers: Mapping[str, KFACBaseLayer], phase: Phase
    ) -> None:
        self.layers = dict(layers)
        self.phase = phase

    def update(self, decay: float) -> None:
        """Fold each layer's current gradient into its factors (a layer
        without a gradient this step is left as it is). Every rank calls
        it on each factor-update step, with the gradients reduced.
        """
        with self.phase('gradient_factors'):
            for layer in self.layers.values():
                grad = layer.helper.get_grad()
                if grad is not None:
                    layer.curvature.update_gradient_factors(grad, decay)

    def follow_modules(self) -> None:
        """Let every layer follow its module to a new device or dtype."""
        for layer in self.layers.values():
            layer.follow_module()
