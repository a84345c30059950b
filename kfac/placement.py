"""The KAISA placement as a pure function returning an immutable plan.

KAISA (Pauloski et al., SC'21) arranges the `W` ranks as a grid. With `gw`
*gradient workers* per layer (`gw` divides `W`) the ranks split into
`W / gw` *gradient-worker groups* of consecutive ranks, and into `gw`
strided *gradient-receiver groups*. For `W = 4`, `gw = 2`:

```text
gradient-worker groups:   (0, 1)  (2, 3)
gradient-receiver groups: (0, 2)  (1, 3)
```

Every layer lives in one gradient-worker group. Each of its factors (`A`,
`G`) is decomposed by one *inverse worker* of that group, which broadcasts
the decomposition to the rest of the group; the group's ranks precondition
the layer's gradient, and each of them broadcasts the result over its
receiver group to the ranks outside the worker group. The gradient worker
fraction `gw / W` picks a point on the grid:

* COMM-OPT (fraction 1): every rank is a gradient worker of every layer;
  decompositions are broadcast to all ranks and no gradient is broadcast.
* MEM-OPT (fraction `1 / W`): one gradient worker per layer, which is also
  its inverse worker; no decomposition is broadcast and the preconditioned
  gradient is broadcast to all other ranks.
* HYBRID-OPT (any fraction in between, 0.5 by name): both broadcasts, each
  over smaller groups.

A layer listed in `shared_bases` (EKFAC's: each rank estimates the scaling
from its own examples, in the layer's eigenbases) has its decompositions
broadcast from its inverse workers to every rank instead of its gradient
workers alone, whatever the fraction.

[`plan_kaisa`][kfac.placement.plan_kaisa] is deterministic, so every rank
computes the same plan without communicating; nothing here needs
`torch.distributed`. [`KAISAAssignment`][kfac.assignment.KAISAAssignment]
turns a plan into process groups.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Iterable
from collections.abc import Mapping
from collections.abc import Sequence

from kfac.enums import AssignmentStrategy
from kfac.enums import DistributedStrategy
from kfac.enums import parse_enum
from kfac.validation import check_bool
from kfac.validation import is_real
from kfac.validation import type_error
from kfac.validation import validate_float
from kfac.validation import validate_int

__all__ = [
    'KAISAPlan',
    'factor_cost',
    'grad_workers_from_fraction',
    'greedy_placement',
    'parse_grad_worker_fraction',
    'plan_kaisa',
    'valid_grad_worker_fractions',
]

_FRACTION_TOLERANCE = 1e-9


@dataclasses.dataclass(frozen=True)
class KAISAPlan:
    """Immutable placement made by [`plan_kaisa`][kfac.placement.plan_kaisa].

    Equal on every rank.

    Attributes:
        world_size: number of ranks `W`.
        grad_workers: gradient workers per layer `gw`.
        grad_worker_groups: the `W / gw` blocks of consecutive ranks, e.g.
            `((0, 1), (2, 3))` for `W = 4`, `gw = 2`.
        grad_receiver_groups: the `gw` strided groups, group `j` holding
            the ranks `r` with `r % gw == j`, e.g. `((0, 2), (1, 3))`.
        inv_workers: layer -> factor -> inverse worker, in the given order.
        layer_groups: layer -> index of its group in `grad_worker_groups`.
        shared_bases: the layers whose decompositions every rank holds.

    """

    world_size: int
    grad_workers: int
    grad_worker_groups: tuple[tuple[int, ...], ...]
    grad_receiver_groups: tuple[tuple[int, ...], ...]
    inv_workers: Mapping[str, Mapping[str, int]]
    layer_groups: Mapping[str, int]
    shared_bases: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        proxy = types.MappingProxyType
        inv = {k: proxy(dict(v)) for k, v in self.inv_workers.items()}
        object.__setattr__(self, 'inv_workers', proxy(inv))
        object.__setattr__(
            self, 'layer_groups', proxy(dict(self.layer_groups))
        )

    def __hash__(self) -> int:
        # Equal plans hash equal; the (unhashable) mappings are left out.
        return hash((self.grad_worker_groups, tuple(self.layer_groups)))


def _check_factors(layer: str, factors: object) -> dict[str, float]:
    argument = f'work[{layer!r}]'
    if not isinstance(factors, Mapping):
        raise type_error(argument, factors, 'a mapping of factor to cost')
    if not factors:
        raise ValueError(f'{argument} must name at least one factor; got {{}}')
    checked: dict[str, float] = {}
    for factor, cost in factors.items():
        if not isinstance(factor, str):
            raise type_error(f'{argument} factor name', factor, 'a str')
        checked[factor] = validate_float(
            f'{argument}[{factor!r}]', cost, low=0.0, low_open=False
        )
    return checked


def _check_work(work: object) -> dict[str, dict[str, float]]:
    if not isinstance(work, Mapping):
        raise type_error('work', work, 'a mapping of layer to factor costs')
    checked: dict[str, dict[str, float]] = {}
    for layer, factors in work.items():
        if not isinstance(layer, str):
            raise type_error('work layer name', layer, 'a str')
        checked[layer] = _check_factors(layer, factors)
    return checked


def factor_cost(dim: int, strategy: AssignmentStrategy | str) -> float:
    """Return the cost of a `dim x dim` factor under `strategy`.

    Args:
        dim: side of the square factor, at least 1.
        strategy: `COMPUTE` gives `dim**3` (time of the decomposition),
            `MEMORY` gives `dim**2` (size of the factor).

    Examples:
        >>> factor_cost(10, 'compute'), factor_cost(10, 'memory')
        (1000.0, 100.0)

    """
    side = validate_int('dim', dim)
    parsed = parse_enum(AssignmentStrategy, strategy, 'strategy')
    return float(side ** (3 if parsed is AssignmentStrategy.COMPUTE else 2))


def valid_grad_worker_fractions(world_size: int) -> list[float]:
    """Return `d / world_size` for each divisor `d`, ascending.

    The first is `1 / world_size` (MEM-OPT), the last 1.0 (COMM-OPT).

    Examples:
        >>> valid_grad_worker_fractions(4)
        [0.25, 0.5, 1.0]

    """
    size = validate_int('world_size', world_size)
    return [d / size for d in range(1, size + 1) if size % d == 0]


def parse_grad_worker_fraction(value: object) -> float | DistributedStrategy:
    """Check a gradient worker fraction without knowing the world size.

    Args:
        value: a real number in (0, 1], or a
            [`DistributedStrategy`][kfac.enums.DistributedStrategy] or its
            name (case-insensitive). 0 is the original KAISA code's
            spelling of one gradient worker per layer, `1 / world_size`:
            it gives `MEM_OPT`.

    Returns:
        The fraction as a `float`, or the strategy.

    Raises:
        TypeError: `value` is neither a real number nor a strategy.
        ValueError: `value` is out of [0, 1] or names no strategy.

    Examples:
        >>> parse_grad_worker_fraction('mem-opt')
        <DistributedStrategy.MEM_OPT: 'mem_opt'>
        >>> parse_grad_worker_fraction(1)
        1.0
        >>> parse_grad_worker_fraction(0)
        <DistributedStrategy.MEM_OPT: 'mem_opt'>

    """
    name = 'grad_worker_fraction'
    if isinstance(value, DistributedStrategy | str):
        return parse_enum(DistributedStrategy, value, name)
    if not is_real(value):
        allowed = 'a float in [0, 1], a DistributedStrategy or its name'
        raise type_error(name, value, allowed)
    if value == 0:
        return DistributedStrategy.MEM_OPT
    return validate_float(name, value, low=0.0, high=1.0)


def grad_workers_from_fraction(value: object, world_size: int) -> int:
    """Return the number of gradient workers a fraction gives.

    Args:
        value: a fraction as
            [`parse_grad_worker_fraction`][kfac.placement.parse_grad_worker_fraction]
            accepts. `COMM_OPT` gives `world_size`, `MEM_OPT` (or 0) 1 and
            `HYBRID_OPT` the fraction 0.5; at `world_size == 1` every
            fraction gives the one rank (as in the original KAISA code, so
            that a script written for many ranks runs on one).
        world_size: number of ranks, at least 1.

    Raises:
        TypeError: an argument has the wrong type.
        ValueError: the fraction is out of (0, 1], or its product with
            `world_size` is not a whole number dividing `world_size`; the
            message lists the valid fractions.

    Examples:
        >>> grad_workers_from_fraction('hybrid_opt', 8)
        4

    """
    size = validate_int('world_size', world_size)
    fraction = parse_grad_worker_fraction(value)
    shown = repr(value)
    if fraction is DistributedStrategy.COMM_OPT:
        return size
    if fraction is DistributedStrategy.MEM_OPT or size == 1:
        return 1
    if isinstance(fraction, DistributedStrategy):
        shown, fraction = f'{fraction.name} (0.5)', 0.5
    workers = fraction * size
    whole = round(workers)
    if (
        whole < 1
        or abs(workers - whole) > _FRACTION_TOLERANCE
        or size % whole != 0
    ):
        raise ValueError(
            f'grad_worker_fraction={shown} gives {workers:g} gradient workers '
            f'at world_size={size}; it must give a whole number of workers '
            f'dividing world_size; valid fractions: '
            f'{valid_grad_worker_fractions(size)}'
        )
    return whole


def _least_loaded(loads: list[float], ranks: Sequence[int]) -> int:
    # min() returns the first minimum, so ties go to the lowest index.
    return min(ranks, key=lambda rank: loads[rank])


def _place(
    work: dict[str, dict[str, float]],
    groups: tuple[tuple[int, ...], ...],
    colocate_factors: bool,
) -> tuple[dict[str, dict[str, int]], dict[str, int]]:
    """Greedy longest-processing-time-first placement of `work`."""
    totals = {layer: sum(costs.values()) for layer, costs in work.items()}
    group_loads = [0.0] * len(groups)
    rank_loads = [0.0] * (max(max(group) for group in groups) + 1)
    placed: dict[str, dict[str, int]] = {}
    layer_groups: dict[str, int] = {}
    # sorted() is stable: equal costs keep the given order.
    for layer in sorted(work, key=lambda name: -totals[name]):
        costs = work[layer]
        index = _least_loaded(group_loads, range(len(groups)))
        group_loads[index] += totals[layer]
        layer_groups[layer] = index
        jobs = [list(costs)] if colocate_factors else [[f] for f in costs]
        ranks: dict[str, int] = {}
        for job in sorted(jobs, key=lambda fs: -sum(costs[f] for f in fs)):
            rank = _least_loaded(rank_loads, groups[index])
            rank_loads[rank] += sum(costs[f] for f in job)
            ranks.update(dict.fromkeys(job, rank))
        placed[layer] = {factor: ranks[factor] for factor in costs}
    return (
        {layer: placed[layer] for layer in work},
        {layer: layer_groups[layer] for layer in work},
    )


def _check_groups(worker_groups: object) -> tuple[tuple[int, ...], ...]:
    shown = 'worker_groups'
    if isinstance(worker_groups, (str, bytes)) or not isinstance(
        worker_groups, Iterable
    ):
        raise type_error(shown, worker_groups, 'a list of lists of ranks')
    groups = []
    for group in worker_groups:
        if isinstance(group, (str, bytes)) or not isinstance(group, Iterable):
            raise type_error(shown, worker_groups, 'a list of lists of ranks')
        groups.append(
            tuple(
                validate_int('worker_groups rank', rank, 0) for rank in group
            )
        )
    ranks = [rank for group in groups for rank in group]
    if not ranks or not all(groups) or len(set(ranks)) != len(ranks):
        raise ValueError(
            'worker_groups must be non-empty groups of distinct ranks, at '
            f'least one; got {worker_groups!r}'
        )
    return tuple(groups)


def greedy_placement(
    work: Mapping[str, Mapping[str, float]],
    worker_groups: Iterable[Iterable[int]],
    *,
    colocate_factors: bool,
) -> dict[str, dict[str, int]]:
    """Place each factor's decomposition on a rank of given groups.

    The greedy placement of [`plan_kaisa`][kfac.placement.plan_kaisa] over
    any worker groups (they need not be equal in size): layers in
    descending total cost (ties in the given order) each go to the group
    with the least load so far, and within it to its least-loaded rank
    (all factors together with `colocate_factors`, else each factor,
    largest first, ties in the given order).

    Args:
        work: layer name -> factor name -> non-negative finite cost.
        worker_groups: the groups, each a non-empty list of distinct
            non-negative ranks (no rank in two groups).
        colocate_factors: keep all factors of a layer on one rank.

    Returns:
        layer -> factor -> rank, in the order of `work`.

    Raises:
        TypeError: an argument has the wrong type.
        ValueError: an argument has a disallowed value.

    Examples:
        >>> greedy_placement(
        ...     {'fc1': {'A': 8.0, 'G': 1.0}, 'fc2': {'A': 2.0, 'G': 2.0}},
        ...     [[0], [1, 2]],
        ...     colocate_factors=False,
        ... )
        {'fc1': {'A': 0, 'G': 0}, 'fc2': {'A': 1, 'G': 2}}

    """
    checked = _check_work(work)
    groups = _check_groups(worker_groups)
    check_bool('colocate_factors', colocate_factors)
    return _place(checked, groups, colocate_factors)[0]


def plan_kaisa(
    work: Mapping[str, Mapping[str, float]],
    *,
    world_size: int,
    grad_workers: int,
    colocate_factors: bool,
    shared_bases: Iterable[str] = (),
) -> KAISAPlan:
    """Place every factor's decomposition on a rank, KAISA style.

    Greedy longest-processing-time-first: layers in descending total cost
    (ties in the given order) each go to the gradient-worker group with the
    least load so far; inside that group, with `colocate_factors` all the
    layer's factors go to its least-loaded rank, otherwise each factor
    (largest first, ties in the given order) goes to the group's
    least-loaded rank at that moment. Ties go to the lowest index or rank.

    Args:
        work: layer name -> factor name -> non-negative finite cost.
        world_size: number of ranks `W`.
        grad_workers: gradient workers per layer; must divide `W`.
        colocate_factors: keep all factors of a layer on one rank.
        shared_bases: layers of `work` whose decompositions go to every
            rank (EKFAC's); placed like the others.

    Returns:
        The plan, a pure function of the arguments (no randomness, no
        dependence on anything but the order of `work`).

    Raises:
        TypeError: an argument has the wrong type.
        ValueError: an argument has a disallowed value.

    Examples:
        >>> plan = plan_kaisa(
        ...     {'fc1': {'A': 8.0, 'G': 1.0}, 'fc2': {'A': 2.0, 'G': 2.0}},
        ...     world_size=2,
        ...     grad_workers=1,
        ...     colocate_factors=True,
        ... )
        >>> {layer: dict(ranks) for layer, ranks in plan.inv_workers.items()}
        {'fc1': {'A': 0, 'G': 0}, 'fc2': {'A': 1, 'G': 1}}

    """
    checked = _check_work(work)
    size = validate_int('world_size', world_size)
    workers = validate_int('grad_workers', grad_workers)
    check_bool('colocate_factors', colocate_factors)
    if size % workers != 0:
        raise ValueError(
            f'grad_workers={workers} must divide world_size={size}; allowed: '
            f'{[d for d in range(1, size + 1) if size % d == 0]}'
        )
    worker_groups = tuple(
        tuple(range(start, start + workers))
        for start in range(0, size, workers)
    )
    shared = frozenset(shared_bases)
    if unknown := sorted(shared - checked.keys()):
        raise ValueError(
            f'shared_bases names layers that are not in work: {unknown}'
        )
    placed, layer_groups = _place(checked, worker_groups, colocate_factors)
    return KAISAPlan(
        world_size=size,
        grad_workers=workers,
        grad_worker_groups=worker_groups,
        grad_receiver_groups=tuple(
            tuple(range(offset, size, workers)) for offset in range(workers)
        ),
        inv_workers=placed,
        layer_groups=layer_groups,
        shared_bases=shared,
    )
