"""Tests of kfac.distributed._communicator without a process group.

The collective itself is replaced by a fake allreduce that sums in place
as a group of two identical ranks would (it doubles the buffer), so the
bookkeeping around it (entries, offsets, averaging, unpacking, when a
bucket starts) is checked exactly in one process. The real collectives
are checked on 2 to 4 ranks by test_distributed.py.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from kfac.distributed import _communicator as buckets
from kfac.distributed._communicator import Bucket
from kfac.distributed._communicator import BucketHandle
from kfac.distributed._communicator import Entry
from kfac.distributed._communicator import finish
from kfac.distributed._communicator import get_triu
from kfac.distributed._communicator import payload
from kfac.distributed._communicator import then_finish
from kfac.distributed._communicator import unflatten

SYMMETRIC = torch.tensor([[1.0, 2.0, 3.0], [2.0, 4.0, 5.0], [3.0, 5.0, 6.0]])


def _completed(value: Any) -> torch.futures.Future[Any]:
    future: torch.futures.Future[Any] = torch.futures.Future()
    future.set_result(value)
    return future


def _failed() -> torch.futures.Future[Any]:
    future: torch.futures.Future[Any] = torch.futures.Future()
    future.set_exception(RuntimeError('collective failed'))
    return future


def test_finish_averages_unpacks_and_reshapes() -> None:
    packed = Entry(SYMMETRIC.shape, 6, packed=True, average=True)
    result = finish(get_triu(SYMMETRIC) * 3, packed, size=3)
    assert torch.equal(result, SYMMETRIC)
    summed = Entry(torch.Size([2, 3]), 6, packed=False, average=False)
    flat = torch.arange(6.0)
    result = finish(flat, summed, size=3)
    assert torch.equal(result, torch.arange(6.0).view(2, 3))
    assert result.data_ptr() == flat.data_ptr()  # a view, not a copy
    same = Entry(torch.Size([6]), 6, packed=False, average=True)
    flat = torch.arange(6.0) * 2
    assert finish(flat, same, size=2) is flat
    assert torch.equal(flat, torch.arange(6.0))  # averaged in place


def test_payload_is_the_triangle_or_a_contiguous_tensor() -> None:
    assert torch.equal(payload(SYMMETRIC, packed=True), get_triu(SYMMETRIC))
    assert payload(SYMMETRIC, packed=False) is SYMMETRIC
    transposed = torch.arange(6.0).view(2, 3).T
    copied = payload(transposed, packed=False)
    assert copied.is_contiguous()
    assert torch.equal(copied, transposed)


def test_then_finish_runs_after_the_collective() -> None:
    buffer = get_triu(SYMMETRIC) * 2
    entry = Entry(SYMMETRIC.shape, 6, packed=True, average=True)
    result = then_finish(_completed(None), buffer, entry, size=2).wait()
    assert torch.equal(result, SYMMETRIC)
    with pytest.raises(RuntimeError, match='collective failed'):
        then_finish(_failed(), buffer, entry, size=2).wait()


def test_unflatten_splits_by_entry() -> None:
    entries = [
        Entry(torch.Size([2]), 2, packed=False, average=False),
        Entry(SYMMETRIC.shape, 6, packed=True, average=False),
        Entry(torch.Size([]), 1, packed=False, average=False),
    ]
    flat = torch.cat(
        [torch.tensor([7.0, 8.0]), get_triu(SYMMETRIC), torch.tensor([9.0])]
    )
    first, second, third = unflatten(_completed(None), flat, entries, 1)
    assert torch.equal(first, torch.tensor([7.0, 8.0]))
    assert torch.equal(second, SYMMETRIC)
    assert third.shape == () and third.item() == 9.0
    with pytest.raises(RuntimeError, match='collective failed'):
        unflatten(_failed(), flat, entries, 1)


class FakeAllreduce:
    """Sums in place as two identical ranks would; records its calls."""

    def __init__(self) -> None:
        self.buffers: list[torch.Tensor] = []

    def __call__(
        self, buffer: torch.Tensor, group: object
    ) -> torch.futures.Future[Any]:
        assert group is GROUP
        self.buffers.append(buffer.clone())
        buffer.mul_(2)
        return _completed([buffer])


GROUP: Any = object()


def test_bucket_reduces_its_tensors_as_one_buffer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake = FakeAllreduce()
    monkeypatch.setattr(buckets, 'start_allreduce', fake)
    recorded: list[tuple[str, torch.Tensor]] = []
    bucket = Bucket(GROUP, 2, lambda kind, b: recorded.append((kind, b)))
    vector = torch.tensor([1.0, 2.0])
    averaged = Entry(vector.shape, 2, packed=False, average=True)
    packed = Entry(SYMMETRIC.shape, 6, packed=True, average=False)
    handles = [
        BucketHandle(bucket, bucket.add(vector, averaged)),
        BucketHandle(bucket, bucket.add(get_triu(SYMMETRIC), packed)),
    ]
    assert bucket.nbytes == 8 * 4
    assert not bucket.started
    assert not any(handle.done() for handle in handles)
    assert fake.buffers == []  # nothing starts before start() or wait()
    assert torch.equal(handles[1].wait(), 2 * SYMMETRIC)
    assert bucket.started and bucket.group is None
    assert torch.equal(handles[0].wait(), vector)  # averaged over 2
    assert all(handle.done() for handle in handles)
    expected = torch.cat([vector, get_triu(SYMMETRIC)])
    assert len(fake.buffers) == 1
    assert torch.equal(fake.buffers[0], expected)
    assert [kind for kind, _ in recorded] == ['allreduce']
    assert recorded[0][1].numel() == 8
    bucket.start()  # started once only
    assert len(fake.buffers) == 1
    assert torch.equal(vector, torch.tensor([1.0, 2.0]))  # input unchanged


def test_all_gather_is_the_name_this_torch_has(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`all_gather_single` where torch has it (2.13 deprecates the older
    name), `all_gather_into_tensor` before.
    """

    def single(*args: object, **kwargs: object) -> dist.Work:
        """Stands in for `dist.all_gather_single`."""
        raise NotImplementedError

    monkeypatch.setattr(dist, 'all_gather_single', single, raising=False)
    assert buckets.all_gather_op() is single
    monkeypatch.delattr(dist, 'all_gather_single')
    assert buckets.all_gather_op() is dist.all_gather_into_tensor
