"""What counts: the best baseline, and everyone's time to its final metric.

The best baseline is the optimizer alone and learning rate with the best
median final metric over the seeds. Its final metric is the target. A run's
time to the target is the training time (evaluation excluded) of the first
evaluation at which its metric is at least as good as the target; a run
that never gets there counts as never (infinite). Medians are over seeds.
Times are CPU seconds (the ratio's clock) and wall seconds, both measured
by `runner.run`.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable
from collections.abc import Sequence
from typing import Any


def _worst(higher_is_better: bool) -> float:
    return -math.inf if higher_is_better else math.inf


def _final(run: dict[str, Any], higher_is_better: bool) -> float:
    value = float(run['final'])
    return _worst(higher_is_better) if math.isnan(value) else value


def reach(
    run: dict[str, Any], target: float, higher_is_better: bool
) -> tuple[float, float, float]:
    """(step, wall seconds, CPU seconds) of `run`'s first evaluation at or
    past `target`; all infinite if none is.
    """
    for step, seconds, metric, cpu in run['evals']:
        if (higher_is_better and metric >= target) or (
            not higher_is_better and metric <= target
        ):
            return float(step), float(seconds), float(cpu)
    return math.inf, math.inf, math.inf


def groups(runs: Iterable[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Runs by configuration label, in first-seen order."""
    grouped: dict[str, list[dict[str, Any]]] = {}
    for run in runs:
        grouped.setdefault(run['label'], []).append(run)
    return grouped


def _median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else math.nan


def summarise(
    runs: Sequence[dict[str, Any]], higher_is_better: bool
) -> dict[str, Any]:
    """The best baseline, its target, and one row per configuration.

    Each row: median final metric and its spread (max - min) over seeds,
    median steps and seconds to the target, median cost per step, the
    ratio of the median time to the best baseline's, and how many seeds
    reached the target.
    """
    grouped = groups(runs)
    sign = 1.0 if higher_is_better else -1.0
    medians = {
        label: _median([_final(r, higher_is_better) for r in rows])
        for label, rows in grouped.items()
    }
    baselines = [
        label for label, rows in grouped.items() if rows[0]['kfac'] is None
    ]
    if not baselines:
        raise ValueError(
            'no baseline runs (optimizer alone) to compare against'
        )
    best = max(baselines, key=lambda label: sign * medians[label])
    target = medians[best]
    table = []
    for label, rows in grouped.items():
        reached = [reach(r, target, higher_is_better) for r in rows]
        finals = [_final(r, higher_is_better) for r in rows]
        table.append(
            {
                'label': label,
                'optimizer': rows[0]['optimizer'],
                'kfac': rows[0]['kfac'],
                'lr': rows[0]['lr'],
                'seeds': len(rows),
                'final_median': medians[label],
                'final_spread': max(finals) - min(finals),
                'steps_to_target': _median([r[0] for r in reached]),
                'seconds_to_target': _median([r[1] for r in reached]),
                'cpu_seconds_to_target': _median([r[2] for r in reached]),
                'reached': sum(math.isfinite(r[0]) for r in reached),
                'seconds_per_step': _median(
                    [r['seconds_per_step'] for r in rows]
                ),
                'cpu_seconds_per_step': _median(
                    [r['cpu_seconds_per_step'] for r in rows]
                ),
                'diverged': sum(bool(r['diverged']) for r in rows),
            }
        )
    base_time = next(
        row['cpu_seconds_to_target'] for row in table if row['label'] == best
    )
    for row in table:
        # No ratio when the best baseline diverged or starts at its target.
        usable = math.isfinite(base_time) and base_time > 0
        row['time_ratio'] = (
            row['cpu_seconds_to_target'] / base_time if usable else math.nan
        )
    return {'best_baseline': best, 'target': target, 'rows': table}


def _number(value: float, digits: int = 3) -> str:
    if math.isinf(value):
        return 'never'
    if math.isnan(value):
        return 'n/a'
    return f'{value:.{digits}g}'


def markdown(summary: dict[str, Any], metric: str) -> str:
    """The summary as a Markdown table, best baseline first."""
    rows = sorted(
        summary['rows'],
        key=lambda r: (
            r['label'] != summary['best_baseline'],
            math.inf if math.isnan(r['time_ratio']) else r['time_ratio'],
        ),
    )
    lines = [
        f"Target: {metric} {summary['target']:.4g}, the best baseline's "
        f'({summary["best_baseline"]}) median final value.',
        '',
        f'| configuration | seeds | final {metric}, median (spread) '
        '| steps to target | CPU s to target | wall s to target '
        '| CPU ms/step | CPU time / best baseline | reached |',
        '| --- | --- | --- | --- | --- | --- | --- | --- | --- |',
    ]
    for r in rows:
        lines.append(
            f'| {r["label"]} | {r["seeds"]} '
            f'| {_number(r["final_median"], 4)} '
            f'({_number(r["final_spread"], 2)}) '
            f'| {_number(r["steps_to_target"], 4)} '
            f'| {_number(r["cpu_seconds_to_target"])} '
            f'| {_number(r["seconds_to_target"])} '
            f'| {1000 * r["cpu_seconds_per_step"]:.1f} '
            f'| {_number(r["time_ratio"], 2)} | {r["reached"]}/{r["seeds"]} |'
        )
    return '\n'.join(lines)


def per_optimizer(
    runs: Sequence[dict[str, Any]], higher_is_better: bool
) -> dict[str, dict[str, Any]]:
    """`summarise` within each optimizer's runs: K-FAC over an optimizer
    against that optimizer's own best learning rate (the comparison of a
    user who adds K-FAC to the optimizer they have).
    """
    names = dict.fromkeys(run['optimizer'] for run in runs)
    out = {}
    for name in names:
        mine = [run for run in runs if run['optimizer'] == name]
        if any(run['kfac'] is None for run in mine):
            out[name] = summarise(mine, higher_is_better)
    return out


def markdown_own(summaries: dict[str, dict[str, Any]], metric: str) -> str:
    """The K-FAC rows of `per_optimizer` as a Markdown table."""
    lines = [
        f'| K-FAC configuration | its optimizer alone at its best lr: final '
        f'{metric} | K-FAC final | steps to that | CPU time / the optimizer '
        "alone's | reached |",
        '| --- | --- | --- | --- | --- | --- |',
    ]
    for summary in summaries.values():
        for r in summary['rows']:
            if r['kfac'] is None:
                continue
            lines.append(
                f'| {r["label"]} | {summary["best_baseline"]}: '
                f'{_number(summary["target"], 4)} '
                f'| {_number(r["final_median"], 4)} '
                f'| {_number(r["steps_to_target"], 4)} '
                f'| {_number(r["time_ratio"], 2)} '
                f'| {r["reached"]}/{r["seeds"]} |'
            )
    return '\n'.join(lines)


def defaults_check(
    runs: Sequence[dict[str, Any]],
    higher_is_better: bool,
    variant: str = 'defaults',
) -> list[dict[str, Any]]:
    """K-FAC with `variant` against each optimizer alone at its best lr.

    For each optimizer with runs alone and runs with `variant` at the
    learning rate whose median final metric is the optimizer's best: both
    medians and spreads (max - min over seeds); `no_worse`, whether
    K-FAC's median is no worse than the optimizer's by more than the
    larger of the two spreads; and the median steps and CPU seconds each
    takes to reach the optimizer's own median final metric, with K-FAC's
    CPU time as a multiple of the optimizer's (`time_ratio`).
    """
    grouped = groups(runs)
    sign = 1.0 if higher_is_better else -1.0
    out = []
    for name in dict.fromkeys(run['optimizer'] for run in runs):
        alone = {
            label: rows
            for label, rows in grouped.items()
            if rows[0]['optimizer'] == name and rows[0]['kfac'] is None
        }
        if not alone:
            continue
        finals = {
            label: [_final(r, higher_is_better) for r in rows]
            for label, rows in alone.items()
        }
        best = max(alone, key=lambda label: sign * _median(finals[label]))
        lr = alone[best][0]['lr']
        kfac = [
            r
            for r in runs
            if r['optimizer'] == name
            and r['kfac'] == variant
            and r['lr'] == lr
        ]
        if not kfac:
            continue
        kfac_finals = [_final(r, higher_is_better) for r in kfac]
        target = _median(finals[best])
        spread = max(
            max(finals[best]) - min(finals[best]),
            max(kfac_finals) - min(kfac_finals),
        )
        own = [reach(r, target, higher_is_better) for r in alone[best]]
        with_kfac = [reach(r, target, higher_is_better) for r in kfac]
        own_cpu = _median([r[2] for r in own])
        kfac_cpu = _median([r[2] for r in with_kfac])
        out.append(
            {
                'optimizer': name,
                'lr': lr,
                'alone_seeds': len(finals[best]),
                'alone_median': target,
                'alone_spread': max(finals[best]) - min(finals[best]),
                'kfac_seeds': len(kfac_finals),
                'kfac_median': _median(kfac_finals),
                'kfac_spread': max(kfac_finals) - min(kfac_finals),
                'allowed': spread,
                'no_worse': sign * (_median(kfac_finals) - target) >= -spread,
                'alone_steps': _median([r[0] for r in own]),
                'kfac_steps': _median([r[0] for r in with_kfac]),
                'alone_cpu_seconds': own_cpu,
                'kfac_cpu_seconds': kfac_cpu,
                'time_ratio': kfac_cpu / own_cpu
                if math.isfinite(own_cpu) and own_cpu > 0
                else math.nan,
                'alone_cpu_ms_per_step': 1000
                * _median([r['cpu_seconds_per_step'] for r in alone[best]]),
                'kfac_cpu_ms_per_step': 1000
                * _median([r['cpu_seconds_per_step'] for r in kfac]),
            }
        )
    return out


def markdown_defaults(rows: Sequence[dict[str, Any]], metric: str) -> str:
    """The rows of `defaults_check` as a Markdown table."""
    lines = [
        f'| optimizer, its best lr | alone: final {metric}, median '
        '(spread), seeds | + K-FAC defaults: final, median (spread), seeds '
        '| no worse (by at most the larger spread) | steps to the '
        "optimizer's final: alone / K-FAC | CPU s to it: alone / K-FAC "
        '| K-FAC time / alone | CPU ms/step: alone / K-FAC |',
        '| --- | --- | --- | --- | --- | --- | --- | --- |',
    ]
    for r in rows:
        lines.append(
            f'| {r["optimizer"]} lr={r["lr"]:g} '
            f'| {_number(r["alone_median"], 4)} '
            f'({_number(r["alone_spread"], 2)}), {r["alone_seeds"]} '
            f'| {_number(r["kfac_median"], 4)} '
            f'({_number(r["kfac_spread"], 2)}), {r["kfac_seeds"]} '
            f'| {"yes" if r["no_worse"] else "**no**"} '
            f'| {_number(r["alone_steps"], 4)} / '
            f'{_number(r["kfac_steps"], 4)} '
            f'| {_number(r["alone_cpu_seconds"])} / '
            f'{_number(r["kfac_cpu_seconds"])} '
            f'| {_number(r["time_ratio"], 2)} '
            f'| {r["alone_cpu_ms_per_step"]:.1f} / '
            f'{r["kfac_cpu_ms_per_step"]:.1f} |'
        )
    return '\n'.join(lines)
