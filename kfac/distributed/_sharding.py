"""Sharded gradients (FSDP2 `fully_shard`, HSDP): who holds what, and the
collectives that move their pieces.

Under FSDP2 a parameter is a DTensor split by rows (`Shard(0)`) over the
shard dimension of its device mesh (replicated over the other dimension
under HSDP), and so is its `.grad` after `backward()`. K-FAC's factors
need nothing special: the hooks of a sharded module see ordinary,
whole-width tensors of the rank's own examples. The preconditioning
`V' = G⁻¹ V A⁻¹` mixes the rows of `V`, so the engine's sharded gradient
placements hold whole gradients while a layer is preconditioned
(`gather_grads`: one
`all_gather` per parameter over its shard group) or, in local mode, this
rank's rows in zeros (`local_grads`),
and write each rank's rows back into its shard afterwards
(`ShardGrads.scatter`).

DTensor is imported when a parameter is first examined, not with `kfac`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from collections.abc import Iterable
from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch

from kfac.distributed._communicator import Handle
from kfac.distributed._communicator import TorchDistributedCommunicator
from kfac.distributed._groups import get_rank
from kfac.distributed._groups import group_ranks
from kfac.layers.helper import Grads

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from kfac.assignment import WorkAssignment
    from kfac.layers.base import KFACBaseLayer

__all__ = [
    'Owned',
    'RowShard',
    'ShardGrads',
    'block_mask',
    'gather_grads',
    'is_sharded',
    'layout',
    'local_grads',
    'owned_entries',
    'owner_labels',
    'row_shard',
    'scatter_owned',
    'sum_over',
]


def _dtensor() -> type[torch.Tensor]:
    from torch.distributed.tensor import DTensor

    return DTensor


@dataclasses.dataclass(frozen=True)
class RowShard:
    """This rank's rows of a parameter split by `Shard(0)`.

    Attributes:
        group: the process group of the mesh dimension that splits rows.
        size: its number of ranks.
        index: this rank's place in it.
        rows: the parameter's number of rows.
    """

    group: ProcessGroup
    size: int
    index: int
    rows: int

    @property
    def span(self) -> slice:
        """This rank's rows: `torch.chunk`'s split, as DTensor's."""
        chunk = -(-self.rows // self.size)
        start = min(self.index * chunk, self.rows)
        return slice(start, min(start + chunk, self.rows))


def is_sharded(param: torch.Tensor) -> bool:
    """Whether `param` is a DTensor."""
    return isinstance(param, _dtensor())


def layout(param: torch.Tensor) -> str:
    """How `param` is laid out over ranks, as text that ranks compare:
    `'not sharded'` for a plain tensor, else the DTensor's placements and
    the shape of its device mesh (`'Shard(dim=0) over mesh (4,)'` under
    FSDP2, `'Replicate(), Shard(dim=0) over mesh (2, 2)'` under HSDP).
    Reads the parameter only: no collective.
    """
    if not is_sharded(param):
        return 'not sharded'
    placements = ', '.join(map(repr, param.placements))  # type: ignore[attr-defined]  # a DTensor
    mesh = tuple(param.device_mesh.shape)  # type: ignore[attr-defined]  # a DTensor
    return f'{placements} over mesh {mesh}'


def row_shard(param: torch.Tensor) -> RowShard | None:
    """How `param` is split over ranks; None for a plain tensor.

    Raises:
        ValueError: a DTensor that is not split by rows over exactly one
            mesh dimension (and replicated over any other), as a tensor-
            parallel or 2-D sharded parameter is.
    """
    if not is_sharded(param):
        return None
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor import Shard

    placements = tuple(param.placements)  # type: ignore[attr-defined]  # a DTensor
    shards = [i for i, p in enumerate(placements) if isinstance(p, Shard)]
    if len(shards) != 1 or not all(
        p == Shard(0) or isinstance(p, Replicate) for p in placements
    ):
        raise ValueError(
            'K-FAC supports DTensor parameters split by rows over one mesh '
            'dimension (FSDP2 fully_shard: Shard(0); HSDP: Replicate(), '
            f'Shard(0)); got placements {placements}',
        )
    mesh = param.device_mesh  # type: ignore[attr-defined]  # a DTensor
    dim = shards[0]
    return RowShard(
        group=mesh.get_group(dim),
        size=mesh.size(dim),
        index=mesh.get_local_rank(dim),
        rows=param.shape[0],
    )


def _unique(params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    seen: set[int] = set()
    unique = []
    for param in params:
        if id(param) not in seen:
            seen.add(id(param))
            unique.append(param)
    return unique


class ShardGrads(Grads):
    """Whole-shaped gradients of sharded parameters, standing in for
    their `.grad` until `scatter`
    writes this rank's rows back (or `clear()` drops them).
    """

    def __init__(self) -> None:
        super().__init__()
        self._shards: dict[int, RowShard] = {}

    def add(
        self, param: torch.Tensor, shard: RowShard, whole: torch.Tensor
    ) -> None:
        """Hold `whole` as `param`'s gradient (no communication)."""
        self.hold(param, whole)
        self._shards[id(param)] = shard

    def scatter(self) -> None:
        """Write this rank's rows of each held gradient into its shard of
        `.grad` (one is made for a parameter without it); no
        communication.
        """
        dtensor = _dtensor()
        for param, whole in self.items():
            rows = whole[self._shards[id(param)].span]
            grad = param.grad
            if grad is None:
                param.grad = dtensor.from_local(  # type: ignore[attr-defined]  # a DTensor class method
                    rows.to(param.dtype).clone(),
                    param.device_mesh,  # type: ignore[attr-defined]  # a DTensor
                    param.placements,  # type: ignore[attr-defined]  # a DTensor
                    shape=param.shape,
                    stride=param.stride(),
                )
            else:
                local = grad.to_local()  # type: ignore[attr-defined]  # a DTensor
                local.copy_(rows.reshape(local.shape))
        self.clear()


def _local_rows(param: torch.Tensor) -> torch.Tensor:
    """This rank's rows of `param`'s gradient (zeros without one)."""
    grad = param.grad
    if grad is None:
        grad = torch.zeros_like(param)
    local: torch.Tensor = grad.to_local()  # type: ignore[attr-defined]  # a DTensor
    return local


def gather_grads(
    communicator: TorchDistributedCommunicator,
    params: Iterable[torch.Tensor],
) -> ShardGrads:
    """Gather the whole gradients of the sharded `params`.

    Every rank of the shard groups calls it with the same parameters in
    the same order. Plain tensors are skipped; a sharded parameter without
    a gradient is taken as zeros. All gathers start before the first is
    waited for.
    """
    started: list[tuple[torch.Tensor, RowShard, Handle]] = []
    for param in _unique(params):
        shard = row_shard(param)
        if shard is None:
            continue
        local = _local_rows(param)
        handle = communicator.all_gather_rows(
            local.reshape(local.shape[0], math.prod(param.shape[1:])),
            rows=shard.rows,
            group=shard.group,
        )
        started.append((param, shard, handle))
    gathered = ShardGrads()
    for param, shard, handle in started:
        gathered.add(param, shard, handle.wait().reshape(param.shape))
    return gathered


def local_grads(params: Iterable[torch.Tensor]) -> ShardGrads:
    """Whole-shaped gradients of the sharded `params` holding only this
    rank's rows (zeros elsewhere); no communication (local mode).
    """
    held = ShardGrads()
    for param in _unique(params):
        shard = row_shard(param)
        if shard is None:
            continue
        local = _local_rows(param)
        whole = local.new_zeros(param.shape)
        whole[shard.span] = local
        held.add(param, shard, whole)
    return held


def owner_labels(
    params: Iterable[torch.Tensor],
    read: Callable[[Grads], torch.Tensor | None],
) -> torch.Tensor | None:
    """Which shard owns each entry of a layer's gradient matrix `V`.

    Holds, as the gradient of each sharded parameter, its rows' shard
    index (`-1` for entries of plain parameters), and returns what
    `read` (the layer's `get_grad`) assembles from them: `V`'s entries
    labelled by owner. None when no parameter is sharded. No
    communication.
    """
    held = ShardGrads()
    for param in _unique(params):
        shard = row_shard(param)
        if shard is None:
            continue
        labels = torch.empty(param.shape, dtype=torch.float64)
        chunk = -(-shard.rows // shard.size)
        for index in range(shard.size):
            labels[index * chunk : (index + 1) * chunk] = index
        held.add(param, shard, labels)
    return read(held) if len(held) else None


def block_mask(labels: torch.Tensor) -> tuple[str, torch.Tensor]:
    """The factor local mode makes block-diagonal, and its mask.

    Args:
        labels: `owner_labels`
            of a layer's `V`: constant along rows when the shards split
            `V`'s rows (the `G` side), along columns when they split its
            columns (an embedding's `V = (∇W)ᵀ`: the `A` side).

    Returns:
        `('G' or 'A', mask)`: `mask[i, j]` is whether the same shard owns
            rows (columns) `i` and `j`.

    Raises:
        ValueError: shards that split `V` neither by rows nor by columns.
    """
    if bool((labels == labels[:, :1]).all()):
        side, owners = 'G', labels[:, 0]
    elif bool((labels == labels[:1, :]).all()):
        side, owners = 'A', labels[0, :]
    else:
        raise ValueError(
            "shard_mode='local' needs shards that split a layer's "
            'gradient matrix by rows or by columns',
        )
    return side, owners[:, None] == owners[None, :]


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
    assert shard is not None  # sharded
    from torch.distributed.tensor import Shard

    placements = param.placements  # type: ignore[attr-defined]  # a DTensor
    dim = [isinstance(p, Shard) for p in placements].index(True)
    grid = param.device_mesh.mesh  # type: ignore[attr-defined]  # a DTensor
    shard_of = {
        int(rank): int((grid == rank).nonzero()[0, dim])
        for rank in grid.flatten()
    }
    return Owned(side, owners.long(), shard.index, shard_of)


def scatter_owned(
    communicator: TorchDistributedCommunicator,
    plan: WorkAssignment,
    name: str,
    layer: KFACBaseLayer,
    owned: Owned,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Send each rank its entries of `name`'s preconditioned gradient
    from the rank that computed it (MEM-OPT and hybrid fractions).

    Every rank of `name`'s gradient-receiver group calls it.

    Returns:
        This rank's entries, and the layer's `grad_statistics()` on the
        sender (zeros on the others: sum them over the receivers).
    """
    group = plan.grad_receiver_group(name)
    src = plan.src_grad_worker(name)
    ranks = group_ranks(group)
    rows, cols = layer.module.grad_shape
    other = cols if owned.side == 'G' else rows
    sizes = {
        k: int((owned.owners == k).sum()) * other
        for k in set(owned.shard_of.values())
    }
    longest = max(sizes[owned.shard_of[r]] for r in ranks)
    out = torch.empty(longest, dtype=layer.inv_dtype, device=layer.device)
    chunks = None
    product = torch.zeros(3, dtype=layer.inv_dtype, device=layer.device)
    if get_rank() == src:
        grad = layer.grad
        assert grad is not None  # the source preconditioned it
        product = layer.grad_statistics()
        chunks = []
        for rank in ranks:
            part = owned.take(grad, owned.shard_of[rank]).reshape(-1)
            padded = out.new_zeros(longest)
            padded[: part.numel()] = part
            chunks.append(padded)
    mine = communicator.scatter(out, chunks, src=src, group=group).wait()
    size = sizes[owned.index]
    shape = (
        (size // other, other) if owned.side == 'G' else (other, size // other)
    )
    return mine[:size].reshape(shape), product


def sum_over(
    communicator: TorchDistributedCommunicator,
    values: torch.Tensor,
    group: ProcessGroup | None,
) -> torch.Tensor:
    """`values` summed over `group`; every rank of `group` calls it."""
    return communicator.allreduce(values, group=group, average=False).wait()
