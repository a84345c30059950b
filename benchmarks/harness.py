"""Timing SGD and SGD + K-FAC steps of one model, interleaved.

Every configuration trains its own copy of the model (same initial
weights, the same fixed batches). After a warm-up step, taken one
configuration at a time so that its peak memory can be read, the
configurations step in turn (one step each per round, each round starting
one configuration later), so slow drifts of a shared machine hit all of
them alike and the ratios to SGD are measured in the same run.

A step is *of kind* ``'fi'`` (factor and decomposition update), ``'f'``
(factor update only) or ``'-'`` (neither); a 10/100 cycle of 100 steps has
1, 9 and 90 of them. The amortised cost of a cycle is either measured over
a full cycle (steps 1 to 100: step 100 is the cycle's ``'fi'`` step) or
composed from the median time of each kind, the ``'fi'`` kind taken from
the 1/1 configuration of the same method when the cycle's own run has no
steady-state ``'fi'`` step.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import ctypes
import dataclasses
import gc
import math
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from benchmarks.models import Bench
from kfac.config import FisherConfig
from kfac.config import StatisticsConfig
from kfac.hyperparams import ORIGINAL_DEFAULTS
from kfac.layers.curvature import method_config
from kfac.preconditioner import KFACPreconditioner
from kfac.tracing import PhaseTimer

__all__ = [
    'CONFIGS',
    'KFAC_DEFAULTS',
    'LR',
    'RANK_CONFIGS',
    'REDUCE_CONFIGS',
    'SAMPLE',
    'SAMPLE_CONFIGS',
    'Config',
    'Runner',
    'Sample',
    'configs_for',
    'interleave',
    'step_kind',
]

#: Learning rate of SGD (momentum 0.9) and of K-FAC's KL clip.
LR = 0.01

#: The original defaults of `damping`, `kl_clip` and `relative_clip` (0.001,
#: 0.001, None: the KL clip alone), which the timings were measured with;
#: a benchmark's ``kfac_options`` override them, each configuration sets
#: the intervals.
KFAC_DEFAULTS: dict[str, Any] = {
    key: value
    for key, value in ORIGINAL_DEFAULTS.items()
    if key not in ('factor_update_steps', 'inv_update_steps', 'compute_method')
}


@dataclasses.dataclass(frozen=True)
class Config:
    """One benchmarked configuration; ``method`` None is SGD alone.

    ``compile_mode`` (a ``torch.compile`` mode, ``'default'`` for its
    default) trains the compiled model, K-FAC built on it;
    ``arithmetic`` passes ``compile_arithmetic=True``; ``fisher`` is
    ``fisher_type`` (``'mc'``: ``sample_fisher`` before each backward pass,
    one extra backward pass on each factor-update step); ``rank`` is
    ``factor_rank``; ``sample`` is ``position_sample``.
    """

    name: str
    method: str | None = None
    factor_steps: int = 1
    inv_steps: int = 1
    approx: str = 'expand'
    compile_mode: str | None = None
    arithmetic: bool = False
    fisher: str = 'empirical'
    rank: int | None = None
    sample: float | None = None

    @property
    def statistics(self) -> str:
        """How the factor statistics are formed: ``approx``, or
        ``'sample'`` with sampled positions (the floors' layer shapes).
        """
        return self.approx if self.sample is None else 'sample'


CONFIGS = (
    Config('sgd'),
    Config('eigen 1/1', 'eigen', 1, 1),
    Config('eigen 10/100', 'eigen', 10, 100),
    Config('inverse 1/1', 'inverse', 1, 1),
    Config('inverse 10/100', 'inverse', 10, 100),
    Config('eigen 10/100 mc', 'eigen', 10, 100, fisher='mc'),
)
#: The same K-FAC configurations with ``kfac_approx='reduce'``, for models
#: whose layers share weights across positions.
REDUCE_CONFIGS = tuple(
    dataclasses.replace(c, name=f'{c.name} reduce', approx='reduce')
    for c in CONFIGS
    if c.method is not None and c.fisher == 'empirical'
)
#: EIGEN with ``factor_rank=64``, for models with much wider factors.
RANK_CONFIGS = tuple(
    dataclasses.replace(c, name=f'{c.name} rank64', rank=64)
    for c in CONFIGS
    if c.method == 'eigen' and c.fisher == 'empirical'
)


#: ``position_sample`` of the sampled configurations: a quarter of each
#: example's positions.
SAMPLE = 0.25
#: EIGEN with factor statistics on :data:`SAMPLE` of the positions, for
#: models whose layers share weights across positions.
SAMPLE_CONFIGS = (
    Config('eigen 1/1 sample', 'eigen', 1, 1, sample=SAMPLE),
    Config('eigen 10/100 sample', 'eigen', 10, 100, sample=SAMPLE),
)


def configs_for(bench: Bench) -> tuple[Config, ...]:
    """:data:`CONFIGS`, plus :data:`REDUCE_CONFIGS` and
    :data:`SAMPLE_CONFIGS` when ``bench`` benchmarks reduce (its layers
    share weights across positions) and :data:`RANK_CONFIGS` when it
    benchmarks ``factor_rank``.
    """
    found: tuple[Config, ...] = CONFIGS
    if 'reduce' in bench.approximations:
        found += REDUCE_CONFIGS + SAMPLE_CONFIGS
    if bench.low_rank:
        found += RANK_CONFIGS
    return found


def step_kind(step: int, config: Config) -> str:
    """``'fi'``, ``'f'``, ``'i'`` or ``'-'``: what step ``step`` updates.

    >>> [step_kind(s, Config('x', 'eigen', 10, 100)) for s in (0, 10, 11)]
    ['fi', 'f', '-']
    """
    if config.method is None:
        return '-'
    kind = 'f' if step % config.factor_steps == 0 else ''
    kind += 'i' if step % config.inv_steps == 0 else ''
    return kind or '-'


@dataclasses.dataclass(frozen=True)
class Sample:
    """One timed step: its index, kind, seconds and seconds per phase."""

    step: int
    kind: str
    seconds: float
    phases: dict[str, float]


def _sync(device: torch.device) -> None:
    if device.type == 'cuda':
        torch.cuda.synchronize(device)


class Runner:
    """A model copy, its optimizer and (optionally) its preconditioner.

    Args:
        bench: the model and its fixed batch (the model is copied).
        config: the configuration.
        device: where to run.

    """

    def __init__(
        self, bench: Bench, config: Config, device: torch.device
    ) -> None:
        self.config = config
        self.device = device
        self.model = copy.deepcopy(bench.model).to(device)
        self.net: torch.nn.Module = self.model
        if config.compile_mode is not None:
            self.net = torch.compile(self.model, mode=config.compile_mode)  # type: ignore[assignment]  # an OptimizedModule
        self.inputs = bench.inputs.to(device)
        self.target = bench.target.to(device)
        self.loss_fn = bench.loss
        self.optimizer = torch.optim.SGD(
            self.model.parameters(), lr=LR, momentum=0.9
        )
        self.preconditioner: KFACPreconditioner | None = None
        sync = torch.cuda.synchronize if device.type == 'cuda' else None
        self.timer = PhaseTimer(sync=sync)
        if config.method is not None:
            self.preconditioner = KFACPreconditioner(
                self.net,
                compute_method=method_config(
                    config.method, factor_rank=config.rank
                ),
                factor_update_steps=config.factor_steps,
                inv_update_steps=config.inv_steps,
                lr=LR,
                skip_layers=bench.skip_layers,
                **{**KFAC_DEFAULTS, **bench.kfac_options},
                statistics=StatisticsConfig(
                    loss_average=bench.loss_average,
                    kfac_approx=config.approx,
                    position_sample=config.sample,
                    compile_arithmetic=config.arithmetic,
                ),
                fisher=FisherConfig(fisher_type=config.fisher),
            )
            self.preconditioner.timer = self.timer
        self.steps = 0
        self.samples: list[Sample] = []
        self.losses: list[float] = []
        self.first_seconds = math.nan
        """Seconds of step 0 (with a compiled model: its compilation)."""

    def step(self, record: bool = True) -> Sample:
        """Take one training step; keep its :class:`Sample` if ``record``."""
        before = dict(self.timer.seconds)
        _sync(self.device)
        start = time.perf_counter()
        self.optimizer.zero_grad()
        batch = self.steps % len(self.inputs)
        output = self.net(self.inputs[batch])
        if self.preconditioner is not None and self.config.fisher == 'mc':
            self.preconditioner.sample_fisher(output)
        loss = self.loss_fn(output, self.target[batch])
        loss.backward()
        if self.preconditioner is not None:
            self.preconditioner.step()
        self.optimizer.step()
        _sync(self.device)
        seconds = time.perf_counter() - start
        if self.steps == 0:
            self.first_seconds = seconds
        phases = {
            name: value - before.get(name, 0.0)
            for name, value in self.timer.seconds.items()
        }
        sample = Sample(
            self.steps, step_kind(self.steps, self.config), seconds, phases
        )
        self.steps += 1
        self.losses.append(float(loss.detach()))
        if record:
            self.samples.append(sample)
        return sample

    def memory_usage(self) -> dict[str, int]:
        """The preconditioner's ``memory_usage()`` (empty for SGD)."""
        pre = self.preconditioner
        return {} if pre is None else pre.memory_usage()


def interleave(
    runners: list[Runner],
    counts: list[int],
    between: Callable[[], None] | None = None,
) -> None:
    """Step ``runners[j]`` ``counts[j]`` times, one step each per round.

    Round ``r`` starts with runner ``r mod len(runners)``, so no runner
    always follows the same one (or ``between``): position effects, such as
    caches evicted by the previous step, average out. ``between`` (e.g.
    :meth:`benchmarks.machine.RateProbe.sample`) runs once per round.
    """
    remaining = list(counts)
    start = 0
    while any(remaining):
        for k in range(len(runners)):
            j = (start + k) % len(runners)
            if remaining[j]:
                runners[j].step()
                remaining[j] -= 1
        start += 1
        if between is not None:
            between()


# Peak memory -----------------------------------------------------------


def _trim_heap() -> None:
    """Return freed heap memory to the OS (glibc), so RSS baselines drop."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL('libc.so.6').malloc_trim(0)


def _status_kib(field: str) -> int | None:
    try:
        with open('/proc/self/status') as status:
            for line in status:
                if line.startswith(field + ':'):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _reset_peak_rss() -> bool:
    """Reset the resident-set high-water mark (Linux ``clear_refs``)."""
    try:
        with open('/proc/self/clear_refs', 'w') as refs:
            refs.write('5')
    except OSError:
        return False
    return True


def peak_memory(runner: Runner, steps: int) -> dict[str, float]:
    """Take ``steps`` unrecorded steps; return their peak memory.

    On CUDA: ``torch.cuda.max_memory_allocated`` (``peak_bytes``) and its
    increase over the allocation before the steps (``increase_bytes``). On
    CPU: the resident-set high-water mark after resetting it, and its
    increase over the resident set before the steps (NaN where the mark
    cannot be reset).
    """
    if runner.device.type == 'cuda':
        torch.cuda.reset_peak_memory_stats(runner.device)
        base = float(torch.cuda.memory_allocated(runner.device))
        for _ in range(steps):
            runner.step(record=False)
        peak = float(torch.cuda.max_memory_allocated(runner.device))
        return {'peak_bytes': peak, 'increase_bytes': peak - base}
    _trim_heap()
    reset = _reset_peak_rss()
    before = _status_kib('VmRSS')
    for _ in range(steps):
        runner.step(record=False)
    high = _status_kib('VmHWM')
    if not reset or before is None or high is None:
        return {'peak_bytes': math.nan, 'increase_bytes': math.nan}
    return {
        'peak_bytes': high * 1024.0,
        'increase_bytes': (high - before) * 1024.0,
    }


# Statistics --------------------------------------------------------------


def spread(times: list[float]) -> dict[str, float]:
    """Median, mean, 10th and 90th percentile, min, max and count."""
    if not times:
        return {'n': 0}
    ordered = sorted(times)
    if len(ordered) > 1:
        deciles = statistics.quantiles(ordered, n=10, method='inclusive')
    else:
        deciles = ordered * 9
    return {
        'n': len(ordered),
        'median': statistics.median(ordered),
        'mean': statistics.fmean(ordered),
        'p10': deciles[0],
        'p90': deciles[-1],
        'min': ordered[0],
        'max': ordered[-1],
    }


def kind_medians(samples: list[Sample]) -> dict[str, dict[str, float]]:
    """Per kind: median step seconds (``'step'``) and median of each phase."""
    by_kind: dict[str, list[Sample]] = collections.defaultdict(list)
    for sample in samples:
        by_kind[sample.kind].append(sample)
    result = {}
    for kind, group in by_kind.items():
        phases = {name for s in group for name in s.phases}
        medians = {
            name: statistics.median(s.phases.get(name, 0.0) for s in group)
            for name in phases
        }
        medians['step'] = statistics.median(s.seconds for s in group)
        medians['n'] = float(len(group))
        result[kind] = medians
    return result


def cycle_kinds(config: Config, cycle: int = 100) -> collections.Counter[str]:
    """How many steps of each kind a cycle of ``cycle`` steps has."""
    return collections.Counter(step_kind(s, config) for s in range(cycle))
