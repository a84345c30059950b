"""How a compiled model hands K-FAC its layer inputs and output gradients.

`torch.compile` traces the forward hooks of the capture into the model's
graph. Python code that changes K-FAC's objects cannot be traced (each
hook would break the graph and recompile per layer), so inside a traced
region the hooks call two custom operators, opaque to the compiler, that
run K-FAC's Python code when the compiled graph runs:

* `kfac::capture_input(input, like, key, fp16)` hands a module call's
  input to the receiver named by `key`, `[receiver, slot]` (a `Capture`),
  and returns the call's *ticket*, an `int64` tensor `[receiver, call]`
  (call `-1`: not captured), and an *anchor*, a zero of the dtype and
  device of `like`;
* `kfac::capture_grad(grad, ticket)` hands the gradient of that call's
  output to the receiver, in the backward pass.

`GradTap`, an autograd function that adds the anchor to the module output
(a new tensor equal to it), carries the ticket from the first to the
second: it saves the ticket and its backward calls `capture_grad`. A call
whose output gets no gradient frees its ticket with its graph (the
receiver forgets the call then).

What keeps the compiler from dropping, moving or merging the operators:

* `capture_grad` returns nothing: it is registered as an *ordered
  effect*, which the compiler keeps in place.
* `capture_input` is needed by the forward pass through the anchor, so it
  runs in the forward pass (a value needed only by the backward pass
  would be computed there, after other calls' gradients). Each call gets
  its own `like`, an empty tensor made by the hook, so that
  common-subexpression elimination cannot merge two calls of a module on
  the same input (empty tensors are never merged). It is not an effect:
  the partitioner of torch 2.13 saves the effect token of an effectful
  operator inside an activation-checkpointed region for the backward
  pass, which then fails. In such a region it is recomputed in the
  backward pass: a call of its own, whose gradient arrives while the
  original's ticket was freed unused (as a recomputed forward hook in
  eager mode).

Both operators are tagged `cudagraph_unsafe`, so inductor keeps them out
of CUDA graphs. Receivers are found by number in a weak registry: a
compiled graph that outlives its preconditioner (`remove()`) calls
operators that do nothing.

Tags on custom operators came with torch 2.8 and effects registered on
them with torch 2.10, whose AOTAutograd still fails on the graphs: the
operators need torch 2.11 (`COMPILE_RELEASE`). On an older torch they are
not defined (`OPERATORS` is None) and eager K-FAC works as on any other;
a preconditioner built on a compiled model, or a hook traced by the
compiler, raises a `RuntimeError` naming the release it needs (under
`fullgraph=True`, the hook is dynamo's error instead: it cannot call the
function that raises outside the graph).
"""

from __future__ import annotations

import itertools
import re
import weakref
from collections.abc import Callable
from typing import Any
from typing import Final
from typing import NamedTuple
from typing import NoReturn
from typing import Protocol

import torch
from torch._library.custom_ops import CustomOpDef

__all__ = [
    'COMPILE_RELEASE',
    'OPERATORS',
    'GradTap',
    'Operators',
    'Receiver',
    'compile_capture_available',
    'operators',
    'parse_release',
    'register_receiver',
    'require_operators',
    'unregister_receiver',
]


class Receiver(Protocol):
    """What the operators call (a `Capture`)."""

    def on_input(
        self, key: torch.Tensor, layer_input: torch.Tensor, fp16: bool
    ) -> torch.Tensor | None:
        """Capture one call's input; its ticket, or None (not captured)."""

    def on_grad(self, ticket: torch.Tensor, grad: torch.Tensor) -> None:
        """Capture the output gradient of the call of `ticket`."""


_RECEIVERS: weakref.WeakValueDictionary[int, Any] = (
    weakref.WeakValueDictionary()
)
_NUMBERS = itertools.count()


def register_receiver(receiver: Receiver) -> int:
    """Register `receiver` (weakly); its number for the operators."""
    number = next(_NUMBERS)
    _RECEIVERS[number] = receiver
    return number


def unregister_receiver(number: int) -> None:
    """Let the operators of receiver `number` do nothing from now on."""
    _RECEIVERS.pop(number, None)


_EAGER_DISPATCH = (
    torch._C._dispatch_tls_local_include_set(),
    torch._C._dispatch_tls_local_exclude_set(),
)
"""The dispatch state of eager code (read at import). A compiled graph
runs its operators with other keys excluded (functionalization, views,
autograd); the operators run the receiver's code in the eager state, so
that it computes as in eager mode and what it compiles itself (the
compiled arithmetic) sees the same state from both."""


def _as_eager() -> torch._C._ForceDispatchKeyGuard:
    return torch._C._ForceDispatchKeyGuard(*_EAGER_DISPATCH)


def no_ticket(receiver: int) -> torch.Tensor:
    """The ticket of a call that is not captured."""
    return torch.tensor([receiver, -1], dtype=torch.int64)


def _capture_input(
    layer_input: torch.Tensor,
    like: torch.Tensor,
    key: torch.Tensor,
    fp16: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    receiver = int(key[0])
    target = _RECEIVERS.get(receiver)
    ticket = None
    if target is not None:
        with _as_eager():
            ticket = target.on_input(key, layer_input, fp16)
    anchor = like.new_zeros(())
    return (no_ticket(receiver) if ticket is None else ticket), anchor


def _capture_grad(grad: torch.Tensor, ticket: torch.Tensor) -> None:
    receiver, call = ticket.tolist()
    target = _RECEIVERS.get(receiver)
    if target is not None and call >= 0:
        with _as_eager():
            target.on_grad(ticket, grad)


def _capture_input_fake(
    layer_input: torch.Tensor,
    like: torch.Tensor,
    key: torch.Tensor,
    fp16: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty(2, dtype=torch.int64), like.new_empty(())


def _capture_grad_fake(grad: torch.Tensor, ticket: torch.Tensor) -> None:
    return None


COMPILE_RELEASE: Final = '2.11'
"""The first torch release whose compiler takes the operators."""


def parse_release(version: str) -> tuple[int, int]:
    """`(major, minor)` of a torch version string (`'2.11.0+cpu'`).

    Raises:
        ValueError: `version` does not start with `major.minor`.
    """
    match = re.match(r'(\d+)\.(\d+)', version)
    if match is None:
        raise ValueError(f'not a torch release: {version!r}')
    return int(match[1]), int(match[2])


def compile_capture_available() -> bool:
    """Whether this torch takes the operators: they need tags on custom
    operators (`torch.Tag.cudagraph_unsafe`, torch 2.8) and ordered effects
    registered on them (`CustomOpDef.register_effect`, torch 2.10), and
    torch 2.10's AOTAutograd partitioner fails on the graphs that carry
    them (`AssertionError: Node getitem_6 was invalid, but is output`,
    under the inductor and aot_eager backends alike).
    """
    return (
        parse_release(torch.__version__) >= parse_release(COMPILE_RELEASE)
        and hasattr(torch.Tag, 'cudagraph_unsafe')
        and hasattr(CustomOpDef, 'register_effect')
    )


class Operators(NamedTuple):
    """K-FAC's custom operators (`torch.ops.kfac`)."""

    capture_input: CustomOpDef
    capture_grad: CustomOpDef


def define_operators() -> Operators | None:
    """Define K-FAC's operators in torch's registry (once, at import).

    Returns:
        The operators, or None where this torch lacks what they need
        (`compile_capture_available`).
    """
    if not compile_capture_available():
        return None
    tags = (torch.Tag.cudagraph_unsafe,)
    capture_input = torch.library.custom_op(
        'kfac::capture_input', _capture_input, mutates_args=(), tags=tags
    )
    capture_grad = torch.library.custom_op(
        'kfac::capture_grad', _capture_grad, mutates_args=(), tags=tags
    )
    capture_input.register_fake(_capture_input_fake)
    capture_grad.register_fake(_capture_grad_fake)
    # torch.library imports EffectType without listing it in __all__
    capture_grad.register_effect(torch.library.EffectType.ORDERED)  # type: ignore[attr-defined]
    return Operators(capture_input, capture_grad)


OPERATORS: Final = define_operators()
"""K-FAC's operators, or None where this torch has none."""


def require_operators() -> Operators:
    """K-FAC's operators, or an error where this torch has none.

    Raises:
        RuntimeError: this torch lacks what the operators need, naming the
            release that has it.
    """
    if OPERATORS is None:
        raise RuntimeError(
            'K-FAC in a model compiled by torch.compile needs '
            f'torch>={COMPILE_RELEASE} (for its custom operators); this is '
            f'torch {torch.__version__}: run the model uncompiled or '
            f'install torch>={COMPILE_RELEASE}'
        )
    return OPERATORS


def operators() -> Operators:
    """K-FAC's operators, for a hook traced by the compiler.

    Raises:
        RuntimeError: as `require_operators`, raised outside the traced
            region (a `raise` traced by the compiler would end the graph
            and let the hook run eagerly, capturing nothing).
    """
    if OPERATORS is None:
        # torch.compiler.disable carries no annotations
        eagerly: Callable[[], NoReturn] = torch.compiler.disable(  # type: ignore[no-untyped-call]
            require_operators
        )
        eagerly()
    return OPERATORS


class GradTap(torch.autograd.Function):
    """`output + anchor` (equal to `output`), whose backward hands the
    gradient to `capture_grad` with the call's ticket.

    A new tensor rather than a view of `output`: a module output is often
    changed in place next (`nn.ReLU(inplace=True)`), which autograd forbids
    on a view made by a custom function.
    """

    @staticmethod
    def forward(
        ctx: Any,
        output: torch.Tensor,
        ticket: torch.Tensor,
        anchor: torch.Tensor,
    ) -> Any:
        """Keep the ticket; return `output + anchor`."""
        ctx.save_for_backward(ticket)
        return output + anchor

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        """Hand `grad` over; pass it on unchanged."""
        (ticket,) = ctx.saved_tensors
        operators().capture_grad(grad, ticket)
        return grad, None, None
