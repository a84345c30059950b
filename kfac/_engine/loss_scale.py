"""The loss scale of mixed-precision training, divided out of `G`.

A `LossScale` reads the scale of a
`torch.amp.GradScaler` (or of a callable returning it) once per step, and
says when the scaler is disabled or has not scaled the loss.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from collections.abc import Iterator
from typing import Protocol

import torch

__all__ = [
    'GradScalerLike',
    'LossScale',
    'check_grad_scaler',
    'fp16_autocast',
    'read_loss_scale',
]


class _Scaler(Protocol):
    def get_scale(self) -> float: ...


GradScalerLike = _Scaler | Callable[[], float]
"""A `torch.amp.GradScaler` (or the deprecated CUDA one), or a callable
returning the current loss scale."""

LogOnce = Callable[..., None]
"""`log_once(key, name, message, *args)`: log a warning once per key and
name."""


def check_grad_scaler(grad_scaler: object) -> None:
    """Raise `TypeError` unless `grad_scaler` is None, has `get_scale()`
    or is callable.
    """
    if grad_scaler is None or callable(grad_scaler):
        return
    if not hasattr(grad_scaler, 'get_scale'):
        raise TypeError(
            'grad_scaler must be None, a GradScaler or a callable '
            f'returning the loss scale; got {grad_scaler!r}',
        )


def read_loss_scale(grad_scaler: GradScalerLike) -> float:
    """The current loss scale of a scaler or a callable returning it."""
    getter = getattr(grad_scaler, 'get_scale', None)
    if getter is not None:
        return float(getter())
    return float(grad_scaler())  # type: ignore[operator]  # no get_scale: a callable


def _scaler_unused(grad_scaler: object) -> bool:
    """Whether a `torch.amp.GradScaler` has never scaled a loss.

    Such a scaler reports its initial scale although no loss was
    multiplied by it (its private `_scale` is created by the first
    `scale()` call).
    """
    return hasattr(grad_scaler, '_scale') and grad_scaler._scale is None


def fp16_autocast(output: torch.Tensor) -> bool:
    """Whether `output` was made under float16 autocast."""
    return output.dtype == torch.float16 and torch.is_autocast_enabled(
        output.device.type
    )


class LossScale:
    """The loss scale of the current step.

    Args:
        grad_scaler: the scaler, or None (a scale of 1).
        log_once: logs a warning once per key and name.
    """

    def __init__(
        self, grad_scaler: GradScalerLike | None, log_once: LogOnce
    ) -> None:
        self.grad_scaler = grad_scaler
        self._log_once = log_once
        self._value: float | None = None
        self._pinned: float | None = None
        is_enabled = getattr(grad_scaler, 'is_enabled', None)
        if callable(is_enabled) and not is_enabled():
            log_once(
                'scaler-disabled',
                '',
                'K-FAC: the grad_scaler passed is disabled (a '
                'torch.cuda.amp.GradScaler without CUDA, or enabled=False); '
                'its scale is taken as 1',
            )

    def value(self) -> float:
        """The loss scale of this step, read once per step (1 without a
        scaler, or with one that has not scaled the loss).
        """
        scaler = self.grad_scaler
        if self._pinned is not None:
            return self._pinned
        if scaler is None:
            return 1.0
        if self._value is None:
            if _scaler_unused(scaler):
                self._log_once(
                    'scaler-unused',
                    '',
                    'K-FAC: the grad_scaler passed has not scaled the loss '
                    '(call scaler.scale(loss).backward()); its scale is '
                    'taken as 1',
                )
                self._value = 1.0
            else:
                self._value = read_loss_scale(scaler)
        return self._value

    def next_step(self) -> None:
        """Forget this step's loss scale."""
        self._value = None

    def for_sampling(self) -> float:
        """The scale to multiply a sampled loss by: this step's (read once),
        or before the scaler has scaled a loss its initial scale (read
        without a host synchronisation), 1 without a scaler.
        """
        scaler = self.grad_scaler
        if scaler is not None and _scaler_unused(scaler):
            return read_loss_scale(scaler)
        return self.value()

    @contextlib.contextmanager
    def pinned(self, scale: float) -> Iterator[None]:
        """Make `value()` return `scale` while the context runs (a backward
        pass of a loss multiplied by it).
        """
        self._pinned = scale
        try:
            yield
        finally:
            self._pinned = None
