"""K-FAC's gradient all-gather under FSDP2 moves the bytes of the formula.

At W = 4, on the GPT-style model of `examples/train_fsdp.py` (a
vocabulary of 99 rows, so shards are padded: 25 rows per rank over 4
ranks, 50 over 2), every rank counts in
`precon.communicator.bytes_communicated['allgather']`, on every step, the
padded shard rows times the row size times the element size, summed over
the preconditioned parameters
(`benchmarks.fsdp_bytes.kfac_allgather_formula`); FSDP2's own
all-gathers and reduce-scatter, counted by wrapping the collectives it
calls, equal their formula too. Cases: 1-D COMM-OPT and MEM-OPT, HSDP
2 x 2 MEM-OPT (gradients gathered over the shard dimension only), and
local mode (`shard_mode='local'`), which gathers nothing.
"""

from __future__ import annotations

import json
import pathlib

import pytest

from benchmarks import fsdp_bytes
from testing.distributed import run_distributed
from testing.torch_release import HSDP_ON_CPU

CASES = [('comm_opt', 1), ('mem_opt', 1), ('mem_opt', 2), ('local', 1)]
WORLD = 4


@HSDP_ON_CPU
@pytest.mark.timeout(180)
def test_allgather_bytes_equal_the_formula(tmp_path: pathlib.Path) -> None:
    run_distributed(
        fsdp_bytes.measure_rank,
        WORLD,
        CASES,
        2,
        str(tmp_path),
        tmp_path=tmp_path,
        timeout=170,
    )
    ranks = [
        json.loads((tmp_path / f'rank{r}.json').read_text())
        for r in range(WORLD)
    ]
    for rank in ranks:
        assert set(rank) == {
            'comm_opt',
            'mem_opt',
            'mem_opt HSDP 2x2',
            'local',
        }
        for label, result in rank.items():
            assert result['shards'] == (2 if 'HSDP' in label else 4)
            formula = result['allgather_formula']
            if label == 'local':  # local mode gathers nothing
                assert formula == 0
            else:  # the padding is visible: the shards are uneven
                assert formula > result['allgather_unpadded'] > 0, label
            for row in result['steps']:
                assert row['allgather'] == formula, (label, row)
                for kind, expected in result['fsdp_formula'].items():
                    assert row[kind] == expected, (label, kind, row)
    # MEM-OPT sends each rank its rows of the preconditioned gradients
    # (a scatter from each layer's gradient worker) every step, and
    # broadcasts no whole gradient.
    for label in ranks[0]:
        steps = len(ranks[0][label]['steps'])
        for step in range(steps):
            rows = [rank[label]['steps'][step] for rank in ranks]
            scattered = sum(row['scatter'] for row in rows)
            assert (scattered > 0) == label.startswith('mem_opt'), label
            if label.startswith('mem_opt'):
                assert all(row['broadcast'] == 0 for row in rows), label
    assert fsdp_bytes.matches(ranks)
