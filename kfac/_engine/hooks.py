"""The hook plumbing of capture: per-module tallies, hooks that copy as
inert ones, and the compiler's part (a guard on hook-less modules, hooks
run uncompiled).
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from collections.abc import Callable
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

__all__ = [
    'Hook',
    'Tally',
    'by_module',
    'disabled',
    'guard_module_hooks',
    'inert',
    'uncompiled',
]


@dataclasses.dataclass
class Tally:
    """A module's calls and backward passes in the current step."""

    pending: int = 0
    """Forward calls captured since its last completed backward pass."""
    fired: int = 0
    """Calls whose gradient arrived in the current backward pass."""
    examples: int = 0
    """Terms `G` averages over for those calls (the largest; see
    `add_call`)."""
    passes: int = 0
    """Backward passes completed in this step."""


def inert(*args: object) -> None:
    """What a copied model's K-FAC hooks do: nothing."""


def guard_module_hooks() -> None:
    """Make `torch._dynamo` guard on modules without hooks, if it is
    loaded (graphs are compiled only once it is).

    By default (`skip_nnmodule_hook_guards`) a graph traced for a module
    without hooks is reused after hooks are added, and for any other
    instance of its class: K-FAC's hooks would silently not run. With the
    guard such a graph is retraced.
    """
    config = sys.modules.get('torch._dynamo.config')
    if config is not None:
        # found in sys.modules, so typed as a plain module
        config.skip_nnmodule_hook_guards = False  # type: ignore[attr-defined]


def uncompiled(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn`, or where `torch._dynamo` is loaded `fn` with the compiler
    disabled while it runs: a hook runs eagerly inside a compiled call when
    dynamo runs the model's own frame eagerly (a graph break in a loop),
    and would otherwise compile every frame K-FAC's Python code calls.
    """
    if 'torch._dynamo' not in sys.modules:
        return fn
    return disabled(fn)


@functools.cache
def disabled(fn: Callable[..., Any]) -> Callable[..., Any]:
    # torch.compiler.disable carries no annotations
    disabled: Callable[..., Any] = torch.compiler.disable(fn)  # type: ignore[no-untyped-call]
    return disabled


def by_module(
    modules: Mapping[str, Sequence[nn.Module]],
) -> dict[nn.Module, tuple[str, ...]]:
    """Per module, in first-seen order, the layers whose calls its calls
    are (several for the tiles or groups of one module).
    """
    names: dict[nn.Module, tuple[str, ...]] = {}
    for name, owners in modules.items():
        for module in owners:
            names[module] = (*names.get(module, ()), name)
    return names


class Hook:
    """A hook of the capture. A deep copy of the model (an EMA or
    evaluation copy) gets an inert hook instead of a copy of the whole
    preconditioner: the copy is not preconditioned.
    """

    def __init__(self, fn: Callable[..., object]) -> None:
        self._fn = fn

    def __call__(self, *args: Any) -> Any:
        return self._fn(*args)

    def __deepcopy__(self, memo: dict[int, object]) -> Callable[..., None]:
        return inert
