"""The byte model of ``benchmarks.comm`` against real gloo runs.

Each rank runs every configuration of ``benchmarks.bytecheck.cases`` and
asserts that the bytes and calls its communicator counted, phase by phase,
equal the model's for its rank.
"""

from __future__ import annotations

import json
import pathlib

import pytest

from benchmarks.bytecheck import cases
from benchmarks.bytecheck import check_rank
from benchmarks.overlap import overlap
from benchmarks.overlap import overlap_table
from testing.distributed import run_distributed


@pytest.mark.parametrize('world_size', [2, 3, 4])
def test_byte_model_matches_gloo_counts(
    world_size: int, tmp_path: pathlib.Path
) -> None:
    run_distributed(
        check_rank,
        world_size,
        world_size,
        str(tmp_path),
        tmp_path=tmp_path,
        timeout=120,
    )
    results = [
        r
        for rank in range(world_size)
        for r in json.loads((tmp_path / f'rank{rank}.json').read_text())
    ]
    assert len(results) == world_size * len(cases(world_size))
    assert all(r['match'] for r in results)
    # The runs communicated: every case with K-FAC's factors moved factor
    # bytes, and none with the gradient's own.
    for r in results:
        moved = r['counted']['factor_allreduce'][0] > 0
        assert moved == ("source='gradient'" not in r['case']), r['case']


def test_overlap_probe_counts_every_factor_allreduce() -> None:
    rows = overlap(['mlp'], world_size=2)
    assert [r['bucket_cap_mb'] for r in rows] == [25.0, 1.0, 0.0]
    unbucketed = rows[2]
    # Without buckets every factor travels alone: two per layer.
    assert unbucketed['collectives'] == 2 * unbucketed['layers']
    # MLP 64-512-512-10 with biases, float32: A and G of each layer.
    sides = [(65, 512), (513, 512), (513, 10)]
    expected = sum(4 * (a * a + g * g) for a, g in sides)
    assert all(r['bytes'] == expected for r in rows)
    # Hook mode: each layer is complete, and its factors handed over, while
    # the backward pass still runs (all but the first layer, which is last
    # in the backward order, complete before backward() returns).
    assert unbucketed['collectives_during_backward'] >= 2 * (
        unbucketed['layers'] - 1
    )
    assert 'bytes started during backward' in overlap_table(rows)
