"""MEM-OPT keeps each layer's decompositions on one rank only."""

from __future__ import annotations

import json
import pathlib

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from kfac.preconditioner import KFACPreconditioner
from testing import oracle
from testing.distributed import run_distributed
from testing.models import TinyCNN
from testing.models import classification_data


def usage_after_one_step(strategy: str) -> dict[str, int]:
    torch.manual_seed(0)
    model = TinyCNN().double()
    wrapped = oracle.wrap(model)
    precon = KFACPreconditioner(
        wrapped,
        grad_worker_fraction=strategy,
        compute_eigenvalue_outer_product=False,
    )
    x, y = classification_data(4, (2, 8, 8))
    F.cross_entropy(wrapped(x), y).backward()
    precon.step()
    usage = precon.memory_usage()
    owned = [
        name
        for name in precon.layers
        if precon.assignment.inv_worker(name, 'A') == precon_rank()
    ]
    for name, layer in precon.layers.items():
        assert layer.has_decomposition == (
            strategy == 'comm_opt' or name in owned
        )
    return usage


def precon_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def body(out_dir: str) -> None:
    results = {s: usage_after_one_step(s) for s in ('comm_opt', 'mem_opt')}
    path = pathlib.Path(out_dir) / f'rank{dist.get_rank()}.json'
    path.write_text(json.dumps(results))


@pytest.mark.timeout(120)
def test_mem_opt_stores_only_owned_decompositions(
    tmp_path: pathlib.Path,
) -> None:
    single = usage_after_one_step('comm_opt')
    run_distributed(body, 2, str(tmp_path), tmp_path=tmp_path)
    ranks = [
        json.loads((tmp_path / f'rank{r}.json').read_text()) for r in (0, 1)
    ]
    for key in ('a_inverses', 'g_inverses'):
        # COMM-OPT: every rank holds every decomposition
        assert all(r['comm_opt'][key] == single[key] for r in ranks)
        # MEM-OPT: each rank holds its own share; together exactly one copy
        assert all(0 < r['mem_opt'][key] < single[key] for r in ranks)
        assert sum(r['mem_opt'][key] for r in ranks) == single[key]
    # factors are held everywhere under both strategies
    assert all(r['mem_opt']['a_factors'] == single['a_factors'] for r in ranks)
