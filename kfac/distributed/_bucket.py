"""The original KAISA code's standalone allreduce bucket.

[`TorchDistributedCommunicator.allreduce_bucketed`][kfac.distributed.TorchDistributedCommunicator.allreduce_bucketed]
buckets by itself; this class keeps the original's explicit bucket for
scripts that use it.
"""

from __future__ import annotations

import torch
from torch.distributed import ProcessGroup

from kfac.distributed._communicator import DeferredHandle
from kfac.distributed._communicator import Handle
from kfac.distributed._communicator import completed
from kfac.distributed._communicator import start_allreduce
from kfac.distributed._groups import group_size
from kfac.validation import type_error


class AllreduceTensorBucket:
    """Tensors summed over a process group by one allreduce.

    Add tensors with
    [`add_tensor`][kfac.distributed.AllreduceTensorBucket.add_tensor] (each
    returns a handle to its sum), then call
    [`allreduce`][kfac.distributed.AllreduceTensorBucket.allreduce] once.
    Every rank of `group` fills its bucket with tensors of the same shapes
    and dtype in the same order and calls `allreduce()` at the same point
    of its sequence of collectives. Without `torch.distributed` (or in a
    group of one) nothing travels.

    Args:
        group: the process group; the default group if None.
    """

    def __init__(self, group: ProcessGroup | None = None) -> None:
        self._group = group
        self._tensors: list[torch.Tensor] = []
        self._result: Handle | None = None
        self._communicated = False

    @property
    def size(self) -> int:
        """Bytes of the tensors added so far."""
        return sum(t.numel() * t.element_size() for t in self._tensors)

    def communicated(self) -> bool:
        """Whether `allreduce()` has been called."""
        return self._communicated

    def add_tensor(self, tensor: torch.Tensor) -> Handle:
        """Add `tensor` (read when the bucket is allreduced).

        Returns:
            A handle to the sum of `tensor` over the group; its `wait()`
            raises `RuntimeError` until `allreduce()` has been called.

        Raises:
            TypeError: `tensor` is not a tensor, or its dtype or device
                differs from the first tensor's.
            RuntimeError: the bucket was already allreduced.
        """
        if self._communicated:
            raise RuntimeError('the bucket was already allreduced')
        if not isinstance(tensor, torch.Tensor):
            raise type_error('tensor', tensor, 'a torch.Tensor')
        if self._tensors and (
            tensor.dtype != self._tensors[0].dtype
            or tensor.device != self._tensors[0].device
        ):
            first = self._tensors[0]
            raise TypeError(
                f'tensor must have the dtype and device of the first '
                f'({first.dtype} on {first.device}); got {tensor.dtype} on '
                f'{tensor.device}'
            )
        self._tensors.append(tensor)
        return _Part(self, len(self._tensors) - 1)

    def allreduce(self) -> Handle | None:
        """Start the sum allreduce of every tensor added, as one buffer.

        Returns:
            A handle to the summed flat buffer (the tensors' elements one
            after another), or None if the bucket is empty.

        Raises:
            RuntimeError: called a second time.
        """
        if self._communicated:
            raise RuntimeError('the bucket can be allreduced only once')
        self._communicated = True
        if not self._tensors:
            return None
        flat = torch.cat([t.reshape(-1) for t in self._tensors])
        if group_size(self._group) == 1:
            self._result = completed(flat)
        else:
            future = start_allreduce(flat, self._group)
            self._result = DeferredHandle(future, lambda: flat)
        return self._result

    def _part(self, index: int) -> torch.Tensor:
        if self._result is None:
            raise RuntimeError(
                'the bucket has not been allreduced: call allreduce() first'
            )
        flat = self._result.wait()
        start = sum(t.numel() for t in self._tensors[:index])
        tensor = self._tensors[index]
        return flat[start : start + tensor.numel()].view(tensor.shape)

    def _done(self) -> bool:
        return self._result is not None and self._result.done()


class _Part(Handle):
    """Handle on one tensor of an `AllreduceTensorBucket`."""

    def __init__(self, bucket: AllreduceTensorBucket, index: int) -> None:
        self._bucket = bucket
        self._index = index

    def wait(self) -> torch.Tensor:
        """The tensor's sum over the group, once the bucket was reduced."""
        return self._bucket._part(self._index)

    def done(self) -> bool:
        """Whether the bucket's allreduce has completed."""
        return self._bucket._done()

    def value(self) -> torch.Tensor:
        """The sum, once `done()` (the original's `Future.value()`).

        Raises:
            RuntimeError: the allreduce has not completed.
        """
        if not self.done():
            raise RuntimeError('the bucket has not completed its allreduce')
        return self.wait()
