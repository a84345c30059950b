"""K-FAC's memory per rank under FSDP2: MEM-OPT holds each layer's
decompositions on its one owner, as under DDP.

At W = 4, each rank trains [`testing.fsdp.ShardLM`][testing.fsdp.ShardLM]
(float64) for one step (factors and decompositions updated) four ways:
DDP and FSDP2 (`fully_shard` per block and root), each with COMM-OPT and
MEM-OPT (eigen, with the eigenvalue outer product), and reports
`precon.memory_usage()` and the layers whose decompositions it owns. The
test counts the expected bytes itself from the layer shapes and that
ownership: factors `a²` and `o²` (a diagonal `A`, the embedding's, as `a`
numbers) on every rank; decompositions `a²` (none for a diagonal `A`) and
`o² + o a` on the layers' gradient workers (every rank under COMM-OPT, the
one owner under MEM-OPT); nothing else held after the step.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from testing import fsdp
from testing.distributed import run_distributed
from testing.torch_release import FSDP2_ON_CPU

WORLD = 4
ITEM = 8  # float64
SETUPS = ['ddp comm_opt', 'ddp mem_opt', 'fsdp comm_opt', 'fsdp mem_opt']


def layer_shapes() -> dict[str, tuple[int, int, bool]]:
    """`(a, o, A diagonal)` of every layer of `ShardLM`, from its sizes."""
    w, h, v = fsdp.WIDTH, fsdp.HIDDEN, fsdp.VOCAB
    kernel = 3  # ShardLM's Conv1d
    shapes = {
        'embed': (v, w, True),
        'conv': (w * kernel + 1, w, False),
        'attn.out_proj': (w + 1, w, False),
        'up': (w + 1, h, False),
        'down': (h + 1, w, False),
        'head': (w, v, False),  # no bias
    }
    for projection in ('q', 'k', 'v'):
        shapes[f'attn.{projection}_proj'] = (w + 1, w, False)
    return shapes


def expected_usage(owned: set[str]) -> dict[str, int]:
    """Bytes after a step, with the decompositions of `owned` held."""
    usage = dict.fromkeys(
        ('a_factors', 'g_factors', 'a_inverses', 'g_inverses'), 0
    )
    for name, (a, o, diagonal) in layer_shapes().items():
        usage['a_factors'] += ITEM * (a if diagonal else a * a)
        usage['g_factors'] += ITEM * o * o
        if name in owned:
            usage['a_inverses'] += 0 if diagonal else ITEM * a * a
            usage['g_inverses'] += ITEM * (o * o + o * a)
    usage['total'] = sum(usage.values())
    return usage


def _usage(setup: str) -> dict[str, Any]:
    kind, strategy = setup.split()
    model: nn.Module = fsdp.fresh()
    if kind == 'fsdp':
        fsdp.shard(model)
    else:
        model = nn.parallel.DistributedDataParallel(model)
    precon = fsdp.train(
        model,
        # EIGEN with the outer product: what `expected_usage` counts
        {'grad_worker_fraction': strategy, 'compute_method': 'eigen'},
        part=(dist.get_rank(), WORLD),
        steps=1,
    )
    assert precon is not None
    return {
        'usage': precon.memory_usage(),
        'owned': sorted(
            name
            for name in precon.layers
            if precon.assignment.is_grad_worker(name)
        ),
        'layers': sorted(precon.layers),
    }


def _body(out_dir: str) -> None:
    torch.manual_seed(0)
    results = {setup: _usage(setup) for setup in SETUPS}
    path = pathlib.Path(out_dir) / f'rank{dist.get_rank()}.json'
    path.write_text(json.dumps(results))


@FSDP2_ON_CPU
@pytest.mark.timeout(180)
def test_mem_opt_shrinks_kfac_state_per_rank(tmp_path: pathlib.Path) -> None:
    run_distributed(
        _body, WORLD, str(tmp_path), tmp_path=tmp_path, timeout=170
    )
    ranks = [
        json.loads((tmp_path / f'rank{r}.json').read_text())
        for r in range(WORLD)
    ]
    names = set(layer_shapes())
    every = expected_usage(names)
    for rank in ranks:
        for setup in SETUPS:
            result = rank[setup]
            assert set(result['layers']) == names, setup
            usage = result['usage']
            owned = set(result['owned'])
            if 'comm_opt' in setup:
                assert owned == names, setup
            expected = expected_usage(owned)
            for key, value in expected.items():
                assert usage[key] == value, (setup, key, usage)
            assert usage['grad'] == usage['a_batch'] == 0, setup
        # The same plan under DDP and FSDP2: the same bytes.
        assert rank['fsdp mem_opt'] == rank['ddp mem_opt']
        assert rank['fsdp comm_opt'] == rank['ddp comm_opt']
        # MEM-OPT holds fewer decompositions on every rank.
        mem = rank['fsdp mem_opt']['usage']
        assert mem['a_inverses'] + mem['g_inverses'] < (
            every['a_inverses'] + every['g_inverses']
        )
        assert mem['total'] < every['total']
    # Under MEM-OPT, each layer has exactly one owner.
    for setup in ('ddp mem_opt', 'fsdp mem_opt'):
        owners = [name for rank in ranks for name in rank[setup]['owned']]
        assert sorted(owners) == sorted(names), setup
    held = sum(r['fsdp mem_opt']['usage']['g_inverses'] for r in ranks)
    assert held == every['g_inverses']
