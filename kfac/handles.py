"""Handles: tensors that may still be in flight.

A collective started with `async_op=True` gives its result later. The
communicator returns a [`Handle`][kfac.handles.Handle] for it, whose
`wait()` blocks until the tensor is there and returns it, rather than a
value that is sometimes a tensor and sometimes a future. Nothing here needs
`torch.distributed`.

Examples:
    >>> import torch
    >>> handle = completed(torch.ones(2))
    >>> handle.done(), handle.wait()
    (True, tensor([1., 1.]))

"""

from __future__ import annotations

import abc

import torch

__all__ = ['FutureHandle', 'Handle', 'completed']


class Handle(abc.ABC):
    """A tensor that may still be in flight."""

    @abc.abstractmethod
    def wait(self) -> torch.Tensor:
        """Block until the value is available and return it."""

    @abc.abstractmethod
    def done(self) -> bool:
        """Return whether `wait()` would return without blocking."""


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


def completed(tensor: torch.Tensor) -> Handle:
    """Return a handle whose `wait()` returns `tensor` at once."""
    return _CompletedHandle(tensor)
