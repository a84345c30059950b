"""The K-FAC engine: hooks, the step's phases, state and introspection.

:class:`BaseKFACPreconditioner` combines the three separate parts of the
library: the per-layer mathematics (:mod:`kfac.layers`), the placement of
work (:class:`kfac.assignment.WorkAssignment`) and communication
(:mod:`kfac.distributed`). :class:`kfac.preconditioner.KFACPreconditioner`
builds all three from a model and keyword arguments.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections import Counter
from collections.abc import Callable
from collections.abc import Iterable
from collections.abc import Mapping
from typing import Any
from typing import Protocol
from typing import cast

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from kfac.assignment import WorkAssignment
from kfac.distributed import Handle
from kfac.distributed import TorchDistributedCommunicator
from kfac.distributed import get_rank
from kfac.exchange import broadcast_decompositions
from kfac.exchange import broadcast_grads
from kfac.exchange import start_health_reduction
from kfac.exchange import wait
from kfac.hyperparams import Hyperparameters
from kfac.hyperparams import Resolved
from kfac.layers.base import FACTOR_NAMES
from kfac.layers.base import KFACBaseLayer
from kfac.layers.factor import KroneckerFactor
from kfac.math import kl_clip_scale
from kfac.state import load_preconditioner_state
from kfac.state import preconditioner_state
from kfac.tracing import PhaseTimer
from kfac.validation import check_bool
from kfac.validation import check_instance
from kfac.validation import validate_int

logger = logging.getLogger(__name__)


def _check_layers(layers: object) -> None:
    if not isinstance(layers, Mapping):
        raise TypeError(
            'layers must be a mapping of module names to KFACBaseLayer; got '
            f'{type(layers).__name__}',
        )
    if not layers:
        raise ValueError('layers must contain at least one layer')
    for name, layer in layers.items():
        if not isinstance(name, str) or not isinstance(layer, KFACBaseLayer):
            raise TypeError(
                'layers must map str names to KFACBaseLayer instances; got '
                f'{name!r}: {type(layer).__name__}',
            )


def _grad_dot(layer: KFACBaseLayer) -> torch.Tensor:
    """``Σ V' ⊙ V`` of a layer whose preconditioned gradient is set."""
    grad = cast(torch.Tensor, layer.grad)
    # A gradient receiver has not read V yet.
    raw = (
        layer.raw_grad
        if layer.raw_grad is not None
        else layer.module.get_grad()
    )
    return torch.vdot(
        grad.reshape(-1),
        cast(torch.Tensor, raw).to(grad.dtype).reshape(-1),
    )


class _Scaler(Protocol):
    def get_scale(self) -> float: ...


#: A ``torch.amp.GradScaler`` (or the deprecated CUDA one), or a callable
#: returning the current loss scale.
GradScalerLike = _Scaler | Callable[[], float]


class BaseKFACPreconditioner:
    """Minimal K-FAC engine over registered layers.

    Args:
        layers: ``{module name: layer}``; the hooks are registered on each
            layer's module.
        assignment: where each decomposition and preconditioning happens.
        hyperparameters: the schedulable hyperparameters.
        accumulation_steps: micro-batches (forward/backward passes) per
            :meth:`step`. Divide each micro-batch's mean loss by this number,
            as for ordinary gradient accumulation.
        update_factors_in_hook: compute factor statistics inside the hooks
            (and start their allreduce after the last micro-batch) instead
            of keeping activations until :meth:`step`.
        grad_scaler: the loss scaler of mixed-precision training, whose
            scale is divided out of output gradients.
        communicator: collectives; default a bucketed
            :class:`~kfac.distributed.TorchDistributedCommunicator`.
        bucketed: allreduce factors in buckets.
        loglevel: level of the preconditioner's informational messages.

    """

    def __init__(
        self,
        layers: Mapping[str, KFACBaseLayer],
        *,
        assignment: WorkAssignment,
        hyperparameters: Hyperparameters | None = None,
        accumulation_steps: int = 1,
        update_factors_in_hook: bool = True,
        grad_scaler: GradScalerLike | None = None,
        communicator: TorchDistributedCommunicator | None = None,
        bucketed: bool = True,
        loglevel: int = logging.DEBUG,
    ) -> None:
        _check_layers(layers)
        check_instance(
            'assignment',
            assignment,
            WorkAssignment,
            'a kfac.assignment.WorkAssignment',
        )
        if hyperparameters is not None:
            check_instance(
                'hyperparameters',
                hyperparameters,
                Hyperparameters,
                'None or a kfac.hyperparams.Hyperparameters',
            )
        if communicator is not None:
            check_instance(
                'communicator',
                communicator,
                TorchDistributedCommunicator,
                'None or a kfac.distributed.TorchDistributedCommunicator',
            )
        check_bool('bucketed', bucketed)
        validate_int('loglevel', loglevel, minimum=0)
        self.hyperparameters = hyperparameters or Hyperparameters()
        self.accumulation_steps = validate_int(
            'accumulation_steps',
            accumulation_steps,
        )
        check_bool('update_factors_in_hook', update_factors_in_hook)
        if not (grad_scaler is None or callable(grad_scaler)) and not hasattr(
            grad_scaler,
            'get_scale',
        ):
            raise TypeError(
                'grad_scaler must be None, a GradScaler or a callable '
                f'returning the loss scale; got {grad_scaler!r}',
            )
        self._layers = dict(layers)
        self.assignment = assignment
        self.update_factors_in_hook = update_factors_in_hook
        self.grad_scaler = grad_scaler
        self.communicator = communicator or TorchDistributedCommunicator()
        self.bucketed = bucketed
        self.loglevel = loglevel
        self._steps = 0
        self._resolved: tuple[int, Resolved] | None = None
        self._loss_scale: tuple[int, float] | None = None
        self._finished: set[str] = set()
        self._reductions: list[tuple[KroneckerFactor, Handle]] = []
        self._decomposed: set[str] = set()
        self._health: list[tuple[str, torch.Tensor]] = []
        #: Preconditioner-wide fault counters (see :meth:`metrics`).
        self.counters: Counter[str] = Counter()
        self._logged: set[tuple[str, str]] = set()
        self._removed = False
        #: Set a :class:`~kfac.tracing.PhaseTimer` to time the step's phases.
        self.timer: PhaseTimer | None = None
        self._hooks: list[RemovableHandle] = [
            layer.module.module.register_forward_hook(
                functools.partial(self._forward_hook, name),
            )
            for name, layer in self._layers.items()
        ]

    def __repr__(self) -> str:
        return (
            f'{type(self).__name__}(layers={len(self._layers)}, '
            f'steps={self._steps}, {self.hyperparameters})'
        )

    # Read-only views --------------------------------------------------------

    @property
    def steps(self) -> int:
        """Number of completed :meth:`step` calls."""
        return self._steps

    @property
    def layers(self) -> Mapping[str, KFACBaseLayer]:
        """The registered layers by module name."""
        return self._layers

    def _hp(self) -> Resolved:
        """Hyperparameter values at the current step (cached per step)."""
        if self._resolved is None or self._resolved[0] != self._steps:
            self._resolved = (
                self._steps,
                self.hyperparameters.at(self._steps),
            )
        return self._resolved[1]

    @property
    def factor_update_steps(self) -> int:
        """Current steps between factor updates."""
        return self._hp().factor_update_steps

    @property
    def inv_update_steps(self) -> int:
        """Current steps between decompositions."""
        return self._hp().inv_update_steps

    @property
    def damping(self) -> float:
        """Current damping ``λ``."""
        return self._hp().damping

    @property
    def factor_decay(self) -> float:
        """Current running-average decay ``ξ``."""
        return self._hp().factor_decay

    @property
    def kl_clip(self) -> float | None:
        """Current KL clip ``κ`` (None: disabled)."""
        return self._hp().kl_clip

    @property
    def lr(self) -> float:
        """Current learning rate used by KL clipping."""
        return self._hp().lr

    def set_hyperparameters(self, **values: Any) -> None:
        """Replace hyperparameters (validated), e.g. from a scheduler."""
        allowed = Hyperparameters.__dataclass_fields__
        unknown = sorted(set(values) - set(allowed))
        if unknown:
            raise ValueError(
                f'unknown hyperparameters {unknown}; allowed: '
                f'{", ".join(allowed)}',
            )
        self.hyperparameters = Hyperparameters(
            **{**self.hyperparameters.__dict__, **values},
        )
        self._resolved = None

    # Hooks --------------------------------------------------------------

    def _phase(self, name: str) -> contextlib.AbstractContextManager[None]:
        timer = self.timer
        return contextlib.nullcontext() if timer is None else timer.phase(name)

    def _log_once(self, key: str, name: str, msg: str, *args: object) -> None:
        if (key, name) not in self._logged:
            self._logged.add((key, name))
            logger.warning(msg, *args)

    def _capturing(self, module: nn.Module) -> bool:
        return (
            module.training
            and torch.is_grad_enabled()
            and self._steps % self._hp().factor_update_steps == 0
        )

    def _forward_hook(
        self,
        name: str,
        module: nn.Module,
        inputs: tuple[Any, ...],
        output: Any,
    ) -> None:
        if not self._capturing(module):
            return
        layer = self._layers[name]
        with self._phase('factor_capture'):
            layer.save_layer_input(inputs[0], now=self.update_factors_in_hook)
        if isinstance(output, torch.Tensor) and output.requires_grad:
            output.register_hook(functools.partial(self._grad_hook, name))

    def _grad_hook(self, name: str, grad: torch.Tensor) -> None:
        layer = self._layers[name]
        scale = self._current_loss_scale()
        with self._phase('factor_capture'):
            layer.save_layer_grad_output(
                grad,
                loss_scale=scale,
                accumulation_steps=self.accumulation_steps,
                now=self.update_factors_in_hook,
            )
        done = layer.g.captures == self.accumulation_steps
        if self.update_factors_in_hook and done and name not in self._finished:
            self._finish_factors(name, layer)

    def _current_loss_scale(self) -> float:
        """The loss scale of this step, read once per step."""
        if self.grad_scaler is None:
            return 1.0
        if self._loss_scale is None or self._loss_scale[0] != self._steps:
            scaler = self.grad_scaler
            getter = getattr(scaler, 'get_scale', None)
            value = getter() if getter is not None else scaler()  # type: ignore[operator]  # callable checked in __init__
            self._loss_scale = (self._steps, float(value))
        return self._loss_scale[1]

    # The step --------------------------------------------------------------

    def step(self) -> None:
        """Precondition the gradients of the registered layers.

        Call after ``loss.backward()`` (after the last micro-batch when
        accumulating) and before ``optimizer.step()``. Every rank must call
        it.
        """
        if self._removed:
            raise RuntimeError('this preconditioner was removed')
        hp = self._hp()
        if self._steps % hp.factor_update_steps == 0:
            self._update_factors()
        if self._steps % hp.inv_update_steps == 0:
            self._update_decompositions(hp.damping)
        self._precondition(hp.damping)
        self._apply(hp)
        self._steps += 1

    def _finish_factors(self, name: str, layer: KFACBaseLayer) -> None:
        """Running-average update of one layer; start its allreduce."""
        self._finished.add(name)
        with self._phase('running_average'):
            finite = layer.update_factors(self._hp().factor_decay)
        if finite is None:
            self._log_once(
                'no-data',
                name,
                'K-FAC: module %s did not run forward and backward in step '
                '%d; its factors were not updated and its gradient is left '
                'as it is until they exist',
                name,
                self._steps,
            )
            return
        self._health.append((name, finite))
        with self._phase('factor_allreduce'):
            self._reductions.extend(
                layer.reduce_factors(
                    self.communicator,
                    None,
                    bucketed=self.bucketed,
                ),
            )

    def _update_factors(self) -> None:
        for name, layer in self._layers.items():
            if name not in self._finished:
                self._finish_factors(name, layer)
            elif layer.g.captures or layer.a.captures:
                self._log_once(
                    'reuse',
                    name,
                    'K-FAC: module %s ran more than accumulation_steps times '
                    'in a step; the extra passes are ignored (use '
                    'update_factors_in_hook=False for shared modules)',
                    name,
                )
                layer.reset_batch()
        with self._phase('factor_allreduce'):
            bad = start_health_reduction(
                self.communicator,
                [finite for _, finite in self._health],
            )
            self.communicator.flush()
            for factor, handle in self._reductions:
                factor.value = wait(handle, f'factor {factor.name} allreduce')
            bad_count = (
                0 if bad is None else int(wait(bad, 'health allreduce'))
            )
        self._resolve_health(bad_count)
        self._reductions.clear()
        self._finished.clear()

    def _resolve_health(self, bad_count: int) -> None:
        """Commit the step's factor updates, or roll all of them back."""
        updated = [self._layers[name] for name, _ in self._health]
        self._health.clear()
        for layer in updated:
            if bad_count:
                layer.rollback_factors()
            else:
                layer.commit_factors()
        if bad_count:
            self.counters['nonfinite_statistics_steps'] += 1
            logger.warning(
                'K-FAC: step %d produced non-finite factor statistics (%d '
                "factor updates on all ranks); this step's statistics were "
                'discarded (%d such steps so far)',
                self._steps,
                bad_count,
                self.counters['nonfinite_statistics_steps'],
            )

    def _update_decompositions(
        self,
        damping: float,
        names: Iterable[str] | None = None,
    ) -> None:
        """Decompose factors on their inverse workers; broadcast them.

        Every rank calls this for the same ``names`` (default: all layers).
        """
        rank = get_rank()
        plan = self.assignment
        ready = [
            name
            for name in (self._layers if names is None else names)
            if self._layers[name].has_factors
        ]
        jobs = [
            (name, f)
            for name in ready
            for f in FACTOR_NAMES
            if plan.inv_worker(name, f) == rank
        ]
        with self._phase('decomposition'):
            # First attempts everywhere, then one host synchronisation reads
            # all their validity flags; only failures are retried.
            first = [
                self._layers[name].try_decomposition(f, damping)
                for name, f in jobs
            ]
            flags = [result[1] for result in first if result is not None]
            valid = iter(torch.stack(flags).tolist() if flags else [])
            for (name, f), result in zip(jobs, first):
                layer = self._layers[name]
                ok = result is not None and next(valid)
                if not layer.finish_decomposition(f, damping, result, ok):
                    self._log_decomposition_failure(name, layer)
        self._decomposed.update(ready)
        if plan.broadcast_inverses():
            with self._phase('decomposition_broadcast'):
                broadcast_decompositions(
                    self.communicator,
                    self.assignment,
                    {name: self._layers[name] for name in ready},
                )

    def _log_decomposition_failure(
        self,
        name: str,
        layer: KFACBaseLayer,
    ) -> None:
        self._log_once(
            'decomposition',
            name,
            'K-FAC: decomposing a factor of %s failed in every attempt '
            '(float64, jitter); the last good decomposition is kept, and '
            'without one the gradient goes unpreconditioned (counters: %s)',
            name,
            dict(layer.counters),
        )

    def _precondition(self, damping: float) -> None:
        plan = self.assignment
        active = [
            name
            for name, layer in self._layers.items()
            if name in self._decomposed
            and layer.module.weight.grad is not None
        ]
        with self._phase('precondition'):
            for name in active:
                layer = self._layers[name]
                if plan.is_grad_worker(name):
                    layer.precondition_grad(damping)
                    if not layer.has_decomposition:
                        self._log_once(
                            'unpreconditioned',
                            name,
                            'K-FAC: module %s has no valid decomposition; '
                            'its raw gradient is used this step',
                            name,
                        )
        if plan.broadcast_gradients():
            with self._phase('grad_broadcast'):
                broadcast_grads(
                    self.communicator,
                    self.assignment,
                    {name: self._layers[name] for name in active},
                )

    def _apply(self, hp: Resolved) -> None:
        """KL-clip the preconditioned gradients and write them back.

        A layer whose preconditioned gradient is not finite keeps its
        original gradient (counted, logged once); one host synchronisation.
        """
        layers = [
            (name, layer)
            for name, layer in self._layers.items()
            if layer.grad is not None
        ]
        if not layers:
            return
        with self._phase('kl_clip'):
            vg = torch.stack([_grad_dot(layer) for _, layer in layers])
            finite = torch.isfinite(vg)
            scale = None
            if hp.kl_clip is not None:
                total = torch.where(finite, vg, torch.zeros_like(vg)).sum()
                scale = kl_clip_scale(total, hp.lr, hp.kl_clip)
            flags = finite.tolist()
        with self._phase('write_back'):
            for (name, layer), ok in zip(layers, flags):
                if ok:
                    layer.write_grad(scale)
                    continue
                layer.grad = layer.raw_grad = None
                layer.counters['nonfinite_gradients'] += 1
                self._log_once(
                    'nonfinite-grad',
                    name,
                    'K-FAC: the preconditioned gradient of %s is not finite '
                    'in step %d; its original gradient is left in place',
                    name,
                    self._steps,
                )

    def metrics(self) -> dict[str, Any]:
        """Fault counters: totals and per layer.

        ``nonfinite_statistics_steps``: factor updates discarded because a
        statistic was NaN/Inf on some rank. Per layer (and summed):
        ``decomposition_retries`` (float64 or jitter attempts that
        succeeded), ``decomposition_failures`` (all attempts failed),
        ``unpreconditioned_steps`` (raw gradient used for lack of a
        decomposition) and ``nonfinite_gradients`` (original gradient kept).
        """
        totals: Counter[str] = Counter(self.counters)
        per_layer = {}
        for name, layer in self._layers.items():
            totals.update(layer.counters)
            per_layer[name] = dict(layer.counters)
        return {**dict(totals), 'layers': per_layer}

    # Housekeeping ----------------------------------------------------------

    def reset_batch(self) -> None:
        """Drop the statistics captured since the last factor update."""
        for layer in self._layers.values():
            layer.reset_batch()
        self._finished.clear()

    def remove(self) -> None:
        """Remove every hook and drop captured data; :meth:`step` then
        raises.
        """
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        self._removed = True
        self.reset_batch()

    def memory_usage(self) -> dict[str, int]:
        """Bytes held by K-FAC on this rank, by kind, and ``'total'``.

        Kinds: ``a_factors``, ``g_factors``, ``a_batch``, ``g_batch``
        (captured statistics or activations not yet folded in),
        ``a_inverses``, ``g_inverses`` (decompositions held here) and
        ``grad``.
        """
        usage: dict[str, int] = {}
        for layer in self._layers.values():
            for key, value in layer.memory_usage().items():
                usage[key] = usage.get(key, 0) + value
        usage['total'] = sum(usage.values())
        return usage

    def state_dict(
        self, include_decompositions: bool = True
    ) -> dict[str, Any]:
        """The preconditioner's state (see :mod:`kfac.state`)."""
        check_bool('include_decompositions', include_decompositions)
        return preconditioner_state(self, include_decompositions)

    def load_state_dict(
        self,
        state_dict: Mapping[str, Any],
        strict: bool = True,
    ) -> None:
        """Load :meth:`state_dict` output (see :mod:`kfac.state`)."""
        check_bool('strict', strict)
        load_preconditioner_state(self, state_dict, strict=strict)
