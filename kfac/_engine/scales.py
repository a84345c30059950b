"""EKFAC's scaling phase of a step.

On a factor-update step, after that step's decompositions (so in the bases
in force from now on), every rank forms the batch scaling `S` of each EKFAC
layer from its own examples, the batches are averaged over all ranks
(bucketed like the factors), and every rank folds the average into the
layer's running `S`; the ranks that precondition a layer keep `1 / (S + λ)`
when asked to (`compute_eigenvalue_outer_product`). A basis refresh
restarts `S`. See [`kfac.layers.ekfac`][kfac.layers.ekfac].
"""

from __future__ import annotations

from collections.abc import Iterable
from collections.abc import Mapping

from kfac.assignment import WorkAssignment
from kfac.distributed import TorchDistributedCommunicator
from kfac.distributed._exchange import allreduce_scales
from kfac.layers.base import KFACBaseLayer
from kfac.layers.ekfac import KFACEKFACLayer
from kfac.tracing import Phase

__all__ = ['ScaleUpdates']


class ScaleUpdates:
    """The scaling `S` of the EKFAC layers, one factor update at a time.

    Args:
        layers: the registered layers (those that are not EKFAC's are
            ignored).
        assignment: who preconditions each layer.
        communicator: the collectives.
        bucketed: allreduce in buckets.
        phase: times a phase of the step.
    """

    def __init__(
        self,
        layers: Mapping[str, KFACBaseLayer],
        assignment: WorkAssignment,
        communicator: TorchDistributedCommunicator,
        bucketed: bool,
        phase: Phase,
    ) -> None:
        self.layers = {
            name: layer
            for name, layer in layers.items()
            if isinstance(layer, KFACEKFACLayer)
        }
        self.assignment = assignment
        self.communicator = communicator
        self.bucketed = bucketed
        self.phase = phase

    def restart(self, names: Iterable[str]) -> None:
        """Restart `S` of the EKFAC layers among `names` (decomposed now)."""
        for name in names:
            layer = self.layers.get(name)
            if layer is not None:
                layer.restart_scale()

    def update(self, decay: float, damping: float) -> None:
        """Estimate, average and fold in `S` of every EKFAC layer whose
        factors were updated in this step. Every rank calls it on each
        factor-update step, after the step's decompositions.
        """
        if not self.layers:
            return
        with self.phase('scale_estimate'):
            batches = {
                name: batch
                for name, layer in self.layers.items()
                if (batch := layer.scale_batch()) is not None
            }
        with self.phase('scale_allreduce'):
            averaged = allreduce_scales(
                self.communicator, batches, bucketed=self.bucketed
            )
        with self.phase('scale_update'):
            for name, batch in averaged.items():
                self.layers[name].update_scale(
                    batch,
                    decay,
                    damping,
                    precompute=self.assignment.is_grad_worker(name),
                )
