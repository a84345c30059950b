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
    # The runs communicated: every case moved factor bytes.
    assert all(r['counted']['factor_allreduce'][0] > 0 for r in results)
