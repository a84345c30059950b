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
from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch

from kfac.sharding import GatheredGrads
from kfac.sharding import block_mask
from kfac.sharding import gather_grads
from kfac.sharding import is_sharded
from kfac.sharding import local_grads
from kfac.sharding import owner_labels
from kfac.sharding import row_shard

if TYPE_CHECKING:
    from kfac.distributed import TorchDistributedCommunicator
    from kfac.hyperparams import HyperparameterValues
    from kfac.layers.base import KFACBaseLayer

__all__ = ['Owned', 'ShardedStep', 'components', 'owned_entries']

Owned = tuple[str, torch.Tensor]
"""`(side, mask)`: the rows (`'G'`) or columns (`'A'`) of a layer's `V`
that this rank's shards hold."""


def owned_entries(layer: KFACBaseLayer) -> Owned | None:
    """The entries of `layer`'s `V` held by this rank's shards; None for a
    layer without sharded parameters. No communication.
    """
    params = layer.module.parameters()
    shards = [s for s in map(row_shard, params) if s is not None]
    if not shards:
        return None
    labels = owner_labels(params, layer.module.get_grad)
    assert labels is not None  # some parameter is sharded
    side, _ = block_mask(labels)
    owners = labels[:, 0] if side == 'G' else labels[0, :]
    return side, owners == shards[0].index


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


def _take(grad: torch.Tensor, owned: Owned) -> torch.Tensor:
    side, mask = owned
    mask = mask.to(grad.device)
    return grad[mask] if side == 'G' else grad[:, mask]


def _put(whole: torch.Tensor, owned: Owned, part: torch.Tensor) -> None:
    side, mask = owned
    mask = mask.to(whole.device)
    if side == 'G':
        whole[mask] = part
    else:
        whole[:, mask] = part


class ShardedStep:
    """Mixin of the engine: the step's preconditioning on sharded models
    (see the module docstring).
    """

    _layers: dict[str, KFACBaseLayer]
    _local_group: object | None
    _owned: dict[str, Owned]
    communicator: TorchDistributedCommunicator

    if TYPE_CHECKING:

        def _phase(
            self, name: str
        ) -> contextlib.AbstractContextManager[None]: ...

        def _precondition(self, damping: float, names: list[str]) -> None: ...

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

    def _precondition_sharded(
        self, active: list[str], values: HyperparameterValues
    ) -> None:
        kept: dict[str, torch.Tensor] = {}
        vg: list[torch.Tensor] = []
        parts = components(active, self._layers)
        for part in parts:
            held = self._hold(part, whole=True)
            try:
                self._precondition(values.damping, part)
                for name in part:
                    layer = self._layers[name]
                    grad = layer.grad
                    assert grad is not None  # active: every rank has V'
                    vg.append(layer.grad_inner_product())
                    owned = self._owned.get(name)
                    kept[name] = grad if owned is None else _take(grad, owned)
                    layer.grad = layer.raw_grad = None
            finally:
                held.release()
        with self._phase('kl_clip'):
            flags, scale = (
                self._clip(torch.stack(vg), values) if vg else ([], None)
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
                        _put(whole, owned, grad)
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
