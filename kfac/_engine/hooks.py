"""The hook plumbing of capture: per-module tallies, hooks that copy as
inert ones, and the compiler's part (a guard on hook-less modules, hooks
run uncompiled).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import sys
import weakref
from collections.abc import Callable
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any
from typing import Protocol

import torch
from torch import nn

from kfac.layers.helper import ModuleHelper

__all__ = [
    'Hook',
    'Sink',
    'Tally',
    'by_module',
    'claim',
    'disabled',
    'guard_module_hooks',
    'inert',
    'uncompiled',
    'warn_about_owners',
]

logger = logging.getLogger(__name__)

Sink = Callable[[int, torch.Tensor, ModuleHelper], torch.Tensor | None]
"""`sink(call, grad, helper)`: sees the output gradient of a captured call
first; returns the gradient to add (None: add nothing now, keep the
call)."""


class _Owner(Protocol):
    @property
    def attached(self) -> bool: ...


_OWNERS: weakref.WeakKeyDictionary[nn.Module, weakref.ref[_Owner]] = (
    weakref.WeakKeyDictionary()
)


def claim(module: nn.Module, owner: _Owner) -> None:
    """Record that `owner` hooks `module` (weakly)."""
    _OWNERS[module] = weakref.ref(owner)


def warn_about_owners(modules: Mapping[str, Sequence[nn.Module]]) -> None:
    """Warn if a layer's module is hooked by another attached owner."""
    for name, owned in modules.items():
        ref = _OWNERS.get(owned[0])
        owner = None if ref is None else ref()
        if owner is not None and owner.attached:
            logger.warning(
                'K-FAC: module %s already has the hooks of another '
                'K-FAC preconditioner, which keep running and slow '
                'every step; call remove() on the old preconditioner '
                '(e.g. before re-running a notebook cell)',
                name,
            )
            return


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
