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
"""

from __future__ import annotations

import collections
from typing import TYPE_CHECKING
from typing import Any

import torch

from kfac.distributed._buckets import Bucket
from kfac.distributed._buckets import BucketHandle
from kfac.distributed._buckets import Entry
from kfac.distributed._buckets import payload
from kfac.distributed._buckets import start_all_gather
from kfac.distributed._buckets import start_allreduce
from kfac.distributed._buckets import start_broadcast
from kfac.distributed._buckets import start_scatter
from kfac.distributed._buckets import then_finish
from kfac.distributed._groups import check_src
from kfac.distributed._groups import group_key
from kfac.distributed._groups import group_size
from kfac.distributed._handles import DeferredHandle
from kfac.distributed._handles import Handle
from kfac.distributed._handles import completed
from kfac.distributed._packing import check_square
from kfac.distributed._packing import get_triu
from kfac.validation import check_bool
from kfac.validation import type_error
from kfac.validation import validate_float

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ['TorchDistributedCommunicator']


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
    `kfac.distributed._handles`).

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
        index = bucket.add(part, entry)
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
