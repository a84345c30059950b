"""Every rank builds the same K-FAC setup, or every rank raises the same
`ValueError` at construction, naming the first difference.

Each case builds, on two gloo ranks, a preconditioner that differs on
rank 1 in one way (a skipped layer, the gradient worker fraction, one
more `Linear` with gradients averaged by hand, the FSDP2 shard mode,
modules left unsharded, the HSDP mesh); each rank writes the message it
raised to `tmp_path`, and the parent checks that both ranks raised the
expected message. Equal setups construct and train, and the check costs
exactly one collective: counted by the communicator and by wrapping every
collective of `torch.distributed` during construction.
"""

from __future__ import annotations

import collections
import json
import pathlib
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from kfac.config import ShardingConfig
from kfac.distributed._exchange import KFACDistributedError
from kfac.preconditioner import KFACPreconditioner
from testing import fsdp
from testing.distributed import run_distributed
from testing.models import classification_data
from testing.options import EVERY_STEP

WORLD = 2
SUFFIX = (
    '; every rank must build the preconditioner from the same model with '
    'the same options'
)


def _mlp(extra: bool = False) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3)]
    if extra:
        layers += [nn.ReLU(), nn.Linear(3, 3)]
    return nn.Sequential(*layers)


def _skip_layers(rank: int) -> KFACPreconditioner:
    return KFACPreconditioner(_mlp(), skip_layers=['2'] if rank else None)


def _fraction(rank: int) -> KFACPreconditioner:
    return KFACPreconditioner(_mlp(), grad_worker_fraction=(1.0, 0.5)[rank])


def _extra_linear(rank: int) -> KFACPreconditioner:
    return KFACPreconditioner(_mlp(extra=rank == 1))


def _shard_mode(rank: int) -> KFACPreconditioner:
    mode = ShardingConfig(shard_mode=('lossless', 'local')[rank])
    return KFACPreconditioner(fsdp.shard(fsdp.fresh()), sharding=mode)


def _unsharded(rank: int) -> KFACPreconditioner:
    model = fsdp.fresh()
    if rank:  # one block only: the other modules stay plain
        fully_shard(model.up)
    else:
        fsdp.shard(model)
    return KFACPreconditioner(model)


def _hsdp_mesh(rank: int) -> KFACPreconditioner:
    meshes = [  # every rank makes both: making a mesh is collective
        init_device_mesh('cpu', shape, mesh_dim_names=('replicate', 'shard'))
        for shape in ((1, WORLD), (WORLD, 1))
    ]
    return KFACPreconditioner(fsdp.shard(fsdp.fresh(), mesh=meshes[rank]))


# Each case: rank r's preconditioner, and the difference named.
CASES: dict[str, tuple[Callable[[int], KFACPreconditioner], str]] = {
    'skip_layers': (
        _skip_layers,
        "registered modules: ['0', '2'] on ranks [0], ['0'] on ranks [1]",
    ),
    'grad_worker_fraction': (
        _fraction,
        'grad_worker_fraction: 1.0 on ranks [0], 0.5 on ranks [1]',
    ),
    'extra Linear': (
        _extra_linear,
        "registered modules: ['0', '2'] on ranks [0], ['0', '2', '4'] on "
        'ranks [1]',
    ),
    'shard_mode': (
        _shard_mode,
        "sharding.shard_mode: 'lossless' on ranks [0], 'local' on ranks [1]",
    ),
    'unsharded': (
        _unsharded,
        "module 'embed' weight sharding: Shard(dim=0) over mesh (2,) on "
        'ranks [0], not sharded on ranks [1]',
    ),
    'HSDP mesh': (
        _hsdp_mesh,
        "module 'embed' weight sharding: Replicate(), Shard(dim=0) over "
        'mesh (1, 2) on ranks [0], Replicate(), Shard(dim=0) over mesh '
        '(2, 1) on ranks [1]',
    ),
}


def _fails(*args: object, **kwargs: object) -> None:
    raise RuntimeError('injected failure')


def mismatches(out: str) -> None:
    rank = dist.get_rank()
    raised = {}
    for case, (build, _) in CASES.items():
        with pytest.raises(ValueError) as info:
            build(rank)
        raised[case] = str(info.value)
    with pytest.MonkeyPatch.context() as patch:  # the descriptions fail
        patch.setattr(dist, 'all_gather_object', _fails)
        with pytest.raises(KFACDistributedError) as failed:
            _skip_layers(rank)
    raised['failed gather'] = str(failed.value)
    path = pathlib.Path(out) / f'rank{rank}.json'
    path.write_text(json.dumps(raised))


@pytest.mark.timeout(120)
def test_a_difference_raises_the_same_error_on_every_rank(
    tmp_path: pathlib.Path,
) -> None:
    run_distributed(mismatches, WORLD, str(tmp_path), tmp_path=tmp_path)
    for rank in range(WORLD):
        raised = json.loads((tmp_path / f'rank{rank}.json').read_text())
        for case, (_, expected) in CASES.items():
            message = f'K-FAC setup differs across ranks: {expected}{SUFFIX}'
            assert raised[case] == message, (rank, case)
        assert raised['failed gather'] == (
            f'K-FAC setup agreement failed on rank {rank}: injected failure'
        )


COLLECTIVES = (
    'all_gather',
    'all_gather_into_tensor',
    'all_gather_object',
    'all_gather_single',
    'all_reduce',
    'all_to_all',
    'all_to_all_single',
    'barrier',
    'broadcast',
    'broadcast_object_list',
    'gather',
    'gather_object',
    'reduce',
    'reduce_scatter',
    'reduce_scatter_tensor',
    'scatter',
    'scatter_object_list',
)
"""The collectives of `torch.distributed` counted during construction."""


def _counted(
    function: Callable[..., Any], name: str, calls: collections.Counter[str]
) -> Callable[..., Any]:
    def counted(*args: Any, **kwargs: Any) -> Any:
        calls[name] += 1
        return function(*args, **kwargs)

    return counted


def equal_setups(out: str) -> None:
    rank = dist.get_rank()
    found: dict[str, dict[str, object]] = {}
    for fraction in ('comm_opt', 'mem_opt'):
        calls: collections.Counter[str] = collections.Counter()
        with pytest.MonkeyPatch.context() as patch:
            for name in COLLECTIVES:
                function = getattr(dist, name, None)
                if function is not None:  # all_gather_single: torch 2.13
                    patch.setattr(dist, name, _counted(function, name, calls))
            model = _mlp().double()
            precon = KFACPreconditioner(
                model, grad_worker_fraction=fraction, **EVERY_STEP
            )
        comm = precon.communicator
        found[fraction] = {
            'calls': dict(calls),
            'started': dict(comm.collectives_started),
            'bytes': dict(comm.bytes_communicated),
        }
        x, y = classification_data(4, (6,), seed=rank)  # rank's own data
        F.cross_entropy(model(x), y).backward()
        for param in model.parameters():  # data parallel, by hand
            assert param.grad is not None  # backward() set it
            dist.all_reduce(param.grad)
        precon.step()
        grads = torch.cat([p.grad.flatten() for p in model.parameters()])  # type: ignore[union-attr]  # backward() set them
        both = [torch.empty_like(grads) for _ in range(WORLD)]
        dist.all_gather(both, grads)
        found[fraction]['grads equal'] = torch.equal(both[0], both[1])
    (pathlib.Path(out) / f'rank{rank}.json').write_text(json.dumps(found))


@pytest.mark.timeout(120)
def test_equal_setups_pay_one_collective(tmp_path: pathlib.Path) -> None:
    run_distributed(equal_setups, WORLD, str(tmp_path), tmp_path=tmp_path)
    # torch 2.13 names the collective all_gather_single, earlier releases
    # all_gather_into_tensor (kfac.distributed uses whichever is there)
    gather = (
        'all_gather_single'
        if hasattr(dist, 'all_gather_single')
        else 'all_gather_into_tensor'
    )
    for rank in range(WORLD):
        found = json.loads((tmp_path / f'rank{rank}.json').read_text())
        for fraction, facts in found.items():
            assert facts['calls'] == {gather: 1}, fraction
            assert facts['started'] == {'agreement': 1}, fraction
            assert facts['bytes'] == {'agreement': 32}, fraction
            assert facts['grads equal'] is True, fraction
