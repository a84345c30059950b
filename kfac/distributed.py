"""Communication for K-FAC: collectives as handles, bucketing, packing.

Every collective here is a ``torch.distributed`` one started with
``async_op=True``; its ``Work`` becomes a ``torch.futures.Future`` through
``get_future()`` and the result is post-processed (averaged, reshaped,
unpacked) with ``Future.then``. A caller gets a :class:`Handle` and reads the
result with :meth:`Handle.wait`.

Without an initialised process group (one process, no ``torch.distributed``
at all), and on a group of one rank, every collective returns a completed
handle holding its input: no process group is needed.

Symmetric matrices (the K-FAC factors) can travel as their packed upper
triangle, ``n (n + 1) / 2`` instead of ``n ** 2`` numbers; see
:func:`get_triu` and :func:`fill_triu`.

Rules for every collective of :class:`TorchDistributedCommunicator`:

* Every rank of ``group`` (the default group when ``None``) calls it, in the
  same order relative to the other collectives on that group, with tensors
  of the same shape, dtype and ``symmetric`` flag. Ranks outside ``group``
  must not call it (:class:`ValueError`).
* A tensor handed to a collective must not be modified until the
  :meth:`Handle.wait` of its handle returns; use the tensor returned by
  ``wait()`` as the result. Each method says whether its input is written.
"""

from __future__ import annotations

import abc
import collections
import dataclasses
import functools
import logging
import math
import numbers
from collections.abc import Callable
from typing import TYPE_CHECKING
from typing import Any

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = [
    'Communicator',
    'FutureHandle',
    'Handle',
    'NonSquareTensorError',
    'TorchDistributedCommunicator',
    'completed',
    'fill_triu',
    'get_rank',
    'get_triu',
    'get_world_size',
]

logger = logging.getLogger(__name__)

#: Matrices up to this size keep their triangle indices in a cache.
_TRIU_CACHE_MAX_N = 512


def _initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def get_rank(group: ProcessGroup | None = None) -> int:
    """Return this process's rank in ``group`` (the default group if None).

    0 when ``torch.distributed`` is unavailable or not initialised; -1 on a
    rank that is not a member of ``group`` (as ``torch.distributed``).
    """
    return dist.get_rank(group) if _initialized() else 0


def get_world_size(group: ProcessGroup | None = None) -> int:
    """Return the number of ranks in ``group`` (the default group if None).

    1 when ``torch.distributed`` is unavailable or not initialised; -1 on a
    rank that is not a member of ``group`` (as ``torch.distributed``).
    """
    return dist.get_world_size(group) if _initialized() else 1


class Handle(abc.ABC):
    """A tensor that may still be in flight."""

    @abc.abstractmethod
    def wait(self) -> torch.Tensor:
        """Block until the value is available and return it."""

    @abc.abstractmethod
    def done(self) -> bool:
        """Return whether :meth:`wait` would return without blocking."""


class _CompletedHandle(Handle):
    def __init__(self, tensor: torch.Tensor) -> None:
        self._tensor = tensor

    def wait(self) -> torch.Tensor:
        return self._tensor

    def done(self) -> bool:
        return True


class FutureHandle(Handle):
    """A handle on a ``torch.futures.Future`` that yields a tensor."""

    def __init__(self, future: torch.futures.Future[torch.Tensor]) -> None:
        self._future = future

    def wait(self) -> torch.Tensor:
        """Return the future's value; re-raise its error if it failed."""
        return self._future.wait()

    def done(self) -> bool:
        """Return whether the future has completed."""
        return self._future.done()


def completed(tensor: torch.Tensor) -> Handle:
    """Return a handle whose :meth:`~Handle.wait` returns ``tensor``."""
    return _CompletedHandle(tensor)


class NonSquareTensorError(ValueError):
    """A symmetric-matrix operation got a tensor that is not square 2-D."""


def _check_square(shape: torch.Size | tuple[int, ...], what: str) -> int:
    if len(shape) != 2 or shape[0] != shape[1]:
        raise NonSquareTensorError(
            f'{what} must be a square 2-D matrix; got shape {tuple(shape)}',
        )
    return int(shape[0])


@functools.lru_cache(maxsize=64)
def _cached_triu_indices(n: int, device: torch.device) -> torch.Tensor:
    return torch.triu_indices(n, n, device=device)


def _triu_indices(n: int, device: torch.device) -> torch.Tensor:
    """Return ``torch.triu_indices(n, n)``: rows and columns, shape (2, m)."""
    if n <= _TRIU_CACHE_MAX_N:
        return _cached_triu_indices(n, device)
    return torch.triu_indices(n, n, device=device)


def get_triu(tensor: torch.Tensor) -> torch.Tensor:
    """Return the upper triangle of a square matrix, diagonal included.

    Args:
        tensor: a matrix of shape (n, n).

    Returns:
        A new 1-D tensor of ``n (n + 1) / 2`` elements, the entries
        ``tensor[i, j]`` with ``i <= j`` in row-major order.

    Raises:
        NonSquareTensorError: ``tensor`` is not a square 2-D tensor.

    """
    n = _check_square(tensor.shape, 'tensor')
    rows, cols = _triu_indices(n, tensor.device)
    return tensor[rows, cols]


def fill_triu(
    shape: torch.Size | tuple[int, ...],
    packed: torch.Tensor,
) -> torch.Tensor:
    """Rebuild a symmetric matrix from its packed upper triangle.

    The inverse of :func:`get_triu` on symmetric matrices: entry ``(i, j)``
    and entry ``(j, i)`` are both the packed value of ``(min, max)``.

    Args:
        shape: the matrix shape, (n, n).
        packed: 1-D tensor of ``n (n + 1) / 2`` elements as from
            :func:`get_triu`.

    Returns:
        A new (n, n) tensor with the dtype and device of ``packed``.

    Raises:
        NonSquareTensorError: ``shape`` is not square 2-D.
        ValueError: ``packed`` is not 1-D of ``n (n + 1) / 2`` elements.

    """
    n = _check_square(tuple(shape), 'shape')
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


@dataclasses.dataclass(frozen=True)
class _Entry:
    """How to turn a reduced flat slice back into the caller's tensor."""

    shape: torch.Size
    numel: int  # elements that travel: the packed triangle's when packed
    packed: bool
    average: bool


def _finish(flat: torch.Tensor, entry: _Entry, size: int) -> torch.Tensor:
    """Average, unpack or reshape the reduced ``flat`` (written in place)."""
    if entry.average:
        flat.div_(size)
    if entry.packed:
        return fill_triu(entry.shape, flat)
    return flat if flat.shape == entry.shape else flat.view(entry.shape)


def _payload(tensor: torch.Tensor, packed: bool) -> torch.Tensor:
    """Return what travels for ``tensor``: its triangle, or it (contiguous)."""
    return get_triu(tensor) if packed else tensor.contiguous()


def _start_allreduce(
    buffer: torch.Tensor,
    group: ProcessGroup | None,
) -> torch.futures.Future[Any]:
    all_reduce: Callable[..., dist.Work] = dist.all_reduce
    work = all_reduce(buffer, op=dist.ReduceOp.SUM, group=group, async_op=True)
    return work.get_future()


def _start_broadcast(
    buffer: torch.Tensor,
    src: int,
    group: ProcessGroup | None,
) -> torch.futures.Future[Any]:
    broadcast: Callable[..., dist.Work] = dist.broadcast
    work = broadcast(buffer, src=src, group=group, async_op=True)
    return work.get_future()


def _then_finish(
    future: torch.futures.Future[Any],
    buffer: torch.Tensor,
    entry: _Entry,
    size: int,
) -> torch.futures.Future[torch.Tensor]:
    """Chain :func:`_finish` of ``buffer`` after the collective ``future``."""

    def callback(done: torch.futures.Future[Any]) -> torch.Tensor:
        done.value()  # re-raises the error of a failed collective
        return _finish(buffer, entry, size)

    return future.then(callback)


_Record = Callable[[str, torch.Tensor], None]


class _Bucket:
    """Tensors of one group, dtype and device reduced as one flat buffer.

    Once started, the bucket forgets its group and the future's callback
    holds only the entries: a process group must not be released by a
    reference cycle collected on its own worker thread.
    """

    def __init__(
        self, group: ProcessGroup, size: int, record: _Record
    ) -> None:
        self.group: ProcessGroup | None = group
        self.size = size
        self.nbytes = 0
        self._record = record
        self._parts: list[torch.Tensor] = []
        self._entries: list[_Entry] = []
        self._future: torch.futures.Future[list[torch.Tensor]] | None = None

    @property
    def started(self) -> bool:
        return self._future is not None

    def add(self, payload: torch.Tensor, entry: _Entry) -> int:
        self._parts.append(payload.reshape(-1))
        self._entries.append(entry)
        self.nbytes += payload.numel() * payload.element_size()
        return len(self._entries) - 1

    def start(self) -> torch.futures.Future[list[torch.Tensor]]:
        """Start the allreduce unless started; return its future."""
        if self._future is None:
            flat = torch.cat(self._parts)
            logger.debug(
                'allreduce of a bucket of %d tensors, %d bytes',
                len(self._parts),
                self.nbytes,
            )
            self._record('allreduce', flat)
            future = _start_allreduce(flat, self.group)
            entries, size = self._entries, self.size
            self._future = future.then(
                lambda done: _unflatten(done, flat, entries, size)
            )
            self._parts, self._entries, self.group = [], [], None
        return self._future


def _unflatten(
    done: torch.futures.Future[Any],
    flat: torch.Tensor,
    entries: list[_Entry],
    size: int,
) -> list[torch.Tensor]:
    """Split a reduced bucket into the tensors of its ``entries``."""
    done.value()  # re-raises the error of a failed collective
    results = []
    offset = 0
    for entry in entries:
        part = flat[offset : offset + entry.numel]
        results.append(_finish(part, entry, size))
        offset += entry.numel
    return results


class _BucketHandle(Handle):
    """Handle on one tensor of a bucket that may not have started yet."""

    def __init__(self, bucket: _Bucket, index: int) -> None:
        self._bucket = bucket
        self._index = index

    def wait(self) -> torch.Tensor:
        """Start the bucket if it is pending, then wait for this tensor.

        Starting a pending bucket is a collective: if any rank can get here
        before ``flush()``, every rank of the group must wait on the same
        handles in the same order.
        """
        return self._bucket.start().wait()[self._index]

    def done(self) -> bool:
        return self._bucket.started and self._bucket.start().done()


def _check_tensor(tensor: object, symmetric: bool, average: bool) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f'tensor must be a torch.Tensor; got {tensor!r}')
    if symmetric:
        _check_square(tensor.shape, 'a tensor with symmetric=True')
    if average and not (tensor.is_floating_point() or tensor.is_complex()):
        raise TypeError(
            f'average=True needs a floating-point or complex tensor; got '
            f'dtype {tensor.dtype} (pass average=False to sum)',
        )


def _check_bucket_cap(value: object) -> float:
    """Return ``value`` as a float if it is a valid bucket cap in MiB."""
    allowed = 'a finite number of MiB >= 0 (0 disables bucketing)'
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(
            f'allreduce_bucket_cap_mb must be {allowed}; got {value!r} of '
            f'type {type(value).__name__}',
        )
    cap = float(value)
    if not (math.isfinite(cap) and cap >= 0):
        raise ValueError(
            f'allreduce_bucket_cap_mb must be {allowed}; got {cap}'
        )
    return cap


def _group_size(group: ProcessGroup | None) -> int:
    """Return the size of ``group``; raise if this rank is not in it."""
    size = get_world_size(group)
    if size < 1:
        raise ValueError(
            f'rank {get_rank()} is not a member of the process group it '
            f"called a collective on; only the group's ranks may call it",
        )
    return size


class TorchDistributedCommunicator:
    """Collectives of ``torch.distributed`` that return :class:`Handle` s.

    Every method's collective is called by every rank of its group in the
    same order with tensors of the same shape and dtype (see the module
    docstring). ``bytes_communicated`` and ``collectives_started`` count, per
    kind (``'allreduce'``, ``'broadcast'``), the payload bytes this rank
    handed to collectives and how many it started; completed world-size-1
    shortcuts are not counted. :meth:`reset_stats` zeroes them.

    Args:
        bucket_cap_mb: largest bucket of :meth:`allreduce_bucketed` in MiB;
            0 disables bucketing.
        symmetry_aware: communicate tensors flagged ``symmetric=True`` as
            their packed upper triangle.

    Raises:
        TypeError: ``bucket_cap_mb`` is not a real number or
            ``symmetry_aware`` not a bool.
        ValueError: ``bucket_cap_mb`` is negative, NaN or infinite.

    """

    def __init__(
        self,
        bucket_cap_mb: float = 25.0,
        symmetry_aware: bool = False,
    ) -> None:
        if not isinstance(symmetry_aware, bool):
            raise TypeError(
                f'symmetry_aware must be a bool; got {symmetry_aware!r}',
            )
        self._bucket_cap_mb = _check_bucket_cap(bucket_cap_mb)
        self._bucket_cap_bytes = int(self._bucket_cap_mb * 2**20)
        self._symmetry_aware = symmetry_aware
        self._pending: dict[tuple[object, ...], _Bucket] = {}
        self.bytes_communicated: collections.Counter[str] = (
            collections.Counter()
        )
        self.collectives_started: collections.Counter[str] = (
            collections.Counter()
        )

    @property
    def bucket_cap_mb(self) -> float:
        """Largest bucket of :meth:`allreduce_bucketed` in MiB (0: none)."""
        return self._bucket_cap_mb

    @property
    def symmetry_aware(self) -> bool:
        """Whether ``symmetric=True`` tensors travel as packed triangles."""
        return self._symmetry_aware

    def __repr__(self) -> str:
        return (
            f'{type(self).__name__}(bucket_cap_mb={self._bucket_cap_mb!r}, '
            f'symmetry_aware={self._symmetry_aware!r})'
        )

    def reset_stats(self) -> None:
        """Zero ``bytes_communicated`` and ``collectives_started``."""
        self.bytes_communicated.clear()
        self.collectives_started.clear()

    def _record(self, kind: str, buffer: torch.Tensor) -> None:
        self.bytes_communicated[kind] += buffer.numel() * buffer.element_size()
        self.collectives_started[kind] += 1

    def allreduce(
        self,
        tensor: torch.Tensor,
        *,
        group: ProcessGroup | None = None,
        symmetric: bool = False,
        average: bool = True,
    ) -> Handle:
        """Start an allreduce (sum, or mean with ``average``) over ``group``.

        Called by every rank of ``group`` in the same order with tensors of
        the same shape and dtype. The sum runs in place in ``tensor`` when it
        is contiguous and not packed (``wait()`` then returns ``tensor``
        itself); a packed or non-contiguous tensor is copied and left
        unchanged.

        Args:
            tensor: the local contribution.
            group: the process group; the default group if None.
            symmetric: ``tensor`` is a symmetric matrix; with
                ``symmetry_aware`` only its upper triangle travels and the
                result is rebuilt from the reduced triangle.
            average: divide the sum by the size of the group.

        Returns:
            A handle to the reduced tensor, identical on every rank.

        Raises:
            TypeError: ``tensor`` is not a tensor, or ``average`` is set for
                an integer tensor.
            NonSquareTensorError: ``symmetric`` for a non-square tensor.
            ValueError: this rank is not a member of ``group``.

        """
        _check_tensor(tensor, symmetric, average)
        size = _group_size(group)
        if size == 1:
            return completed(tensor)
        packed = symmetric and self._symmetry_aware
        buffer = _payload(tensor, packed)
        entry = _Entry(tensor.shape, buffer.numel(), packed, average)
        self._record('allreduce', buffer)
        future = _start_allreduce(buffer, group)
        return FutureHandle(_then_finish(future, buffer, entry, size))

    def allreduce_bucketed(
        self,
        tensor: torch.Tensor,
        *,
        group: ProcessGroup | None = None,
        symmetric: bool = False,
        average: bool = True,
    ) -> Handle:
        """Add ``tensor`` to a bucket that is allreduced as one collective.

        Called by every rank of ``group`` in the same order with tensors of
        the same shape and dtype. Tensors are bucketed by process group
        (the group object; None is the default group), dtype and device, in
        call order. A bucket is started when the next tensor would take it
        past ``bucket_cap_mb``, as soon as it holds ``bucket_cap_mb`` or
        more (so a tensor larger than the cap travels alone, at once), by
        :meth:`flush`, or by the ``wait()`` of one of its handles (see
        :meth:`flush`). ``tensor`` is read when its bucket starts and never
        written. With ``bucket_cap_mb == 0`` this is :meth:`allreduce`.

        Args:
            tensor: the local contribution.
            group: the process group; the default group if None.
            symmetric: as in :meth:`allreduce`.
            average: divide the sum by the size of the group.

        Returns:
            A handle to the reduced tensor, identical on every rank.

        Raises:
            TypeError: as in :meth:`allreduce`.
            NonSquareTensorError: as in :meth:`allreduce`.
            ValueError: this rank is not a member of ``group``.

        """
        if self._bucket_cap_mb == 0:
            return self.allreduce(
                tensor, group=group, symmetric=symmetric, average=average
            )
        _check_tensor(tensor, symmetric, average)
        size = _group_size(group)
        if size == 1:
            return completed(tensor)
        packed = symmetric and self._symmetry_aware
        payload = get_triu(tensor) if packed else tensor
        nbytes = payload.numel() * payload.element_size()
        key = (_group_key(group), tensor.dtype, tensor.device)
        bucket = self._pending.get(key)
        if bucket is not None and (
            bucket.started or bucket.nbytes + nbytes > self._bucket_cap_bytes
        ):
            self._start(key)
            bucket = None
        if bucket is None:
            bucket = _Bucket(_group_key(group), size, self._record)
            self._pending[key] = bucket
        entry = _Entry(tensor.shape, payload.numel(), packed, average)
        index = bucket.add(payload, entry)
        if bucket.nbytes >= self._bucket_cap_bytes:
            self._start(key)
        return _BucketHandle(bucket, index)

    def _start(self, key: tuple[object, ...]) -> None:
        self._pending.pop(key).start()

    def flush(self) -> None:
        """Start every pending bucket, in the order they were created.

        Called by every rank that called :meth:`allreduce_bucketed`, at the
        same point of the sequence of collectives. The ``wait()`` of a
        handle whose bucket is pending starts that bucket alone: a program
        that waits before flushing must make every rank of the group wait on
        the same handles in the same order.
        """
        for key in list(self._pending):
            self._start(key)

    def broadcast(
        self,
        tensor: torch.Tensor,
        *,
        src: int,
        group: ProcessGroup | None = None,
        symmetric: bool = False,
    ) -> Handle:
        """Start a broadcast of the ``src`` rank's tensor over ``group``.

        Called by every rank of ``group`` in the same order with tensors of
        the same shape and dtype; the source's values win. Without packing,
        ``tensor`` (if contiguous) receives the values in place on the other
        ranks and ``wait()`` returns it; the source's tensor is not written.
        With packing, every rank, the source too, gets a new matrix rebuilt
        from the source's upper triangle.

        Args:
            tensor: the values on ``src``, a buffer of the same shape and
                dtype elsewhere.
            src: the global rank (rank in the default group) that sends; a
                member of ``group``.
            group: the process group; the default group if None.
            symmetric: ``tensor`` is a symmetric matrix; with
                ``symmetry_aware`` only its upper triangle travels.

        Returns:
            A handle to the source's tensor.

        Raises:
            TypeError: ``tensor`` is not a tensor or ``src`` not an int.
            NonSquareTensorError: ``symmetric`` for a non-square tensor.
            ValueError: ``src`` or this rank is not a member of ``group``.

        """
        _check_tensor(tensor, symmetric, average=False)
        size = _group_size(group)
        _check_src(src, group)
        if size == 1:
            return completed(tensor)
        packed = symmetric and self._symmetry_aware
        buffer = _payload(tensor, packed)
        entry = _Entry(tensor.shape, buffer.numel(), packed, average=False)
        self._record('broadcast', buffer)
        future = _start_broadcast(buffer, src, group)
        return FutureHandle(_then_finish(future, buffer, entry, size))


#: The communicator K-FAC uses; see :class:`TorchDistributedCommunicator`.
Communicator = TorchDistributedCommunicator


def _group_key(group: ProcessGroup | None) -> ProcessGroup:
    """Return ``group``, with None resolved to the default group object."""
    if group is None:
        group = dist.group.WORLD
    assert group is not None  # only called with a process group initialised
    return group


def _check_src(src: object, group: ProcessGroup | None) -> None:
    if isinstance(src, bool) or not isinstance(src, int):
        raise TypeError(f'src must be an int (a global rank); got {src!r}')
    ranks = dist.get_process_group_ranks(group) if _initialized() else [0]
    if src not in ranks:
        raise ValueError(
            f'src={src} is not a member of the process group; its global '
            f'ranks are {ranks}',
        )
