"""What K-FAC communicates, per rank and per step, from layer shapes.

Derived from what :class:`kfac.base_preconditioner.BaseKFACPreconditioner`
asks the communicator for:

* **factors** (every factor-update step, when the world has more than one
  rank): ``A`` (``a x a``) and ``G`` (``g x g``) of every layer are
  allreduced over the world, bucketed; packed as ``n (n + 1) / 2`` elements
  with ``symmetry_aware``. Every rank takes part in every one. Then one
  more allreduce of a 1-element float32 (:data:`HEALTH_BYTES`): the number
  of non-finite statistics, so that every rank keeps or rolls back the
  update alike.
* **decompositions** (every decomposition step, when there is more than one
  gradient worker per layer): each factor's inverse worker broadcasts its
  decomposition to the layer's gradient-worker group. Eigen: ``Q`` (``n x
  n``) and the eigenvalues (``n``) per factor, or, with
  ``compute_eigenvalue_outer_product``, ``Q_A`` alone and ``Q_G`` with the
  ``g x a`` matrix ``1 / (d_G d_Aᵀ + λ)``; never packed (not symmetric).
  Inverse: one symmetric ``n x n`` inverse per factor, packable. EKFAC:
  ``Q`` and the eigenvalues per factor (its ``1 / (S + λ)`` is formed where
  ``S`` is updated), broadcast to *every* rank whatever the fraction: each
  rank estimates the scaling from its own examples. Every rank takes part
  in every EKFAC layer's broadcasts (there are some whenever the world has
  more than one rank). EIGEN_ADAM: ``Q`` and the eigenvalues per factor,
  as eigen without ``compute_eigenvalue_outer_product`` (its second
  moments stay on the gradient workers and never travel). ONE_SIDED:
  ``Q`` and the eigenvalues of the factor it preconditions with, one value
  (the mean eigenvalue) of the other. With ``factor_rank`` ``k``, a layer
  with a dense factor longer than ``k`` is a low-rank layer: each such
  factor sends ``Q_k`` (``n x k``) and ``k + 1`` values (eigen and inverse
  alike, never packed), its other factor what the plain method sends without
  ``compute_eigenvalue_outer_product`` (which low-rank layers ignore).
* **the gradient's own factors** (``source='gradient'``, EIGEN_ADAM and
  ONE_SIDED): formed on every rank from the averaged gradient, so nothing
  of them is allreduced; with every layer so, the factor-update step has
  no factor allreduce and no health allreduce either. Their
  decompositions travel as K-FAC's do.
* **EKFAC's scaling** (every factor-update step, more than one rank): each
  layer's batch ``S``, shaped like its ``g x a`` gradient, allreduced over
  the world after the decompositions, bucketed like the factors but never
  packed (not symmetric), and no health allreduce (a non-finite ``S``
  becomes non-finite on every rank, which each handles alike).
* **gradients** (every step, when a layer has fewer gradient workers than
  ranks): each layer's preconditioned ``g x a`` gradient is broadcast over
  every gradient-receiver group, from the group's member among the layer's
  gradient workers. Every rank takes part for every layer.

Two accountings:

* :func:`counted` is the communicator's: the payload bytes of each
  collective call, counted once on every rank that calls it (a rank counts
  a broadcast it receives as much as one it sends), and the number of calls
  (buckets for the factor allreduce). The real runs of
  :mod:`benchmarks.bytecheck` must match it exactly.
* :func:`traffic` is the network's: bytes each rank sends and receives,
  with a ring allreduce (each rank sends and receives ``2 (p - 1) / p`` of
  the payload) and a pipelined chain broadcast from the root through the
  group in rank order (every rank but the root receives the payload, every
  rank but the root's predecessor forwards it): the bandwidth-optimal
  algorithms NCCL uses for large messages.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from benchmarks.floor import LayerShape
from kfac.placement import KAISAPlan

__all__ = [
    'COMM_PHASES',
    'HEALTH_BYTES',
    'CommConfig',
    'bucket_count',
    'counted',
    'decomposition_payloads',
    'factor_payloads',
    'traffic',
]

#: Bytes of the health allreduce that follows each factor allreduce.
HEALTH_BYTES = 4
#: The communicating phases, as :mod:`kfac.tracing` names them.
COMM_PHASES = (
    'factor_allreduce',
    'decomposition_broadcast',
    'scale_allreduce',
    'grad_broadcast',
)


@dataclasses.dataclass(frozen=True)
class CommConfig:
    """The preconditioner options that decide what travels.

    Attributes:
        method: ``'eigen'``, ``'inverse'``, ``'ekfac'``, ``'eigen_adam'``
            or ``'one_sided'``.
        prediv: ``compute_eigenvalue_outer_product`` (what travels changes
            for eigen only).
        symmetry_aware: symmetric matrices travel as packed triangles.
        itemsize: bytes per element of factors, decompositions, gradients.
        bucket_cap_mb: ``allreduce_bucket_cap_mb`` (0: no bucketing).
        factor_rank: ``factor_rank`` (eigen and inverse), or None.
        source: ``'kfac'`` or ``'gradient'`` (eigen_adam and one_sided).
        side: ``'input'`` or ``'output'``, the factor one_sided uses.
    """

    method: str = 'eigen'
    prediv: bool = True
    symmetry_aware: bool = False
    itemsize: int = 4
    bucket_cap_mb: float = 25.0
    factor_rank: int | None = None
    source: str = 'kfac'
    side: str = 'input'

    @property
    def side_factor(self) -> str:
        """The factor one_sided preconditions with: ``'A'`` or ``'G'``."""
        return 'A' if self.side == 'input' else 'G'


_TWO_TENSORS = ('ekfac', 'eigen_adam', 'one_sided')
"""The methods that send ``Q`` and the eigenvalues whatever ``prediv``."""


def _square(n: int, packed: bool) -> int:
    return n * (n + 1) // 2 if packed else n * n


def factor_payloads(layer: LayerShape, config: CommConfig) -> list[int]:
    """Elements allreduced for ``A`` then ``G`` (none for the gradient's
    own factors).
    """
    if config.source == 'gradient':
        return []
    packed = config.symmetry_aware
    return [_square(layer.a_dim, packed), _square(layer.g_dim, packed)]


def decomposition_payloads(
    layer: LayerShape, factor: str, config: CommConfig
) -> list[int]:
    """Elements of each tensor broadcast for ``factor`` (``'A'``/``'G'``)."""
    n = layer.a_dim if factor == 'A' else layer.g_dim
    k = config.factor_rank
    dense = [layer.g_dim] + ([] if layer.a_diagonal else [layer.a_dim])
    if k is not None and max(dense) > k:  # a low-rank layer
        if n > k:
            return [n * k, k + 1]
        if config.method == 'eigen':
            return [n * n, n]
    if config.method == 'inverse':
        return [_square(n, config.symmetry_aware)]
    if config.method == 'one_sided' and factor != config.side_factor:
        return [1]
    if not config.prediv or config.method in _TWO_TENSORS:
        return [n * n, n]
    return [n * n] if factor == 'A' else [n * n, layer.grad_numel]


def bucket_count(payload_bytes: Sequence[int], cap_mb: float) -> int:
    """Allreduce calls that bucketing makes for payloads in call order.

    A bucket is started when the next payload would take it past the cap,
    and as soon as it holds the cap or more; ``cap_mb == 0`` is one call per
    payload.
    """
    if cap_mb == 0:
        return len(payload_bytes)
    cap = int(cap_mb * 2**20)
    calls, held = 0, -1  # -1: no open bucket
    for nbytes in payload_bytes:
        if held >= 0 and held + nbytes > cap:
            calls, held = calls + 1, -1
        held = max(held, 0) + nbytes
        if held >= cap:
            calls, held = calls + 1, -1
    return calls + (held >= 0)


def counted(
    layers: Sequence[LayerShape],
    plan: KAISAPlan,
    rank: int,
    config: CommConfig,
) -> dict[str, tuple[int, int]]:
    """Per communicating phase, ``(bytes, calls)`` counted on ``rank`` once.

    ``layers`` in the order their factors are reduced (for the bucket
    count; the backward order under ``update_factors_in_hook``).
    """
    size = config.itemsize
    result = dict.fromkeys(COMM_PHASES, (0, 0))
    if plan.world_size == 1:
        return result
    payloads = [e * size for x in layers for e in factor_payloads(x, config)]
    if payloads:
        calls = bucket_count(payloads, config.bucket_cap_mb)
        result['factor_allreduce'] = (sum(payloads) + HEALTH_BYTES, calls + 1)
    ekfac = config.method == 'ekfac'
    if plan.grad_workers > 1 or ekfac:
        sent = [
            e * size
            for x in layers
            if ekfac
            or rank in plan.grad_worker_groups[plan.layer_groups[x.name]]
            for f in ('A', 'G')
            for e in decomposition_payloads(x, f, config)
        ]
        result['decomposition_broadcast'] = (sum(sent), len(sent))
    if ekfac:  # in model order: the reverse of the factors'
        scales = [x.grad_numel * size for x in reversed(layers)]
        calls = bucket_count(scales, config.bucket_cap_mb)
        result['scale_allreduce'] = (sum(scales), calls)
    if plan.grad_workers < plan.world_size:
        grads = [x.grad_numel * size for x in layers]
        result['grad_broadcast'] = (sum(grads), len(grads))
    return result


def _chain(
    sent: torch.Tensor,
    recv: torch.Tensor,
    group: Sequence[int],
    root: int,
    nbytes: float,
) -> None:
    """Add a chain broadcast of ``nbytes`` from ``root`` over ``group``, a
    run of consecutive ranks (a gradient-worker group).
    """
    first, last = group[0], group[-1]
    assert list(group) == list(range(first, last + 1))
    recv[first : last + 1] += nbytes
    sent[first : last + 1] += nbytes
    recv[root] -= nbytes
    sent[group[group.index(root) - 1]] -= nbytes


def traffic(
    layers: Sequence[LayerShape],
    plan: KAISAPlan,
    config: CommConfig,
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Per phase, bytes ``(sent, received)`` by each rank once (float64)."""
    world = plan.world_size
    zeros = torch.zeros(world, dtype=torch.float64)
    result = {p: (zeros.clone(), zeros.clone()) for p in COMM_PHASES}
    if world == 1:
        return result
    total = sum(sum(factor_payloads(x, config)) for x in layers)
    if total:
        nbytes = total * config.itemsize + HEALTH_BYTES
        ring = 2.0 * (world - 1) / world * nbytes
        result['factor_allreduce'] = (zeros + ring, zeros + ring)
    ekfac = config.method == 'ekfac'
    if ekfac:
        scales = sum(x.grad_numel for x in layers) * config.itemsize
        ring = 2.0 * (world - 1) / world * scales
        result['scale_allreduce'] = (zeros + ring, zeros + ring)
    if plan.grad_workers > 1 or ekfac:
        sent, recv = result['decomposition_broadcast']
        for x in layers:
            group = plan.grad_worker_groups[plan.layer_groups[x.name]]
            if ekfac:  # to every rank
                group = tuple(range(world))
            for f in ('A', 'G'):
                nbytes = sum(decomposition_payloads(x, f, config))
                root = plan.inv_workers[x.name][f]
                _chain(sent, recv, group, root, nbytes * config.itemsize)
    if plan.grad_workers < world:
        _gradient_traffic(layers, plan, config, *result['grad_broadcast'])
    return result


def _gradient_traffic(
    layers: Sequence[LayerShape],
    plan: KAISAPlan,
    config: CommConfig,
    sent: torch.Tensor,
    recv: torch.Tensor,
) -> None:
    """Chain broadcasts over every receiver group, vectorised.

    Receiver group ``j`` is the ranks ``j, j + gw, ...``; for a layer of
    worker group ``k`` its root is the group's ``k``-th member, so every
    rank outside worker group ``k`` receives, and every rank outside worker
    group ``k - 1`` (the roots' predecessors) sends.
    """
    gw = plan.grad_workers
    blocks = plan.world_size // gw
    for x in layers:
        k = plan.layer_groups[x.name]
        nbytes = float(x.grad_numel * config.itemsize)
        recv += nbytes
        recv[k * gw : (k + 1) * gw] -= nbytes
        sent += nbytes
        last = (k - 1) % blocks
        sent[last * gw : (last + 1) * gw] -= nbytes
