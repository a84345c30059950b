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
from typing import NamedTuple

import torch

from kfac._engine.distributor import GradientDistributor
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
from kfac.math import relative_clip_scale
from kfac.tracing import Phase

__all__ = [
    'Clip',
    'ClipMonitor',
    'FactorUpdates',
    'Faults',
    'decompose',
    'precondition',
]


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


class Clip(NamedTuple):
    """What the clip of one step did."""

    scale: float
    """`ν`, the factor every preconditioned gradient was multiplied by
    (1.0 without a clip)."""
    ratio: float
    """`‖ν V'‖ / ‖V‖` over all preconditioned layers."""
    kl_scale: float | None = None
    """`ν_KL`, the KL clip's own bound (None without `kl_clip`)."""


class ClipMonitor:
    """The last step's [`Clip`][kfac._engine.phases.Clip], and a warning
    when K-FAC holds training back, each logged once: the KL clip's `ν_KL`
    below 0.1 on each of 100 consecutive steps (the learning rate then
    hardly changes the step); the norm ratio below 0.01 on each of 100
    consecutive steps.

    A small `ν` from `relative_clip` alone only means that the step is held
    at `ρ` times the raw gradient's length, which the learning rate still
    scales.

    Args:
        faults: where warnings go.
    """

    WINDOW = 100
    LOW_SCALE = 0.1
    LOW_RATIO = 0.01

    def __init__(self, faults: Faults) -> None:
        self.faults = faults
        self.last: Clip | None = None
        self._low_scale = self._low_ratio = 0

    def metrics(self) -> dict[str, float | None]:
        """`kl_clip_scale` and `grad_norm_ratio` of the last step."""
        last = self.last
        return {
            'kl_clip_scale': None if last is None else last.scale,
            'grad_norm_ratio': None if last is None else last.ratio,
        }

    def record(self, clip: Clip) -> None:
        """Keep `clip`; warn once when a run of low values is long."""
        self.last = clip
        kl = clip.kl_scale
        low_scale = kl is not None and kl < self.LOW_SCALE
        low_ratio = clip.ratio < self.LOW_RATIO
        self._low_scale = self._low_scale + 1 if low_scale else 0
        self._low_ratio = self._low_ratio + 1 if low_ratio else 0
        if self._low_scale >= self.WINDOW:
            self.faults.once(
                'clip-scale',
                '',
                'K-FAC: the KL clip scaled the preconditioned gradients by '
                'less than %g on each of the last %d steps (kl_clip_scale '
                '%.3g), so the learning rate hardly changes the step; raise '
                'kl_clip, or clip with relative_clip instead (kl_clip=None)',
                self.LOW_SCALE,
                self.WINDOW,
                kl,
            )
        if self._low_ratio >= self.WINDOW:
            self.faults.once(
                'norm-ratio',
                '',
                'K-FAC: the gradients handed to the optimizer were less '
                'than %g times as long as the raw gradients on each of the '
                'last %d steps (grad_norm_ratio %.3g); lower damping, or '
                'raise kl_clip if kl_clip_scale is small too',
                self.LOW_RATIO,
                self.WINDOW,
                clip.ratio,
            )


def precondition(
    distributor: GradientDistributor,
    active: list[str],
    values: HyperparameterValues,
    step: int,
    *,
    phase: Phase,
    log_once: Callable[..., None],
    monitor: ClipMonitor,
) -> None:
    """The preconditioning phase of a step: precondition the `active`
    layers on their gradient workers, clip, write `.grad`,
    holding and moving gradients as `distributor` says; `monitor` records the
    clip.

    A layer whose preconditioned gradient is not finite keeps its
    original gradient (counted, logged once); one host read. Every rank
    calls it with the same `active` layers.
    """
    layers = distributor.layers
    for part, grads in distributor.precondition(active):
        with phase('precondition'):
            for name in part:
                if distributor.assignment.is_grad_worker(name):
                    _precondition(name, layers[name], values, grads, log_once)
    with phase('kl_clip'):
        names, stats = distributor.statistics()
        flags, scale, clip = _clip(names, stats, values)
    if clip is not None:
        monitor.record(clip)
    ok = dict(zip(names, flags))
    for part, grads in distributor.write_back():
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
    names: list[str],
    stats: torch.Tensor | None,
    values: HyperparameterValues,
) -> tuple[list[bool], torch.Tensor | None, Clip | None]:
    """Per layer, whether its statistics are finite; the clip's scale
    `ν = min(ν_KL, ν_rel)` (None without a clip; see
    [`kfac.math`][kfac.math]); the step's
    [`Clip`][kfac._engine.phases.Clip]. One host read.
    """
    if stats is None:
        return [], None, None
    finite = torch.isfinite(stats).all(dim=1)
    kept = torch.where(finite[:, None], stats, torch.zeros_like(stats))
    vg, pre_sq, raw_sq = (column.contiguous() for column in kept.unbind(1))
    scale = kl = None
    if values.relative_clip is not None:
        scale = relative_clip_scale(
            raw_sq.sum(), pre_sq.sum(), values.relative_clip
        )
    if values.kl_clip is not None:
        if values.lrs is None:
            kl = kl_clip_scale(vg.sum(), values.lr, values.kl_clip)
        else:
            lrs = torch.tensor(
                [values.lrs[n] for n in names], dtype=vg.dtype
            ).to(vg.device)
            kl = kl_clip_scale((vg * lrs * lrs).sum(), 1.0, values.kl_clip)
        scale = kl if scale is None else torch.minimum(scale, kl)
    nu = torch.ones_like(vg[0]) if scale is None else scale
    ratio = nu * torch.sqrt(pre_sq.sum() / raw_sq.sum())
    tail = [nu[None], ratio[None]] + ([] if kl is None else [kl[None]])
    read = torch.cat([finite.to(vg.dtype), *tail]).tolist()
    count = len(names)
    flags = [bool(f) for f in read[:count]]
    kl_scale = None if kl is None else read[count + 2]
    return flags, scale, Clip(read[count], read[count + 1], kl_scale)
