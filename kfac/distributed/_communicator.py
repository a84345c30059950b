"""The communicator: every collective K-FAC issues, as handles.

Every collective here is a `torch.distributed` one started with
`async_op=True`; its `Work` becomes a `torch.futures.Future` through
`get_future()`. A caller gets a `Handle` whose `wait()` waits for the
future and post-processes the result (averages, reshapes, unpacks it) on
the calling thread: nothing is chained to the future with `Future.then`.

Without an initialised process group (one process, no `torch.distributed`
at all), and on a group of one rank, every collective returns a completed
handle holding its input: no process group is needed.

Symmetric matrices (the K-FAC factors) can travel as their packed upper
triangle, `n (n + 1) / 2` instead of `n ** 2` numbers
([`get_triu`][kfac.distributed.get_triu]).

Rules for every collective of
[`TorchDistributedCommunicator`][kfac.distributed.TorchDistributedCommunicator]:

* Every rank of `group` (the default group when `None`) calls it, in the
  same order relative to the other collectives on that group, with tensors
  of the same shape, dtype and `symmetric` flag. Ranks outside `group` must
  not call it (`ValueError`).
* A tensor handed to a collective must not be modified until the `wait()`
  of its handle returns; use the tensor returned by `wait()` as the result.
  Each method says whether its input is written.

Handles. A collective started with `async_op=True` gives its result
later; the communicator returns a `Handle` whose `wait()` blocks until the
tensor is there and returns it, rather than a value that is sometimes a
tensor and sometimes a future. What the result needs afterwards
(averaging, unpacking) runs in `wait()`, on the thread that waits
(`DeferredHandle`), never as a Python callback chained with
`Future.then`: torch runs such a callback, and frees it, on the thread
that completes the future, for gloo a worker thread of the process group,
which must take the GIL to do so. That thread must also take the GIL when
it drops the last reference to a tensor other than its Python object's
own (torch >= 2.10 then releases the Python object), so the communicator
keeps each future, whose value holds the tensors, past its completion. A
worker still waiting for the GIL when the interpreter starts shutting
down is ended by CPython (`pthread_exit`) inside C++ code that may not be
unwound, and the process aborts (`terminate called without an active
exception`, SIGABRT) after the user's script has returned.

Buffers and buckets. What travels in a collective is a flat buffer: a
tensor, its packed upper triangle, or many of them concatenated into a
bucket. An `Entry` records how to turn a reduced buffer back into the
caller's tensor, and `finish` does it once the collective's future has
completed, in the `wait()` of the handle, on the waiting thread.

Packing. A symmetric `n x n` matrix is determined by its upper triangle;
`get_triu` and `fill_triu` are pure tensor functions, as are the handles:
neither needs `torch.distributed`.

Examples:
    >>> import torch
    >>> matrix = torch.tensor([[1.0, 2.0], [2.0, 3.0]])
    >>> get_triu(matrix)
    tensor([1., 2., 3.])
    >>> torch.equal(fill_triu(matrix.shape, get_triu(matrix)), matrix)
    True
    >>> handle = completed(torch.ones(2))
    >>> handle.done(), handle.wait()
    (True, tensor([1., 1.]))
"""

from __future__ import annotations

import abc
import collections
import dataclasses
import functools
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING
from typing import Any

import torch
import torch.distributed as dist

from kfac.distributed._groups import check_src
from kfac.distributed._groups import group_key
from kfac.distributed._groups import group_size
from kfac.validation import check_bool
from kfac.validation import type_error
from kfac.validation import validate_float

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = [
    'Bucket',
    'BucketHandle',
    'DeferredHandle',
    'Entry',
    'FutureHandle',
    'Handle',
    'NonSquareTensorError',
    'Record',
    'TorchDistributedCommunicator',
    'all_gather_op',
    'completed',
    'fill_triu',
    'finish',
    'get_triu',
    'payload',
    'start_all_gather',
    'start_allreduce',
    'start_broadcast',
    'start_scatter',
    'then_finish',
    'unflatten',
]

TRIU_CACHE_MAX_N = 512
"""Matrices up to this size keep their triangle indices in a cache."""


class NonSquareTensorError(ValueError):
    """A symmetric-matrix operation got a tensor that is not square 2-D."""


def check_square(shape: torch.Size | tuple[int, ...], what: str) -> int:
    """Return `n` if `shape` is `(n, n)`.

    Args:
        shape: the shape to check.
        what: how the message names the tensor.

    Raises:
        NonSquareTensorError: `shape` is not `(n, n)`.

    """
    if len(shape) != 2 or shape[0] != shape[1]:
        raise NonSquareTensorError(
            f'{what} must be a square 2-D matrix; got shape {tuple(shape)}',
        )
    return int(shape[0])


@functools.lru_cache(maxsize=64)
def _cached_triu_indices(n: int, device: torch.device) -> torch.Tensor:
    return torch.triu_indices(n, n, device=device)


def _triu_indices(n: int, device: torch.device) -> torch.Tensor:
    """Return `torch.triu_indices(n, n)`: rows and columns, shape (2, m)."""
    if n <= TRIU_CACHE_MAX_N:
        return _cached_triu_indices(n, device)
    return torch.triu_indices(n, n, device=device)


def get_triu(tensor: torch.Tensor) -> torch.Tensor:
    """Return the upper triangle of a square matrix, diagonal included.

    Args:
        tensor: a matrix of shape (n, n).

    Returns:
        A new 1-D tensor of `n (n + 1) / 2` elements, the entries
        `tensor[i, j]` with `i <= j` in row-major order.

    Raises:
        NonSquareTensorError: `tensor` is not a square 2-D tensor.

    """
    n = check_square(tensor.shape, 'tensor')
    rows, cols = _triu_indices(n, tensor.device)
    return tensor[rows, cols]


def fill_triu(
    shape: torch.Size | tuple[int, ...],
    packed: torch.Tensor,
) -> torch.Tensor:
    """Rebuild a symmetric matrix from its packed upper triangle.

    The inverse of `get_triu` on symmetric
    matrices: entry `(i, j)` and entry `(j, i)` are both the packed value of
    `(min(i, j), max(i, j))`.

    Args:
        shape: the matrix shape, (n, n).
        packed: 1-D tensor of `n (n + 1) / 2` elements as from
            `get_triu`.

    Returns:
        A new (n, n) tensor with the dtype and device of `packed`.

    Raises:
        NonSquareTensorError: `shape` is not square 2-D.
        ValueError: `packed` is not 1-D of `n (n + 1) / 2` elements.

    """
    n = check_square(tuple(shape), 'shape')
    if packed.dim() != 1 or packed.numel() != n * (n + 1) // 2:
        raise ValueError(
            f'packed must be 1-D with n * (n + 1) / 2 = {n * (n + 1) // 2} '
            f'elements for shape {tuple(shape)}; got shape '
            f'{tuple(packed.shape)}',
        )
    rows, cols = _triu_indices(n, packed.device)
    matrix = packed.new_empty((n, n))
    matrix[rows, cols] = packed
    matrix[cols, rows] = packed
    return matrix


class Handle(abc.ABC):
    """A tensor that may still be in flight."""

    @abc.abstractmethod
    def wait(self) -> torch.Tensor:
        """Block until the value is available and return it."""

    @abc.abstractmethod
    def done(self) -> bool:
        """Return whether `wait()` would return without blocking."""

    @property
    def labels(self) -> tuple[str, ...]:
        """The labels given to the tensors travelling in the same
        collective as this one (a bucket's), in order; empty unless
        labelled.
        """
        return ()


class _CompletedHandle(Handle):
    def __init__(self, tensor: torch.Tensor) -> None:
        self._tensor = tensor

    def wait(self) -> torch.Tensor:
        return self._tensor

    def done(self) -> bool:
        return True


class FutureHandle(Handle):
    """A handle on a `torch.futures.Future` that yields a tensor."""

    def __init__(self, future: torch.futures.Future[torch.Tensor]) -> None:
        self._future = future

    def wait(self) -> torch.Tensor:
        """Return the future's value; re-raise its error if it failed."""
        return self._future.wait()

    def done(self) -> bool:
        """Return whether the future has completed."""
        return self._future.done()


class DeferredHandle(Handle):
    """A handle on a future whose result `finish()` computes in `wait()`.

    The first `wait()` waits for `future` (raising its error if it
    failed), then calls `finish()` on the waiting thread and keeps its
    result; later calls return that result. No Python callback is attached
    to `future`, so the thread that completes it (a process group's worker
    thread) runs no Python code (see the module docstring).

    Args:
        future: the collective's future, typically from `Work.get_future()`.
        finish: turns what the collective wrote into the result; called at
            most once, after `future` has completed.

    Examples:
        >>> future = torch.futures.Future()
        >>> handle = DeferredHandle(future, lambda: torch.ones(2) / 2)
        >>> handle.done()
        False
        >>> future.set_result(None)
        >>> handle.done(), handle.wait()
        (True, tensor([0.5000, 0.5000]))
        >>> handle.wait() is handle.wait()  # finished once
        True

    """

    def __init__(
        self,
        future: torch.futures.Future[Any],
        finish: Callable[[], torch.Tensor],
    ) -> None:
        self._future = future
        self._finish: Callable[[], torch.Tensor] | None = finish
        self._result: torch.Tensor | None = None

    def wait(self) -> torch.Tensor:
        """Wait for the future, then return the finished result."""
        if self._finish is not None:
            self._future.wait()  # raises the error of a failed collective
            self._result = self._finish()
            self._finish = None
        assert self._result is not None  # set with _finish cleared
        return self._result

    def done(self) -> bool:
        """Return whether the future has completed."""
        return self._future.done()


def completed(tensor: torch.Tensor) -> Handle:
    """Return a handle whose `wait()` returns `tensor` at once."""
    return _CompletedHandle(tensor)


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
    reduced buffer into its tensors (on the waiting thread, see the
    module's docstring).

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
        self.labels: list[str] = []
        """The label of each tensor added, in order (kept to name the
        bucket when its collective fails)."""
        self._future: torch.futures.Future[Any] | None = None
        self._flat: torch.Tensor | None = None
        self._results: list[torch.Tensor] | None = None

    @property
    def started(self) -> bool:
        """Whether the allreduce has been started."""
        return self._future is not None

    def add(self, tensor: torch.Tensor, entry: Entry, label: str = '') -> int:
        """Append `tensor` (read when the bucket starts) with its `label`;
        return its index.
        """
        self._parts.append(tensor.reshape(-1))
        self._entries.append(entry)
        self.labels.append(label)
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

    @property
    def labels(self) -> tuple[str, ...]:
        """The labels of every tensor of the bucket, in order."""
        return tuple(self._bucket.labels)


def _check_tensor(tensor: object, symmetric: bool, average: bool) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise type_error('tensor', tensor, 'a torch.Tensor')
    if symmetric:
        check_square(tensor.shape, 'a tensor with symmetric=True')
    if average and not (tensor.is_floating_point() or tensor.is_complex()):
        raise TypeError(
            f'average=True needs a floating-point or complex tensor; got '
            f'dtype {tensor.dtype} (pass average=False to sum)',
        )


class TorchDistributedCommunicator:
    """Collectives of `torch.distributed` that return handles.

    Each method returns a `Handle`. Every method's
    collective is called by every rank of its group in the same order with
    tensors of the same shape and dtype (see the module docstring).
    `bytes_communicated` and `collectives_started` count, per kind
    (`'allreduce'`, `'broadcast'`, `'allgather'`, `'scatter'`: only the
    source's bytes; `'agreement'`: the setup check of construction), the
    payload bytes this rank handed to collectives and how many it started;
    completed world-size-1 shortcuts are not counted.
    [`reset_stats`][kfac.distributed.TorchDistributedCommunicator.reset_stats]
    zeroes them.

    The communicator keeps the future of each collective it starts, and
    with it the collective's tensors, until it starts another collective
    after that one has completed (the last ones until it is freed itself):
    the process group's worker thread lets go of the tensors just after
    the future completes and must not be the last to hold them (see
    the module's docstring).

    Args:
        bucket_cap_mb: largest bucket of `allreduce_bucketed` in MiB; 0
            disables bucketing.
        symmetry_aware: communicate tensors flagged `symmetric=True` as
            their packed upper triangle.

    Raises:
        TypeError: `bucket_cap_mb` is not a real number or
            `symmetry_aware` not a bool.
        ValueError: `bucket_cap_mb` is negative, NaN or infinite.

    """

    def __init__(
        self,
        bucket_cap_mb: float = 25.0,
        symmetry_aware: bool = False,
    ) -> None:
        self._bucket_cap_mb = validate_float(
            'allreduce_bucket_cap_mb', bucket_cap_mb, low=0.0, low_open=False
        )
        self._bucket_cap_bytes = int(self._bucket_cap_mb * 2**20)
        self._symmetry_aware = check_bool('symmetry_aware', symmetry_aware)
        self._pending: dict[tuple[object, ...], Bucket] = {}
        self._kept: list[
            tuple[torch.futures.Future[Any], tuple[torch.Tensor, ...]]
        ] = []
        self.bytes_communicated: collections.Counter[str] = (
            collections.Counter()
        )
        self.collectives_started: collections.Counter[str] = (
            collections.Counter()
        )

    @property
    def bucket_cap_mb(self) -> float:
        """Largest bucket of `allreduce_bucketed` in MiB (0: no bucketing)."""
        return self._bucket_cap_mb

    @property
    def symmetry_aware(self) -> bool:
        """Whether `symmetric=True` tensors travel as packed triangles."""
        return self._symmetry_aware

    def __repr__(self) -> str:
        return (
            f'{type(self).__name__}(bucket_cap_mb={self._bucket_cap_mb!r}, '
            f'symmetry_aware={self._symmetry_aware!r})'
        )

    def reset_stats(self) -> None:
        """Zero `bytes_communicated` and `collectives_started`."""
        self.bytes_communicated.clear()
        self.collectives_started.clear()

    def _record(self, kind: str, buffer: torch.Tensor) -> None:
        self.bytes_communicated[kind] += buffer.numel() * buffer.element_size()
        self.collectives_started[kind] += 1

    def _keep(
        self, future: torch.futures.Future[Any], *inputs: torch.Tensor
    ) -> None:
        """Keep `future`; let go of those that had completed before."""
        self._kept = [kept for kept in self._kept if not kept[0].done()]
        self._kept.append((future, inputs))

    def allreduce(
        self,
        tensor: torch.Tensor,
        *,
        group: ProcessGroup | None = None,
        symmetric: bool = False,
        average: bool = True,
    ) -> Handle:
        """Start an allreduce (sum, or mean with `average`) over `group`.

        Called by every rank of `group` in the same order with tensors of
        the same shape and dtype. The sum runs in place in `tensor` when it
        is contiguous and not packed (`wait()` then returns `tensor`
        itself); a packed or non-contiguous tensor is copied and left
        unchanged.

        Args:
            tensor: the local contribution.
            group: the process group; the default group if None.
            symmetric: `tensor` is a symmetric matrix; with
                `symmetry_aware` only its upper triangle travels and the
                result is rebuilt from the reduced triangle.
            average: divide the sum by the size of the group.

        Returns:
            A handle to the reduced tensor, identical on every rank.

        Raises:
            TypeError: `tensor` is not a tensor, or `average` is set for
                an integer tensor.
            NonSquareTensorError: `symmetric` for a non-square tensor.
            ValueError: this rank is not a member of `group`.

        """
        _check_tensor(tensor, symmetric, average)
        size = group_size(group)
        if size == 1:
            return completed(tensor)
        packed = symmetric and self._symmetry_aware
        buffer = payload(tensor, packed)
        entry = Entry(tensor.shape, buffer.numel(), packed, average)
        self._record('allreduce', buffer)
        future = start_allreduce(buffer, group)
        self._keep(future)
        return then_finish(future, buffer, entry, size)

    def allreduce_bucketed(
        self,
        tensor: torch.Tensor,
        *,
        group: ProcessGroup | None = None,
        symmetric: bool = False,
        average: bool = True,
        label: str = '',
    ) -> Handle:
        """Add `tensor` to a bucket that is allreduced as one collective.

        Called by every rank of `group` in the same order with tensors of
        the same shape and dtype. Tensors are bucketed by process group
        (the group object; None is the default group), dtype and device, in
        call order. A bucket is started when the next tensor would take it
        past `bucket_cap_mb`, as soon as it holds `bucket_cap_mb` or more
        (so a tensor larger than the cap travels alone, at once), by
        `flush()`, or by the `wait()` of one of its handles (see
        [`flush`][kfac.distributed.TorchDistributedCommunicator.flush]).
        `tensor` is read when its bucket starts and never written. With
        `bucket_cap_mb == 0` this is
        [`allreduce`][kfac.distributed.TorchDistributedCommunicator.allreduce].

        Args:
            tensor: the local contribution.
            group: the process group; the default group if None.
            symmetric: as in `allreduce()`.
            average: divide the sum by the size of the group.
            label: names `tensor` in the handle's `labels` (which say
                what a failed bucket held).

        Returns:
            A handle to the reduced tensor, identical on every rank.

        Raises:
            TypeError: as in `allreduce()`.
            NonSquareTensorError: as in `allreduce()`.
            ValueError: this rank is not a member of `group`.

        """
        if self._bucket_cap_mb == 0:
            return self.allreduce(
                tensor, group=group, symmetric=symmetric, average=average
            )
        _check_tensor(tensor, symmetric, average)
        size = group_size(group)
        if size == 1:
            return completed(tensor)
        packed = symmetric and self._symmetry_aware
        part = get_triu(tensor) if packed else tensor
        nbytes = part.numel() * part.element_size()
        key = (group_key(group), tensor.dtype, tensor.device)
        bucket = self._pending.get(key)
        if bucket is not None and (
            bucket.started or bucket.nbytes + nbytes > self._bucket_cap_bytes
        ):
            self._start(key)
            bucket = None
        if bucket is None:
            bucket = Bucket(group_key(group), size, self._record)
            self._pending[key] = bucket
        entry = Entry(tensor.shape, part.numel(), packed, average)
        index = bucket.add(part, entry, label)
        if bucket.nbytes >= self._bucket_cap_bytes:
            self._start(key)
        return BucketHandle(bucket, index)

    def _start(self, key: tuple[object, ...]) -> None:
        self._keep(self._pending.pop(key).start())

    def flush(self) -> None:
        """Start every pending bucket, in the order they were created.

        Called by every rank that called
        [`allreduce_bucketed`][kfac.distributed.TorchDistributedCommunicator.allreduce_bucketed],
        at the same point of the sequence of collectives. The `wait()` of a
        handle whose bucket is pending starts that bucket alone: a program
        that waits before flushing must make every rank of the group wait on
        the same handles in the same order.
        """
        for key in list(self._pending):
            self._start(key)

    def flush_allreduce_buckets(self) -> None:
        """The original's name of
        [`flush`][kfac.distributed.TorchDistributedCommunicator.flush].
        """
        self.flush()

    def broadcast(
        self,
        tensor: torch.Tensor,
        *,
        src: int,
        group: ProcessGroup | None = None,
        symmetric: bool = False,
    ) -> Handle:
        """Start a broadcast of the `src` rank's tensor over `group`.

        Called by every rank of `group` in the same order with tensors of
        the same shape and dtype; the source's values win. Without packing,
        `tensor` (if contiguous) receives the values in place on the other
        ranks and `wait()` returns it; the source's tensor is not written.
        With packing, every rank, the source too, gets a new matrix rebuilt
        from the source's upper triangle.

        Args:
            tensor: the values on `src`, a buffer of the same shape and
                dtype elsewhere.
            src: the global rank (rank in the default group) that sends; a
                member of `group`.
            group: the process group; the default group if None.
            symmetric: `tensor` is a symmetric matrix; with
                `symmetry_aware` only its upper triangle travels.

        Returns:
            A handle to the source's tensor.

        Raises:
            TypeError: `tensor` is not a tensor or `src` not an int.
            NonSquareTensorError: `symmetric` for a non-square tensor.
            ValueError: `src` or this rank is not a member of `group`.

        """
        _check_tensor(tensor, symmetric, average=False)
        size = group_size(group)
        src = check_src(src, group)
        if size == 1:
            return completed(tensor)
        packed = symmetric and self._symmetry_aware
        buffer = payload(tensor, packed)
        entry = Entry(tensor.shape, buffer.numel(), packed, average=False)
        self._record('broadcast', buffer)
        future = start_broadcast(buffer, src, group)
        self._keep(future)
        return then_finish(future, buffer, entry, size)

    def all_gather(
        self,
        tensor: torch.Tensor,
        *,
        group: ProcessGroup | None = None,
        kind: str = 'allgather',
    ) -> Handle:
        """Start gathering every rank's `tensor` over `group`.

        Called by every rank of `group` in the same order with tensors of
        the same shape and dtype. `tensor` is read, never written.

        Args:
            tensor: the local contribution.
            group: the process group; the default group if None.
            kind: the key of `collectives_started` and
                `bytes_communicated` it is counted under (the setup check
                of construction counts as `'agreement'`).

        Returns:
            A handle to a `(size, *tensor.shape)` tensor whose `i`-th
                entry is the tensor of the group's `i`-th rank, identical
                on every rank.

        Raises:
            TypeError: `tensor` is not a tensor.
            ValueError: this rank is not a member of `group`.
        """
        _check_tensor(tensor, symmetric=False, average=False)
        size = group_size(group)
        if size == 1:
            return completed(tensor.unsqueeze(0))
        buffer = tensor.reshape(-1)  # gloo gathers flat buffers only
        out = buffer.new_empty(size * buffer.numel())
        self._record(kind, buffer)
        future = start_all_gather(out, buffer, group_key(group))
        self._keep(future, buffer)  # the future's value holds only `out`
        return DeferredHandle(future, lambda: out.view(size, *tensor.shape))

    def all_gather_rows(
        self,
        local: torch.Tensor,
        *,
        rows: int,
        group: ProcessGroup,
    ) -> Handle:
        """Start gathering a tensor split by rows over `group`.

        Rank `i` of `group` holds rows `[i c, min((i + 1) c, rows))` of the
        whole, with `c = ⌈rows / size⌉` (`torch.chunk`'s split, the one of
        a DTensor `Shard(0)`: trailing ranks may hold none). Each part is
        padded to `c` rows, so the collective is an even
        `all_gather_into_tensor`. `local` is read, never written.

        Returns:
            A handle to the whole tensor `(rows, *local.shape[1:])`,
            identical on every rank.
        """
        size = group_size(group)
        if size == 1:
            return completed(local)
        chunk = -(-rows // size)
        padded = local.new_zeros((chunk, *local.shape[1:]))
        padded[: local.shape[0]] = local
        out = local.new_empty((chunk * size, *local.shape[1:]))
        self._record('allgather', padded)
        future = start_all_gather(out, padded, group)
        self._keep(future, padded)  # the future's value holds only `out`
        return DeferredHandle(future, lambda: out[:rows])

    def scatter(
        self,
        out: torch.Tensor,
        chunks: list[torch.Tensor] | None,
        *,
        src: int,
        group: ProcessGroup | None = None,
    ) -> Handle:
        """Start sending chunk `i` of the `src` rank's `chunks` to the
        `i`-th rank of `group` (in `get_process_group_ranks` order).

        Every rank of `group` calls it with an `out` of the chunks' shape
        and dtype; only `src` passes `chunks` (one per rank of `group`),
        and only its bytes are counted (`'scatter'`).

        Returns:
            A handle to `out`, written with this rank's chunk.
        """
        size = group_size(group)
        src = check_src(src, group)
        if size == 1:
            assert chunks is not None  # the only rank is the source
            return completed(out.copy_(chunks[0]))
        if chunks is not None:
            self.bytes_communicated['scatter'] += sum(
                c.numel() * c.element_size() for c in chunks
            )
            self.collectives_started['scatter'] += 1
        future = start_scatter(out, chunks, src, group)
        self._keep(future, *(chunks or ()))  # the value holds only `out`
        return DeferredHandle(future, lambda: out)
