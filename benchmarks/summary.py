"""Benchmark one model: run the configurations, compare with SGD and with
the floor of every phase.
"""

from __future__ import annotations

import collections
import statistics
from typing import Any

import torch

from benchmarks.floor import PHASE_SCHEDULE
from benchmarks.floor import LayerShape
from benchmarks.floor import cycle_counts
from benchmarks.floor import floor_seconds
from benchmarks.floor import layer_shapes
from benchmarks.floor import step_work
from benchmarks.harness import Config
from benchmarks.harness import Runner
from benchmarks.harness import Sample
from benchmarks.harness import configs_for
from benchmarks.harness import cycle_kinds
from benchmarks.harness import interleave
from benchmarks.harness import kind_medians
from benchmarks.harness import peak_memory
from benchmarks.harness import spread
from benchmarks.machine import RateProbe
from benchmarks.machine import Rates
from benchmarks.models import build
from kfac.tracing import PHASES

__all__ = ['run_model', 'summarise']

CYCLE = 100


def _counts(runner: Runner, steps: int, fi_steps: int, full: bool) -> int:
    config = runner.config
    if config.method is not None and config.factor_steps == config.inv_steps:
        return fi_steps
    return CYCLE if full else steps


def run_model(
    name: str,
    *,
    device: torch.device,
    steps: int,
    fi_steps: int,
    full_cycle: bool,
) -> dict[str, Any]:
    """Benchmark model ``name`` in every configuration of
    :func:`~benchmarks.harness.configs_for` it.

    Args:
        name: a key of :data:`benchmarks.models.MODELS`.
        device: where to run.
        steps: timed steps of SGD and of the 10/100 configurations when
            not measuring a full cycle (step 0 is the warm-up).
        fi_steps: timed steps of the 1/1 configurations.
        full_cycle: time steps 1 to 100 of SGD and the 10/100
            configurations, a full cycle, instead of ``steps``.

    """
    bench = build(name)
    configs = configs_for(bench)
    kinds = {config.statistics: config for config in configs}
    shapes = {
        kind: layer_shapes(
            bench.model,
            bench.inputs[0],
            kfac_approx=config.approx,
            skip_types=bench.skip_layers,
            position_sample=config.sample,
        )
        for kind, config in kinds.items()
    }
    Runner(bench, configs[0], device).step(record=False)  # process warm-up
    runners = [Runner(bench, config, device) for config in configs]
    memory = [peak_memory(runner, 1) for runner in runners]
    counts = [_counts(r, steps, fi_steps, full_cycle) for r in runners]
    probe = RateProbe(device)
    interleave(runners, counts, between=probe.sample)
    result = summarise(runners, shapes, probe.rates(), full_cycle)
    result['rates'] = probe.as_dict()
    for runner, peak in zip(runners, memory):
        result['configs'][runner.config.name]['memory'] = {
            **peak,
            'memory_usage': runner.memory_usage(),
        }
    result['layers'] = len(shapes['expand'])
    result['parameters'] = sum(p.numel() for p in bench.model.parameters())
    return result


def _phase_names(runner: Runner) -> list[str]:
    """The phases of :mod:`kfac.tracing`, then any others the timer saw."""
    seen = {name for sample in runner.samples for name in sample.phases}
    return [*PHASES, *sorted(seen - set(PHASES))]


def paired_ratios(
    samples: list[Sample],
    sgd_seconds: list[float],
) -> dict[str, float]:
    """Per kind: the median over rounds of a step's time over the SGD step
    of the same round.

    The ``i``-th timed step of every configuration runs in round ``i``
    (:func:`~benchmarks.harness.interleave`), so each ratio compares steps
    taken under the same load of the shared machine.
    """
    by_kind: dict[str, list[float]] = collections.defaultdict(list)
    for sample, sgd in zip(samples, sgd_seconds):
        by_kind[sample.kind].append(sample.seconds / sgd)
    return {kind: statistics.median(v) for kind, v in by_kind.items()}


Fallbacks = dict[tuple[str, str, int | None], dict[str, float]]


def _fi_fallbacks(runners: list[Runner]) -> Fallbacks:
    """Per method and approximation: the ``'fi'`` medians of the runner
    with most of them, with their ratio to SGD paired by round
    (``'paired_ratio'``).
    """
    sgd = next(r for r in runners if r.config.method is None)
    sgd_times = [s.seconds for s in sgd.samples]
    found: Fallbacks = {}
    for runner in runners:
        medians = kind_medians(runner.samples).get('fi')
        if runner.config.method is None or medians is None:
            continue
        method = (
            runner.config.method,
            runner.config.statistics,
            runner.config.rank,
        )
        if medians['n'] > found.get(method, {}).get('n', 0.0):
            ratio = paired_ratios(runner.samples, sgd_times)['fi']
            found[method] = {**medians, 'paired_ratio': ratio}
    return found


def summarise(
    runners: list[Runner],
    shapes: dict[str, list[LayerShape]],
    rates: Rates,
    full_cycle: bool,
) -> dict[str, Any]:
    """Per configuration: step statistics, amortised ratio to SGD, phases
    against their floors (``shapes`` per ``Config.statistics``).
    """
    sgd = next(r for r in runners if r.config.method is None)
    sgd_times = [s.seconds for s in sgd.samples]
    base = {
        'median': statistics.median(sgd_times),
        'mean': statistics.fmean(sgd_times),
    }
    fallbacks = _fi_fallbacks(runners)
    configs: dict[str, Any] = {}
    for runner in runners:
        entry: dict[str, Any] = {
            'step_seconds': spread([s.seconds for s in runner.samples]),
            'loss': runner.losses[-1],
        }
        if runner.config.method is not None:
            entry.update(
                _kfac(
                    runner,
                    shapes[runner.config.statistics],
                    rates,
                    base,
                    fallbacks,
                    sgd_times,
                )
            )
        configs[runner.config.name] = entry
    return {'sgd_seconds': base, 'full_cycle': full_cycle, 'configs': configs}


def _kfac(
    runner: Runner,
    shapes: list[LayerShape],
    rates: Rates,
    base: dict[str, float],
    fallbacks: Fallbacks,
    sgd_times: list[float],
) -> dict[str, Any]:
    config = runner.config
    assert config.method is not None
    medians = kind_medians(runner.samples)
    paired = paired_ratios(runner.samples, sgd_times)
    key = (config.method, config.statistics, config.rank)
    if 'fi' not in medians and key in fallbacks:
        medians['fi'] = fallbacks[key]
        paired['fi'] = fallbacks[key]['paired_ratio']
    kinds = cycle_kinds(config, CYCLE)
    missing = [k for k in kinds if not medians.get(k)]
    if missing:
        raise ValueError(
            f'{config.name}: no timed step of kind {missing}; time at least '
            f'{config.factor_steps} steps'
        )
    names = _phase_names(runner)
    composed = {
        key: sum(kinds[k] * medians[k].get(key, 0.0) for k in kinds) / CYCLE
        for key in ('step', *names)
    }
    cycle: dict[str, float] = {
        'composed_seconds': composed['step'],
        'ratio_composed': composed['step'] / base['median'],
        'ratio_paired': sum(kinds[k] * paired[k] for k in kinds) / CYCLE,
    }
    phase_seconds = {p: composed[p] for p in names}
    measured = [s for s in runner.samples if 1 <= s.step <= CYCLE]
    if len(measured) == CYCLE and config.factor_steps != config.inv_steps:
        mean = statistics.fmean(s.seconds for s in measured)
        cycle['measured_seconds'] = mean
        cycle['ratio_measured'] = mean / base['mean']
        phase_seconds = {
            p: sum(s.phases.get(p, 0.0) for s in measured) / CYCLE
            for p in names
        }
    cycle['ratio_to_sgd'] = cycle.get('ratio_measured', cycle['ratio_paired'])
    phases = _phases(config.method, config, shapes, rates, phase_seconds)
    floor = sum(p['floor_seconds'] or 0.0 for p in phases.values())
    if 'measured_seconds' in cycle:
        step, sgd = cycle['measured_seconds'], base['mean']
    else:
        step, sgd = composed['step'], base['median']
    return {
        'kinds': medians,
        'cycle': cycle,
        'phases': phases,
        'other_seconds': step - sgd - sum(phase_seconds.values()),
        'floor_ratio_to_sgd': (sgd + floor) / sgd,
    }


def _phases(
    method: str,
    config: Config,
    shapes: list[LayerShape],
    rates: Rates,
    seconds: dict[str, float],
) -> dict[str, dict[str, float | None]]:
    """Per phase, amortised per step: seconds, floor seconds, their ratio."""
    work = step_work(shapes, method, rank=config.rank)
    counts = cycle_counts(config.factor_steps, config.inv_steps, CYCLE)
    result: dict[str, dict[str, float | None]] = {}
    for phase in seconds:
        times = counts[PHASE_SCHEDULE.get(phase, 'step')] / CYCLE
        floor = 0.0
        if phase in work:
            floor = times * floor_seconds(
                work[phase], rates.flops_per_s, rates.bytes_per_s
            )
        spent = seconds.get(phase, 0.0)
        result[phase] = {
            'seconds': spent,
            'floor_seconds': floor,
            'ratio': spent / floor if floor > 0 else None,
        }
    return result
