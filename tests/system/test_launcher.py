"""Tests of testing.distributed.run_distributed, the multi-process launcher."""

from __future__ import annotations

import os
import pathlib
import time

import pytest
import torch
import torch.distributed as dist

from testing import distributed as launcher
from testing.distributed import DistributedTestError
from testing.distributed import run_distributed


def write_allreduced_rank(out_dir: pathlib.Path) -> None:
    """Every rank writes the sum over ranks of ``rank + 1``."""
    total = torch.tensor([dist.get_rank() + 1.0])
    dist.all_reduce(total)
    rank = dist.get_rank()
    (out_dir / f'rank{rank}').write_text(
        f'{dist.get_world_size()} {torch.get_num_threads()} {total.item():g}'
    )


def raise_or_exit() -> None:
    """Rank 0 raises, rank 1 exits with code 3 without a traceback."""
    if dist.get_rank() == 0:
        raise ValueError('boom from rank 0')
    os._exit(3)


def hang_on_rank_one() -> None:
    """Rank 1 never returns; rank 0 passes."""
    if dist.get_rank() == 1:
        sleep_forever()


def sleep_forever() -> None:
    while True:
        time.sleep(1)


def fail_rank_zero_hang_others() -> None:
    if dist.get_rank() == 0:
        raise RuntimeError('rank 0 gives up')
    sleep_forever()


@pytest.mark.timeout(120)
def test_passing_run(tmp_path: pathlib.Path) -> None:
    run_distributed(write_allreduced_rank, 3, tmp_path, tmp_path=tmp_path)
    for rank in range(3):
        assert (tmp_path / f'rank{rank}').read_text() == '3 1 6'


@pytest.mark.timeout(120)
def test_reports_raising_and_exiting_ranks(tmp_path: pathlib.Path) -> None:
    with pytest.raises(DistributedTestError) as info:
        run_distributed(raise_or_exit, 2, tmp_path=tmp_path, timeout=60)
    message = str(info.value)
    assert 'tests.system.test_launcher.raise_or_exit' in message
    assert 'rank 0: exit code 1\n' in message
    assert 'Traceback (most recent call last)' in message
    assert 'in raise_or_exit' in message
    assert 'ValueError: boom from rank 0' in message
    assert 'rank 1: exit code 3\n    (no traceback' in message
    assert isinstance(info.value, AssertionError)


@pytest.mark.timeout(120)
def test_reports_a_hanging_rank(tmp_path: pathlib.Path) -> None:
    start = time.monotonic()
    with pytest.raises(DistributedTestError) as info:
        run_distributed(hang_on_rank_one, 2, tmp_path=tmp_path, timeout=8)
    elapsed = time.monotonic() - start
    message = str(info.value)
    assert 'timeout=8s' in message
    assert 'rank 1: exit code' in message
    assert 'still running at the timeout; terminated' in message
    # The stacks dumped before termination show where it hangs.
    assert 'stacks when it was stopped' in message
    assert 'in sleep_forever' in message
    assert 'rank 0' not in message
    assert 8 <= elapsed < 40


@pytest.mark.timeout(120)
def test_failure_stops_the_other_ranks(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(launcher, 'PEER_FAILURE_GRACE_S', 1.0)
    start = time.monotonic()
    with pytest.raises(DistributedTestError) as info:
        run_distributed(
            fail_rank_zero_hang_others, 3, tmp_path=tmp_path, timeout=100
        )
    elapsed = time.monotonic() - start
    message = str(info.value)
    assert 'RuntimeError: rank 0 gives up' in message
    for rank in (1, 2):
        assert f'rank {rank}: exit code' in message
    assert message.count('still running 1s after rank 0 failed') == 2
    assert elapsed < 60


@pytest.mark.parametrize(
    ('world_size', 'timeout', 'error', 'match'),
    [
        (0, 10.0, ValueError, 'world_size must be >= 1'),
        (2.0, 10.0, TypeError, 'world_size must be an int'),
        (True, 10.0, TypeError, 'world_size must be an int'),
        (2, 0.0, ValueError, 'timeout must be > 0'),
        (2, float('nan'), ValueError, 'timeout must be > 0'),
    ],
)
def test_rejects_bad_arguments(
    tmp_path: pathlib.Path,
    world_size: int,
    timeout: float,
    error: type[Exception],
    match: str,
) -> None:
    with pytest.raises(error, match=match):
        run_distributed(
            write_allreduced_rank,
            world_size,
            tmp_path,
            tmp_path=tmp_path,
            timeout=timeout,
        )
    assert not list(tmp_path.iterdir())
