"""The calls of one factor update, kept whole for statistics of each example.

K-FAC's factors need only sums of outer products, formed in the hooks; EKFAC's
scaling (see [`kfac.math.ekfac`][kfac.math.ekfac]) needs each example's
gradient `Σ_t g_{n,t} ã_{n,t}ᵀ` in the eigenbases in force *after* the
step's decomposition. A layer that keeps
[`ExampleRows`][kfac.layers.examples.ExampleRows] therefore holds each
captured call's input and output gradient (with the multiplier of `g`) until
the step uses them, grouped by backward pass: the calls of one pass are
positions of the same examples, and each pass brings its own examples and its
count `Z` (the terms `G` averages over).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

import torch

__all__ = ['Call', 'ExampleRows', 'Pass']


class Call(NamedTuple):
    """One call of the module whose output got its gradient."""

    use: int
    """Which use of a weight tied in transposed roles (0 otherwise)."""
    layer_input: torch.Tensor
    """The module's input (detached)."""
    grad_output: torch.Tensor
    """The gradient of the loss with respect to its output (detached)."""
    scale: float
    """The multiplier turning `grad_output` into `g`."""


class Pass(NamedTuple):
    """The calls of one backward pass and the terms `Z` it counts."""

    calls: tuple[Call, ...]
    """The calls, in the order their gradients arrived."""
    terms: int
    """The terms `G` averages over for this pass (0 for a summed loss)."""


class ExampleRows:
    """The calls of the current factor update, grouped by backward pass.

    Calls are added as their gradients arrive, a pass ends with its count,
    and the factor update *seals* the passes so far: the step takes them
    once (`take`). Captures after the seal belong to the next update.
    """

    def __init__(self) -> None:
        self._calls: list[Call] = []
        self._passes: list[Pass] = []
        self._sealed: tuple[Pass, ...] = ()

    def add(self, call: Call) -> None:
        """Keep one call of the current backward pass."""
        self._calls.append(call)

    def end_pass(self, count: int) -> None:
        """End the current backward pass, which counts `count` terms (a
        pass without calls is not kept).
        """
        if self._calls:
            self._passes.append(Pass(tuple(self._calls), count))
        self._calls = []

    def scale(self, ratio: float) -> None:
        """Multiply the `g` multiplier of every call not sealed yet by
        `ratio`.
        """

        def scaled(calls: Iterable[Call]) -> tuple[Call, ...]:
            return tuple(c._replace(scale=c.scale * ratio) for c in calls)

        self._calls = list(scaled(self._calls))
        self._passes = [
            p._replace(calls=scaled(p.calls)) for p in self._passes
        ]

    def seal(self) -> None:
        """Make the passes so far the factor update's (replacing any sealed
        before); calls of an unfinished pass are dropped.
        """
        self._sealed = tuple(self._passes)
        self._passes, self._calls = [], []

    def take(self) -> tuple[Pass, ...]:
        """The sealed passes, handed over once."""
        sealed, self._sealed = self._sealed, ()
        return sealed

    def discard(self) -> None:
        """Drop the passes not sealed yet."""
        self._passes, self._calls = [], []

    def drop_sealed(self) -> None:
        """Drop the sealed passes (their factor update was rolled back)."""
        self._sealed = ()

    def move(self, device: torch.device) -> None:
        """Move every kept tensor to `device`."""

        def moved(calls: tuple[Call, ...] | list[Call]) -> tuple[Call, ...]:
            return tuple(
                c._replace(
                    layer_input=c.layer_input.to(device),
                    grad_output=c.grad_output.to(device),
                )
                for c in calls
            )

        self._calls = list(moved(self._calls))
        self._passes = [p._replace(calls=moved(p.calls)) for p in self._passes]
        self._sealed = tuple(
            p._replace(calls=moved(p.calls)) for p in self._sealed
        )

    def nbytes(self) -> tuple[int, int]:
        """Bytes of the kept inputs and of the kept output gradients."""
        calls = [
            *self._calls,
            *(c for p in (*self._passes, *self._sealed) for c in p.calls),
        ]
        inputs = sum(_nbytes(c.layer_input) for c in calls)
        grads = sum(_nbytes(c.grad_output) for c in calls)
        return inputs, grads


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()
