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
from collections.abc import Sequence
from typing import TYPE_CHECKING
from typing import NamedTuple

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
    """A K-FAC collective failed (e.g. a peer rank died, or stopped
    calling collectives and the process group's timeout expired).

    Args:
        message: what failed, and why.
        phase: the phase of the step it belongs to (one of
            [`PHASES`][kfac.tracing.PHASES]; `''` outside a step).
        layers: the layers whose tensors travelled in the collective
            that failed (a bucket's: all of its layers).
    """

    def __init__(
        self, message: str, phase: str = '', layers: tuple[str, ...] = ()
    ) -> None:
        super().__init__(message)
        self.phase = phase
        """The phase of the step the collective belongs to."""
        self.layers = layers
        """The layers whose tensors it carried."""


def wait(
    handle: Handle,
    what: str,
    *,
    phase: str = '',
    layers: tuple[str, ...] = (),
) -> torch.Tensor:
    """`handle.wait()`, naming the K-FAC operation if it fails.

    Args:
        handle: the collective's handle.
        what: the operation, e.g. `'factor A allreduce'`.
        phase: the phase of the step it belongs to.
        layers: the layers it carries; a bucket's handle names the layers
            of the whole bucket instead (its `labels`).

    Raises:
        KFACDistributedError: the collective failed; the message names
            the operation, this rank, the phase and the layers.
    """
    try:
        return handle.wait()
    except RuntimeError as err:
        held = tuple(dict.fromkeys(handle.labels or layers))
        where = f' in phase {phase}' if phase else ''
        if held:
            where += f' (it carried layers {", ".join(held)})'
        raise KFACDistributedError(
            f'K-FAC {what} failed on rank {get_rank()}{where}: {err}',
            phase,
            held,
        ) from err


# Factors -----------------------------------------------------------------


def start_factor_allreduce(
    comm: TorchDistributedCommunicator,
    layer: KFACBaseLayer,
    *,
    name: str = '',
    group: ProcessGroup | None = None,
    bucketed: bool,
) -> list[Handle]:
    """Start averaging both running factors of `layer` over `group`.

    Every rank of `group` calls this for the same layers in the same order.
    A dense factor is flagged symmetric (it may travel as a packed
    triangle); a diagonal one travels as its vector. Bucketed, each is
    labelled with the layer's `name`.

    Returns:
        One handle per factor, in the order of `layer.factors`.
    """
    handles = []
    for factor in layer.factors:
        if factor.value is None:
            raise RuntimeError(
                f'{layer}: factor {factor.name} is allreduced before its '
                'first update',
            )
        symmetric = not factor.diagonal
        if bucketed:
            handle = comm.allreduce_bucketed(
                factor.value, group=group, symmetric=symmetric, label=name
            )
        else:
            handle = comm.allreduce(
                factor.value, group=group, symmetric=symmetric
            )
        handles.append(handle)
    return handles


def start_health_reduction(
    comm: TorchDistributedCommunicator,
    finite: list[torch.Tensor],
    shared: Sequence[float] | None = None,
) -> Handle | None:
    """Start summing, over all ranks, the non-finite statistics, and
    `shared`.

    Every rank calls this once per factor update with one 0-d bool tensor
    per updated layer (None when no layer was updated anywhere) and the
    same kind of `shared`: None, or values of the same length on every
    rank (all zeros: nothing is copied to the device).

    Returns:
        A handle to the float32 count of non-finite statistics (without
        `shared`), or to a float64 vector: per layer of `finite`, the
        number of ranks whose statistics of it were not finite, then
        `shared` summed.
    """
    if not finite:
        return None
    flags = torch.stack([~flag for flag in finite])
    if shared is None:
        count = flags.sum(dtype=torch.float32).reshape(1)
        return comm.allreduce(count, average=False)
    flags = flags.to(torch.float64)
    if any(shared):
        values = torch.tensor(shared, dtype=torch.float64)
        flags = torch.cat([flags, values.to(flags.device)])
    else:
        flags = torch.cat([flags, flags.new_zeros(len(shared))])
    return comm.allreduce(flags, average=False)


class Health(NamedTuple):
    """What the health reduction of one factor update found, identical
    on every rank.
    """

    reduced: bool
    """Whether some layer was reduced (else nothing was learnt)."""
    bad_count: int
    """Non-finite batch statistics, summed over the layers and ranks (0:
    the updates were committed)."""
    nonfinite: tuple[str, ...] = ()
    """The layers whose statistics were not finite on some rank (known
    only with `shared`)."""
    shared: tuple[float, ...] = ()
    """The `shared` values of every rank, summed."""


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
            self.comm, layer, name=name, bucketed=self.bucketed
        )
        self._started.append((name, layer, handles))
        self._finite.append(finite)

    def finish(self, shared: Sequence[float] | None = None) -> Health:
        """Wait for every started allreduce and store the averages.

        The updates are then committed on every layer reduced, or, if any
        rank had a non-finite batch statistic, all rolled back (every rank
        decides the same). One host read.

        Args:
            shared: None (only the count travels, a float32), or values
                summed over the ranks with the health count, of the same
                length on every rank; they travel only when some layer was
                started, and so do the names of the layers whose
                statistics were not finite.

        Returns:
            What the health count found.
        """
        bad = start_health_reduction(self.comm, self._finite, shared)
        self.comm.flush()
        for name, layer, handles in self._started:
            for factor, handle in zip(layer.factors, handles):
                value = wait(
                    handle,
                    f'factor {factor.name} allreduce',
                    phase='factor_allreduce',
                    layers=(name,),
                )
                layer.set_factor(factor.name, value)
        health = Health(False, 0)
        if bad is not None:
            read = wait(bad, 'health allreduce', phase='factor_allreduce')
            health = self._health(read.tolist(), shared is not None)
        for _, layer, _ in self._started:
            if health.bad_count:
                layer.rollback_factors()
            else:
                layer.commit_factors()
        self._started.clear()
        self._finite.clear()
        return health

    def _health(self, read: list[float], detailed: bool) -> Health:
        """The health count read on the host."""
        if not detailed:
            return Health(True, int(read[0]))
        count = len(self._finite)
        flags = read[:count]
        bad = tuple(n for (n, _, _), f in zip(self._started, flags) if f)
        return Health(True, int(sum(flags)), bad, tuple(read[count:]))


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
            pending.append((name, layer, f, handles))
    received = [
        (
            layer,
            f,
            tuple(
                wait(
                    h,
                    f'decomposition broadcast of factor {f}',
                    phase='decomposition_broadcast',
                    layers=(name,),
                )
                for h in hs
            ),
        )
        for name, layer, f, hs in pending
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

    Every rank calls this with the same keys (`'<layer>/<name>'`) in the
    same order (the
    statistics of the layers whose factors were updated in this step),
    each holding those of its own examples; a non-finite entry on one rank
    makes it non-finite on all, which the curvatures then handle alike.

    Returns:
        The averages, by key, identical on every rank.
    """
    handles = {
        key: (
            comm.allreduce_bucketed(value, label=key.split('/')[0])
            if bucketed
            else comm.allreduce(value)
        )
        for key, value in statistics.items()
    }
    comm.flush()
    return {
        key: wait(
            handle,
            f'curvature statistics allreduce of {key}',
            phase='scale_allreduce',
            layers=(key.split('/')[0],),
        )
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
            name,
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
    for name, layer, handle in handles:
        grad = wait(
            handle,
            'gradient broadcast',
            phase='grad_broadcast',
            layers=(name,),
        )
        layer.set_preconditioned_grad(grad)
