"""The preconditioning of a step on a sharded (FSDP2) model, in bounded
memory.

Whole gradients are needed only while a layer is preconditioned. The
layers are therefore taken in *components* (layers that share a
parameter, such as the q, k and v projections of one packed attention
weight, or the tiles of a blocked layer, go together; any other layer
alone), and for each component in turn the step

1. assembles the whole gradients of its parameters (lossless mode: an
   `all_gather` per parameter; local mode: this rank's rows in zeros),
2. preconditions its layers (and, with MEM-OPT, broadcasts their
   preconditioned gradients),
3. computes each layer's `Σ V' ⊙ V` for the KL clip and keeps only the
   entries of `V'` this rank owns (the rows, or an embedding's columns,
   of its shards),

then lets the whole gradients go. Once every component is done, the KL
clip's scale is known, and each component's kept entries are written into
this rank's shards of `.grad`. A rank so holds at most one component's
whole gradients at a time, plus its own share of every preconditioned
gradient (the size of its shards). The result is the same as
preconditioning all layers at once.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Shard

from kfac.sharding import GatheredGrads
from kfac.sharding import block_mask
from kfac.sharding import gather_grads
from kfac.sharding import is_sharded
from kfac.sharding import local_grads
from kfac.sharding import owner_labels
from kfac.sharding import row_shard

if TYPE_CHECKING:
    from kfac.assignment import WorkAssignment
    from kfac.distributed import TorchDistributedCommunicator
    from kfac.hyperparams import HyperparameterValues
    from kfac.layers.base import KFACBaseLayer

__all__ = ['Owned', 'ShardedStep', 'components', 'owned_entries']


@dataclasses.dataclass(frozen=True)
class Owned:
    """Which entries of a layer's `V` each shard holds."""

    side: str
    """`'G'`: the shards split `V`'s rows; `'A'`: its columns."""
    owners: torch.Tensor
    """The shard index of each row (column) of `V`."""
    index: int
    """This rank's shard index."""
    shard_of: Mapping[int, int]
    """The shard index of every global rank of the mesh."""

    def take(
        self, grad: torch.Tensor, index: int | None = None
    ) -> torch.Tensor:
        """The entries of `grad` (shaped as `V`) that shard `index` holds
        (default: this rank's).
        """
        mask = self.owners.to(grad.device) == (
            self.index if index is None else index
        )
        return grad[mask] if self.side == 'G' else grad[:, mask]

    def put(self, whole: torch.Tensor, part: torch.Tensor) -> None:
        """Write this rank's entries `part` into `whole`."""
        mask = self.owners.to(whole.device) == self.index
        if self.side == 'G':
            whole[mask] = part
        else:
            whole[:, mask] = part


def owned_entries(layer: KFACBaseLayer) -> Owned | None:
    """The entries of `layer`'s `V` held by each shard; None for a layer
    without sharded parameters. No communication.
    """
    params = layer.module.parameters()
    sharded = [p for p in params if row_shard(p) is not None]
    if not sharded:
        return None
    labels = owner_labels(params, layer.module.get_grad)
    assert labels is not None  # some parameter is sharded
    side, _ = block_mask(labels)
    owners = labels[:, 0] if side == 'G' else labels[0, :]
    param = sharded[0]
    shard = row_shard(param)
    assert shard is not None and isinstance(param, DTensor)
    dim = [isinstance(p, Shard) for p in param.placements].index(True)
    grid = param.device_mesh.mesh
    shard_of = {
        int(rank): int((grid == rank).nonzero()[0, dim])
        for rank in grid.flatten()
    }
    return Owned(side, owners.long(), shard.index, shard_of)


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


class ShardedStep:
    """Mixin of the engine: the step's preconditioning on sharded models
    (see the module docstring).
    """

    _layers: dict[str, KFACBaseLayer]
    assignment: WorkAssignment
    _local_group: object | None
    _owned: dict[str, Owned]
    communicator: TorchDistributedCommunicator

    if TYPE_CHECKING:

        def _phase(
            self, name: str
        ) -> contextlib.AbstractContextManager[None]: ...

        def _precondition(
            self,
            damping: float,
            active: list[str],
            broadcast: list[str] | None = None,
        ) -> None: ...

        def _clip(
            self, vg: torch.Tensor, values: HyperparameterValues
        ) -> tuple[list[bool], torch.Tensor | None]: ...

        def _write_back(
            self,
            layers: list[tuple[str, KFACBaseLayer]],
            flags: list[bool],
            scale: torch.Tensor | None,
        ) -> None: ...

    def _hold(self, names: list[str], whole: bool) -> GatheredGrads:
        """The component's gradients, whole (lossless mode, when `whole`)
        or as this rank's rows in zeros.
        """
        params = [
            p for n in names for p in self._layers[n].module.parameters()
        ]
        if whole and self._local_group is None:
            with self._phase('grad_gather'):
                return gather_grads(self.communicator, params)
        return local_grads(params)

    def _scatter(
        self, name: str, owned: Owned
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Send each rank its entries of `name`'s preconditioned gradient
        from the rank that computed it (MEM-OPT and hybrid fractions).

        Returns:
            This rank's entries, and `Σ V' ⊙ V` on the sender (0 on the
            others; `_gather_products` sums it over the receivers).
        """
        layer = self._layers[name]
        plan = self.assignment
        group = plan.grad_receiver_group(name)
        src = plan.src_grad_worker(name)
        ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
        rows, cols = layer.module.grad_shape
        other = cols if owned.side == 'G' else rows
        sizes = {
            k: int((owned.owners == k).sum()) * other
            for k in set(owned.shard_of.values())
        }
        longest = max(sizes[owned.shard_of[r]] for r in ranks)
        out = torch.empty(longest, dtype=layer.inv_dtype, device=layer.device)
        chunks = None
        product = torch.zeros((), dtype=layer.inv_dtype, device=layer.device)
        if dist.get_rank() == src:
            grad = layer.grad
            assert grad is not None  # the source preconditioned it
            product = layer.grad_inner_product()
            chunks = []
            for rank in ranks:
                part = owned.take(grad, owned.shard_of[rank]).reshape(-1)
                padded = out.new_zeros(longest)
                padded[: part.numel()] = part
                chunks.append(padded)
        with self._phase('grad_scatter'):
            mine = self.communicator.scatter(
                out, chunks, src=src, group=group
            ).wait()
        size = sizes[owned.index]
        shape = (
            (size // other, other)
            if owned.side == 'G'
            else (other, size // other)
        )
        return mine[:size].reshape(shape), product

    def _gather_products(
        self, vg: list[torch.Tensor], scattered: list[bool]
    ) -> torch.Tensor:
        """Every layer's `Σ V' ⊙ V` on every rank: those of scattered
        layers summed over the receivers (one sender each).
        """
        stacked = torch.stack(vg)
        if not any(scattered):
            return stacked
        # KAISA gives a rank one receiver group for all layers, holding
        # one gradient worker (sender) of each.
        group = self.assignment.grad_receiver_group(next(iter(self._owned)))
        mask = torch.tensor(scattered, device=stacked.device)
        summed = self.communicator.allreduce(
            torch.where(mask, stacked, torch.zeros_like(stacked)),
            group=group,
            average=False,
        ).wait()
        return torch.where(mask, summed, stacked)

    def _precondition_sharded(
        self, active: list[str], values: HyperparameterValues
    ) -> None:
        kept: dict[str, torch.Tensor] = {}
        vg: list[torch.Tensor] = []
        scattered: list[bool] = []
        parts = components(active, self._layers)
        sends = self.assignment.broadcast_gradients()
        for part in parts:
            held = self._hold(part, whole=True)
            try:
                scatter = [n for n in part if sends and n in self._owned]
                broadcast = [n for n in part if n not in scatter]
                self._precondition(values.damping, part, broadcast)
                for name in part:
                    layer = self._layers[name]
                    owned = self._owned.get(name)
                    if name in scatter:
                        assert owned is not None  # scattered: owned
                        kept[name], product = self._scatter(name, owned)
                    else:
                        grad = layer.grad
                        assert grad is not None  # every rank has V'
                        product = layer.grad_inner_product()
                        kept[name] = (
                            grad if owned is None else owned.take(grad)
                        )
                    vg.append(product)
                    scattered.append(name in scatter)
                    layer.grad = layer.raw_grad = None
            finally:
                held.release()
        with self._phase('kl_clip'):
            flags, scale = (
                self._clip(self._gather_products(vg, scattered), values)
                if vg
                else ([], None)
            )
        ok = dict(zip(kept, flags))
        for part in parts:
            mine = [name for name in part if name in kept]
            held = self._hold(mine, whole=False)
            try:
                for name in mine:
                    layer = self._layers[name]
                    owned = self._owned.get(name)
                    grad = kept[name]
                    if owned is not None and ok[name]:
                        raw = layer.module.get_grad()
                        assert raw is not None  # the layer had a gradient
                        whole = raw.to(grad.dtype)
                        owned.put(whole, grad)
                        grad = whole
                    layer.grad = grad
                with self._phase('write_back'):
                    self._write_back(
                        [(n, self._layers[n]) for n in mine],
                        [ok[n] for n in mine],
                        scale,
                    )
            finally:
                held.scatter()


def is_sharded_model(layers: Mapping[str, KFACBaseLayer]) -> bool:
    """Whether some registered layer has a sharded (DTensor) parameter."""
    return any(
        is_sharded(p)
        for layer in layers.values()
        for p in layer.module.parameters()
    )
