"""What a user plots: the values behind `metrics()` beyond fault counts.

Per layer, the trace of each running factor (`trace_A`, `trace_G`; the sum
of a diagonal factor), read from the device in one transfer; the current
damping; and, with a [`PhaseTimer`][kfac.tracing.PhaseTimer], the share of
wall-clock time spent in K-FAC's phases.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from kfac.layers.base import KFACBaseLayer
from kfac.tracing import PhaseTimer


def factor_traces(
    layers: Mapping[str, KFACBaseLayer],
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
    layers: Mapping[str, KFACBaseLayer],
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
