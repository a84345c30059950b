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
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import weakref
from collections.abc import Callable
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any
from typing import Protocol

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from kfac.layers.base import KFACBaseLayer
from kfac.layers.factor import Captured

logger = logging.getLogger(__name__)


class _Scaler(Protocol):
    def get_scale(self) -> float: ...


GradScalerLike = _Scaler | Callable[[], float]
"""A `torch.amp.GradScaler` (or the deprecated CUDA one), or a callable
returning the current loss scale."""

Phase = Callable[[str], contextlib.AbstractContextManager[None]]
"""Makes the context manager that times a phase of the step."""

LogOnce = Callable[..., None]
"""`log_once(key, name, message, *args)`: log a warning once per key and
name."""

_OWNERS: weakref.WeakKeyDictionary[nn.Module, weakref.ref[Capture]] = (
    weakref.WeakKeyDictionary()
)


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


def _fp16_autocast(output: torch.Tensor) -> bool:
    return output.dtype == torch.float16 and torch.is_autocast_enabled(
        output.device.type
    )


@dataclasses.dataclass
class _Tally:
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


def _inert(*args: object) -> None:
    """What a copied model's K-FAC hooks do: nothing."""


class _Hook:
    """A hook of the capture. A deep copy of the model (an EMA or
    evaluation copy) gets an inert hook instead of a copy of the whole
    preconditioner: the copy is not preconditioned.
    """

    def __init__(self, fn: Callable[..., object]) -> None:
        self._fn = fn

    def __call__(self, *args: Any) -> Any:
        return self._fn(*args)

    def __deepcopy__(self, memo: dict[int, object]) -> Callable[..., None]:
        return _inert


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
        self.grad_scaler = grad_scaler
        self.accumulation_steps = accumulation_steps
        self.in_hook = in_hook
        self._on_complete = on_complete
        self._phase = phase
        self._log_once = log_once
        self._loss_scale: float | None = None
        self._tallies = {name: _Tally() for name in layers}
        self._queued = False
        self._fresh = False
        self._modules = {
            name: [layer.module.module, *(aliases or {}).get(name, ())]
            for name, layer in layers.items()
        }
        self._warn_about_owners()
        self._weights = {
            name: layer.module.weight for name, layer in layers.items()
        }
        self._handles: list[RemovableHandle] = []
        for name, layer in layers.items():
            for module in self._modules[name]:
                self._handles.append(
                    module.register_forward_hook(
                        _Hook(functools.partial(self._forward_hook, name))
                    )
                )
                _OWNERS[module] = weakref.ref(self)
            self._handles.append(
                layer.module.weight.register_post_accumulate_grad_hook(
                    _Hook(self._accumulated)
                )
            )
        is_enabled = getattr(grad_scaler, 'is_enabled', None)
        if callable(is_enabled) and not is_enabled():
            log_once(
                'scaler-disabled',
                '',
                'K-FAC: the grad_scaler passed is disabled (a '
                'torch.cuda.amp.GradScaler without CUDA, or enabled=False); '
                'its scale is taken as 1',
            )

    def _warn_about_owners(self) -> None:
        for name, modules in self._modules.items():
            ref = _OWNERS.get(modules[0])
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
        layer = self._layers[name]
        if not (
            self.capturing(module)
            and layer.module.weight.requires_grad
            and isinstance(output, torch.Tensor)
            and output.requires_grad
        ):
            return
        if self.grad_scaler is None and _fp16_autocast(output):
            self._log_once(
                'fp16-no-scaler',
                '',
                'K-FAC: a forward pass runs under float16 autocast but no '
                'grad_scaler was given; pass the GradScaler that scales the '
                'loss as KFACPreconditioner(..., grad_scaler=scaler), or G '
                'is inflated by the loss scale',
            )
        layer.follow_module()
        with self._phase('factor_capture'):
            captured = layer.prepare_input(inputs[0], now=self.in_hook)
        self._tallies[name].pending += 1
        output.register_hook(
            functools.partial(self._grad_hook, name, captured)
        )

    def _grad_hook(
        self, name: str, captured: Captured, grad: torch.Tensor
    ) -> None:
        layer = self._layers[name]
        scale = self.loss_scale()
        with self._phase('factor_capture'):
            examples = layer.add_call(
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
            # No public end-of-backward callback: the one DDP and FSDP use.
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
                after the preconditioner was built).
        """
        for name, weight in self._weights.items():
            if self._layers[name].module.weight is not weight:
                raise RuntimeError(
                    f'K-FAC: the weight of module {name} was replaced after '
                    'the preconditioner was built (by fully_shard, or by '
                    'assigning .weight); build the preconditioner after '
                    'the model is sharded or wrapped',
                )
        fresh, self._fresh = self._fresh, False
        weights = [layer.module.weight for layer in self._layers.values()]
        return fresh or not any(w.requires_grad for w in weights)

    def follow_modules(self) -> None:
        """Let every layer follow its module to a new device or dtype."""
        for layer in self._layers.values():
            layer.follow_module()

    def loss_scale(self) -> float:
        """The loss scale of this step, read once per step (1 without a
        scaler, or with one that has not scaled the loss).
        """
        scaler = self.grad_scaler
        if scaler is None:
            return 1.0
        if self._loss_scale is None:
            if _scaler_unused(scaler):
                self._log_once(
                    'scaler-unused',
                    '',
                    'K-FAC: the grad_scaler passed has not scaled the loss '
                    '(call scaler.scale(loss).backward()); its scale is '
                    'taken as 1',
                )
                self._loss_scale = 1.0
            else:
                self._loss_scale = read_loss_scale(scaler)
        return self._loss_scale

    def next_step(self) -> None:
        """Forget this step's loss scale."""
        self._loss_scale = None

    def reset(self) -> None:
        """Forget the calls and passes counted since the last factor
        update, and the loss scale read for them (a step a loss scaler
        skipped leaves a scale that is no longer current).
        """
        self._queued = False
        self._loss_scale = None
        for name in self._tallies:
            self._tallies[name] = _Tally()

    def remove(self) -> None:
        """Remove every hook."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
