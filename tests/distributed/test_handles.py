"""kfac.distributed._communicator: completed handles and handles on futures."""

from __future__ import annotations

import pytest
import torch

from kfac.distributed._communicator import FutureHandle
from kfac.distributed._communicator import Handle
from kfac.distributed._communicator import completed


def test_completed_handle_returns_its_tensor() -> None:
    tensor = torch.arange(3.0)
    handle = completed(tensor)
    assert isinstance(handle, Handle)
    assert handle.done()
    assert handle.wait() is tensor


def test_future_handle_waits_for_its_future() -> None:
    tensor = torch.arange(3.0)
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    pending = FutureHandle(future)
    assert not pending.done()
    future.set_result(tensor)
    assert pending.done()
    assert pending.wait() is tensor


def test_future_handle_raises_the_error_of_its_future() -> None:
    failing: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    # torch's stub types the argument of set_exception as the result type.
    failing.set_exception(RuntimeError('collective failed'))  # type: ignore[arg-type]  # torch's stub: the result type
    handle = FutureHandle(failing)
    assert handle.done()
    with pytest.raises(RuntimeError, match='collective failed'):
        handle.wait()
