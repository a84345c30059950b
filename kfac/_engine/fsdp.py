"""Construction-time handling of FSDP2-sharded models.

`check_model` refuses, at construction,
the sharded set-ups whose gradients K-FAC cannot handle (FSDP1,
tensor-parallel DTensor parameters, CPU offload) and reshards every
`fully_shard` module; `setup_local_mode`
prepares the layers for `shard_mode='local'`. `torch.distributed.fsdp` is
imported only when a model is checked.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from torch import nn

from kfac.distributed._sharding import block_mask
from kfac.distributed._sharding import is_sharded
from kfac.distributed._sharding import owner_labels
from kfac.distributed._sharding import row_shard
from kfac.layers.attention import KFACMultiheadAttention

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from kfac.assignment import WorkAssignment
    from kfac.layers.base import KFACBaseLayer

__all__ = ['check_model', 'setup_local_mode']


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
        layer.mask_factor(side, mask)
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
        if is_sharded(param) and id(param) not in managed:
            raise ValueError(
                f'model: parameter {name} is a DTensor not managed by '
                'fully_shard (tensor parallelism, parallelize_module?); '
                'K-FAC supports FSDP2 and HSDP sharding only',
            )
        row_shard(param)
