"""Markdown tables of a benchmark result (the JSON written by ``make
bench``).
"""

from __future__ import annotations

from collections.abc import Iterable
from collections.abc import Mapping
from typing import Any

from benchmarks.compiled import compiled_table
from benchmarks.machine import LINALG_OPS
from benchmarks.overlap import overlap_table

__all__ = ['markdown']

MB = 1e6


def _table(header: Iterable[str], rows: Iterable[Iterable[object]]) -> str:
    head = list(header)
    lines = ['| ' + ' | '.join(head) + ' |', '|' + ' --- |' * len(head)]
    lines += ['| ' + ' | '.join(str(c) for c in row) + ' |' for row in rows]
    return '\n'.join(lines)


def _f(value: float | None, digits: int = 2) -> str:
    return '-' if value is None else f'{value:.{digits}f}'


def _ms(seconds: float | None) -> str:
    return '-' if seconds is None else f'{seconds * 1e3:.1f}'


def worst_phase(entry: Mapping[str, Any]) -> tuple[str, float] | None:
    """The phase with the largest time over floor, and that ratio."""
    ratios = [
        (name, phase['ratio'])
        for name, phase in entry.get('phases', {}).items()
        if phase['ratio'] is not None
    ]
    return max(ratios, key=lambda item: item[1]) if ratios else None


def _machine(result: Mapping[str, Any]) -> str:
    info = result['machine']
    rows = [[k, v] for k, v in info.items()]
    for model, data in result['models'].items():
        r = data['rates']
        rows.append(
            [
                f'matmul GFLOP/s during {model} (median, min-max)',
                f'{r["matmul_gflops_median"]:.1f} '
                f'({r["matmul_gflops_min"]:.1f}-{r["matmul_gflops_max"]:.1f})',
            ]
        )
        rows.append(
            [f'copy GB/s during {model}', _f(r['copy_gbytes_per_s_median'], 1)]
        )
    linalg = _table(
        ['n', *(f'{op} ms (c)' for op in LINALG_OPS)],
        (
            [
                int(row['n']),
                *(
                    f'{row[f"{op}_ms"]:.1f} ({row[f"{op}_c"]:.1f})'
                    for op in LINALG_OPS
                ),
            ]
            for row in result['linalg']
        ),
    )
    return (
        _table(['machine', ''], rows)
        + '\n\nEffective constants c = time x matmul rate / n³:\n\n'
        + linalg
    )


def _steps(result: Mapping[str, Any]) -> str:
    rows = []
    for model, data in result['models'].items():
        for name, entry in data['configs'].items():
            step = entry['step_seconds']
            cycle = entry.get('cycle', {})
            worst = worst_phase(entry)
            mem = entry['memory']
            rows.append(
                [
                    model,
                    name,
                    _ms(step['median']),
                    f'{_ms(step["p10"])}-{_ms(step["p90"])}',
                    _f(cycle.get('ratio_paired', 1.0)),
                    _f(cycle.get('ratio_composed', 1.0)),
                    _f(cycle.get('ratio_measured')),
                    _f(entry.get('floor_ratio_to_sgd', 1.0)),
                    _f(mem['increase_bytes'] / MB, 0),
                    _f(mem['memory_usage'].get('total', 0) / MB, 1),
                    '-' if worst is None else f'{worst[1]:.1f} ({worst[0]})',
                ]
            )
    header = [
        'model',
        'config',
        'step ms (median)',
        'p10-p90 ms',
        'x SGD (cycle, paired)',
        'x SGD (cycle, composed)',
        'x SGD (cycle, measured)',
        'x SGD floor',
        'peak step MB',
        'K-FAC state MB',
        'worst phase/floor',
    ]
    return _table(header, rows)


def _phases(result: Mapping[str, Any]) -> str:
    rows = []
    for model, data in result['models'].items():
        for name, entry in data['configs'].items():
            for phase, p in entry.get('phases', {}).items():
                if p['seconds'] == 0 and p['floor_seconds'] == 0:
                    continue
                rows.append(
                    [
                        model,
                        name,
                        phase,
                        _ms(p['seconds']),
                        _ms(p['floor_seconds']),
                        _f(p['ratio']),
                    ]
                )
            if 'other_seconds' in entry:
                rows.append(
                    [
                        model,
                        name,
                        '(outside phases)',
                        _ms(entry['other_seconds']),
                        '-',
                        '-',
                    ]
                )
    header = ['model', 'config', 'phase', 'ms/step', 'floor ms/step', 'ratio']
    return _table(header, rows)


def _worst(configs: Mapping[str, Any], having: str) -> str:
    worst = [
        w
        for name, entry in configs.items()
        if name.endswith(having) and (w := worst_phase(entry)) is not None
    ]
    if not worst:
        return '-'
    name, ratio = max(worst, key=lambda item: item[1])
    return f'{ratio:.1f} ({name})'


def _ratio(configs: Mapping[str, Any], name: str, key: str) -> str:
    entry = configs.get(name)
    if entry is None:
        return '-'
    value = entry['cycle']['ratio_to_sgd'] if key == 'x' else entry[key]
    return _f(value)


_LABELS = {
    '': 'expand',
    ' reduce': 'reduce',
    ' rank64': 'factor_rank=64',
    ' sample': 'sample',
}


def summary_table(result: Mapping[str, Any]) -> str:
    """Per model and ``kfac_approx`` (and ``factor_rank=64`` and sampled
    positions where benchmarked): the 10/100 ratios to SGD, their floors,
    and the worst phase/floor.
    """
    rows = []
    for model, data in result['models'].items():
        configs = data['configs']
        for suffix in ('', ' reduce', ' rank64', ' sample'):
            eigen, inverse = f'eigen 10/100{suffix}', f'inverse 10/100{suffix}'
            if eigen not in configs:
                continue
            floors = [
                _ratio(configs, n, 'floor_ratio_to_sgd')
                for n in (eigen, inverse)
            ]
            rows.append(
                [
                    model,
                    _LABELS[suffix],
                    _ratio(configs, eigen, 'x'),
                    _ratio(configs, inverse, 'x'),
                    ' / '.join(floors),
                    _worst(configs, f'10/100{suffix}'),
                ]
            )
    header = [
        'model',
        'kfac_approx',
        'eigen 10/100 x SGD',
        'inverse 10/100 x SGD',
        'floor: eigen / inverse x SGD',
        'worst phase/floor at 10/100',
    ]
    return _table(header, rows)


def _balance(result: Mapping[str, Any]) -> str:
    rows = []
    for model, data in result['scaling'].items():
        for world, by_fraction in data['worlds'].items():
            comm = by_fraction['comm_opt']['balance']
            hybrid = by_fraction['hybrid_opt']['balance']
            rows.append(
                [
                    model,
                    world,
                    _f(comm['compute']['max_over_mean']),
                    _f(hybrid['compute']['max_over_mean']),
                    _f(comm['compute']['lower_bound']),
                    _f(comm['memory']['max_over_mean']),
                    _f(comm['memory']['time_max_over_mean']),
                    _f(comm['memory']['lower_bound']),
                    int(comm['compute']['busy_ranks']),
                ]
            )
    header = [
        'model',
        'W',
        'COMPUTE max/mean (COMM-OPT, MEM-OPT)',
        'COMPUTE max/mean (HYBRID)',
        'COMPUTE lower bound',
        'MEMORY max/mean n²',
        'MEMORY max/mean n³',
        'MEMORY lower bound',
        'busy ranks',
    ]
    return _table(header, rows)


def _bytes(result: Mapping[str, Any]) -> str:
    rows = []
    for model, data in result['scaling'].items():
        for world, by_fraction in data['worlds'].items():
            for fraction, entry in by_fraction.items():
                b = entry['bytes']
                rows.append(
                    [
                        model,
                        world,
                        f'{fraction} (gw={entry["grad_workers"]})',
                        *(
                            _f(b[c]['factor_allreduce']['sent_max'] / MB, 0)
                            for c in ('eigen', 'eigen packed')
                        ),
                        *(
                            _f(
                                b[c]['decomposition_broadcast']['recv_max']
                                / MB,
                                0,
                            )
                            for c in ('eigen', 'inverse', 'inverse packed')
                        ),
                        _f(b['eigen']['grad_broadcast']['recv_max'] / MB, 1),
                        *(
                            _f(b[c]['amortised_10_100']['sent_max'] / MB, 0)
                            for c in (
                                'eigen',
                                'eigen packed',
                                'inverse packed',
                                'ekfac',
                            )
                        ),
                    ]
                )
    header = [
        'model',
        'W',
        'strategy',
        'factors MB',
        'factors packed MB',
        'decomp. eigen MB',
        'decomp. inverse MB',
        'decomp. inverse packed MB',
        'grads MB',
        'per step, eigen',
        'per step, eigen packed',
        'per step, inverse packed',
        'per step, ekfac',
    ]
    return _table(header, rows)


def _bytecheck(result: Mapping[str, Any]) -> str:
    check = result.get('bytecheck')
    if not check:
        return 'not run'
    rows = [
        [w, c['cases'], c['ranks'], c['matched'], c['mismatched']]
        for w, c in check.items()
    ]
    return _table(
        ['world size', 'cases', 'ranks', 'matched', 'mismatched'], rows
    )


def markdown(result: Mapping[str, Any]) -> str:
    """The whole report: machine, steps, phases, scaling, byte check."""
    parts = [
        '## Machine\n\n' + _machine(result),
        '## Summary\n\n' + summary_table(result),
        '## Step time, memory\n\n' + _steps(result),
        '## Phases against their floor (amortised per step)\n\n'
        + _phases(result),
    ]
    if result.get('compiled'):
        parts.append(
            '## Compiled models (torch.compile)\n\n'
            + compiled_table(result['compiled'])
        )
    if 'scaling' in result:
        parts += [
            '## Inverse-worker load balance\n\n' + _balance(result),
            '## Bytes per rank (max over ranks; once, and per step at '
            '10/100)\n\n' + _bytes(result),
        ]
    parts.append('## Byte model against gloo runs\n\n' + _bytecheck(result))
    if 'overlap' in result:
        parts.append(
            '## Factor allreduce during the backward pass (2 gloo ranks, '
            'one factor step, hook mode)\n\n'
            + overlap_table(result['overlap'])
        )
    return '\n\n'.join(parts) + '\n'
