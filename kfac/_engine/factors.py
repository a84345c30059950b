"""The factor-update phase of a step: running averages and their allreduce.

[`FactorUpdates`][kfac._engine.factors.FactorUpdates] folds each layer's
captured statistics into its running averages as soon as its capture is
complete (in the backward hook, to overlap the allreduce with the backward
pass), starts the allreduce, and at the step waits for it and checks that
every rank's statistics were finite.
"""

from __future__ import annotations

from collections.abc import Mapping

from kfac.distributed import TorchDistributedCommunicator
from kfac.distributed._exchange import FactorReduction
from kfac.layers.base import KFACBaseLayer
from kfac.tracing import Faults
from kfac.tracing import Phase

__all__ = ['FactorUpdates']


class FactorUpdates:
    """Running averages and their allreduce, one factor update at a time.

    Args:
        layers: the registered layers.
        communicator: the collectives.
        bucketed: allreduce factors in buckets.
        phase: times a phase of the step.
        faults: the preconditioner's fault counters and warnings.
        compiled: running averages with compiled arithmetic.
    """

    def __init__(
        self,
        layers: Mapping[str, KFACBaseLayer],
        communicator: TorchDistributedCommunicator,
        *,
        bucketed: bool,
        phase: Phase,
        faults: Faults,
        compiled: bool = False,
    ) -> None:
        self.layers = layers
        self.compiled = compiled
        self.phase = phase
        self.faults = faults
        self._finished: set[str] = set()
        self._reduction = FactorReduction(communicator, bucketed=bucketed)

    def reset(self) -> None:
        """Forget which layers finished (statistics dropped)."""
        self._finished.clear()

    def finish(self, name: str, decay: float, step: int) -> None:
        """Running-average update of layer `name` (with decay `decay`);
        start its allreduce. Each layer at most once per factor update.
        """
        layer = self.layers[name]
        self._finished.add(name)
        with self.phase('running_average'):
            finite = layer.update_factors(decay, compiled=self.compiled)
        if finite is not None:
            with self.phase('factor_allreduce'):
                self._reduction.start(name, layer, finite)
        elif not layer.module.weight.requires_grad:
            self.faults.once(
                'frozen',
                name,
                'K-FAC: module %s was frozen after the preconditioner was '
                'built; its factors are not updated until it trains again',
                name,
            )
        else:
            self.faults.once(
                'no-data',
                name,
                'K-FAC: module %s did not run forward and backward in step '
                '%d; its factors were not updated and its gradient is left '
                'as it is until they exist',
                name,
                step,
            )

    def update(self, decay: float, step: int) -> None:
        """Finish every layer not finished yet, wait for the allreduce and
        count a step whose statistics were not finite on some rank. Every
        rank calls it on each factor-update step.
        """
        for name, layer in self.layers.items():
            if name not in self._finished:
                self.finish(name, decay, step)
            elif any(layer.captures):
                self.faults.once(
                    'reuse',
                    name,
                    'K-FAC: module %s got more backward passes than '
                    'accumulation_steps in one step; the extra passes are '
                    'ignored (set accumulation_steps to the number of '
                    'backward passes per step)',
                    name,
                )
                layer.reset_batch()
        with self.phase('factor_allreduce'):
            bad_count = self._reduction.finish()
        self._finished.clear()
        if bad_count:
            counters = self.faults.counters
            counters['nonfinite_statistics_steps'] += 1
            self.faults.logger.warning(
                'K-FAC: step %d produced non-finite factor statistics (%d '
                "factor updates on all ranks); this step's statistics were "
                'discarded (%d such steps so far)',
                step,
                bad_count,
                counters['nonfinite_statistics_steps'],
            )
