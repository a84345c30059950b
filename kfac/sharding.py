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
from collections.abc import Iterable
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

    from kfac.distributed import TorchDistributedCommunicator

__all__ = [
    'GatheredGrads',
    'RowShard',
    'check_model',
    'current_grad',
    'gather_grads',
    'is_sharded',
    'row_shard',
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


def _check_attention(name: str, module: nn.Module) -> None:
    from kfac.layers.attention import KFACMultiheadAttention

    from torch.distributed.fsdp import FSDPModule

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
