"""A checkpoint written at world size W loads at other world sizes."""

from __future__ import annotations

import pathlib
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from kfac.preconditioner import KFACPreconditioner
from testing import oracle
from testing.asserts import assert_rel_close
from testing.distributed import run_distributed
from testing.models import TinyCNN
from testing.models import classification_data

GLOBAL_BATCH = 12
OPTIONS: dict[str, Any] = {
    'compute_method': 'eigen',
    'factor_update_steps': 1,
    'inv_update_steps': 2,
    'damping': 0.01,
    'kl_clip': 0.01,
}


def setup(
    strategy: str,
) -> tuple[nn.Module, nn.Module, KFACPreconditioner, torch.optim.Optimizer]:
    torch.manual_seed(7)
    model = TinyCNN().double()
    wrapped = oracle.wrap(model)
    precon = KFACPreconditioner(
        wrapped, grad_worker_fraction=strategy, **OPTIONS
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return model, wrapped, precon, optimizer


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    return classification_data(GLOBAL_BATCH, (2, 8, 8), seed=step)


def steps(
    wrapped: nn.Module,
    precon: KFACPreconditioner,
    optimizer: torch.optim.Optimizer,
    which: range,
) -> None:
    oracle.train_steps(
        wrapped, precon, optimizer, _batch, which, oracle.this_rank()
    )


def resume(strategy: str, checkpoint: pathlib.Path) -> torch.Tensor:
    model, wrapped, precon, optimizer = setup(strategy)
    state = torch.load(checkpoint, weights_only=True)
    model.load_state_dict(state['model'])
    optimizer.load_state_dict(state['optimizer'])
    precon.load_state_dict(state['kfac'])
    steps(wrapped, precon, optimizer, range(state['kfac']['steps'], 5))
    return oracle.flat_params(model)


def save_then_continue(out_dir: str) -> None:
    """At W=2 (MEM-OPT): train, save, go on; then resume from the save."""
    out = pathlib.Path(out_dir)
    model, wrapped, precon, optimizer = setup('mem_opt')
    steps(wrapped, precon, optimizer, range(3))
    if dist.get_rank() == 0:
        state = {
            'model': model.state_dict(),
            'optimizer': optimizer.state_dict(),
            'kfac': precon.state_dict(),
        }
        torch.save(state, out / 'checkpoint.pt')
    dist.barrier()
    steps(wrapped, precon, optimizer, range(3, 5))
    final = oracle.flat_params(model)
    resumed = resume('mem_opt', out / 'checkpoint.pt')
    assert_rel_close(
        resumed, final, rtol=1e-9, label='resume across world sizes'
    )
    if dist.get_rank() == 0:
        torch.save(final, out / 'final.pt')


def load_elsewhere(out_dir: str, strategy: str) -> None:
    out = pathlib.Path(out_dir)
    resumed = resume(strategy, out / 'checkpoint.pt')
    final = torch.load(out / 'final.pt', weights_only=True)
    assert_rel_close(
        resumed, final, rtol=1e-9, label='resume across world sizes'
    )


@pytest.mark.timeout(240)
def test_checkpoint_moves_between_world_sizes(tmp_path: pathlib.Path) -> None:
    run_distributed(save_then_continue, 2, str(tmp_path), tmp_path=tmp_path)
    # world size 1, no process group at all
    resumed = resume('comm_opt', tmp_path / 'checkpoint.pt')
    final = torch.load(tmp_path / 'final.pt', weights_only=True)
    assert_rel_close(
        resumed, final, rtol=1e-9, label='resume across world sizes'
    )
    # world size 3, each rank holding a third of the batch
    run_distributed(
        load_elsewhere, 3, str(tmp_path), 'mem_opt', tmp_path=tmp_path
    )
