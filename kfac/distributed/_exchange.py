"""The collectives of one K-FAC step: every one the engine issues.

Layers expose tensors (running factors, decompositions and their layout,
preconditioned gradients); the functions and the
`FactorReduction` here move them between
ranks through a communicator
([`TorchDistributedCommunicator`][kfac.distributed.TorchDistributedCommunicator]),
where the [`WorkAssignment`][kfac.assignment.WorkAssignment] says, and
store the results back through the layers' methods. The preconditioner
decides when each runs; every rank calls each of them for the same layers
in the same order.

A rank that has no valid decomposition of a factor still takes part in
its broadcast: it sends NaNs, and receivers store "no decomposition"
(None) for anything that is not finite. Both sides build what they hand
to the broadcast with one function,
`decomposition_payload`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch

from kfac.distributed._communicator import Handle
from kfac.distributed._communicator import TorchDistributedCommunicator
from kfac.distributed._groups import get_rank
from kfac.enums import FACTOR_NAMES

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from kfac.assignment import WorkAssignment
    from kfac.layers.base import KFACBaseLayer


class KFACDistributedError(RuntimeError):
    """A K-FAC collective failed (e.g. a peer rank died or timed out)."""


def wait(handle: Handle, what: str) -> torch.Tensor:
    """`handle.wait()`, naming the K-FAC operation if it fails."""
    try:
        return handle.wait()
    except RuntimeError as err:
        raise KFACDistributedError(
            f'K-FAC {what} failed on rank {get_rank()}: {err}',
        ) from err


# Factors -----------------------------------------------------------------


def start_factor_allreduce(
    comm: TorchDistributedCommunicator,
    layer: KFACBaseLayer,
    *,
    group: ProcessGroup | None = None,
    bucketed: bool,
) -> list[Handle]:
    """Start averaging both running factors of `layer` over `group`.

    Every rank of `group` calls this for the same layers in the same order.
    A dense factor is flagged symmetric (it may travel as a packed
    triangle); a diagonal one travels as its vector.

    Returns:
        One handle per factor, in the order of `layer.factors`.
    """
    reduce = comm.allreduce_bucketed if bucketed else comm.allreduce
    handles = []
    for factor in layer.factors:
        if factor.value is None:
            raise RuntimeError(
                f'{layer}: factor {factor.name} is allreduced before its '
                'first update',
            )
        handles.append(
            reduce(factor.value, group=group, symmetric=not factor.diagonal)
        )
    return handles


def start_health_reduction(
    comm: TorchDistributedCommunicator,
    finite: list[torch.Tensor],
) -> Handle | None:
    """Start summing, over all ranks, the number of non-finite statistics.

    Every rank calls this once per factor update with one 0-d bool tensor
    per updated layer (None when no layer was updated anywhere).
    """
    if not finite:
        return None
    flags = torch.stack([~flag for flag in finite])
    count = flags.sum(dtype=torch.float32).reshape(1)
    return comm.allreduce(count, average=False)


class FactorReduction:
    """The factor allreduce of one factor-update step, with its health
    count.

    `start` each layer as soon as
    its running average is updated (in the backward hook, to overlap the
    backward pass), then `finish`
    once per step. Every rank starts the same layers in the same order.

    Args:
        comm: the communicator.
        bucketed: allreduce factors in buckets.
    """

    def __init__(
        self, comm: TorchDistributedCommunicator, *, bucketed: bool
    ) -> None:
        self.comm = comm
        self.bucketed = bucketed
        self._started: list[tuple[str, KFACBaseLayer, list[Handle]]] = []
        self._finite: list[torch.Tensor] = []

    def start(
        self, name: str, layer: KFACBaseLayer, finite: torch.Tensor
    ) -> None:
        """Start the allreduce of `layer`'s updated factors.

        Args:
            name: the layer's name.
            layer: a layer whose `update_factors` just returned `finite`.
            finite: 0-d bool tensor, whether its batch statistics were
                finite.
        """
        handles = start_factor_allreduce(
            self.comm, layer, bucketed=self.bucketed
        )
        self._started.append((name, layer, handles))
        self._finite.append(finite)

    def finish(self) -> int:
        """Wait for every started allreduce and store the averages.

        The updates are then committed on every layer reduced, or, if any
        rank had a non-finite batch statistic, all rolled back (every rank
        decides the same).

        Returns:
            The number of non-finite batch statistics summed over all
            ranks (0: the updates were committed).
        """
        bad = start_health_reduction(self.comm, self._finite)
        self.comm.flush()
        for _, layer, handles in self._started:
            for factor, handle in zip(layer.factors, handles):
                value = wait(handle, f'factor {factor.name} allreduce')
                layer.set_factor(factor.name, value)
        bad_count = 0 if bad is None else int(wait(bad, 'health allreduce'))
        for _, layer, _ in self._started:
            if bad_count:
                layer.rollback_factors()
            else:
                layer.commit_factors()
        self._started.clear()
        self._finite.clear()
        return bad_count


# Decompositions ----------------------------------------------------------


def decomposition_payload(
    layer: KFACBaseLayer, name: str
) -> tuple[torch.Tensor, ...]:
    """What this rank hands to the broadcast of factor `name`'s
    decomposition: its own decomposition, or NaNs of the same layout.

    The source sends NaNs when it has no valid decomposition; on the
    other ranks the tensors are receive buffers.
    """
    tensors = layer.decomposition(name)
    if tensors is not None:
        return tensors
    return tuple(
        torch.full(shape, math.nan, dtype=layer.inv_dtype, device=layer.device)
        for shape, _ in layer.decomposition_layout(name)
    )


def start_decomposition_broadcast(
    comm: TorchDistributedCommunicator,
    layer: KFACBaseLayer,
    name: str,
    *,
    src: int,
    group: ProcessGroup | None,
) -> list[Handle]:
    """Start broadcasting factor `name`'s decomposition from `src`.

    Every rank of `group` (the layer's gradient workers) calls this.

    Returns:
        One handle per tensor of the layer's `decomposition_layout`.
    """
    layout = layer.decomposition_layout(name)
    payload = decomposition_payload(layer, name)
    return [
        comm.broadcast(t, src=src, group=group, symmetric=symmetric)
        for t, (_, symmetric) in zip(payload, layout)
    ]


def broadcast_decompositions(
    comm: TorchDistributedCommunicator,
    plan: WorkAssignment,
    layers: Mapping[str, KFACBaseLayer],
) -> None:
    """Send each factor's decomposition from its inverse worker to the
    ranks that hold the layer's decompositions (its gradient workers, or
    every rank for shared bases); store it there, or None if not finite.

    Called by every rank; a rank takes part only for the layers whose
    decompositions it holds. One host synchronisation checks all received
    tensors.
    """
    pending = []
    for name, layer in layers.items():
        if not plan.holds_decomposition(name):
            continue
        for f in FACTOR_NAMES:
            handles = start_decomposition_broadcast(
                comm,
                layer,
                f,
                src=plan.inv_worker(name, f),
                group=plan.factor_group(name, f),
            )
            pending.append((layer, f, handles))
    received = [
        (layer, f, tuple(wait(h, 'decomposition broadcast') for h in hs))
        for layer, f, hs in pending
    ]
    checks = [torch.isfinite(t).all() for _, _, ts in received for t in ts]
    flags = torch.stack(checks).tolist() if checks else []
    index = 0
    for layer, f, tensors in received:
        valid = all(flags[index : index + len(tensors)])
        index += len(tensors)
        layer.set_decomposition(f, tensors if valid else None)


# Curvatures' own statistics (EKFAC's scaling) ---------------------------


def allreduce_statistics(
    comm: TorchDistributedCommunicator,
    statistics: Mapping[str, torch.Tensor],
    *,
    bucketed: bool,
) -> dict[str, torch.Tensor]:
    """Average each of the curvatures' batch statistics over all ranks
    (see
    [`Curvature.batch_statistics`][kfac.layers.curvature.base.Curvature.batch_statistics]).

    Every rank calls this with the same keys in the same order (the
    statistics of the layers whose factors were updated in this step),
    each holding those of its own examples; a non-finite entry on one rank
    makes it non-finite on all, which the curvatures then handle alike.

    Returns:
        The averages, by key, identical on every rank.
    """
    reduce = comm.allreduce_bucketed if bucketed else comm.allreduce
    handles = {key: reduce(value) for key, value in statistics.items()}
    comm.flush()
    return {
        key: wait(handle, f'curvature statistics allreduce of {key}')
        for key, handle in handles.items()
    }


# Gradients ---------------------------------------------------------------


def start_grad_broadcast(
    comm: TorchDistributedCommunicator,
    layer: KFACBaseLayer,
    *,
    src: int,
    group: ProcessGroup | None,
) -> Handle:
    """Start broadcasting `layer`'s preconditioned gradient from `src`.

    Every rank of `group` (the gradient receivers served by `src`) calls
    this; receivers hand over a buffer of the gradient's shape.
    """
    return comm.broadcast(layer.grad_buffer(), src=src, group=group)


def broadcast_grads(
    comm: TorchDistributedCommunicator,
    plan: WorkAssignment,
    layers: Mapping[str, KFACBaseLayer],
) -> None:
    """Send preconditioned gradients from gradient workers to receivers.

    Called by every rank for the same layers: each rank receives a layer's
    gradient from its
    [`src_grad_worker`][kfac.assignment.WorkAssignment.src_grad_worker]
    over its gradient-receiver group.
    """
    handles = [
        (
            layer,
            start_grad_broadcast(
                comm,
                layer,
                src=plan.src_grad_worker(name),
                group=plan.grad_receiver_group(name),
            ),
        )
        for name, layer in layers.items()
    ]
    for layer, handle in handles:
        layer.set_preconditioned_grad(wait(handle, 'gradient broadcast'))
