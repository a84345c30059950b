"""The collectives of one K-FAC step, as stateless functions.

Each function takes the communicator, the work assignment and the layers
concerned, starts its collectives, waits for them and stores the results in
the layers. The preconditioner decides when each runs; every rank calls
each function for the same layers in the same order.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from kfac.assignment import WorkAssignment
from kfac.distributed import Handle
from kfac.distributed import TorchDistributedCommunicator
from kfac.distributed import get_rank
from kfac.layers.base import FACTOR_NAMES
from kfac.layers.base import KFACBaseLayer


class KFACDistributedError(RuntimeError):
    """A K-FAC collective failed (e.g. a peer rank died or timed out)."""


def wait(handle: Handle, what: str) -> torch.Tensor:
    """``handle.wait()``, naming the K-FAC operation if it fails."""
    try:
        return handle.wait()
    except RuntimeError as err:
        raise KFACDistributedError(
            f'K-FAC {what} failed on rank {get_rank()}: {err}',
        ) from err


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


def broadcast_decompositions(
    comm: TorchDistributedCommunicator,
    plan: WorkAssignment,
    layers: Mapping[str, KFACBaseLayer],
) -> None:
    """Send each factor's decomposition from its inverse worker to the
    layer's gradient workers; store it there, or None if not finite.

    Called by every rank; a rank takes part only for the layers it is a
    gradient worker of. One host synchronisation checks all received
    tensors.
    """
    pending = []
    for name, layer in layers.items():
        if not plan.is_grad_worker(name):
            continue
        for f in FACTOR_NAMES:
            handles = layer.broadcast_decomposition(
                f,
                comm,
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


def broadcast_grads(
    comm: TorchDistributedCommunicator,
    plan: WorkAssignment,
    layers: Mapping[str, KFACBaseLayer],
) -> None:
    """Send preconditioned gradients from gradient workers to receivers.

    Called by every rank for the same layers: each rank receives a layer's
    gradient from :meth:`~kfac.assignment.WorkAssignment.src_grad_worker`
    over its gradient-receiver group.
    """
    handles = [
        (
            layer,
            layer.broadcast_grad(
                comm,
                src=plan.src_grad_worker(name),
                group=plan.grad_receiver_group(name),
            ),
        )
        for name, layer in layers.items()
    ]
    for layer, handle in handles:
        layer.grad = wait(handle, 'gradient broadcast')
