"""Flat buffers of the collectives, and the buckets that batch allreduces.

What travels in a collective is a flat buffer: a tensor, its packed upper
triangle (see `kfac.distributed._packing`), or many of them concatenated
into a bucket. An `Entry` records how to turn a
reduced buffer back into the caller's tensor, and
`finish` does it once the collective's future has
completed, in the `wait()` of the handle, on the waiting thread: no Python
callback is chained to a collective's future (see
`kfac.distributed._handles` for why).

This is the machinery of
[`TorchDistributedCommunicator`][kfac.distributed.TorchDistributedCommunicator];
the communicator's methods document which ranks call each collective.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING
from typing import Any

import torch
import torch.distributed as dist

from kfac.distributed._handles import DeferredHandle
from kfac.distributed._handles import Handle
from kfac.distributed._packing import fill_triu
from kfac.distributed._packing import get_triu

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = [
    'Bucket',
    'BucketHandle',
    'Entry',
    'Record',
    'all_gather_op',
    'finish',
    'payload',
    'start_all_gather',
    'start_allreduce',
    'start_broadcast',
    'start_scatter',
    'then_finish',
    'unflatten',
]

logger = logging.getLogger(__name__)

Record = Callable[[str, torch.Tensor], None]
"""Counts a collective: called with its kind and the buffer it sends."""


@dataclasses.dataclass(frozen=True)
class Entry:
    """How to turn a reduced flat slice back into the caller's tensor.

    Attributes:
        shape: the caller's tensor shape.
        numel: elements that travel (the packed triangle's when `packed`).
        packed: the slice is a packed upper triangle.
        average: divide the reduced slice by the group size.

    """

    shape: torch.Size
    numel: int
    packed: bool
    average: bool


def finish(flat: torch.Tensor, entry: Entry, size: int) -> torch.Tensor:
    """Average, unpack or reshape the reduced `flat` (written in place).

    Args:
        flat: the reduced 1-D slice (or the caller's tensor itself).
        entry: what `flat` stands for.
        size: the size of the group, divided by when `entry.average`.

    Examples:
        >>> entry = Entry(torch.Size([2, 2]), 3, packed=True, average=True)
        >>> finish(torch.tensor([2.0, 4.0, 6.0]), entry, size=2)
        tensor([[1., 2.],
                [2., 3.]])

    """
    if entry.average:
        flat.div_(size)
    if entry.packed:
        return fill_triu(entry.shape, flat)
    return flat if flat.shape == entry.shape else flat.view(entry.shape)


def payload(tensor: torch.Tensor, packed: bool) -> torch.Tensor:
    """Return what travels for `tensor`: its triangle, or it (contiguous)."""
    return get_triu(tensor) if packed else tensor.contiguous()


def start_allreduce(
    buffer: torch.Tensor,
    group: ProcessGroup | None,
) -> torch.futures.Future[Any]:
    """Start a sum allreduce of `buffer` in place; return its future.

    Every rank of `group` calls it with a buffer of the same shape.
    """
    all_reduce: Callable[..., dist.Work] = dist.all_reduce
    work = all_reduce(buffer, op=dist.ReduceOp.SUM, group=group, async_op=True)
    return work.get_future()


def start_broadcast(
    buffer: torch.Tensor,
    src: int,
    group: ProcessGroup | None,
) -> torch.futures.Future[Any]:
    """Start a broadcast of `src`'s `buffer` in place; return its future.

    Every rank of `group` calls it with a buffer of the same shape.
    """
    broadcast: Callable[..., dist.Work] = dist.broadcast
    work = broadcast(buffer, src=src, group=group, async_op=True)
    return work.get_future()


def all_gather_op() -> Callable[..., dist.Work]:
    """`dist.all_gather_single` (torch 2.13, which deprecates its older
    name), or before it `dist.all_gather_into_tensor`, the same collective.
    """
    single: Callable[..., dist.Work] | None = getattr(
        dist, 'all_gather_single', None
    )
    return dist.all_gather_into_tensor if single is None else single


def start_all_gather(
    out: torch.Tensor,
    buffer: torch.Tensor,
    group: ProcessGroup,
) -> torch.futures.Future[Any]:
    """Start gathering every rank's `buffer` into `out`; return its future.

    Every rank of `group` calls it with buffers of the same shape; `out`
    holds `size` of them, in rank order.
    """
    gather = all_gather_op()
    work = gather(out, buffer, group=group, async_op=True)
    return work.get_future()


def start_scatter(
    out: torch.Tensor,
    chunks: list[torch.Tensor] | None,
    src: int,
    group: ProcessGroup | None,
) -> torch.futures.Future[Any]:
    """Start scattering `src`'s `chunks` into every rank's `out`; return
    its future.
    """
    scatter: Callable[..., dist.Work] = dist.scatter
    work = scatter(out, chunks, src=src, group=group, async_op=True)
    return work.get_future()


def then_finish(
    future: torch.futures.Future[Any],
    buffer: torch.Tensor,
    entry: Entry,
    size: int,
) -> Handle:
    """Return a handle that waits for `future`, then finishes `buffer`.

    `finish` runs in the handle's first `wait()`,
    on the waiting thread, not as a callback of `future`. The error of a
    failed collective is raised by `wait()`.
    """
    return DeferredHandle(future, lambda: finish(buffer, entry, size))


class Bucket:
    """Tensors of one group, dtype and device reduced as one flat buffer.

    Once started, the bucket forgets its group and its parts; it keeps the
    flat buffer and the entries until the first `wait()` splits the
    reduced buffer into its tensors (on the waiting thread, see
    `kfac.distributed._handles`).

    Args:
        group: the process group of the allreduce.
        size: the size of `group`.
        record: called with `'allreduce'` and the flat buffer when the
            bucket starts.

    """

    def __init__(self, group: ProcessGroup, size: int, record: Record) -> None:
        self.group: ProcessGroup | None = group
        self.size = size
        self.nbytes = 0
        self._record = record
        self._parts: list[torch.Tensor] = []
        self._entries: list[Entry] = []
        self._future: torch.futures.Future[Any] | None = None
        self._flat: torch.Tensor | None = None
        self._results: list[torch.Tensor] | None = None

    @property
    def started(self) -> bool:
        """Whether the allreduce has been started."""
        return self._future is not None

    def add(self, tensor: torch.Tensor, entry: Entry) -> int:
        """Append `tensor` (read when the bucket starts); return its index."""
        self._parts.append(tensor.reshape(-1))
        self._entries.append(entry)
        self.nbytes += tensor.numel() * tensor.element_size()
        return len(self._entries) - 1

    def start(self) -> torch.futures.Future[Any]:
        """Start the allreduce unless started; return its future.

        A collective: every rank of the group starts its matching bucket at
        the same point of its sequence of collectives.
        """
        if self._future is None:
            flat = torch.cat(self._parts)
            logger.debug(
                'allreduce of a bucket of %d tensors, %d bytes',
                len(self._parts),
                self.nbytes,
            )
            self._record('allreduce', flat)
            self._future = start_allreduce(flat, self.group)
            self._flat = flat
            self._parts, self.group = [], None
        return self._future

    def wait(self) -> list[torch.Tensor]:
        """Start the allreduce if pending, wait for it; return the tensors.

        The reduced buffer is split (and averaged, unpacked) by the first
        call; later calls return the same tensors.
        """
        future = self.start()
        if self._results is None:
            future.wait()  # raises the error of a failed collective
            assert self._flat is not None  # set by start()
            self._results = unflatten(
                future, self._flat, self._entries, self.size
            )
            self._flat, self._entries = None, []
        return self._results


def unflatten(
    done: torch.futures.Future[Any],
    flat: torch.Tensor,
    entries: list[Entry],
    size: int,
) -> list[torch.Tensor]:
    """Split a reduced bucket into the tensors of its `entries`.

    Args:
        done: the completed future of the allreduce; its error, if any, is
            raised.
        flat: the reduced buffer, the entries' slices one after another.
        entries: what each slice stands for, in order.
        size: the size of the group.

    """
    done.value()  # re-raises the error of a failed collective
    results = []
    offset = 0
    for entry in entries:
        part = flat[offset : offset + entry.numel]
        results.append(finish(part, entry, size))
        offset += entry.numel
    return results


class BucketHandle(Handle):
    """Handle on one tensor of a bucket that may not have started yet."""

    def __init__(self, bucket: Bucket, index: int) -> None:
        self._bucket = bucket
        self._index = index

    def wait(self) -> torch.Tensor:
        """Start the bucket if it is pending, then wait for this tensor.

        Starting a pending bucket is a collective: if any rank can get here
        before `flush()`, every rank of the group must wait on the same
        handles in the same order.
        """
        return self._bucket.wait()[self._index]

    def done(self) -> bool:
        """Return whether the bucket has started and completed."""
        return self._bucket.started and self._bucket.start().done()
