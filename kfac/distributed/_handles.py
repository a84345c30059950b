"""Handles: tensors that may still be in flight.

A collective started with `async_op=True` gives its result later. The
communicator returns a `Handle` for it, whose
`wait()` blocks until the tensor is there and returns it, rather than a
value that is sometimes a tensor and sometimes a future. Nothing here needs
`torch.distributed`.

What a collective's result needs afterwards (averaging, unpacking) runs in
`wait()`, on the thread that waits
(`DeferredHandle`), never as a Python
callback chained with `Future.then`: torch runs such a callback, and frees
it, on the thread that completes the future, for gloo a worker thread of
the process group, which must take the GIL to do so. That thread must also
take the GIL when it drops the last reference to a tensor other than its
Python object's own (torch >= 2.10 then releases the Python object), so
the communicator keeps each future, whose value holds the tensors, past
its completion
([`TorchDistributedCommunicator`][kfac.distributed.TorchDistributedCommunicator]).
A worker still waiting for the GIL when the interpreter starts shutting
down is ended by CPython (`pthread_exit`) inside C++ code that may not be
unwound, and the process aborts (`terminate called without an active
exception`, SIGABRT) after the user's script has returned.

Examples:
    >>> import torch
    >>> handle = completed(torch.ones(2))
    >>> handle.done(), handle.wait()
    (True, tensor([1., 1.]))

"""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import Any

import torch

__all__ = ['DeferredHandle', 'FutureHandle', 'Handle', 'completed']


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
