"""The factor-update and decomposition phases of a step.

`FactorUpdates` folds each layer's
captured statistics into its running averages as soon as its capture is
complete (in the backward hook, to overlap the allreduce with the
backward pass), starts the allreduce, and at the step waits for it and
checks that every rank's statistics were finite;
`decompose` decomposes the factors each
rank is the inverse worker of and broadcasts them where the assignment
says.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from collections.abc import Iterable
from collections.abc import Mapping

import torch

from kfac._engine.grad_placement import GradientPlacement
from kfac.assignment import WorkAssignment
from kfac.distributed import TorchDistributedCommunicator
from kfac.distributed import get_rank
from kfac.distributed._exchange import FactorReduction
from kfac.distributed._exchange import broadcast_decompositions
from kfac.enums import FACTOR_NAMES
from kfac.hyperparams import HyperparameterValues
from kfac.layers.base import KFACBaseLayer
from kfac.layers.decomposition import decompose_all
from kfac.layers.helper import Grads
from kfac.math import kl_clip_scale
from kfac.tracing import Phase

__all__ = ['FactorUpdates', 'Faults', 'decompose', 'precondition']


class Faults:
    """Fault counters of the whole preconditioner, and warnings logged
    once per `(kind, layer)`.

    Args:
        logger: where the warnings go.
    """

    def __init__(self, logger: logging.Logger) -> None:
        self.logger = logger
        self.counters: Counter[str] = Counter()
        self._logged: set[tuple[str, str]] = set()

    def once(self, key: str, name: str, msg: str, *args: object) -> None:
        """Log `msg % args` unless `(key, name)` was logged before."""
        if (key, name) not in self._logged:
            self._logged.add((key, name))
            self.logger.warning(msg, *args)


class FactorUpdates:
    """Running averages and their allreduce, one factor update at a time.

    Args:
        layers: the registered layers.
        communicator: the collectives.
        bucketed: allreduce factors in buckets.
        phase: times a phase of the step.
        faults: the preconditioner's fault counters and warnings.
    """

    def __init__(
        self,
        layers: Mapping[str, KFACBaseLayer],
        communicator: TorchDistributedCommunicator,
        *,
        bucketed: bool,
        phase: Phase,
        faults: Faults,
    ) -> None:
        self.layers = layers
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
            finite = layer.update_factors(decay)
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


def decompose(
    layers: Mapping[str, KFACBaseLayer],
    names: Iterable[str],
    plan: WorkAssignment,
    communicator: TorchDistributedCommunicator,
    damping: float,
    *,
    phase: Phase,
    log_once: Callable[..., None],
) -> list[str]:
    """Decompose the factors of `names` this rank is the inverse worker
    of, then broadcast them to the gradient workers where the plan says.

    Every rank calls it with the same `names`.

    Returns:
        The layers of `names` that have factors (those decomposed).
    """
    rank = get_rank()
    ready = [name for name in names if layers[name].has_factors]
    jobs = [
        (name, f)
        for name in ready
        for f in FACTOR_NAMES
        if plan.inv_worker(name, f) == rank
    ]
    with phase('decomposition'):
        failed = decompose_all([(layers[n], f) for n, f in jobs], damping)
    for index in failed:
        name = jobs[index][0]
        log_once(
            'decomposition',
            name,
            'K-FAC: decomposing a factor of %s failed in every attempt '
            '(float64, jitter); the last good decomposition is kept, and '
            'without one the gradient goes unpreconditioned (counters: '
            '%s)',
            name,
            dict(layers[name].counters),
        )
    if plan.broadcast_inverses():
        with phase('decomposition_broadcast'):
            broadcast_decompositions(
                communicator, plan, {name: layers[name] for name in ready}
            )
    return ready


def precondition(
    place: GradientPlacement,
    active: list[str],
    values: HyperparameterValues,
    step: int,
    *,
    phase: Phase,
    log_once: Callable[..., None],
) -> None:
    """The preconditioning phase of a step: precondition the `active`
    layers on their gradient workers, KL-clip, write `.grad`, holding and
    moving gradients as `place` says.

    A layer whose preconditioned gradient is not finite keeps its
    original gradient (counted, logged once); one host read. Every rank
    calls it with the same `active` layers.
    """
    layers = place.layers
    for part, grads in place.precondition(active):
        with phase('precondition'):
            for name in part:
                if place.assignment.is_grad_worker(name):
                    _precondition(name, layers[name], values, grads, log_once)
    with phase('kl_clip'):
        names, vg = place.products()
        flags, scale = _clip(vg, values)
    ok = dict(zip(names, flags))
    for part, grads in place.write_back():
        with phase('write_back'):
            for name in part:
                layer = layers[name]
                if ok[name]:
                    layer.write_grad(scale, grads)
                    continue
                layer.discard_grad()
                log_once(
                    'nonfinite-grad',
                    name,
                    'K-FAC: the preconditioned gradient of %s is not '
                    'finite in step %d; its original gradient is left in '
                    'place',
                    name,
                    step,
                )


def _precondition(
    name: str,
    layer: KFACBaseLayer,
    values: HyperparameterValues,
    grads: Grads | None,
    log_once: Callable[..., None],
) -> None:
    layer.precondition_grad(values.damping, grads)
    if not layer.has_decomposition:
        log_once(
            'unpreconditioned',
            name,
            'K-FAC: module %s has no valid decomposition; its raw '
            'gradient is used this step',
            name,
        )


def _clip(
    vg: torch.Tensor | None, values: HyperparameterValues
) -> tuple[list[bool], torch.Tensor | None]:
    """Per layer, whether its `Σ V' ⊙ V` is finite; the KL clip's scale
    (None without a clip). One host synchronisation.
    """
    if vg is None:
        return [], None
    finite = torch.isfinite(vg)
    scale = None
    if values.kl_clip is not None:
        total = torch.where(finite, vg, torch.zeros_like(vg)).sum()
        scale = kl_clip_scale(total, values.lr, values.kl_clip)
    return finite.tolist(), scale
