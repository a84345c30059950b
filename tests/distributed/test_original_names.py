"""The original KAISA code's names in kfac.distributed: its explicit
`AllreduceTensorBucket`, `Future` and `flush_allreduce_buckets()`."""

from __future__ import annotations

import pathlib

import pytest
import torch
import torch.distributed as dist

from kfac.distributed import AllreduceTensorBucket
from kfac.distributed import Future
from kfac.distributed import Handle
from kfac.distributed import TorchDistributedCommunicator
from testing.distributed import run_distributed


def test_future_is_the_handle() -> None:
    assert Future is Handle
    handle = TorchDistributedCommunicator().allreduce(torch.ones(2))
    assert isinstance(handle, Future)


def test_an_empty_bucket_is_allreduced_once() -> None:
    bucket = AllreduceTensorBucket()
    assert not bucket.communicated()
    assert bucket.allreduce() is None
    assert bucket.communicated()
    with pytest.raises(RuntimeError, match='allreduced only once'):
        bucket.allreduce()
    with pytest.raises(RuntimeError, match='already allreduced'):
        bucket.add_tensor(torch.ones(1))


def test_bucket_on_one_process_returns_its_tensors() -> None:
    bucket = AllreduceTensorBucket()
    first = torch.arange(4.0).view(2, 2)
    second = torch.arange(4.0, 10.0).view(3, 2)
    parts = [bucket.add_tensor(first), bucket.add_tensor(second)]
    assert bucket.size == 10 * 4
    assert not parts[0].done()
    with pytest.raises(RuntimeError, match='call allreduce\\(\\) first'):
        parts[0].wait()
    with pytest.raises(RuntimeError, match='not completed its allreduce'):
        parts[1].value()  # type: ignore[attr-defined]  # the bucket's handles have value()
    flat = bucket.allreduce()
    assert flat is not None
    assert torch.equal(flat.wait(), torch.arange(10.0))
    assert all(part.done() for part in parts)
    assert torch.equal(parts[0].wait(), first)
    assert torch.equal(parts[1].value(), second)  # type: ignore[attr-defined]  # as above


def test_bucket_argument_errors() -> None:
    bucket = AllreduceTensorBucket()
    with pytest.raises(TypeError, match='^tensor must be a torch.Tensor'):
        bucket.add_tensor([1.0])  # type: ignore[arg-type]  # the wrong type tested
    bucket.add_tensor(torch.ones(2))
    with pytest.raises(TypeError, match='^tensor must have the dtype and'):
        bucket.add_tensor(torch.ones(2, dtype=torch.float64))


def _sums_over_ranks() -> None:
    rank, size = dist.get_rank(), dist.get_world_size()
    expected_first = torch.full((2, 3), float(sum(range(size))))
    expected_second = torch.arange(5.0) * size
    bucket = AllreduceTensorBucket()
    first = bucket.add_tensor(torch.full((2, 3), float(rank)))
    second = bucket.add_tensor(torch.arange(5.0))
    flat = bucket.allreduce()
    assert flat is not None and flat.wait().shape == (11,)
    assert torch.equal(first.wait(), expected_first)
    assert torch.equal(second.wait(), expected_second)
    # The communicator's original name of flush() starts its buckets.
    comm = TorchDistributedCommunicator(bucket_cap_mb=1.0)
    handle = comm.allreduce_bucketed(torch.ones(3), average=False)
    comm.flush_allreduce_buckets()
    assert comm.collectives_started['allreduce'] == 1
    assert torch.equal(handle.wait(), torch.full((3,), float(size)))


def test_bucket_sums_over_three_ranks(tmp_path: pathlib.Path) -> None:
    run_distributed(_sums_over_ranks, 3, tmp_path=tmp_path)
