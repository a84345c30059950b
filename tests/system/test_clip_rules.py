"""The relative clip (`relative_clip`) and `optimizer=` under FSDP2 at
W = 2: the norms of the clip are summed over what each rank holds.

* Lossless mode with MEM-OPT (each rank's entries of `V'` scattered to it,
  the statistics summed over the receivers) equals one process on the
  whole batch.
* Local mode (each rank preconditions its own rows): the written gradient
  is `ν V'` with `ν = min(1, κ ‖V‖ / ‖V'‖)` over the whole, sharded
  gradients, `V'` being local mode's unclipped result.
"""

from __future__ import annotations

import json
import math
import pathlib

import pytest
import torch
import torch.distributed as dist
from torch import nn

from kfac.config import ShardingConfig
from kfac.config import StatisticsConfig
from kfac.preconditioner import KFACPreconditioner
from testing import fsdp
from testing.asserts import WORST
from testing.asserts import relative_error
from testing.distributed import run_distributed
from testing.torch_release import FSDP2_ON_CPU

KAPPA = 0.5
BATCH = 12


def _lossless(part: tuple[int, int]) -> nn.Module:
    model = fsdp.fresh()
    if part[1] > 1:
        fsdp.shard(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    precon = KFACPreconditioner(
        model,
        inv_update_steps=2,
        damping=0.01,
        relative_clip=KAPPA,
        grad_worker_fraction='mem_opt',
        optimizer=optimizer,
        statistics=StatisticsConfig(loss_average='batch+sequence'),
    )
    fsdp.run(model, precon, optimizer, range(fsdp.STEPS), part)
    assert precon.metrics()['kl_clip_scale'] < 1.0  # the clip was active
    return model


def _mlp() -> nn.Sequential:
    torch.manual_seed(3)
    return nn.Sequential(
        nn.Linear(4, 7), nn.Tanh(), nn.Linear(7, 5), nn.Tanh(), nn.Linear(5, 3)
    ).double()


def _local_grads(kl_clip: float | None) -> tuple[list[torch.Tensor], ...]:
    """One local-mode step: the raw and the written whole gradients."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    model = _mlp()
    for module in model:
        if isinstance(module, nn.Linear):
            fully_shard(module)
    fully_shard(model)
    precon = KFACPreconditioner(
        model,
        damping=0.01,
        relative_clip=kl_clip,
        sharding=ShardingConfig(shard_mode='local'),
    )
    generator = torch.Generator().manual_seed(11)
    x = torch.randn(BATCH, 4, dtype=torch.float64, generator=generator)
    y = torch.randint(0, 3, (BATCH,), generator=generator)
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
    nn.functional.cross_entropy(model(x[mine]), y[mine]).backward()

    def whole() -> list[torch.Tensor]:
        grads = []
        for param in model.parameters():
            grad = param.grad
            assert isinstance(grad, DTensor)
            grads.append(grad.full_tensor().detach().clone())
        return grads

    raw = whole()
    precon.step()
    return raw, whole()


def _body(out_dir: str) -> None:
    expected = torch.load(pathlib.Path(out_dir) / 'expected.pt')
    rank, world = dist.get_rank(), dist.get_world_size()
    model = _lossless((rank, world))
    results = {'lossless': relative_error(fsdp.whole_params(model), expected)}
    raw, unclipped = _local_grads(None)
    _, clipped = _local_grads(KAPPA)
    norm = math.sqrt(sum(float(g.square().sum()) for g in raw))
    pre = math.sqrt(sum(float(g.square().sum()) for g in unclipped))
    nu = min(1.0, KAPPA * norm / pre)
    results['local nu'] = nu
    results['local'] = relative_error(
        torch.cat([g.reshape(-1) for g in clipped]),
        torch.cat([nu * g.reshape(-1) for g in unclipped]),
    )
    if rank == 0:
        (pathlib.Path(out_dir) / 'results.json').write_text(
            json.dumps(results)
        )


@FSDP2_ON_CPU
@pytest.mark.timeout(200)
def test_relative_clip_under_fsdp(tmp_path: pathlib.Path) -> None:
    torch.save(fsdp.whole_params(_lossless((0, 1))), tmp_path / 'expected.pt')
    run_distributed(_body, 2, str(tmp_path), tmp_path=tmp_path, timeout=180)
    results = json.loads((tmp_path / 'results.json').read_text())
    assert results['local nu'] < 1.0  # the clip was active
    WORST['FSDP2 W=2 relative clip, MEM-OPT vs single process'] = results[
        'lossless'
    ]
    WORST['FSDP2 W=2 relative clip, local mode vs formula'] = results['local']
    assert results['lossless'] <= 1e-10
    assert results['local'] <= 1e-12
