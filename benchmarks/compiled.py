"""Compiled models: SGD and SGD + K-FAC on ``torch.compile(model)``, and
K-FAC's compiled arithmetic (``compile_arithmetic=True``), beside eager.

All configurations of a model step in the same rounds
(:func:`~benchmarks.harness.interleave`), so every ratio is paired by
round: compiled K-FAC over compiled SGD (what K-FAC costs a compiled
model), compiled K-FAC over eager K-FAC, compiled SGD over eager SGD.
Per phase, each configuration's time is set against its floor as in
:mod:`benchmarks.summary`. The warm-up step of a compiled configuration
is its compilation (``first_seconds``); it is not timed with the others.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any

import torch

from benchmarks.floor import layer_shapes
from benchmarks.harness import Config
from benchmarks.harness import Runner
from benchmarks.harness import cycle_kinds
from benchmarks.harness import interleave
from benchmarks.machine import RateProbe
from benchmarks.models import Bench
from benchmarks.models import build
from benchmarks.summary import CYCLE
from benchmarks.summary import summarise

__all__ = [
    'COMPILED_CONFIGS',
    'MODES',
    'compiled_configs',
    'compiled_table',
    'run_compiled',
]

MODES = ('default', 'max-autotune-no-cudagraphs')
"""Compile modes the study can run (the second autotunes matrix products:
minutes of compilation)."""


def compiled_configs(mode: str = 'default') -> tuple[Config, ...]:
    """SGD, eigen 1/1 (the cycle's ``'fi'`` steps) and eigen 10/100, eager
    and compiled in ``mode``; eigen 10/100 with compiled arithmetic too.
    """
    suffix = ' compiled' if mode == 'default' else f' compiled ({mode})'
    configs = []
    for compile_mode in (None, mode):
        tag = '' if compile_mode is None else suffix
        configs += [
            Config(f'sgd{tag}', compile_mode=compile_mode),
            Config(
                f'eigen 1/1{tag}', 'eigen', 1, 1, compile_mode=compile_mode
            ),
            Config(
                f'eigen 10/100{tag}',
                'eigen',
                10,
                100,
                compile_mode=compile_mode,
            ),
            Config(
                f'eigen 10/100{tag} + arithmetic',
                'eigen',
                10,
                100,
                compile_mode=compile_mode,
                arithmetic=True,
            ),
        ]
    return tuple(configs)


COMPILED_CONFIGS = compiled_configs()


def _paired_cycle(
    mine: Sequence[Runner], theirs: Sequence[Runner], config: Config
) -> float:
    """The cycle's time of ``mine`` over ``theirs``, paired by round per
    step kind (``'fi'`` from the first runners, the 1/1 ones), weighted
    by the kinds of ``config``'s cycle.
    """
    ratios: dict[str, list[float]] = {}
    for a, b in zip(mine, theirs):
        for sa, sb in zip(a.samples, b.samples):
            ratios.setdefault(sa.kind, []).append(sa.seconds / sb.seconds)
    kinds = cycle_kinds(config, CYCLE)
    medians = {k: statistics.median(v) for k, v in ratios.items()}
    return sum(n * medians[k] for k, n in kinds.items()) / CYCLE


def _warm_arithmetic(bench: Bench, device: torch.device) -> float:
    """Compile `compile_arithmetic`'s kernel for every variant the model
    needs (first and later updates, dense and diagonal factors), so that
    no timed step compiles it: two steps of a throwaway 1/1 run.

    Returns:
        The seconds of those two steps over two eager ones: about the
        compilation's cost.
    """
    eager = Runner(bench, Config('eigen 1/1', 'eigen', 1, 1), device)
    fused = Runner(
        bench, Config('warm-up', 'eigen', 1, 1, arithmetic=True), device
    )
    seconds = []
    for runner in (eager, fused):
        start = time.perf_counter()
        for _ in range(2):
            runner.step(record=False)
        seconds.append(time.perf_counter() - start)
    return seconds[1] - seconds[0]


def run_compiled(
    name: str,
    *,
    device: torch.device,
    steps: int,
    fi_steps: int,
    mode: str = 'default',
) -> dict[str, Any]:
    """Benchmark model ``name`` eager and compiled (:func:`compiled_configs`).

    Args:
        name: a key of :data:`benchmarks.models.MODELS`.
        device: where to run.
        steps: timed steps of SGD and the 10/100 configurations.
        fi_steps: timed steps of the 1/1 configurations.
        mode: the ``torch.compile`` mode.

    Returns:
        ``eager`` and ``compiled``: :func:`~benchmarks.summary.summarise`
        of each half (ratios to the SGD of the same half);
        ``compiled_over_eager``: per K-FAC configuration and for SGD, the
        compiled cycle over the eager one, paired; ``first_seconds``: the
        warm-up (compilation) step of each configuration.
    """
    bench = build(name)
    shapes = {
        'expand': layer_shapes(
            bench.model, bench.inputs[0], skip_types=bench.skip_layers
        )
    }
    configs = compiled_configs(mode)
    arithmetic = _warm_arithmetic(bench, device)
    runners = [Runner(bench, config, device) for config in configs]
    for runner in runners:  # warm-up, compilation included
        runner.step(record=False)
    counts = [
        fi_steps
        if r.config.method is not None
        and r.config.factor_steps == r.config.inv_steps
        else steps
        for r in runners
    ]
    probe = RateProbe(device)
    interleave(runners, counts, between=probe.sample)
    half = len(runners) // 2
    eager, compiled = runners[:half], runners[half:]
    result: dict[str, Any] = {
        'mode': mode,
        'eager': summarise(eager, shapes, probe.rates(), False)['configs'],
        'compiled': summarise(compiled, shapes, probe.rates(), False)[
            'configs'
        ],
        'first_seconds': {r.config.name: r.first_seconds for r in runners},
        'arithmetic_compile_seconds': arithmetic,
        'rates': probe.as_dict(),
    }
    over: dict[str, float] = {}
    sgd_config = eager[0].config
    over[compiled[0].config.name] = _paired_cycle(
        compiled[:1], eager[:1], sgd_config
    )
    for index in (2, 3):
        over[compiled[index].config.name] = _paired_cycle(
            [compiled[1], compiled[index]],
            [eager[1], eager[index]],
            eager[index].config,
        )
    result['compiled_over_eager'] = over
    return result


def _cell(value: float | None, digits: int = 2) -> str:
    return '-' if value is None else f'{value:.{digits}f}'


def compiled_table(results: Mapping[str, Mapping[str, Any]]) -> str:
    """Markdown: per model and configuration, the step, the cycle over the
    SGD of the same mode and over the same configuration eager, the
    running average against its floor, and the first (compiling) step.
    """
    lines = [
        '| model | config | step ms (median) | x SGD of its mode (cycle, '
        'paired) | compiled / eager (cycle, paired) | running_average '
        'ms/step (x floor) | first step s |',
        '|' + ' --- |' * 7,
    ]
    for model, data in results.items():
        over = data['compiled_over_eager']
        for half in ('eager', 'compiled'):
            for name, entry in data[half].items():
                if name.startswith('eigen 1/1'):
                    continue  # the cycle's 'fi' steps, shown in the cycle
                average = entry.get('phases', {}).get('running_average')
                cell = '-'
                if average is not None:
                    cell = (
                        f'{average["seconds"] * 1e3:.2f} '
                        f'({_cell(average["ratio"], 1)})'
                    )
                ratio = entry.get('cycle', {}).get('ratio_paired', 1.0)
                lines.append(
                    f'| {model} | {name} | '
                    f'{entry["step_seconds"]["median"] * 1e3:.1f} | '
                    f'{_cell(ratio)} | {_cell(over.get(name))} | {cell} | '
                    f'{data["first_seconds"][name]:.1f} |'
                )
        lines.append(
            f"| {model} | (compiling compile_arithmetic's kernel) | - | - "
            f'| - | - | {data["arithmetic_compile_seconds"]:.1f} |'
        )
    return '\n'.join(lines)
