"""The factor-update phase of a step: running averages and their allreduce.

[`FactorUpdates`][kfac._engine.factors.FactorUpdates] folds each layer's
captured statistics into its running averages as soon as its capture is
complete (in the backward hook, to overlap the allreduce with the backward
pass), starts the allreduce, and at the step waits for it and checks that
every rank's statistics were finite.

Failures in a row. With a limit set, the health count of that allreduce
becomes a float64 vector that also names the layers whose statistics were
not finite and carries, from each factor's inverse worker, how many of its
decompositions in a row failed in every attempt and the trace of the last
such matrix (zeros elsewhere), so every rank learns them at the next
factor update without a collective or host read of its own; every rank
then applies the same limits (`max_nonfinite_statistics`,
`max_decomposition_failures`) and raises the same
[`FailureLimitError`][kfac.tracing.FailureLimitError].
"""

from __future__ import annotations

from collections.abc import Mapping

from kfac.assignment import WorkAssignment
from kfac.distributed import TorchDistributedCommunicator
from kfac.distributed import get_rank
from kfac.distributed._exchange import FactorReduction
from kfac.distributed._exchange import Health
from kfac.enums import FACTOR_NAMES
from kfac.layers.base import KFACBaseLayer
from kfac.tracing import FailureLimitError
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
        assignment: who decomposes each factor.
        compiled: running averages with compiled arithmetic.
        max_nonfinite_statistics: factor updates discarded in a row
            tolerated (None: no limit).
        max_decomposition_failures: failed decompositions of a factor in
            a row tolerated (None: no limit).
    """

    def __init__(
        self,
        layers: Mapping[str, KFACBaseLayer],
        communicator: TorchDistributedCommunicator,
        *,
        bucketed: bool,
        phase: Phase,
        faults: Faults,
        assignment: WorkAssignment,
        compiled: bool = False,
        max_nonfinite_statistics: int | None = None,
        max_decomposition_failures: int | None = None,
    ) -> None:
        self.layers = layers
        self.assignment = assignment
        self.compiled = compiled
        self.max_nonfinite_statistics = max_nonfinite_statistics
        self.max_decomposition_failures = max_decomposition_failures
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
            health = self._reduction.finish(
                self._failures() if self._limited else None
            )
        self._finished.clear()
        if health.reduced:
            self._check_statistics(health, step)
        if health.reduced and self._limited:
            self._check_decompositions(health.shared)

    @property
    def _limited(self) -> bool:
        """Whether a limit is set (the failures then travel with the
        health count; without one, it stays the one float of before).
        """
        return (
            self.max_nonfinite_statistics is not None
            or self.max_decomposition_failures is not None
        )

    def _check_statistics(self, health: Health, step: int) -> None:
        """Count a discarded update; raise past the limit."""
        counters = self.faults.counters
        if health.bad_count:
            counters['nonfinite_statistics_steps'] += 1
            self.faults.logger.warning(
                'K-FAC: step %d produced non-finite factor statistics (%d '
                "factor updates on all ranks); this step's statistics were "
                'discarded (%d such steps so far)',
                step,
                health.bad_count,
                counters['nonfinite_statistics_steps'],
            )
        run = self.faults.streak(
            'nonfinite_statistics_in_a_row', bool(health.bad_count)
        )
        limit = self.max_nonfinite_statistics
        if limit is not None and run > limit:
            names = tuple(n for n in self.layers if n in health.nonfinite)
            raise FailureLimitError(
                f'K-FAC: the factor statistics were not finite on {run} '
                f'factor updates in a row, more than '
                f'max_nonfinite_statistics={limit} tolerates (each was '
                f'discarded); in step {step}, those of layers '
                f'{", ".join(names)}',
                names,
                run,
            )

    def _failures(self) -> list[float]:
        """Per layer and factor, `[failures in a row, trace]` where this
        rank is its inverse worker, zeros elsewhere.
        """
        rank = get_rank()
        values: list[float] = []
        for name, layer in self.layers.items():
            for f in FACTOR_NAMES:
                count = 0
                if self.assignment.inv_worker(name, f) == rank:
                    count = layer.failures_in_a_row[f]
                trace = layer.failed_traces.get(f, 0.0) if count else 0.0
                values += [float(count), trace]
        return values

    def _check_decompositions(self, shared: tuple[float, ...]) -> None:
        """Store every rank's failures in a row (`shared` summed, laid out
        as `_failures`); raise past the limit.
        """
        over = []
        limit = self.max_decomposition_failures
        pairs = iter(zip(shared[::2], shared[1::2]))
        for name, layer in self.layers.items():
            for f in FACTOR_NAMES:
                count, trace = next(pairs)
                layer.failures_in_a_row[f] = int(count)
                if count:
                    layer.failed_traces[f] = trace
                else:
                    del layer.failures_in_a_row[f]
                if limit is not None and count > limit:
                    over.append((name, f, trace, int(count)))
        if over:
            described = '; '.join(
                f'layer {name}, factor {f} (trace {trace:.6g}): {count}'
                for name, f, trace, count in over
            )
            raise FailureLimitError(
                'K-FAC: decomposing a factor failed in every attempt '
                '(float64, jitter) more times in a row than '
                f'max_decomposition_failures={limit} tolerates: '
                f'{described}',
                tuple(dict.fromkeys(name for name, *_ in over)),
                max(count for *_, count in over),
            )
