"""Sharded gradients (FSDP2 `fully_shard`, HSDP): read whole, written back
to their shards.

Under FSDP2 a parameter is a DTensor split by rows (`Shard(0)`) over the
shard dimension of its device mesh (replicated over the other dimension
under HSDP), and so is its `.grad` after `backward()`. K-FAC's factors
need nothing special: the forward and backward hooks of a sharded module
see ordinary, whole-width tensors of the rank's own examples, so `A` and
`G` are formed and allreduced over all ranks exactly as under DDP.

The preconditioning `V' = G⁻¹ V A⁻¹` mixes the rows of `V` (the `G` side),
so in *lossless* mode, the only one so far, each step gathers every
registered layer's whole gradient
([`gather_grads`][kfac.sharding.gather_grads], one `all_gather` per
parameter over its shard group, through the
communicator so its bytes are counted), lets the layers read and write
whole gradients through [`current_grad`][kfac.sharding.current_grad]
while they precondition, and writes each rank's rows back into its shard
of `.grad` ([`GatheredGrads.scatter`][kfac.sharding.GatheredGrads.scatter]).
Since every rank then holds the same whole gradients, the KL clip and the
gradient-worker fraction keep their meaning, and the result equals one
process on the whole batch.

[`check_model`][kfac.sharding.check_model] refuses, at construction, the
sharded set-ups whose gradients this cannot handle: FSDP1, tensor-parallel
DTensor parameters and CPU offload.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from collections.abc import Iterable
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Replicate
from torch.distributed.tensor import Shard

from kfac.handles import Handle

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from kfac.assignment import WorkAssignment
    from kfac.distributed import TorchDistributedCommunicator
    from kfac.layers.base import KFACBaseLayer

__all__ = [
    'GatheredGrads',
    'RowShard',
    'block_mask',
    'check_model',
    'current_grad',
    'gather_grads',
    'is_sharded',
    'local_grads',
    'owner_labels',
    'row_shard',
    'setup_local_mode',
]

_WHOLE: dict[int, torch.Tensor] = {}
"""Whole gradients of sharded parameters, by `id`, while a step
preconditions (the parameters are kept alive meanwhile)."""


@dataclass(frozen=True)
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
    return isinstance(param, DTensor)


def row_shard(param: torch.Tensor) -> RowShard | None:
    """How `param` is split over ranks; None for a plain tensor.

    Raises:
        ValueError: a DTensor that is not split by rows over exactly one
            mesh dimension (and replicated over any other), as a tensor-
            parallel or 2-D sharded parameter is.
    """
    if not isinstance(param, DTensor):
        return None
    placements = tuple(param.placements)
    shards = [i for i, p in enumerate(placements) if isinstance(p, Shard)]
    if len(shards) != 1 or not all(
        p == Shard(0) or isinstance(p, Replicate) for p in placements
    ):
        raise ValueError(
            'K-FAC supports DTensor parameters split by rows over one mesh '
            'dimension (FSDP2 fully_shard: Shard(0); HSDP: Replicate(), '
            f'Shard(0)); got placements {placements}',
        )
    mesh = param.device_mesh
    dim = shards[0]
    return RowShard(
        group=mesh.get_group(dim),
        size=mesh.size(dim),
        index=mesh.get_local_rank(dim),
        rows=param.shape[0],
    )


def current_grad(param: torch.Tensor) -> torch.Tensor | None:
    """`param.grad`, or its whole gradient while it is gathered."""
    whole = _WHOLE.get(id(param))
    return param.grad if whole is None else whole


class GatheredGrads:
    """Whole gradients of sharded parameters, until `scatter()`.

    Built by [`gather_grads`][kfac.sharding.gather_grads]. While it lives,
    [`current_grad`][kfac.sharding.current_grad] returns a parameter's
    whole gradient, which the layers read and overwrite.
    """

    def __init__(self) -> None:
        self._params: list[tuple[torch.Tensor, RowShard]] = []

    def __len__(self) -> int:
        return len(self._params)

    def add(
        self, param: torch.Tensor, shard: RowShard, whole: torch.Tensor
    ) -> None:
        """Hold `whole` as `param`'s gradient (no communication)."""
        _WHOLE[id(param)] = whole
        self._params.append((param, shard))

    def release(self) -> None:
        """Let the whole gradients go, writing nothing."""
        for param, _ in self._params:
            _WHOLE.pop(id(param))
        self._params.clear()

    def scatter(self) -> None:
        """Write each rank's rows of the whole gradients into its shards.

        Local: every rank holds the same whole gradients. A parameter
        that had no `.grad` gets one.
        """
        for param, shard in self._params:
            rows = _WHOLE.pop(id(param))[shard.span]
            grad = param.grad
            if grad is None:
                assert isinstance(param, DTensor)  # only DTensors are held
                param.grad = DTensor.from_local(
                    rows.to(param.dtype).clone(),
                    param.device_mesh,
                    param.placements,
                    shape=param.shape,
                    stride=param.stride(),
                )
            else:
                local = grad.to_local()  # type: ignore[attr-defined]
                local.copy_(rows.reshape(local.shape))
        self._params.clear()


def gather_grads(
    communicator: TorchDistributedCommunicator,
    params: Iterable[torch.Tensor],
) -> GatheredGrads:
    """Gather the whole gradients of the sharded `params`.

    Every rank of the shard groups calls it with the same parameters in
    the same order. Plain tensors are skipped. A sharded parameter without
    a gradient is taken as zeros. All gathers are started before the
    first is waited for.
    """
    started: list[tuple[torch.Tensor, RowShard, Handle]] = []
    seen: set[int] = set()
    for param in params:
        shard = row_shard(param)
        if shard is None or id(param) in seen:
            continue
        seen.add(id(param))
        grad = param.grad
        if grad is None:
            local = torch.zeros_like(param).to_local()  # type: ignore[attr-defined]
        else:
            local = grad.to_local()  # type: ignore[attr-defined]
        handle = communicator.all_gather_rows(
            local.reshape(local.shape[0], math.prod(param.shape[1:])),
            rows=shard.rows,
            group=shard.group,
        )
        started.append((param, shard, handle))
    gathered = GatheredGrads()
    for param, shard, handle in started:
        gathered.add(param, shard, handle.wait().reshape(param.shape))
    return gathered


def _unique(params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    seen: set[int] = set()
    unique = []
    for param in params:
        if id(param) not in seen:
            seen.add(id(param))
            unique.append(param)
    return unique


def _local_rows(param: torch.Tensor) -> torch.Tensor:
    """This rank's rows of `param`'s gradient (zeros without one)."""
    grad = param.grad
    if grad is None:
        grad = torch.zeros_like(param)
    local: torch.Tensor = grad.to_local()  # type: ignore[attr-defined]
    return local


def local_grads(params: Iterable[torch.Tensor]) -> GatheredGrads:
    """Whole-shaped gradients of the sharded `params` holding only this
    rank's rows (zeros elsewhere); no communication (local mode).
    """
    held = GatheredGrads()
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
    params: Iterable[torch.Tensor], read: Callable[[], torch.Tensor | None]
) -> torch.Tensor | None:
    """Which shard owns each entry of a layer's gradient matrix `V`.

    Holds, as the gradient of each sharded parameter, its rows' shard
    index (`-1` for entries of plain parameters), and returns what
    `read()` (the layer's `get_grad`) assembles from them: `V`'s entries
    labelled by owner. None when no parameter is sharded. No
    communication.
    """
    held = GatheredGrads()
    for param in _unique(params):
        shard = row_shard(param)
        if shard is None:
            continue
        labels = torch.empty(param.shape, dtype=torch.float64)
        chunk = -(-shard.rows // shard.size)
        for index in range(shard.size):
            labels[index * chunk : (index + 1) * chunk] = index
        held.add(param, shard, labels)
    if not len(held):
        return None
    try:
        return read()
    finally:
        held.release()


def block_mask(labels: torch.Tensor) -> tuple[str, torch.Tensor]:
    """The factor local mode makes block-diagonal, and its mask.

    Args:
        labels: [`owner_labels`][kfac.sharding.owner_labels] of a layer's
            `V`: constant along rows when the shards split `V`'s rows (the
            `G` side), along columns when they split its columns (an
            embedding's `V = (∇W)ᵀ`: the `A` side).

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


def setup_local_mode(
    layers: Mapping[str, KFACBaseLayer], assignment: WorkAssignment
) -> ProcessGroup:
    """Mask the factors of the sharded layers for local mode; return the
    process group over which their shards are split.

    Raises:
        ValueError: a registered layer is not sharded, the layers are
            sharded over different groups, or some rank is not a gradient
            worker of every layer (local mode needs `COMM_OPT`).
    """
    groups: dict[int, ProcessGroup] = {}
    plain = []
    for name, layer in layers.items():
        params = layer.module.parameters()
        shards = [s for s in map(row_shard, params) if s is not None]
        if len(shards) != len(params):
            plain.append(name)
            continue
        groups.update((id(s.group), s.group) for s in shards)
        labels = owner_labels(params, layer.module.get_grad)
        assert labels is not None  # some parameter is sharded
        side, mask = block_mask(labels)
        if not layer.factor(side).diagonal:
            layer.factor_masks[side] = mask
    if plain:
        raise ValueError(
            "shard_mode='local' needs every registered layer sharded with "
            f'fully_shard; not sharded: {", ".join(plain)}',
        )
    if len(groups) != 1:
        raise ValueError(
            "shard_mode='local' needs every layer sharded over the same "
            f'process group; got {len(groups)} groups',
        )
    if assignment.broadcast_gradients() or not all(
        assignment.is_grad_worker(name) for name in layers
    ):
        raise ValueError(
            "shard_mode='local' needs grad_worker_fraction='comm_opt' "
            '(every rank preconditions its own rows)',
        )
    return next(iter(groups.values()))


def _check_attention(name: str, module: nn.Module) -> None:
    from torch.distributed.fsdp import FSDPModule

    from kfac.layers.attention import KFACMultiheadAttention

    if (
        isinstance(module, FSDPModule)
        and isinstance(module, nn.MultiheadAttention)
        and not isinstance(module, KFACMultiheadAttention)
    ):
        raise ValueError(
            f'model: the nn.MultiheadAttention {name} was passed to '
            'fully_shard before K-FAC converted it; call '
            'kfac.layers.attention.convert_attention(model) before '
            'fully_shard',
        )


def check_model(model: nn.Module) -> None:
    """Refuse sharded set-ups whose gradients K-FAC cannot handle.

    Every `fully_shard` module is resharded first (`FSDPModule.reshard()`:
    the root keeps its parameters gathered after a forward pass, e.g. an
    evaluation before the preconditioner is built), so that the hooks are
    registered on the sharded parameters, the ones that get gradients.

    Raises:
        TypeError: the model uses FSDP1 (`FullyShardedDataParallel`).
        ValueError: a parameter is a DTensor outside `fully_shard`
            (tensor parallelism) or not split by rows, a `fully_shard`
            module offloads to the CPU, or an `nn.MultiheadAttention` was
            sharded itself before
            [`convert_attention`][kfac.layers.attention.convert_attention].
    """
    from torch.distributed.fsdp import CPUOffloadPolicy
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp import FullyShardedDataParallel

    managed: set[int] = set()
    for name, module in model.named_modules():
        _check_attention(name, module)
        if isinstance(module, FullyShardedDataParallel):
            raise TypeError(
                'model: FSDP1 (FullyShardedDataParallel) is not supported; '
                'shard the model with torch.distributed.fsdp.fully_shard '
                '(FSDP2), which K-FAC supports',
            )
        if isinstance(module, FSDPModule):
            module.reshard()
            group = module._get_fsdp_state()._fsdp_param_group
            if group is None:
                continue
            if isinstance(group.offload_policy, CPUOffloadPolicy):
                raise ValueError(
                    f'model: module {name or "(root)"} was sharded with '
                    'fully_shard(offload_policy=CPUOffloadPolicy()); K-FAC '
                    'does not support CPU offload (its gradients live on '
                    'the CPU, its factors on the accelerator)',
                )
            managed.update(id(p.sharded_param) for p in group.fsdp_params)
    for name, param in model.named_parameters():
        if isinstance(param, DTensor) and id(param) not in managed:
            raise ValueError(
                f'model: parameter {name} is a DTensor not managed by '
                'fully_shard (tensor parallelism, parallelize_module?); '
                'K-FAC supports FSDP2 and HSDP sharding only',
            )
        row_shard(param)
