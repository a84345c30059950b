"""Smoke tests of the example scripts: a few steps, no download."""

from __future__ import annotations

import pathlib

import pytest
import torch.distributed as dist

from examples import train_ddp
from testing.distributed import run_distributed

QUICK = ['--epochs', '2', '--steps-per-epoch', '2', '--batch-size', '8']


def test_train_ddp_single_process(tmp_path: pathlib.Path) -> None:
    checkpoint = str(tmp_path / 'ck.pt')
    accuracy = train_ddp.main([*QUICK, '--checkpoint', checkpoint])
    assert 0.0 <= accuracy <= 1.0
    # resume: the last epoch is done, so nothing more to train
    train_ddp.main([*QUICK, '--epochs', '3', '--checkpoint', checkpoint])
    assert train_ddp.main([*QUICK, '--no-kfac', '--strategy', '1.0']) >= 0.0


def _ddp_body(checkpoint: str) -> None:
    assert dist.get_world_size() == 2
    for strategy in ('mem_opt', '0.5'):
        train_ddp.main(
            [*QUICK, '--strategy', strategy, '--checkpoint', checkpoint]
        )


@pytest.mark.timeout(180)
def test_train_ddp_two_processes(tmp_path: pathlib.Path) -> None:
    run_distributed(_ddp_body, 2, str(tmp_path / 'ck.pt'), tmp_path=tmp_path)
