"""The curvature-statistics phase of a step.

Some curvatures keep statistics of their own that every rank estimates
from its own examples (EKFAC's scaling `S`; see
[`Curvature.batch_statistics`][kfac.layers.curvature.base.Curvature.batch_statistics]).
On a factor-update step, after that step's decompositions (so in the bases
in force from now on), every rank forms its batch statistics, the batches
are averaged over all ranks (bucketed like the factors), and every rank
folds the average into its layers' curvatures. Every curvature is told
of a decomposition refresh (`restart`): EKFAC restarts its statistics,
EIGEN_ADAM carries its second moments into the new bases.
"""

from __future__ import annotations

from collections.abc import Iterable
from collections.abc import Mapping

import torch

from kfac.assignment import WorkAssignment
from kfac.distributed import TorchDistributedCommunicator
from kfac.distributed._exchange import allreduce_statistics
from kfac.layers.base import KFACBaseLayer
from kfac.layers.curvature.base import Curvature
from kfac.tracing import Phase

__all__ = ['CurvatureUpdates']


class CurvatureUpdates:
    """The curvatures' own statistics, one factor update at a time.

    Args:
        layers: the registered layers (those whose curvature reduces no
            statistics are only told of refreshes).
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
        self.refreshed = {
            name: layer
            for name, layer in layers.items()
            if type(layer.curvature).restart is not Curvature.restart
        }
        """The layers whose curvature does something on a refresh
        (`restart`): every other one keeps the default, which does
        nothing."""
        self.layers = {
            name: layer
            for name, layer in layers.items()
            if layer.curvature.reduces_statistics
        }
        self.assignment = assignment
        self.communicator = communicator
        self.bucketed = bucketed
        self.phase = phase

    def restart(self, names: Iterable[str]) -> None:
        """Tell the curvatures of `names` (decomposed now) of the refresh
        (EKFAC restarts `S`, EIGEN_ADAM carries its second moments into
        the new bases). Every rank calls it after the step's
        decompositions.
        """
        for name in names:
            if name in self.refreshed:
                self.refreshed[name].curvature.restart()

    def update(self, decay: float, damping: float) -> None:
        """Estimate, average and fold in the batch statistics of every
        curvature that has some for this step. Every rank calls it on each
        factor-update step, after the step's decompositions.
        """
        if not self.layers:
            return
        with self.phase('scale_estimate'):
            batches = {
                f'{name}/{key}': (name, key, tensor)
                for name, layer in self.layers.items()
                for key, tensor in layer.curvature.batch_statistics().items()
            }
        with self.phase('scale_allreduce'):
            averaged = allreduce_statistics(
                self.communicator,
                {k: tensor for k, (_, _, tensor) in batches.items()},
                bucketed=self.bucketed,
            )
        with self.phase('scale_update'):
            per_layer: dict[str, dict[str, torch.Tensor]] = {}
            for k, (name, key, _) in batches.items():
                per_layer.setdefault(name, {})[key] = averaged[k]
            for name, statistics in per_layer.items():
                self.layers[name].curvature.update_statistics(
                    statistics,
                    decay,
                    damping,
                    preconditions=self.assignment.is_grad_worker(name),
                )
