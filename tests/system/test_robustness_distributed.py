"""Faults on one rank are handled the same way on every rank."""

from __future__ import annotations

import math
import os
import pathlib
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from kfac import math as kmath
from kfac.layers.base import LinAlgError
from kfac.layers.curvature import eigen as eigen_module
from kfac.preconditioner import KFACPreconditioner
from testing.distributed import DistributedTestError
from testing.distributed import run_distributed
from testing.models import TinyMLP
from testing.models import classification_data
from testing.options import EVERY_STEP


def _step(
    model: nn.Module,
    precon: KFACPreconditioner,
    seed: int,
    poison: bool = False,
) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = classification_data(4 * world, (6,), seed=seed)
    x, y = x[rank * 4 : (rank + 1) * 4], y[rank * 4 : (rank + 1) * 4]
    if poison:
        x[0, 0] = math.nan
    model.zero_grad()
    F.cross_entropy(model(x), y).backward()
    precon.step()


def _gathered(tensor: torch.Tensor) -> list[torch.Tensor]:
    out = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(out, tensor.contiguous())
    return out


def nonfinite_on_one_rank() -> None:
    torch.manual_seed(0)
    model = TinyMLP().double()
    precon = KFACPreconditioner(
        model, grad_worker_fraction='mem_opt', **EVERY_STEP
    )
    _step(model, precon, 0)
    before = [
        f.value.clone()  # type: ignore[union-attr]  # a step above formed the factors
        for layer in precon.layers.values()
        for f in layer.factors
    ]
    _step(model, precon, 1, poison=dist.get_rank() == 1)
    after = [
        f.value for layer in precon.layers.values() for f in layer.factors
    ]
    assert all(torch.equal(a, b) for a, b in zip(before, after))  # type: ignore[arg-type]  # a step above formed the factors
    assert precon.metrics()['nonfinite_statistics_steps'] == 1
    _step(model, precon, 2)
    for layer in precon.layers.values():
        for factor in layer.factors:
            values = _gathered(factor.value)  # type: ignore[arg-type]  # a step above formed the factors
            assert all(torch.equal(v, values[0]) for v in values)


def failed_eigh_on_one_rank() -> None:
    original = kmath.symmetric_eigh

    def eigh(
        matrix: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if dist.get_rank() == 0:
            raise LinAlgError('injected failure')
        return original(matrix, dtype)

    setattr(eigen_module, 'symmetric_eigh', eigh)  # noqa: B010
    torch.manual_seed(0)
    model = TinyMLP().double()
    ddp = nn.parallel.DistributedDataParallel(model)
    precon = KFACPreconditioner(
        ddp, relative_clip=None, compute_method='eigen'
    )
    rank0 = [
        n for n in precon.layers if precon.assignment.inv_worker(n, 'A') == 0
    ]
    assert rank0  # rank 0 is the inverse worker of some layer
    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = classification_data(4 * world, (6,))
    part = slice(rank * 4, rank * 4 + 4)
    F.cross_entropy(ddp(x[part]), y[part]).backward()
    raw = {n: precon.layers[n].module.get_grad().clone() for n in rank0}  # type: ignore[union-attr]  # backward() above set it
    precon.step()
    for name, layer in precon.layers.items():
        grad = layer.module.get_grad()
        assert grad is not None
        assert all(torch.equal(g, grad) for g in _gathered(grad))
        if name in rank0:
            assert not layer.has_decomposition
            assert torch.equal(grad, raw[name])
        else:
            assert layer.has_decomposition


@pytest.mark.timeout(120)
def test_faults_on_one_rank_are_handled_on_all(tmp_path: pathlib.Path) -> None:
    run_distributed(nonfinite_on_one_rank, 2, tmp_path=tmp_path)
    run_distributed(failed_eigh_on_one_rank, 2, tmp_path=tmp_path)


def rank_dies_before_step() -> None:
    torch.manual_seed(0)
    model = TinyMLP().double()
    precon = KFACPreconditioner(model)
    x, y = classification_data(4, (6,))
    F.cross_entropy(model(x), y).backward()
    if dist.get_rank() == 1:
        os._exit(3)  # a crashed peer
    precon.step()


@pytest.mark.timeout(120)
def test_dead_rank_fails_the_others_with_a_named_operation(
    tmp_path: pathlib.Path,
) -> None:
    began = time.monotonic()
    with pytest.raises(DistributedTestError) as info:
        run_distributed(
            rank_dies_before_step, 2, tmp_path=tmp_path, timeout=60
        )
    elapsed = time.monotonic() - began
    report = str(info.value)
    assert 'rank 1' in report
    assert 'KFACDistributedError: K-FAC factor' in report
    assert 'allreduce failed on rank 0 in phase factor_allreduce' in report
    assert '(it carried layers fc2, fc1)' in report  # one bucket, as filled
    assert elapsed < 60  # failed, not timed out
