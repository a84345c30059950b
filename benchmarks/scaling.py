"""Scaling without a cluster: load balance and bytes per rank at 8-1024.

For the layer shapes of :mod:`benchmarks.shapes`, at each world size and
KAISA strategy:

* the inverse-worker load balance of :class:`kfac.assignment.
  KAISAAssignment`: the largest over the mean per-rank cost of the
  decompositions placed on each rank (mean over all ranks, idle ones
  included), under the ``COMPUTE`` (cost ``n³``) and ``MEMORY`` (``n²``)
  strategies, each judged by its own cost and by decomposition time
  (``n³``), with a lower bound for any placement of whole layers (the
  largest layer, the mean, or the ``W``-th plus ``W+1``-th largest layer)
  over the mean;
* the bytes each rank sends and receives (:func:`benchmarks.comm.traffic`)
  for factors, decompositions and gradients, once each, and amortised per
  step over a 10/100 cycle.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from benchmarks.comm import COMM_PHASES
from benchmarks.comm import CommConfig
from benchmarks.comm import traffic
from benchmarks.floor import LayerShape
from benchmarks.shapes import SCALING_MODELS
from kfac.assignment import KAISAAssignment
from kfac.placement import KAISAPlan
from kfac.placement import factor_cost

__all__ = [
    'FRACTIONS',
    'WORLD_SIZES',
    'bytes_summary',
    'load_balance',
    'make_plan',
    'scaling',
]

WORLD_SIZES = (8, 16, 32, 64, 128, 256, 512, 1024)
FRACTIONS = ('comm_opt', 'hybrid_opt', 'mem_opt')
#: Per-step share of each communicating phase in a 10/100 cycle.
AMORTISED = {
    'factor_allreduce': 1 / 10,
    'decomposition_broadcast': 1 / 100,
    'scale_allreduce': 1 / 10,
    'grad_broadcast': 1.0,
}
COMM_CONFIGS = {
    'eigen': CommConfig('eigen'),
    'eigen packed': CommConfig('eigen', symmetry_aware=True),
    'inverse': CommConfig('inverse'),
    'inverse packed': CommConfig('inverse', symmetry_aware=True),
    'ekfac': CommConfig('ekfac'),
    'eigen_adam gradient': CommConfig('eigen_adam', source='gradient'),
    'one_sided': CommConfig('one_sided'),
}


def make_plan(
    layers: Sequence[LayerShape],
    world_size: int,
    fraction: str,
    strategy: str = 'compute',
) -> KAISAPlan:
    """The plan :class:`KAISAAssignment` makes (colocated factors)."""
    work = {
        x.name: {
            'A': factor_cost(x.a_dim, strategy),
            'G': factor_cost(x.g_dim, strategy),
        }
        for x in layers
    }
    assignment = KAISAAssignment(
        work,
        local_rank=0,
        world_size=world_size,
        grad_worker_fraction=fraction,
        group_func=lambda ranks: None,
    )
    return assignment.plan


def _ratio(loads: list[float]) -> float:
    mean = sum(loads) / len(loads)
    return max(loads) / mean if mean > 0 else 1.0


def _lower_bound(jobs: list[float], world_size: int) -> float:
    """A lower bound on the largest load of any placement of ``jobs``.

    The largest job, the mean load, and (more jobs than ranks) the sum of
    the ``W``-th and ``W+1``-th largest jobs, two of which share a rank.
    """
    ordered = sorted(jobs, reverse=True)
    bound = max(ordered[0], sum(jobs) / world_size)
    if len(ordered) > world_size:
        bound = max(bound, ordered[world_size - 1] + ordered[world_size])
    return bound


def load_balance(
    layers: Sequence[LayerShape],
    world_size: int,
    fraction: str,
    strategy: str,
) -> dict[str, float]:
    """Max over mean per-rank decomposition cost under ``strategy``."""
    plan = make_plan(layers, world_size, fraction, strategy)
    power = 3 if strategy == 'compute' else 2
    own = [0.0] * world_size
    time = [0.0] * world_size
    jobs = []
    for x in layers:
        job = 0.0
        for factor, n in (('A', x.a_dim), ('G', x.g_dim)):
            rank = plan.inv_workers[x.name][factor]
            own[rank] += float(n**power)
            time[rank] += float(n**3)
            job += float(n**power)
        jobs.append(job)
    mean = sum(jobs) / world_size
    return {
        'max_over_mean': _ratio(own),
        'time_max_over_mean': _ratio(time),
        'lower_bound': _lower_bound(jobs, world_size) / mean,
        'busy_ranks': float(sum(load > 0 for load in own)),
    }


def bytes_summary(
    layers: Sequence[LayerShape], plan: KAISAPlan, config: CommConfig
) -> dict[str, dict[str, float]]:
    """Per phase and amortised: max and mean bytes sent/received per rank."""
    summary: dict[str, dict[str, float]] = {}
    sent_total = recv_total = None
    for phase, (sent, recv) in traffic(layers, plan, config).items():
        summary[phase] = {
            'sent_max': float(sent.max()),
            'sent_mean': float(sent.mean()),
            'recv_max': float(recv.max()),
            'recv_mean': float(recv.mean()),
        }
        share = AMORTISED[phase]
        sent_total = sent * share + (0 if sent_total is None else sent_total)
        recv_total = recv * share + (0 if recv_total is None else recv_total)
    assert sent_total is not None and recv_total is not None
    summary['amortised_10_100'] = {
        'sent_max': float(sent_total.max()),
        'sent_mean': float(sent_total.mean()),
        'recv_max': float(recv_total.max()),
        'recv_mean': float(recv_total.mean()),
    }
    return summary


def _world(layers: Sequence[LayerShape], world: int) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for fraction in FRACTIONS:
        plan = make_plan(layers, world, fraction)
        result[fraction] = {
            'grad_workers': plan.grad_workers,
            'balance': {
                s: load_balance(layers, world, fraction, s)
                for s in ('compute', 'memory')
            },
            'bytes': {
                name: bytes_summary(layers, plan, config)
                for name, config in COMM_CONFIGS.items()
            },
        }
    return result


def scaling(
    world_sizes: Sequence[int] = WORLD_SIZES,
) -> dict[str, Any]:
    """The whole scaling study, for every model of ``SCALING_MODELS``."""
    assert set(AMORTISED) == set(COMM_PHASES)
    results: dict[str, Any] = {}
    for name, shapes in SCALING_MODELS.items():
        layers = shapes()
        results[name] = {
            'layers': len(layers),
            'worlds': {str(w): _world(layers, w) for w in world_sizes},
        }
    return results
