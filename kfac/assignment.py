"""Where each K-FAC computation and communication happens.

[`WorkAssignment`][kfac.assignment.WorkAssignment] is the interface the
preconditioner asks: who decomposes each factor, who preconditions each
layer's gradient, and over which process groups the results travel.
[`KAISAAssignment`][kfac.assignment.KAISAAssignment] answers it with the
KAISA placement of [`kfac.placement`][kfac.placement] (the grid of
gradient-worker and gradient-receiver groups is explained there), making the
process groups with an injected function, so that the placement needs no
live process group.
"""

from __future__ import annotations

import abc
from collections.abc import Iterable
from collections.abc import Mapping
from typing import TYPE_CHECKING
from typing import TypeAlias

from kfac.distributed import GroupFunc
from kfac.distributed import default_group_func
from kfac.enums import FACTOR_NAMES
from kfac.enums import AssignmentStrategy
from kfac.enums import DistributedStrategy
from kfac.enums import parse_enum
from kfac.placement import KAISAPlan
from kfac.placement import grad_workers_from_fraction
from kfac.placement import greedy_placement
from kfac.placement import plan_kaisa
from kfac.validation import check_callable
from kfac.validation import is_int
from kfac.validation import type_error
from kfac.validation import validate_int

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from kfac.layers.base import KFACBaseLayer

__all__ = [
    'KAISAAssignment',
    'WorkAssignment',
    'decomposition_work',
]

_Group: TypeAlias = 'ProcessGroup | None'


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
        """Whether decompositions go from inverse workers to the ranks
        that hold them (gradient workers; every rank for shared bases).
        """

    @abc.abstractmethod
    def get_layers(self) -> tuple[str, ...]:
        """Names of the layers, in the order given."""

    @abc.abstractmethod
    def get_factors(self, layer: str) -> tuple[str, ...]:
        """Names of the factors of `layer` (e.g. `('A', 'G')`)."""

    @abc.abstractmethod
    def inv_worker(self, layer: str, factor: str) -> int:
        """Global rank that decomposes `factor` of `layer`."""

    @abc.abstractmethod
    def is_grad_worker(self, layer: str) -> bool:
        """Whether the local rank preconditions the gradient of `layer`."""

    def holds_decomposition(self, layer: str) -> bool:
        """Whether the local rank holds the decompositions of `layer`
        (receives them, keeps them, loads them): its gradient workers, here.
        """
        return self.is_grad_worker(layer)

    @abc.abstractmethod
    def src_grad_worker(self, layer: str) -> int:
        """Rank the local rank gets the preconditioned gradient from.

        The local rank itself when it is a gradient worker of `layer`.
        """

    @abc.abstractmethod
    def factor_group(self, layer: str, factor: str) -> ProcessGroup | None:
        """Group over which the decomposition of `factor` is broadcast: the
        ranks that hold it (see `holds_decomposition`).
        """

    @abc.abstractmethod
    def grad_worker_group(self, layer: str) -> ProcessGroup | None:
        """Group of the gradient workers of `layer`."""

    @abc.abstractmethod
    def grad_receiver_group(self, layer: str) -> ProcessGroup | None:
        """Group over which the local rank receives the gradient of `layer`.

        The broadcast's source is
        [`src_grad_worker`][kfac.assignment.WorkAssignment.src_grad_worker].
        """


def decomposition_work(
    layers: Mapping[str, KFACBaseLayer],
    strategy: AssignmentStrategy | str,
) -> dict[str, dict[str, float]]:
    """The `work` of [`KAISAAssignment`][kfac.assignment.KAISAAssignment]
    for `layers`: per layer, the cost of decomposing each factor, as its
    curvature counts it
    ([`Curvature.cost`][kfac.layers.curvature.base.Curvature.cost]: a
    dense factor [`factor_cost`][kfac.placement.factor_cost], a diagonal
    one its length). Every tile of a blocked module (see
    [`kfac.layers.blocks`][kfac.layers.blocks]) is a layer of its own.
    """
    parsed = parse_enum(AssignmentStrategy, strategy, 'strategy')
    return {
        name: {f: layer.curvature.cost(f, parsed) for f in FACTOR_NAMES}
        for name, layer in layers.items()
    }


def _grid(world_size: int, grad_workers: int) -> KAISAPlan:
    """The plan of no layers: its groups alone."""
    return plan_kaisa(
        {},
        world_size=world_size,
        grad_workers=grad_workers,
        colocate_factors=True,
    )


class KAISAAssignment(WorkAssignment):
    """KAISA work assignment seen from one rank.

    Layer `L` placed in worker group `k` has group `k` as its gradient
    workers; its decompositions are broadcast over group `k`; the local rank
    `r` receives its preconditioned gradient from group `k`'s member at
    position `r % gw`, over receiver group `r % gw`. A layer of
    `shared_bases` (see [`kfac.placement`][kfac.placement]) has its
    decompositions broadcast over the default group (every rank).

    `group_func` is called once per gradient-worker group, then once per
    gradient-receiver group, in rank order and on every rank (as
    `torch.distributed.new_group` requires), including groups spanning one
    rank or the whole world, so that the sequence of calls is uniform. It is
    not called at all when `world_size == 1`; every group is then None.

    Args:
        work: layer name -> factor name -> non-negative finite cost (see
            [`factor_cost`][kfac.placement.factor_cost]).
        local_rank: global rank of this process, in `[0, world_size)`.
        world_size: number of ranks.
        grad_worker_fraction: gradient workers per layer over `world_size`:
            a float in (0, 1] whose product with `world_size` divides
            `world_size`, or a
            [`DistributedStrategy`][kfac.enums.DistributedStrategy] (or its
            name): `COMM_OPT` = 1, `MEM_OPT` = `1 / world_size`,
            `HYBRID_OPT` = 0.5. At `world_size == 1` there is only one rank,
            so `HYBRID_OPT` then means fraction 1.
        group_func: makes a process group from a list of global ranks;
            defaults to
            [`default_group_func`][kfac.assignment.default_group_func].
        colocate_factors: decompose all factors of a layer on one rank.
        shared_bases: layers whose decompositions every rank holds
            (EKFAC's).

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
        shared_bases: Iterable[str] = (),
    ) -> None:
        size = validate_int('world_size', world_size)
        if not is_int(local_rank):
            raise type_error('local_rank', local_rank, 'an int')
        if not 0 <= int(local_rank) < size:
            raise ValueError(
                f'local_rank must be in [0, world_size={size}); '
                f'got {local_rank}'
            )
        check_callable('group_func', group_func, optional=True)
        self._rank = int(local_rank)
        self._plan = plan = plan_kaisa(
            work,
            world_size=size,
            grad_workers=grad_workers_from_fraction(
                grad_worker_fraction, size
            ),
            colocate_factors=colocate_factors,
            shared_bases=shared_bases,
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

    @staticmethod
    def partition_grad_workers(
        world_size: int, grad_workers: int
    ) -> set[frozenset[int]]:
        """The gradient-worker groups of `world_size` ranks with
        `grad_workers` workers per layer: the `world_size / grad_workers`
        blocks of consecutive ranks (the original's name; it returned the
        strided groups, see [the grid][kfac.placement]).

        Raises:
            TypeError: an argument is not an int.
            ValueError: an argument is below 1, or `grad_workers` does not
                divide `world_size`.

        Examples:
            >>> groups = KAISAAssignment.partition_grad_workers(4, 2)
            >>> sorted(map(sorted, groups))
            [[0, 1], [2, 3]]
        """
        plan = _grid(world_size, grad_workers)
        return {frozenset(group) for group in plan.grad_worker_groups}

    @staticmethod
    def partition_grad_receivers(
        world_size: int, grad_workers: int
    ) -> set[frozenset[int]]:
        """The gradient-receiver groups of `world_size` ranks with
        `grad_workers` workers per layer: the `grad_workers` strided groups
        (the original's name; it returned blocks of consecutive ranks).

        Raises:
            TypeError: an argument is not an int.
            ValueError: an argument is below 1, or `grad_workers` does not
                divide `world_size`.

        Examples:
            >>> groups = KAISAAssignment.partition_grad_receivers(4, 2)
            >>> sorted(map(sorted, groups))
            [[0, 2], [1, 3]]
        """
        plan = _grid(world_size, grad_workers)
        return {frozenset(group) for group in plan.grad_receiver_groups}

    @staticmethod
    def greedy_assignment(
        work: Mapping[str, Mapping[str, float]],
        worker_groups: Iterable[Iterable[int]],
        world_size: int,
        colocate_factors: bool,
    ) -> dict[str, dict[str, int]]:
        """The inverse worker of each factor, placed greedily over
        `worker_groups` (the original's name of
        [`greedy_placement`][kfac.placement.greedy_placement]; factors of
        equal cost are placed in the given order, where the original
        placed them in descending order of their names).

        Args:
            work: layer name -> factor name -> non-negative finite cost.
            worker_groups: the groups of ranks, in `[0, world_size)`.
            world_size: number of ranks.
            colocate_factors: keep all factors of a layer on one rank.

        Returns:
            layer -> factor -> rank.

        Raises:
            TypeError: an argument has the wrong type.
            ValueError: an argument has a disallowed value, or a rank is
                not below `world_size`.
        """
        size = validate_int('world_size', world_size)
        groups = [list(group) for group in worker_groups]
        if outside := [r for g in groups for r in g if r >= size]:
            raise ValueError(
                f'worker_groups ranks must be < world_size={size}; '
                f'got {outside}'
            )
        return greedy_placement(
            work, groups, colocate_factors=colocate_factors
        )

    def _group(self, layer: str) -> int:
        if layer not in self._plan.layer_groups:
            raise KeyError(
                f'unknown layer {layer!r}; known layers: {self.get_layers()}'
            )
        return self._plan.layer_groups[layer]

    def broadcast_gradients(self) -> bool:  # noqa: D102
        return self._plan.grad_workers < self._plan.world_size

    def broadcast_inverses(self) -> bool:  # noqa: D102
        plan = self._plan
        shared = plan.world_size > 1 and bool(plan.shared_bases)
        return plan.grad_workers > 1 or shared

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

    def holds_decomposition(self, layer: str) -> bool:
        """Whether the local rank holds the decompositions of `layer`: its
        gradient workers, and every rank for a layer of `shared_bases`.
        """
        shared = layer in self._plan.shared_bases
        return shared or self.is_grad_worker(layer)

    def src_grad_worker(self, layer: str) -> int:  # noqa: D102
        group = self._plan.grad_worker_groups[self._group(layer)]
        return group[self._rank % self._plan.grad_workers]

    def factor_group(self, layer: str, factor: str) -> _Group:  # noqa: D102
        self.inv_worker(layer, factor)
        if layer in self._plan.shared_bases:
            return None  # every rank: the default group
        return self.grad_worker_group(layer)

    def grad_worker_group(self, layer: str) -> _Group:  # noqa: D102
        return self._worker_groups[self._group(layer)]

    def grad_receiver_group(self, layer: str) -> _Group:  # noqa: D102
        self._group(layer)
        return self._receiver_groups[self._rank % self._plan.grad_workers]

    def __repr__(self) -> str:
        plan = self._plan
        lines = [
            f'  {layer!r}: inv_workers={dict(ranks)}, '
            f'is_grad_worker={self.is_grad_worker(layer)}, '
            f'src_grad_worker={self.src_grad_worker(layer)},'
            for layer, ranks in plan.inv_workers.items()
        ]
        return '\n'.join(
            [
                f'{type(self).__name__}(local_rank={self._rank}, '
                f'world_size={plan.world_size}, '
                f'grad_workers={plan.grad_workers}, '
                f'grad_worker_groups={plan.grad_worker_groups},',
                *lines,
                ')',
            ]
        )
