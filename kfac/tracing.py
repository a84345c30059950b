"""Wall-clock time of each phase of the K-FAC step, for benchmarks.

Disabled by default (no cost). Enable with
`preconditioner.timer = PhaseTimer()`; pass `sync=torch.cuda.synchronize`
on GPUs so asynchronous kernels are charged to the phase that launched them.
"""

from __future__ import annotations

import contextlib
import time
from collections import Counter
from collections.abc import Callable
from collections.abc import Iterable
from collections.abc import Iterator
from collections.abc import Mapping
from typing import Any
from typing import Protocol

Phase = Callable[[str], contextlib.AbstractContextManager[None]]
"""Times one phase of the step: `with phase('decomposition'): ...`."""

PHASES = (
    'factor_capture',
    'running_average',
    'factor_allreduce',
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
"""Phases of one step, in order (`scale_*` only with EKFAC layers;
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
