"""Capturing layer inputs and output gradients with module hooks.

A forward hook on each registered module captures its input (the `A`
side) and registers a gradient hook on that call's output. Only when the
gradient arrives does the call count: the hook adds the input and output
gradient of *that* call to the factors together. A forward pass whose
output never receives a gradient (monitoring, a rollout, an evaluation in
training mode) leaves no trace: its captured input is freed with its
autograd graph.

A module called several times before one backward pass (a shared module,
siamese or contrastive passes) contributes every call as further
weight-sharing positions of the same examples: `A` counts every call's
rows, `G` counts the examples once per backward pass. A module is done
with a backward pass when every forward call since the previous pass has
received its gradient (so its factor allreduce can start while the
backward pass goes on) or, failing that, when the pass ends.

Data is captured only on the steps that update factors, in training mode,
with gradients enabled and while the module's weight requires a gradient.
A hook on each weight's gradient accumulation tells whether any backward
pass ran since the last `step()`.

Each call is a numbered *ticket* that the call's gradient brings back. In
eager mode the ticket rides on a gradient hook of the call's output; in a
region traced by `torch.compile` the forward hook instead calls the
custom operators of `kfac._engine.taps`, which run
the same code when the compiled graph runs, so K-FAC adds no graph break
and no recompilation to the model's forward. Training mode, grad mode and
`requires_grad` are read when the hook runs (or is traced: the compiler
guards on them); whether the step updates factors is read when the call
runs.

Also here, as parts of capture: the hook plumbing (per-module tallies,
hooks that copy as inert ones, the warning when another preconditioner
hooks the same module, the compiler's guard on hook-less modules) and the
loss scale of mixed-precision training, which `LossScale` reads from a
`torch.amp.GradScaler` once per step and divides out of `G`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import logging
import sys
import weakref
from collections.abc import Callable
from collections.abc import Iterator
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any
from typing import Protocol

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from kfac._engine.taps import GradTap
from kfac._engine.taps import operators
from kfac._engine.taps import register_receiver
from kfac._engine.taps import unregister_receiver
from kfac.layers.base import KFACBaseLayer
from kfac.layers.helper import ModuleHelper
from kfac.layers.statistics import Captured

__all__ = [
    'Capture',
    'GradScalerLike',
    'Hook',
    'LossScale',
    'Sink',
    'Tally',
    'by_module',
    'check_grad_scaler',
    'claim',
    'disabled',
    'fp16_autocast',
    'guard_module_hooks',
    'inert',
    'read_loss_scale',
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


Phase = Callable[[str], contextlib.AbstractContextManager[None]]
"""Makes the context manager that times a phase of the step."""


class Capture:
    """The hooks that feed the registered layers' factors.

    Args:
        layers: `{module name: layer}`; a forward hook is registered on
            each layer's module and a gradient-accumulation hook on its
            weight.
        active: whether the current step updates factors.
        grad_scaler: the loss scaler whose scale is divided out of output
            gradients, or None.
        accumulation_steps: backward passes (micro-batches) per step.
        in_hook: compute statistics in the hooks (else keep the tensors
            until the factor update).
        on_complete: called with a layer's name when, with `in_hook`, it
            has completed `accumulation_steps` backward passes.
        phase: times the capture (see
            [`PhaseTimer`][kfac.tracing.PhaseTimer]).
        log_once: logs a warning once per key and module.
        aliases: further modules per layer name whose calls are calls of
            the layer's module (modules sharing its weight).
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
        log_once: LogOnce,
        aliases: Mapping[str, Sequence[nn.Module]] | None = None,
    ) -> None:
        self._layers = layers
        self._active = active
        self.capturing = True  # step 0 updates factors
        """Whether this step updates factors (kept by `refresh`): read by
        the hooks, so that a compiled graph of a step that does not update
        factors has no operator of K-FAC (a second graph)."""
        self.scale = LossScale(grad_scaler, log_once)
        """The loss scale divided out of output gradients."""
        self.accumulation_steps = accumulation_steps
        self.in_hook = in_hook
        self._on_complete = on_complete
        self._phase = phase
        self._log_once = log_once
        self._tallies = {name: Tally() for name in layers}
        self._queued = False
        self._fresh = False
        self._modules = {
            name: [layer.module.module, *(aliases or {}).get(name, ())]
            for name, layer in layers.items()
        }
        warn_about_owners(self._modules)
        self._weights = {
            name: layer.module.weight for name, layer in layers.items()
        }
        guard_module_hooks()
        self._receiver = register_receiver(self)
        self._calls: dict[int, tuple[tuple[str, Captured], ...]] = {}
        self._numbers = itertools.count()
        self._slots: list[tuple[str, ...]] = []
        """Per hooked module, the layers its calls are calls of."""
        self._hooked: list[nn.Module] = []
        self._slot_weights: list[torch.Tensor] = []
        self._seen = False
        """Whether a hooked call ran since the last `take_fresh`."""
        self.sink: Sink | None = None
        """Sees each output gradient first (the Monte Carlo Fisher's)."""
        self._handles: list[RemovableHandle] = []
        for module, names in by_module(self._modules).items():
            key = torch.tensor([self._receiver, len(self._slots)])
            self._handles.append(
                module.register_forward_hook(
                    Hook(functools.partial(self._forward_hook, key))
                )
            )
            self._slots.append(names)
            self._hooked.append(module)
            self._slot_weights.append(self._weights[names[0]])
            claim(module, self)
        for weight in self._weights.values():
            self._handles.append(
                weight.register_post_accumulate_grad_hook(
                    Hook(self._accumulated)
                )
            )

    @property
    def attached(self) -> bool:
        """Whether the hooks are registered (until `remove`)."""
        return bool(self._handles)

    def _forward_hook(
        self,
        key: torch.Tensor,
        module: nn.Module,
        inputs: tuple[Any, ...],
        output: Any,
    ) -> Any:
        """Capture a call of `module` whose output needs a gradient; in a
        traced region, through the operators (returns the tapped output).

        `key` is `[receiver, slot]`, a tensor so that a hook traced alone
        (when the model's own frame runs eagerly) is one graph for every
        module: nothing read here differs between modules.
        """
        if not (
            self.capturing
            and module.training
            and torch.is_grad_enabled()
            and isinstance(output, torch.Tensor)
            and output.requires_grad
        ):
            return None
        fp16 = fp16_autocast(output)
        layer_input = inputs[0].detach()
        if torch.compiler.is_compiling():
            like = torch.empty(0, dtype=output.dtype, device=output.device)
            capture_input = operators().capture_input
            ticket, anchor = capture_input(layer_input, like, key, fp16)
            # Function.apply carries no annotations in torch
            return GradTap.apply(output, ticket, anchor)  # type: ignore[no-untyped-call]
        eager = uncompiled(Capture.on_input)(self, key, layer_input, fp16)
        if eager is not None:
            output.register_hook(functools.partial(self.on_grad, eager))
        return None

    def on_input(
        self, key: torch.Tensor, layer_input: torch.Tensor, fp16: bool
    ) -> torch.Tensor | None:
        """Capture one call's input for the layers of a hooked module, if
        the step updates factors and the module's weight is trained.

        Args:
            key: `[receiver, slot]`, the module's key.
            layer_input: its input.
            fp16: whether the call ran under float16 autocast.

        Returns:
            The call's ticket (None: not captured). The call is forgotten
            when the ticket is freed.
        """
        self._seen = True
        slot = int(key[1])
        if not (self._active() and self._slot_weights[slot].requires_grad):
            return None
        if fp16 and self.grad_scaler is None:
            self._log_once(
                'fp16-no-scaler',
                '',
                'K-FAC: a forward pass runs under float16 autocast but no '
                'grad_scaler was given; pass the GradScaler that scales the '
                'loss as KFACPreconditioner(..., grad_scaler=scaler), or G '
                'is inflated by the loss scale',
            )
        captures = []
        for name in self._slots[slot]:
            layer = self._layers[name]
            layer.follow_module()
            with self._phase('factor_capture'):
                captured = layer.prepare_input(layer_input, now=self.in_hook)
            self._tallies[name].pending += 1
            captures.append((name, captured))
        number = next(self._numbers)
        self._calls[number] = tuple(captures)
        ticket = torch.tensor([self._receiver, number], dtype=torch.int64)
        weakref.finalize(ticket, self._calls.pop, number, None)
        return ticket

    def on_grad(self, ticket: torch.Tensor, grad: torch.Tensor) -> None:
        """Add the call of `ticket` with its output gradient `grad`
        (nothing after `remove`).
        """
        number = int(ticket[1])
        if number not in self._calls:  # forgotten, or taken by a sample
            return
        if self.sink is not None:
            name = self._calls[number][0][0]
            got = self.sink(number, grad, self._layers[name].module)
            if got is None:
                return
            grad = got
        call = self._calls.pop(number)
        scale = self.loss_scale()
        for name, captured in call:
            with self._phase('factor_capture'):
                examples = self._layers[name].add_call(
                    captured,
                    grad,
                    loss_scale=scale,
                    accumulation_steps=self.accumulation_steps,
                    now=self.in_hook,
                )
            tally = self._tallies[name]
            tally.fired += 1
            tally.examples = max(tally.examples, examples)
            if tally.fired >= tally.pending:
                self._complete(name)
            elif not self._queued:
                self._queued = True
                # No public end-of-backward callback: the one DDP and FSDP
                # use.
                engine = torch.autograd.Variable._execution_engine
                engine.queue_callback(self.flush)

    def _complete(self, name: str) -> None:
        """End a module's backward pass: count its examples."""
        tally = self._tallies[name]
        self._layers[name].add_examples(tally.examples)
        tally.passes += 1
        tally.pending = tally.fired = tally.examples = 0
        if self.in_hook and tally.passes == self.accumulation_steps:
            self._on_complete(name)

    def passes(self) -> int:
        """The most backward passes a layer completed since the last
        factor update (the step's passes, once `flush` ended the last).
        """
        return max((t.passes for t in self._tallies.values()), default=0)

    def flush(self) -> None:
        """End the backward pass for every module still waiting on
        forward calls that got no gradient (run at the end of a backward
        pass, and by the engine before a factor update).
        """
        self._queued = False
        for name, tally in self._tallies.items():
            if tally.fired:
                self._complete(name)
            tally.pending = 0

    def _accumulated(self, param: torch.Tensor) -> None:
        self._fresh = True

    def take_fresh(self) -> bool:
        """Whether a backward pass reached a registered weight since the
        last call (always True when no registered weight is trained: there
        is nothing to guard).

        Raises:
            RuntimeError: a registered module's weight is no longer the
                parameter it had when the hooks were registered (the model
                was sharded with `fully_shard`, or `.weight` reassigned,
                after the preconditioner was built); or a backward pass
                reached the weights of modules in training mode but none of
                the forward hooks ran (a graph compiled before the hooks
                were added).
        """
        for name, weight in self._weights.items():
            if self._layers[name].module.weight is not weight:
                raise RuntimeError(
                    f'K-FAC: the weight of module {name} was replaced after '
                    'the preconditioner was built (by fully_shard, or by '
                    'assigning .weight); build the preconditioner after '
                    'the model is sharded or wrapped',
                )
        guard_module_hooks()
        fresh, self._fresh = self._fresh, False
        seen, self._seen = self._seen, False
        hooked = any(m.training for m in self._hooked)
        if fresh and self.capturing and not seen and hooked:
            raise RuntimeError(
                'K-FAC: a backward pass reached the registered weights but '
                "none of K-FAC's forward hooks ran since the last step(): "
                'the model runs a graph torch.compile made for it (or for '
                'another instance of its class) without hooks, before the '
                'preconditioner was built (torch._dynamo does not notice '
                'hooks added to a module that had none). Build the '
                'preconditioner before the first call of a compiled model, '
                'or call torch._dynamo.reset() after building it',
            )
        weights = [layer.module.weight for layer in self._layers.values()]
        return fresh or not any(w.requires_grad for w in weights)

    def weights(self) -> list[torch.Tensor]:
        """The registered weights, each once."""
        return list({id(w): w for w in self._weights.values()}.values())

    def follow_modules(self) -> None:
        """Let every layer follow its module to a new device or dtype."""
        for layer in self._layers.values():
            layer.follow_module()

    @property
    def grad_scaler(self) -> GradScalerLike | None:
        """The loss scaler whose scale is divided out of output gradients."""
        return self.scale.grad_scaler

    def loss_scale(self) -> float:
        """The loss scale of this step (see `LossScale.value`)."""
        return self.scale.value()

    def next_step(self) -> None:
        """Forget this step's loss scale; `refresh`."""
        self.scale.next_step()
        self.refresh()

    def refresh(self) -> None:
        """Read again whether the current step updates factors (after the
        step count or the hyperparameters changed).
        """
        self.capturing = self._active()

    def reset(self) -> None:
        """Forget the calls and passes counted since the last factor
        update, and the loss scale read for them (a step a loss scaler
        skipped leaves a scale that is no longer current).
        """
        self._queued = False
        self.scale.next_step()
        for name in self._tallies:
            self._tallies[name] = Tally()

    def remove(self) -> None:
        """Remove every hook; operators in compiled graphs that outlive
        them do nothing.
        """
        for handle in self._handles:
            handle.remove()
        self._handles = []
        unregister_receiver(self._receiver)
        self._calls.clear()
