"""Gathering the statistics a curvature keeps on gradient workers.

EIGEN_ADAM keeps its second moments where the layer's gradient is
preconditioned (see
[`Curvature.grad_worker_statistics`][kfac.layers.curvature.base.Curvature.grad_worker_statistics]):
on every rank under COMM-OPT, on some ranks otherwise.
[`gather_worker_statistics`][kfac.distributed._statistics.gather_worker_statistics]
hands each rank a copy, so that any rank's `state_dict()` holds them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch

from kfac.distributed._communicator import TorchDistributedCommunicator

if TYPE_CHECKING:  # typing only: the engine hands over its plan and layers
    from kfac.assignment import WorkAssignment
    from kfac.layers.base import KFACBaseLayer

__all__ = ['gather_worker_statistics']


def gather_worker_statistics(
    comm: TorchDistributedCommunicator,
    plan: WorkAssignment,
    layers: Mapping[str, KFACBaseLayer],
) -> dict[str, dict[str, torch.Tensor]]:
    """The statistics of every layer whose curvature keeps them on its
    gradient workers, on this rank.

    Without gradient receivers (every rank preconditions every layer) each
    rank's own are returned. Otherwise every rank gets them from its
    [`src_grad_worker`][kfac.assignment.WorkAssignment.src_grad_worker]
    over its gradient-receiver group (the path of the preconditioned
    gradient), a statistic not held there travelling as zeros. Every rank
    calls it with the same layers, in the same order.
    """
    kept = {
        name: layer
        for name, layer in layers.items()
        if layer.curvature.grad_worker_statistics
    }
    if not plan.broadcast_gradients():
        return {n: x.curvature.saved_statistics() for n, x in kept.items()}
    handles = []
    for name, layer in kept.items():
        curvature = layer.curvature
        held = (
            curvature.saved_statistics() if plan.is_grad_worker(name) else {}
        )
        for key, shape in curvature.statistic_shapes().items():
            tensor = held.get(key)
            if tensor is None:
                tensor = torch.zeros(
                    shape, dtype=layer.inv_dtype, device=layer.device
                )
            handle = comm.broadcast(
                tensor,
                src=plan.src_grad_worker(name),
                group=plan.grad_receiver_group(name),
            )
            handles.append((name, key, handle))
    gathered: dict[str, dict[str, torch.Tensor]] = {n: {} for n in kept}
    for name, key, handle in handles:
        gathered[name][key] = handle.wait()
    return gathered
