"""Capturing layer inputs and output gradients with module hooks.

A forward hook on each registered module records its input (the `A`
side) and registers a gradient hook on its output, which records the
output gradient (the `G` side) when the backward pass reaches it. Data is
captured only on the steps that update factors, in training mode and
with gradients enabled. With `in_hook`, statistics are computed inside
the hooks and the engine is told as soon as a layer has seen all its
micro-batches, so its factor allreduce can start while the backward pass
goes on.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from collections.abc import Mapping
from typing import Any
from typing import Protocol

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from kfac.layers.base import KFACBaseLayer


class _Scaler(Protocol):
    def get_scale(self) -> float: ...


GradScalerLike = _Scaler | Callable[[], float]
"""A `torch.amp.GradScaler` (or the deprecated CUDA one), or a callable
returning the current loss scale."""

Phase = Callable[[str], contextlib.AbstractContextManager[None]]
"""Makes the context manager that times a phase of the step."""


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


class Capture:
    """The hooks that feed the registered layers' factors.

    Args:
        layers: `{module name: layer}`; a forward hook is registered on
            each layer's module.
        active: whether the current step updates factors.
        grad_scaler: the loss scaler whose scale is divided out of output
            gradients, or None.
        accumulation_steps: micro-batches per step.
        in_hook: compute statistics in the hooks (else keep the tensors
            until the factor update).
        on_complete: called with a layer's name when, with `in_hook`, its
            output gradients of all micro-batches have been captured.
        phase: times the capture (see [`PhaseTimer`][kfac.tracing.PhaseTimer]).
    """

    def __init__(
        self,
        layers: Mapping[str, KFACBaseLayer],
        *,
        active: Callable[[], bool],
        grad_scaler: GradScalerLike | None,
        accumulation_steps: int,
        in_hook: bool,
        on_complete: Callable[[str], None],
        phase: Phase,
    ) -> None:
        self._layers = layers
        self._active = active
        self.grad_scaler = grad_scaler
        self.accumulation_steps = accumulation_steps
        self.in_hook = in_hook
        self._on_complete = on_complete
        self._phase = phase
        self._loss_scale: float | None = None
        self._handles: list[RemovableHandle] = [
            layer.module.module.register_forward_hook(
                functools.partial(self._forward_hook, name),
            )
            for name, layer in layers.items()
        ]

    @property
    def attached(self) -> bool:
        """Whether the hooks are registered (until `remove`)."""
        return bool(self._handles)

    def capturing(self, module: nn.Module) -> bool:
        """Whether a forward pass of `module` now is captured."""
        return module.training and torch.is_grad_enabled() and self._active()

    def _forward_hook(
        self,
        name: str,
        module: nn.Module,
        inputs: tuple[Any, ...],
        output: Any,
    ) -> None:
        if not self.capturing(module):
            return
        layer = self._layers[name]
        with self._phase('factor_capture'):
            layer.save_layer_input(inputs[0], now=self.in_hook)
        if isinstance(output, torch.Tensor) and output.requires_grad:
            output.register_hook(functools.partial(self._grad_hook, name))

    def _grad_hook(self, name: str, grad: torch.Tensor) -> None:
        layer = self._layers[name]
        scale = self.loss_scale()
        with self._phase('factor_capture'):
            layer.save_layer_grad_output(
                grad,
                loss_scale=scale,
                accumulation_steps=self.accumulation_steps,
                now=self.in_hook,
            )
        if self.in_hook and layer.captures[1] == self.accumulation_steps:
            self._on_complete(name)

    def loss_scale(self) -> float:
        """The loss scale of this step, read once per step (1 without a
        scaler).
        """
        if self.grad_scaler is None:
            return 1.0
        if self._loss_scale is None:
            self._loss_scale = read_loss_scale(self.grad_scaler)
        return self._loss_scale

    def next_step(self) -> None:
        """Forget this step's loss scale."""
        self._loss_scale = None

    def remove(self) -> None:
        """Remove every hook."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
