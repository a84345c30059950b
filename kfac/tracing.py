"""What a preconditioner reports: faults, the clip, metrics and timings.

* Faults: [`Faults`][kfac.tracing.Faults] counts them and logs each kind
  of warning once per layer; `fault_counts` gathers the layers' counters.
* The clip of each step: [`ClipMonitor`][kfac.tracing.ClipMonitor] keeps
  the last [`Clip`][kfac.tracing.Clip] and warns when K-FAC holds
  training back.
* Metrics to plot: factor traces, damping, K-FAC's share of the time
  (`plot_metrics`), and memory by kind (`memory_totals`).
* Wall-clock time of each phase of the step, for benchmarks: the
  [`PhaseTimer`][kfac.tracing.PhaseTimer], disabled by default (no cost).
  Enable with `preconditioner.timer = PhaseTimer()`; pass
  `sync=torch.cuda.synchronize` on GPUs so asynchronous kernels are
  charged to the phase that launched them.
* The original KAISA code's timing decorator, kept for scripts that use
  it: [`trace`][kfac.tracing.trace] records the seconds of each call of a
  function of yours in one table per process, read with
  [`get_trace`][kfac.tracing.get_trace], logged with
  [`log_trace`][kfac.tracing.log_trace] and emptied with
  [`clear_trace`][kfac.tracing.clear_trace]. K-FAC itself does not use it.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
import warnings
from collections import Counter
from collections.abc import Callable
from collections.abc import Iterable
from collections.abc import Iterator
from collections.abc import Mapping
from typing import Any
from typing import NamedTuple
from typing import Protocol
from typing import TypeVar

import torch

logger = logging.getLogger(__name__)

Phase = Callable[[str], contextlib.AbstractContextManager[None]]
"""Times one phase of the step: `with phase('decomposition'): ...`."""

PHASES = (
    'factor_capture',
    'running_average',
    'factor_allreduce',
    'gradient_factors',
    'decomposition',
    'decomposition_broadcast',
    'scale_estimate',
    'scale_allreduce',
    'scale_update',
    'grad_gather',
    'precondition',
    'grad_broadcast',
    'grad_scatter',
    'kl_clip',
    'kl_clip_allreduce',
    'write_back',
)
"""Phases of one step, in order (`gradient_factors` only with layers whose
factors are the gradient's own; `scale_*` only with EKFAC layers;
`grad_gather`, `grad_scatter` and `kl_clip_allreduce` only with sharded
parameters)."""


class PhaseTimer:
    """Accumulates seconds and counts per phase.

    Args:
        sync: called before and after each timed phase (e.g.
            `torch.cuda.synchronize`), or None.

    Raises:
        TypeError: `sync` is neither None nor callable.
    """

    def __init__(self, sync: Callable[[], None] | None = None) -> None:
        if sync is not None and not callable(sync):
            raise TypeError(f'sync must be None or callable; got {sync!r}')
        self.sync = sync
        self.seconds: dict[str, float] = {}
        self.counts: Counter[str] = Counter()
        self.started = time.perf_counter()

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time the enclosed block as phase `name`."""
        if self.sync is not None:
            self.sync()
        start = time.perf_counter()
        try:
            yield
        finally:
            if self.sync is not None:
                self.sync()
            elapsed = time.perf_counter() - start
            self.seconds[name] = self.seconds.get(name, 0.0) + elapsed
            self.counts[name] += 1

    def reset(self) -> None:
        """Forget all measurements; `share()` counts from now."""
        self.seconds.clear()
        self.counts.clear()
        self.started = time.perf_counter()

    def share(self) -> float:
        """The fraction of wall-clock time since this timer was made (or
        reset) spent in the timed phases: reset it at the start of a
        logging interval to get K-FAC's share of that interval's steps.
        """
        elapsed = time.perf_counter() - self.started
        return sum(self.seconds.values()) / elapsed


class _Counted(Protocol):
    @property
    def counters(self) -> Counter[str]: ...

    def memory_usage(self) -> dict[str, int]: ...


def fault_counts(
    counters: Counter[str], layers: Mapping[str, _Counted]
) -> dict[str, Any]:
    """`counters` plus every layer's counters, summed, and per layer under
    `'layers'`.
    """
    totals: Counter[str] = Counter(counters)
    per_layer = {}
    for name, layer in layers.items():
        totals.update(layer.counters)
        per_layer[name] = dict(layer.counters)
    return {**dict(totals), 'layers': per_layer}


def memory_totals(layers: Iterable[_Counted]) -> dict[str, int]:
    """The layers' `memory_usage()` summed by kind, and `'total'`."""
    usage: dict[str, int] = {}
    for layer in layers:
        for key, value in layer.memory_usage().items():
            usage[key] = usage.get(key, 0) + value
    usage['total'] = sum(usage.values())
    return usage


class _Factor(Protocol):
    @property
    def name(self) -> str: ...

    @property
    def value(self) -> torch.Tensor | None: ...

    @property
    def diagonal(self) -> bool: ...


class _Traced(Protocol):
    @property
    def factors(self) -> tuple[_Factor, ...]: ...


def factor_traces(
    layers: Mapping[str, _Traced],
) -> dict[str, dict[str, float]]:
    """Per layer, `{'trace_A': tr A, 'trace_G': tr G}` of the factors
    that exist (none before the first factor update).
    """
    keys: list[tuple[str, str]] = []
    traces: list[torch.Tensor] = []
    for name, layer in layers.items():
        for factor in layer.factors:
            value = factor.value
            if value is not None:
                keys.append((name, f'trace_{factor.name}'))
                total = value.sum() if factor.diagonal else value.trace()
                traces.append(total.double())
    out: dict[str, dict[str, float]] = {name: {} for name in layers}
    if traces:
        device = traces[0].device
        values = torch.stack([t.to(device) for t in traces]).tolist()
        for (name, key), number in zip(keys, values, strict=True):
            out[name][key] = number
    return out


def plot_metrics(
    metrics: dict[str, Any],
    layers: Mapping[str, _Traced],
    damping: float,
    timer: PhaseTimer | None,
) -> dict[str, Any]:
    """`metrics` (with a `'layers'` entry per layer) with the factor
    traces merged in per layer, `'damping'` and, with `timer`,
    `'kfac_time_share'`.
    """
    for name, traces in factor_traces(layers).items():
        metrics['layers'][name].update(traces)
    metrics['damping'] = damping
    if timer is not None:
        metrics['kfac_time_share'] = timer.share()
    return metrics


# Faults and the clip -------------------------------------------------------


class FailureLimitError(RuntimeError):
    """More failures in a row than a limit tolerates: decompositions of
    one factor that failed in every attempt (`max_decomposition_failures`),
    or factor updates discarded for non-finite statistics
    (`max_nonfinite_statistics`; see
    [`StatisticsConfig`][kfac.config.StatisticsConfig]). Raised by
    `step()` on every rank alike.

    Args:
        message: what failed, how often, and the limit.
        layers: the layers concerned.
        count: the failures in a row.
    """

    def __init__(
        self, message: str, layers: tuple[str, ...], count: int
    ) -> None:
        super().__init__(message)
        self.layers = layers
        """The layers concerned."""
        self.count = count
        """The failures in a row."""


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

    def streak(self, key: str, failed: bool) -> int:
        """Count one more event `key` in a row if `failed`, else end the
        run (the counter drops out of `counters`); return the run's
        length.
        """
        if failed:
            self.counters[key] += 1
        else:
            del self.counters[key]
        return self.counters[key]

    def once(self, key: str, name: str, msg: str, *args: object) -> None:
        """Log `msg % args` unless `(key, name)` was logged before."""
        if (key, name) not in self._logged:
            self._logged.add((key, name))
            self.logger.warning(msg, *args)


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
    """The last step's [`Clip`][kfac.tracing.Clip], and a warning
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


_R = TypeVar('_R')

_TRACES: dict[str, list[float]] = {}
"""Seconds of each call of each function decorated with `trace`, by the
function's name (one table per process)."""


def trace(
    sync: bool | Callable[[], None] = False,
) -> Callable[[Callable[..., _R]], Callable[..., _R]]:
    """Decorator recording the wall-clock seconds of each call.

    The original KAISA code's timing decorator, for your own functions:
    each call's seconds are appended, under the function's `__name__`, to
    one table per process, read by [`get_trace`][kfac.tracing.get_trace].
    To time K-FAC's own step, use
    [`PhaseTimer`][kfac.tracing.PhaseTimer] instead.

    Args:
        sync: called before and after each call, so that the time includes
            the work the call queued (e.g. `torch.cuda.synchronize`, or
            `torch.distributed.barrier` to time the slowest rank). The
            original's `True`, a `torch.distributed.barrier()`, is no
            longer issued here (`kfac.tracing` issues no collective): it
            emits a `DeprecationWarning` and times without one; pass
            `sync=torch.distributed.barrier` for the original's timing.

    Returns:
        The decorator.

    Raises:
        TypeError: `sync` is neither a bool nor callable.

    Examples:
        >>> clear_trace()
        >>> @trace()
        ... def double(x):
        ...     return 2 * x
        >>> double(3)
        6
        >>> list(get_trace())
        ['double']
        >>> clear_trace()
    """
    if sync is True:
        warnings.warn(
            'trace(sync=True) no longer calls torch.distributed.barrier() '
            '(kfac.tracing issues no collective); pass '
            'sync=torch.distributed.barrier to time with a barrier',
            DeprecationWarning,
            stacklevel=2,
        )
    if not isinstance(sync, bool) and not callable(sync):
        raise TypeError(f'sync must be a bool or callable; got {sync!r}')
    wait = None if isinstance(sync, bool) else sync

    def decorator(func: Callable[..., _R]) -> Callable[..., _R]:
        @functools.wraps(func)
        def timed(*args: Any, **kwargs: Any) -> _R:
            if wait is not None:
                wait()
            start = time.perf_counter()
            result = func(*args, **kwargs)
            if wait is not None:
                wait()
            seconds = time.perf_counter() - start
            _TRACES.setdefault(func.__name__, []).append(seconds)
            return result

        return timed

    return decorator


def get_trace(
    average: bool = True,
    max_history: int | None = None,
) -> dict[str, float]:
    """Seconds per function recorded by [`trace`][kfac.tracing.trace].

    Args:
        average: the mean seconds per call if true, else their sum.
        max_history: use only the last `max_history` calls of each
            function (all if None).

    Returns:
        Function name -> seconds.

    Raises:
        ValueError: `max_history` is not a positive int or None.
    """
    if max_history is not None and (
        isinstance(max_history, bool)
        or not isinstance(max_history, int)
        or max_history < 1
    ):
        raise ValueError(
            f'max_history must be a positive int or None; got {max_history!r}'
        )
    table = {}
    for name, seconds in _TRACES.items():
        kept = seconds if max_history is None else seconds[-max_history:]
        total = sum(kept)
        table[name] = total / len(kept) if average else total
    return table


def log_trace(
    average: bool = True,
    max_history: int | None = None,
    loglevel: int = logging.INFO,
) -> None:
    """Log [`get_trace`][kfac.tracing.get_trace]'s table, one record per
    function, at `loglevel` on this module's logger.
    """
    for name, seconds in get_trace(average, max_history).items():
        logger.log(loglevel, '%s: %.6f s', name, seconds)


def clear_trace() -> None:
    """Forget every time recorded by [`trace`][kfac.tracing.trace]."""
    _TRACES.clear()
