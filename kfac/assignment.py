"""Placement of K-FAC work across ranks, following KAISA.

KAISA (Pauloski et al., SC'21) arranges the ``W`` ranks as a grid. With
``gw`` *gradient workers* per layer (``gw`` divides ``W``) the ranks split
into ``W / gw`` *gradient-worker groups* of consecutive ranks, and into
``gw`` strided *gradient-receiver groups*. For ``W = 4``, ``gw = 2``::

    gradient-worker groups:   (0, 1)  (2, 3)
    gradient-receiver groups: (0, 2)  (1, 3)

Every layer lives in one gradient-worker group. Each of its factors (``A``,
``G``) is decomposed by one *inverse worker* of that group, which broadcasts
the decomposition to the rest of the group; the group's ranks precondition
the layer's gradient, and each of them broadcasts the result over its
receiver group to the ranks outside the worker group. The gradient worker
fraction ``gw / W`` picks a point on the grid:

* COMM-OPT (fraction 1): every rank is a gradient worker of every layer;
  decompositions are broadcast to all ranks and no gradient is broadcast.
* MEM-OPT (fraction ``1 / W``): one gradient worker per layer, which is also
  its inverse worker; no decomposition is broadcast and the preconditioned
  gradient is broadcast to all other ranks.
* HYBRID-OPT (any fraction in between, 0.5 by name): both broadcasts, each
  over smaller groups.

The plan (:func:`plan_kaisa`) is pure and deterministic, so every rank
computes the same one without communicating. Process groups are made by an
injected function, so the plan needs no live process group.
"""

from __future__ import annotations

import abc
import dataclasses
import math
import numbers
import types
from collections.abc import Callable
from collections.abc import Mapping
from collections.abc import Sequence
from typing import TYPE_CHECKING
from typing import TypeAlias
from typing import TypeGuard

import torch.distributed as dist

from kfac.enums import AssignmentStrategy
from kfac.enums import DistributedStrategy
from kfac.enums import parse_enum

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

_Group: TypeAlias = 'ProcessGroup | None'
GroupFunc = Callable[[list[int]], 'ProcessGroup | None']
"""Makes a process group from a list of global ranks (or returns None)."""

_FRACTION_TOLERANCE = 1e-9


class WorkAssignment(abc.ABC):
    """Where each K-FAC computation and communication happens.

    Answers are from the point of view of the local rank; every rank must
    get answers consistent with every other rank's.
    """

    @abc.abstractmethod
    def broadcast_gradients(self) -> bool:
        """Whether preconditioned gradients go from workers to receivers."""

    @abc.abstractmethod
    def broadcast_inverses(self) -> bool:
        """Whether decompositions go from inverse to gradient workers."""

    @abc.abstractmethod
    def get_layers(self) -> tuple[str, ...]:
        """Names of the layers, in the order given."""

    @abc.abstractmethod
    def get_factors(self, layer: str) -> tuple[str, ...]:
        """Names of the factors of ``layer`` (e.g. ``('A', 'G')``)."""

    @abc.abstractmethod
    def inv_worker(self, layer: str, factor: str) -> int:
        """Global rank that decomposes ``factor`` of ``layer``."""

    @abc.abstractmethod
    def is_grad_worker(self, layer: str) -> bool:
        """Whether the local rank preconditions the gradient of ``layer``."""

    @abc.abstractmethod
    def src_grad_worker(self, layer: str) -> int:
        """Rank the local rank gets the preconditioned gradient from.

        The local rank itself when it is a gradient worker of ``layer``.
        """

    @abc.abstractmethod
    def factor_group(self, layer: str, factor: str) -> ProcessGroup | None:
        """Group over which the decomposition of ``factor`` is broadcast."""

    @abc.abstractmethod
    def grad_worker_group(self, layer: str) -> ProcessGroup | None:
        """Group of the gradient workers of ``layer``."""

    @abc.abstractmethod
    def grad_receiver_group(self, layer: str) -> ProcessGroup | None:
        """Group over which the local rank receives the gradient of ``layer``.

        The broadcast's source is :meth:`src_grad_worker`.
        """


@dataclasses.dataclass(frozen=True)
class KAISAPlan:
    """Immutable placement made by :func:`plan_kaisa`; equal on every rank.

    Attributes:
        world_size: number of ranks ``W``.
        grad_workers: gradient workers per layer ``gw``.
        grad_worker_groups: the ``W / gw`` blocks of consecutive ranks, e.g.
            ``((0, 1), (2, 3))`` for ``W = 4``, ``gw = 2``.
        grad_receiver_groups: the ``gw`` strided groups, group ``j`` holding
            the ranks ``r`` with ``r % gw == j``, e.g. ``((0, 2), (1, 3))``.
        inv_workers: layer -> factor -> inverse worker, in the given order.
        layer_groups: layer -> index of its group in ``grad_worker_groups``.

    """

    world_size: int
    grad_workers: int
    grad_worker_groups: tuple[tuple[int, ...], ...]
    grad_receiver_groups: tuple[tuple[int, ...], ...]
    inv_workers: Mapping[str, Mapping[str, int]]
    layer_groups: Mapping[str, int]

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


def _is_int(value: object) -> TypeGuard[numbers.Integral]:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value: object) -> TypeGuard[numbers.Real]:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _type_error(argument: str, value: object, allowed: str) -> TypeError:
    return TypeError(
        f'{argument} must be {allowed}; got {value!r} of type '
        f'{type(value).__name__}'
    )


def _check_positive_int(value: object, argument: str) -> int:
    if not _is_int(value):
        raise _type_error(argument, value, 'an int')
    if value < 1:
        raise ValueError(f'{argument} must be >= 1; got {value!r}')
    return int(value)


def _check_factors(layer: str, factors: object) -> dict[str, float]:
    argument = f'work[{layer!r}]'
    if not isinstance(factors, Mapping):
        raise _type_error(argument, factors, 'a mapping of factor to cost')
    if not factors:
        raise ValueError(f'{argument} must name at least one factor; got {{}}')
    checked: dict[str, float] = {}
    for factor, cost in factors.items():
        if not isinstance(factor, str):
            raise _type_error(f'{argument} factor name', factor, 'a str')
        if not _is_real(cost):
            raise _type_error(f'{argument}[{factor!r}]', cost, 'a real number')
        if not math.isfinite(cost) or cost < 0:
            raise ValueError(
                f'{argument}[{factor!r}] must be a finite real number >= 0; '
                f'got {cost!r}'
            )
        checked[factor] = float(cost)
    return checked


def _check_work(work: object) -> dict[str, dict[str, float]]:
    if not isinstance(work, Mapping):
        raise _type_error('work', work, 'a mapping of layer to factor costs')
    if not work:
        raise ValueError('work must name at least one layer; got {}')
    checked: dict[str, dict[str, float]] = {}
    for layer, factors in work.items():
        if not isinstance(layer, str):
            raise _type_error('work layer name', layer, 'a str')
        checked[layer] = _check_factors(layer, factors)
    return checked


def factor_cost(dim: int, strategy: AssignmentStrategy | str) -> float:
    """Return the cost of a ``dim x dim`` factor under ``strategy``.

    Args:
        dim: side of the square factor, at least 1.
        strategy: ``COMPUTE`` gives ``dim**3`` (time of the decomposition),
            ``MEMORY`` gives ``dim**2`` (size of the factor).

    """
    side = _check_positive_int(dim, 'dim')
    parsed = parse_enum(AssignmentStrategy, strategy, 'strategy')
    return float(side ** (3 if parsed is AssignmentStrategy.COMPUTE else 2))


def valid_grad_worker_fractions(world_size: int) -> list[float]:
    """Return ``d / world_size`` for each divisor ``d``, ascending.

    The first is ``1 / world_size`` (MEM-OPT), the last 1.0 (COMM-OPT).
    """
    size = _check_positive_int(world_size, 'world_size')
    return [d / size for d in range(1, size + 1) if size % d == 0]


def _least_loaded(loads: list[float], ranks: Sequence[int]) -> int:
    # min() returns the first minimum, so ties go to the lowest index.
    return min(ranks, key=lambda rank: loads[rank])


def _place(
    work: dict[str, dict[str, float]],
    groups: tuple[tuple[int, ...], ...],
    colocate_factors: bool,
) -> tuple[dict[str, dict[str, int]], dict[str, int]]:
    """Greedy longest-processing-time-first placement of ``work``."""
    totals = {layer: sum(costs.values()) for layer, costs in work.items()}
    group_loads = [0.0] * len(groups)
    rank_loads = [0.0] * sum(len(group) for group in groups)
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


def plan_kaisa(
    work: Mapping[str, Mapping[str, float]],
    *,
    world_size: int,
    grad_workers: int,
    colocate_factors: bool,
) -> KAISAPlan:
    """Place every factor's decomposition on a rank, KAISA style.

    Greedy longest-processing-time-first: layers in descending total cost
    (ties in the given order) each go to the gradient-worker group with the
    least load so far; inside that group, with ``colocate_factors`` all the
    layer's factors go to its least-loaded rank, otherwise each factor
    (largest first, ties in the given order) goes to the group's
    least-loaded rank at that moment. Ties go to the lowest index or rank.

    Args:
        work: layer name -> factor name -> non-negative finite cost.
        world_size: number of ranks ``W``.
        grad_workers: gradient workers per layer; must divide ``W``.
        colocate_factors: keep all factors of a layer on one rank.

    Returns:
        The plan, a pure function of the arguments (no randomness, no
        dependence on anything but the order of ``work``).

    Raises:
        TypeError: an argument has the wrong type.
        ValueError: an argument has a disallowed value.

    """
    checked = _check_work(work)
    size = _check_positive_int(world_size, 'world_size')
    workers = _check_positive_int(grad_workers, 'grad_workers')
    if not isinstance(colocate_factors, bool):
        raise _type_error('colocate_factors', colocate_factors, 'a bool')
    if size % workers != 0:
        raise ValueError(
            f'grad_workers={workers} must divide world_size={size}; allowed: '
            f'{[d for d in range(1, size + 1) if size % d == 0]}'
        )
    worker_groups = tuple(
        tuple(range(start, start + workers))
        for start in range(0, size, workers)
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
    )


_GROUPS: dict[tuple[int, ...], ProcessGroup | None] = {}
_GROUPS_WORLD: list[object] = [None]


def _shared_group(ranks: list[int]) -> ProcessGroup | None:
    """``new_group(ranks)``, made once per set of ranks and default group.

    The whole world is the default group itself; other sets are created
    once and reused by later assignments (every rank decides the same way,
    so the collective ``new_group`` calls still match across ranks).
    """
    world = dist.group.WORLD
    if _GROUPS_WORLD[0] is not world:
        _GROUPS.clear()
        _GROUPS_WORLD[0] = world
    key = tuple(ranks)
    if key == tuple(range(dist.get_world_size())):
        return world
    if key not in _GROUPS:
        _GROUPS[key] = dist.new_group(ranks)
    return _GROUPS[key]


def default_group_func(world_size: int) -> GroupFunc:
    """Return a ``torch.distributed.new_group`` wrapper if usable, else a
    no-op.

    The wrapper is used when ``torch.distributed`` is available and
    initialised and ``world_size > 1``: it returns the default group for
    all ranks and creates every other group once per default group
    (:func:`_shared_group`); otherwise the function returned makes no group
    and returns None.
    """
    if world_size > 1 and dist.is_available() and dist.is_initialized():
        return _shared_group
    return lambda ranks: None


def _grad_workers_from_fraction(value: object, world_size: int) -> int:
    """Return the number of gradient workers a fraction asks for."""
    shown = repr(value)
    if isinstance(value, DistributedStrategy | str):
        strategy = parse_enum(
            DistributedStrategy, value, 'grad_worker_fraction'
        )
        if strategy is DistributedStrategy.COMM_OPT:
            return world_size
        if strategy is DistributedStrategy.MEM_OPT or world_size == 1:
            return 1
        shown, value = f'{strategy.name} (0.5)', 0.5
    if not _is_real(value):
        allowed = 'a float in (0, 1] or a DistributedStrategy'
        raise _type_error('grad_worker_fraction', value, allowed)
    workers = float(value) * world_size
    whole = round(workers) if math.isfinite(workers) else 0
    if (
        whole < 1
        or abs(workers - whole) > _FRACTION_TOLERANCE
        or world_size % whole != 0
    ):
        raise ValueError(
            f'grad_worker_fraction={shown} gives {workers:g} gradient workers '
            f'at world_size={world_size}; it must be in (0, 1] and give a '
            f'whole number of workers dividing world_size; valid fractions: '
            f'{valid_grad_worker_fractions(world_size)}'
        )
    return whole


class KAISAAssignment(WorkAssignment):
    """KAISA work assignment seen from one rank.

    Layer ``L`` placed in worker group ``k`` has group ``k`` as its gradient
    workers; its decompositions are broadcast over group ``k``; the local
    rank ``r`` receives its preconditioned gradient from group ``k``'s member
    at position ``r % gw``, over receiver group ``r % gw``.

    ``group_func`` is called once per gradient-worker group, then once per
    gradient-receiver group, in rank order and on every rank (as
    ``torch.distributed.new_group`` requires), including groups spanning one
    rank or the whole world, so that the sequence of calls is uniform. It is
    not called at all when ``world_size == 1``; every group is then None.

    Args:
        work: layer name -> factor name -> non-negative finite cost (see
            :func:`factor_cost`).
        local_rank: global rank of this process, in ``[0, world_size)``.
        world_size: number of ranks.
        grad_worker_fraction: gradient workers per layer over
            ``world_size``: a float in (0, 1] whose product with
            ``world_size`` divides ``world_size``, or a
            :class:`~kfac.enums.DistributedStrategy` (or its name):
            ``COMM_OPT`` = 1, ``MEM_OPT`` = ``1 / world_size``,
            ``HYBRID_OPT`` = 0.5. At ``world_size == 1`` there is only one
            rank, so ``HYBRID_OPT`` then means fraction 1.
        group_func: makes a process group from a list of global ranks;
            defaults to :func:`default_group_func`.
        colocate_factors: decompose all factors of a layer on one rank.

    Raises:
        TypeError: an argument has the wrong type.
        ValueError: an argument has a disallowed value.

    """

    def __init__(
        self,
        work: Mapping[str, Mapping[str, float]],
        *,
        local_rank: int,
        world_size: int,
        grad_worker_fraction: float | DistributedStrategy | str,
        group_func: GroupFunc | None = None,
        colocate_factors: bool = True,
    ) -> None:
        size = _check_positive_int(world_size, 'world_size')
        if not _is_int(local_rank):
            raise _type_error('local_rank', local_rank, 'an int')
        if not 0 <= int(local_rank) < size:
            raise ValueError(
                f'local_rank must be in [0, world_size={size}); '
                f'got {local_rank}'
            )
        if group_func is not None and not callable(group_func):
            raise _type_error('group_func', group_func, 'callable or None')
        self._rank = int(local_rank)
        self._plan = plan = plan_kaisa(
            work,
            world_size=size,
            grad_workers=_grad_workers_from_fraction(
                grad_worker_fraction, size
            ),
            colocate_factors=colocate_factors,
        )
        make = default_group_func(size) if group_func is None else group_func
        # One call per group, worker groups first, identical on every rank.
        groups = [
            make(list(ranks)) if size > 1 else None
            for ranks in plan.grad_worker_groups + plan.grad_receiver_groups
        ]
        count = len(plan.grad_worker_groups)
        self._worker_groups = tuple(groups[:count])
        self._receiver_groups = tuple(groups[count:])

    @property
    def plan(self) -> KAISAPlan:
        """The placement, identical on every rank."""
        return self._plan

    @property
    def grad_workers(self) -> int:
        """Gradient workers per layer."""
        return self._plan.grad_workers

    @property
    def grad_worker_fraction(self) -> float:
        """Gradient workers per layer over the world size."""
        return self._plan.grad_workers / self._plan.world_size

    def _group(self, layer: str) -> int:
        if layer not in self._plan.layer_groups:
            raise KeyError(
                f'unknown layer {layer!r}; known layers: {self.get_layers()}'
            )
        return self._plan.layer_groups[layer]

    def broadcast_gradients(self) -> bool:  # noqa: D102
        return self._plan.grad_workers < self._plan.world_size

    def broadcast_inverses(self) -> bool:  # noqa: D102
        return self._plan.grad_workers > 1

    def get_layers(self) -> tuple[str, ...]:  # noqa: D102
        return tuple(self._plan.inv_workers)

    def get_factors(self, layer: str) -> tuple[str, ...]:  # noqa: D102
        self._group(layer)
        return tuple(self._plan.inv_workers[layer])

    def inv_worker(self, layer: str, factor: str) -> int:  # noqa: D102
        factors = self.get_factors(layer)
        if factor not in factors:
            raise KeyError(
                f'unknown factor {factor!r} of layer {layer!r}; known '
                f'factors: {factors}'
            )
        return self._plan.inv_workers[layer][factor]

    def is_grad_worker(self, layer: str) -> bool:  # noqa: D102
        return self._rank in self._plan.grad_worker_groups[self._group(layer)]

    def src_grad_worker(self, layer: str) -> int:  # noqa: D102
        group = self._plan.grad_worker_groups[self._group(layer)]
        return group[self._rank % self._plan.grad_workers]

    def factor_group(self, layer: str, factor: str) -> _Group:  # noqa: D102
        self.inv_worker(layer, factor)
        return self.grad_worker_group(layer)

    def grad_worker_group(self, layer: str) -> _Group:  # noqa: D102
        return self._worker_groups[self._group(layer)]

    def grad_receiver_group(self, layer: str) -> _Group:  # noqa: D102
        self._group(layer)
        return self._receiver_groups[self._rank % self._plan.grad_workers]

    def __repr__(self) -> str:
        plan = self._plan
        placement = {k: dict(v) for k, v in plan.inv_workers.items()}
        return (
            f'{type(self).__name__}(local_rank={self._rank}, '
            f'world_size={plan.world_size}, '
            f'grad_workers={plan.grad_workers}, '
            f'grad_worker_groups={plan.grad_worker_groups}, '
            f'inv_workers={placement})'
        )
