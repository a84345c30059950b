"""The twin oracle under DDP: at W = 2, each rank on half of each batch,
a weight shared by several modules is one module called as often.

Raw gradients (allreduced by DDP), factors (allreduced by K-FAC) and
preconditioned gradients of the twins agree on every rank at every step
(see `testing.twins`), for each kind of sharer with COMM-OPT and, with
three sharers of which sometimes one runs alone, MEM-OPT with factors
computed at the update and two micro-batches per step. One launch loops
over the cases (gloo on the CPU).
"""

from __future__ import annotations

import json
import pathlib

import pytest
import torch.distributed as dist

from testing.distributed import run_distributed
from testing.twins import KINDS
from testing.twins import Case
from testing.twins import check_twins

WORLD = 2
CASES = [Case(kind) for kind in KINDS] + [
    Case(
        kind,
        sharers=3,
        runs=((1,), (0, 1, 2), (2, 0)),
        options={
            'grad_worker_fraction': 'mem_opt',
            'update_factors_in_hook': False,
            'accumulation_steps': 2,
            'compute_method': method,
        },
    )
    for kind, method in (('conv', 'eigen'), ('embedding', 'inverse'))
]


def _body(out_dir: str) -> None:
    rank = dist.get_rank()
    steps = [check_twins(case, part=(rank, WORLD)) for case in CASES]
    path = pathlib.Path(out_dir) / f'rank{rank}.json'
    path.write_text(json.dumps(steps))


@pytest.mark.timeout(200)
def test_shared_weight_under_ddp_equals_one_module_called_as_often(
    tmp_path: pathlib.Path,
) -> None:
    run_distributed(
        _body, WORLD, str(tmp_path), tmp_path=tmp_path, timeout=180
    )
    for rank in range(WORLD):
        steps = json.loads((tmp_path / f'rank{rank}.json').read_text())
        assert steps == [len(case.runs) for case in CASES], rank
