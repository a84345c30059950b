"""Gradient distributors: how a step holds, moves and writes gradients.

The engine's step is the same sequence of phases for every model; what
differs between a replicated model (one process or DDP) and one sharded
by FSDP2 is one object chosen at construction, a
`GradientDistributor`:

* which layers are preconditioned together and how their gradients are
  held while they are
  (`precondition`:
  as they are, gathered whole, or this rank's rows in zeros),
* how preconditioned gradients reach the ranks that write them
  (broadcast, or each rank's entries scattered) and what each rank keeps,
* how the KL clip's `Σ V' ⊙ V` are summed
  (`products`),
* how the result is written back
  (`write_back`).

`Replicated` is the distributor of
plain parameters; `Lossless` and
`Local` those of FSDP2 sharded
parameters (`shard_mode`). Sharded distributors take the layers in
*components* (layers that share a parameter go together), so a rank holds
at most one component's whole gradients at a time plus its own share of
every preconditioned gradient.
"""

from __future__ import annotations

import abc
from collections.abc import Iterator
from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch

from kfac._engine.fsdp import setup_local_mode
from kfac.assignment import WorkAssignment
from kfac.distributed import TorchDistributedCommunicator
from kfac.distributed._exchange import broadcast_grads
from kfac.distributed._sharding import Owned
from kfac.distributed._sharding import ShardGrads
from kfac.distributed._sharding import gather_grads
from kfac.distributed._sharding import is_sharded
from kfac.distributed._sharding import local_grads
from kfac.distributed._sharding import owned_entries
from kfac.distributed._sharding import scatter_owned
from kfac.distributed._sharding import sum_over
from kfac.layers.base import KFACBaseLayer
from kfac.layers.helper import Grads
from kfac.tracing import Phase

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = [
    'GradientDistributor',
    'Local',
    'Lossless',
    'Replicated',
    'components',
    'make_distributor',
]

Parts = Iterator[tuple[list[str], Grads | None]]
"""Groups of layer names, each with the gradients its layers read and
write (None: the parameters' `.grad`)."""


class GradientDistributor(abc.ABC):
    """How one step's gradients are held, moved and written back.

    Every rank calls every method in the same order; the iterators must
    be consumed to the end.

    Args:
        layers: the registered layers.
        assignment: who preconditions each layer.
        communicator: the collectives.
        phase: times a phase of the step.
    """

    def __init__(
        self,
        layers: Mapping[str, KFACBaseLayer],
        assignment: WorkAssignment,
        communicator: TorchDistributedCommunicator,
        phase: Phase,
    ) -> None:
        self.layers = layers
        self.assignment = assignment
        self.communicator = communicator
        self.phase = phase

    def _broadcast(self, names: list[str]) -> None:
        """Send the preconditioned gradients of `names` from their
        gradient workers to their receivers (MEM-OPT, hybrid fractions).
        """
        if names and self.assignment.broadcast_gradients():
            with self.phase('grad_broadcast'):
                broadcast_grads(
                    self.communicator,
                    self.assignment,
                    {name: self.layers[name] for name in names},
                )

    @abc.abstractmethod
    def precondition(self, active: list[str]) -> Parts:
        """Yield the `active` layers in groups with the gradients to read;
        the caller preconditions each group on its gradient workers before
        asking for the next, and the distributor then moves the results.
        """

    @abc.abstractmethod
    def statistics(self) -> tuple[list[str], torch.Tensor | None]:
        """The layers with a preconditioned gradient and their
        `grad_statistics()` (stacked `(layers, 3)`, summed over what each
        rank holds; None for no layer).
        """

    @abc.abstractmethod
    def write_back(self) -> Parts:
        """Yield the layers of `statistics` in groups, each with the
        gradients the caller writes their results to; the distributor
        finishes writing a group when the next is asked for.
        """


class Replicated(GradientDistributor):
    """Plain parameters (one process, DDP): every rank reads and writes
    whole gradients in `.grad`; receivers get `V'` by broadcast.
    """

    def precondition(self, active: list[str]) -> Parts:
        yield active, None
        self._broadcast(active)

    def statistics(self) -> tuple[list[str], torch.Tensor | None]:
        names = [
            n for n, layer in self.layers.items() if layer.grad is not None
        ]
        if not names:
            return [], None
        return names, torch.stack(
            [self.layers[n].grad_statistics() for n in names]
        )

    def write_back(self) -> Parts:
        yield (
            [n for n, layer in self.layers.items() if layer.grad is not None],
            None,
        )


def components(
    names: list[str], layers: Mapping[str, KFACBaseLayer]
) -> list[list[str]]:
    """`names` grouped by shared parameters, in order of first layer."""
    groups: list[tuple[set[int], list[str]]] = []
    for name in names:
        ids = {id(p) for p in layers[name].module.parameters()}
        touching = [g for g in groups if g[0] & ids]
        merged = (ids, [name])
        for group in touching:
            groups.remove(group)
            merged = (merged[0] | group[0], group[1] + merged[1])
        groups.append(merged)
    order = {name: index for index, name in enumerate(names)}
    return sorted(
        (sorted(g[1], key=order.__getitem__) for g in groups),
        key=lambda g: order[g[0]],
    )


class _Sharded(GradientDistributor):
    """FSDP2 parameters: layers taken component by component; each rank
    keeps only the entries of `V'` its shards own until the KL clip's
    scale is known, then writes them into its shards of `.grad`.
    """

    def __init__(
        self,
        layers: Mapping[str, KFACBaseLayer],
        assignment: WorkAssignment,
        communicator: TorchDistributedCommunicator,
        phase: Phase,
    ) -> None:
        super().__init__(layers, assignment, communicator, phase)
        self._owned: dict[str, Owned] = {
            name: owned
            for name, layer in layers.items()
            if (owned := owned_entries(layer)) is not None
        }
        self._parts: list[list[str]] = []
        self._kept: dict[str, torch.Tensor] = {}
        self._statistics: dict[str, torch.Tensor] = {}
        self._scattered: set[str] = set()

    def _params(self, names: list[str]) -> list[torch.Tensor]:
        return [p for n in names for p in self.layers[n].module.parameters()]

    @abc.abstractmethod
    def _hold(self, names: list[str]) -> ShardGrads:
        """The gradients of `names` while they are preconditioned."""

    def precondition(self, active: list[str]) -> Parts:
        self._parts = components(active, self.layers)
        self._kept.clear()
        self._statistics.clear()
        self._scattered.clear()
        sends = self.assignment.broadcast_gradients()
        for part in self._parts:
            held = self._hold(part)
            try:
                yield part, held
                scatter = {n for n in part if sends and n in self._owned}
                self._broadcast([n for n in part if n not in scatter])
                for name in part:
                    self._keep(name, held, name in scatter)
            finally:
                held.clear()

    def _keep(self, name: str, held: Grads, scatter: bool) -> None:
        """Keep this rank's entries of `name`'s `V'` and its statistics."""
        layer = self.layers[name]
        owned = self._owned.get(name)
        if scatter:
            assert owned is not None  # only owned layers are scattered
            with self.phase('grad_scatter'):
                kept, product = scatter_owned(
                    self.communicator, self.assignment, name, layer, owned
                )
            self._scattered.add(name)
        else:
            grad = layer.grad
            assert grad is not None  # every rank has V' now
            product = layer.grad_statistics(held)
            kept = grad if owned is None else owned.take(grad)
        self._kept[name] = kept
        self._statistics[name] = product
        layer.clear_grad()

    def write_back(self) -> Parts:
        for part in self._parts:
            mine = [name for name in part if name in self._kept]
            held = local_grads(self._params(mine))
            try:
                for name in mine:
                    self._restore(name, held)
                yield mine, held
            finally:
                held.scatter()

    def _restore(self, name: str, held: Grads) -> None:
        """Give `name` back its preconditioned gradient, whole-shaped with
        this rank's kept entries (the rest is not written).
        """
        layer = self.layers[name]
        grad = self._kept[name]
        owned = self._owned.get(name)
        if owned is not None:
            raw = layer.module.get_grad(held)
            assert raw is not None  # the layer had a gradient
            whole = raw.to(grad.dtype)
            owned.put(whole, grad)
            grad = whole
        layer.set_preconditioned_grad(grad)


class Lossless(_Sharded):
    """`shard_mode='lossless'`: each component's whole gradients are
    gathered, so the result equals one process on the whole batch; under
    MEM-OPT each rank's entries of `V'` are scattered to it.
    """

    def _hold(self, names: list[str]) -> ShardGrads:
        with self.phase('grad_gather'):
            return gather_grads(self.communicator, self._params(names))

    def statistics(self) -> tuple[list[str], torch.Tensor | None]:
        names = list(self._statistics)
        if not names:
            return [], None
        stacked = torch.stack([self._statistics[n] for n in names])
        if not self._scattered:
            return names, stacked
        # KAISA gives a rank one receiver group for all layers, holding
        # one gradient worker (sender) of each.
        group = self.assignment.grad_receiver_group(next(iter(self._owned)))
        mask = torch.tensor(
            [[n in self._scattered] for n in names], device=stacked.device
        )
        summed = sum_over(
            self.communicator,
            torch.where(mask, stacked, torch.zeros_like(stacked)),
            group,
        )
        return names, torch.where(mask, summed, stacked)


class Local(_Sharded):
    """`shard_mode='local'`: each rank preconditions its own rows with
    the factor on the sharded side block-diagonal by shard (no gradient
    communication); the statistics are summed over the shard group.
    """

    def __init__(
        self,
        layers: Mapping[str, KFACBaseLayer],
        assignment: WorkAssignment,
        communicator: TorchDistributedCommunicator,
        phase: Phase,
        group: ProcessGroup,
    ) -> None:
        super().__init__(layers, assignment, communicator, phase)
        self.group = group

    def _hold(self, names: list[str]) -> ShardGrads:
        return local_grads(self._params(names))

    def statistics(self) -> tuple[list[str], torch.Tensor | None]:
        names = list(self._statistics)
        if not names:
            return [], None
        stacked = torch.stack([self._statistics[n] for n in names])
        with self.phase('kl_clip_allreduce'):
            return names, sum_over(self.communicator, stacked, self.group)


def make_distributor(
    shard_mode: str,
    layers: Mapping[str, KFACBaseLayer],
    assignment: WorkAssignment,
    communicator: TorchDistributedCommunicator,
    phase: Phase,
) -> GradientDistributor:
    """The distributor for `layers`: `Local` in local mode, `Lossless` when
    some parameter is sharded, `Replicated` otherwise.

    Raises:
        ValueError: local mode on layers it cannot handle (see
            `setup_local_mode`).
    """
    if shard_mode == 'local':
        group = setup_local_mode(layers, assignment)
        return Local(layers, assignment, communicator, phase, group)
    if any(
        is_sharded(p)
        for layer in layers.values()
        for p in layer.module.parameters()
    ):
        return Lossless(layers, assignment, communicator, phase)
    return Replicated(layers, assignment, communicator, phase)
