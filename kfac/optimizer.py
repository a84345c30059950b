"""K-FAC as a `torch.optim.Optimizer`, for trainers that expect one.

[`KFACOptimizer`][kfac.optimizer.KFACOptimizer] wraps a base optimizer (or
several, say Muon on the weight matrices and AdamW on the rest) and a
preconditioner: its `step()` runs the closure (if any), preconditions the
gradients, then steps the base optimizers. Lightning, the Hugging Face
`Trainer` and Accelerate take it wherever they take an optimizer, and then
unscale and clip the gradients before its `step()`, so K-FAC sees the
gradients the base optimizers would have seen.

```python
preconditioner = kfac.KFACPreconditioner(model)
sgd = torch.optim.SGD(model.parameters(), lr=0.1)
optimizer = kfac.KFACOptimizer(sgd, preconditioner)
```

Rules (see the trainers guide):

* The learning rate: the wrapper makes the preconditioner read it from
  the base optimizers' param groups at every step (as with
  `KFACPreconditioner(..., optimizer=base_optimizer)`), each layer from the
  group holding its weight, so LR schedulers on the wrapper reach K-FAC.
* Several base optimizers: their param groups are the wrapper's, in the
  order given; no parameter may be in two of them; each is stepped, in
  order, after one preconditioning.
* Loss scaling: pass the wrapper to the `GradScaler` (`scaler.step(wrapper)`)
  and build the preconditioner with `grad_scaler=scaler` and
  `update_factors_in_hook=False`. On a step the scaler skips (non-finite
  gradients), the wrapper discards that step's K-FAC statistics, does not
  advance the preconditioner's step count and does not step the base
  optimizer. Stepping with scaled gradients (calling `step()` yourself,
  or giving the scaler the base optimizer) raises `RuntimeError`.
* Accumulation: set the preconditioner's `accumulation_steps` to the
  trainer's `accumulate_grad_batches` or `gradient_accumulation_steps`.
  A step after fewer backward passes (the last batches of an epoch) is
  preconditioned as the trainer divided its losses: say how with
  `StatisticsConfig(accumulation_divisor=...)` (`'accumulation_steps'` for
  Lightning, `'passes'` for the Hugging Face `Trainer`). A step after more
  passes, or none, raises `ValueError`.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections import defaultdict
from collections.abc import Callable
from collections.abc import Iterator
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any

import torch

from kfac.base_preconditioner import BaseKFACPreconditioner
from kfac.hyperparams import OptimizerLike
from kfac.hyperparams import OptimizerLR
from kfac.validation import check_instance

__all__ = ['KFACOptimizer']


class KFACOptimizer(torch.optim.Optimizer):
    """Base optimizers whose steps are preconditioned by K-FAC.

    With one base optimizer, `param_groups`, `state` and `defaults` are
    its own (so LR schedulers, gradient clipping and loss scalers given the
    wrapper act on the base optimizer). With several, `param_groups` is
    the list of their groups in the order given (the same group objects,
    so a schedule setting `group['lr']` reaches them), `state` a mapping
    of every parameter's state (the same per-parameter dicts), and
    `defaults` the first one's. `state_dict()` holds the base optimizers'
    and the preconditioner's state together.

    Args:
        base_optimizer: any `torch.optim` optimizer training the model
            (`torch.optim.Muon` included), or a non-empty sequence of them
            (Muon on the weight matrices and AdamW on the rest), that
            together hold every registered weight, none holding a
            parameter another holds.
        preconditioner: the preconditioner of the same model; its learning
            rate is set to follow the base optimizers.

    Raises:
        TypeError: an argument of the wrong type.
        ValueError: a registered weight is in no param group of the base
            optimizers, or a parameter is in two of them; or the
            preconditioner has a `grad_scaler` and
            `update_factors_in_hook=True` (a skipped step's statistics
            could not be discarded).
    """

    _step_supports_amp_scaling = True
    """`GradScaler.step` calls `step()` on every step, passing
    `found_inf` (and `grad_scale` when it has not unscaled the gradients)
    as attributes, so that the wrapper can discard a skipped step."""

    def __init__(
        self,
        base_optimizer: OptimizerLike,
        preconditioner: BaseKFACPreconditioner,
    ) -> None:
        optimizers = _check_base_optimizers(base_optimizer)
        check_instance(
            'preconditioner',
            preconditioner,
            BaseKFACPreconditioner,
            'a kfac.BaseKFACPreconditioner',
        )
        weights = {
            name: layer.module.weight
            for name, layer in preconditioner.layers.items()
        }
        if (
            preconditioner.grad_scaler is not None
            and preconditioner.options.update_factors_in_hook
        ):
            raise ValueError(
                'preconditioner: with a grad_scaler, KFACOptimizer needs '
                'update_factors_in_hook=False, so that the statistics of a '
                'step the scaler skips can be discarded',
            )
        preconditioner.set_hyperparameters(lr=OptimizerLR(optimizers, weights))
        self.base_optimizers = tuple(optimizers)
        """The base optimizers, in the order given (stepped in it)."""
        self.preconditioner = preconditioner
        # Optimizer.__init__ would copy the param groups; share the base's.
        self._optimizer_step_pre_hooks = OrderedDict()
        self._optimizer_step_post_hooks = OrderedDict()
        self._optimizer_state_dict_pre_hooks = OrderedDict()
        self._optimizer_state_dict_post_hooks = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks = OrderedDict()
        self._optimizer_load_state_dict_post_hooks = OrderedDict()
        self._patch_step_function()
        self._warned_capturable_if_run_uncaptured = True
        self._in_step = False
        self._backwards = 0
        self._handles = [
            optimizer.register_step_pre_hook(self._guard)
            for optimizer in optimizers
        ]
        # Backward passes are counted on one trained registered weight
        # (its gradient accumulates once per backward pass).
        trained = [w for w in weights.values() if w.requires_grad]
        self._counting = bool(trained)
        self._handles.extend(
            w.register_post_accumulate_grad_hook(self._count)
            for w in trained[:1]
        )

    def __repr__(self) -> str:
        names = ', '.join(type(o).__name__ for o in self.base_optimizers)
        return f'{type(self).__name__}({names}, {self.preconditioner!r})'

    @property
    def base_optimizer(self) -> torch.optim.Optimizer:
        """The base optimizer, when there is one.

        Raises:
            AttributeError: there are several (see `base_optimizers`).
        """
        if len(self.base_optimizers) > 1:
            raise AttributeError(
                f'this KFACOptimizer has {len(self.base_optimizers)} base '
                'optimizers: use base_optimizers',
            )
        return self.base_optimizers[0]

    # What the base optimizers hold -----------------------------------------

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The base optimizer's param groups (the same list); with several,
        a list of all their groups, in order (the same group objects).
        """
        if len(self.base_optimizers) == 1:
            return self.base_optimizers[0].param_groups
        return [g for o in self.base_optimizers for g in o.param_groups]

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        counts = [len(o.param_groups) for o in self.base_optimizers]
        if len(self.base_optimizers) > 1 and len(value) != sum(counts):
            raise ValueError(
                f'param_groups: {len(value)} groups for base optimizers '
                f"holding {counts}; set each base optimizer's own",
            )
        start = 0
        for optimizer, count in zip(self.base_optimizers, counts):
            optimizer.param_groups = (
                value if len(counts) == 1 else value[start : start + count]
            )
            start += count

    @property
    def state(self) -> Any:
        """The base optimizer's per-parameter state; with several, a
        mapping of all their parameters' states (the same dicts).
        """
        if len(self.base_optimizers) == 1:
            return self.base_optimizers[0].state
        merged: defaultdict[Any, Any] = defaultdict(dict)
        for optimizer in self.base_optimizers:
            merged.update(optimizer.state)
        return merged

    @state.setter
    def state(self, value: Any) -> None:
        if len(self.base_optimizers) == 1:
            self.base_optimizers[0].state = value
            return
        for optimizer in self.base_optimizers:
            held = {id(p) for g in optimizer.param_groups for p in g['params']}
            own: defaultdict[Any, Any] = defaultdict(dict)
            own.update((p, s) for p, s in value.items() if id(p) in held)
            optimizer.state = own

    @property
    def defaults(self) -> dict[str, Any]:
        """The (first) base optimizer's defaults."""
        return self.base_optimizers[0].defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self.base_optimizers[0].defaults = value

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a param group to the base optimizer.

        Raises:
            ValueError: there are several base optimizers (add the group
                to the one that should train it, in `base_optimizers`).
        """
        if len(self.base_optimizers) > 1:
            raise ValueError(
                f'add_param_group: this KFACOptimizer has '
                f'{len(self.base_optimizers)} base optimizers; add the group '
                'to the one that should train it (base_optimizers[i])',
            )
        self.base_optimizers[0].add_param_group(param_group)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Every base optimizer's `zero_grad`."""
        for optimizer in self.base_optimizers:
            optimizer.zero_grad(set_to_none=set_to_none)

    # State -----------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """`{'base_optimizer': ..., 'preconditioner': ...}` (with several
        base optimizers `'base_optimizers'`, a list of their states in
        order): loadable with `torch.load(..., weights_only=True)`.
        """
        states = [o.state_dict() for o in self.base_optimizers]
        if len(states) == 1:
            return {
                'base_optimizer': states[0],
                'preconditioner': self.preconditioner.state_dict(),
            }
        return {
            'base_optimizers': states,
            'preconditioner': self.preconditioner.state_dict(),
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load `state_dict()` output into the base optimizers and the
        preconditioner. A state of one base optimizer (`'base_optimizer'`,
        as every release has written for one) and a list of one load
        alike into a wrapper of one.

        Raises:
            ValueError: `state_dict` lacks a part (for instance a base
                optimizer's own state), or holds the states of another
                number of base optimizers.
        """
        states = _base_states(state_dict)
        if len(states) != len(self.base_optimizers):
            raise ValueError(
                f'KFACOptimizer.load_state_dict: the state holds '
                f'{len(states)} base optimizer states; this KFACOptimizer '
                f'has {len(self.base_optimizers)} base optimizers',
            )
        for optimizer, state in zip(self.base_optimizers, states):
            optimizer.load_state_dict(state)
        self.preconditioner.load_state_dict(state_dict['preconditioner'])
        self._backwards = 0

    # The step --------------------------------------------------------------

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Run `closure` (with gradients enabled), precondition, step the
        base optimizer; return the closure's value (None without one).

        Raises:
            RuntimeError: the gradients may still be scaled by a loss
                scaler, or a scaler steps this optimizer while the
                preconditioner has no `grad_scaler`.
            ValueError: no backward pass, or more than the
                preconditioner's `accumulation_steps`, since the last step;
                or fewer, and the preconditioner was not told how the
                trainer divided the losses (`accumulation_divisor`).
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if not self._unscaled():
            self._discard()
            return loss
        self._check_accumulation()
        self.preconditioner.step()
        self._backwards = 0
        with self._stepping():
            for optimizer in self.base_optimizers:
                optimizer.step()
        return loss

    def _unscaled(self) -> bool:
        """Unscale the gradients if a scaler asks to; whether they are
        finite (False: the scaler skips this step).
        """
        found_inf: torch.Tensor | None = getattr(self, 'found_inf', None)
        scaler = self.preconditioner.grad_scaler
        if found_inf is None:
            if (
                isinstance(scaler, torch.amp.GradScaler)
                and scaler.is_enabled()
            ):
                raise RuntimeError(
                    'KFACOptimizer.step() was called with gradients scaled '
                    'by the grad_scaler; call scaler.step(optimizer) with '
                    'this KFACOptimizer (not its base optimizer)',
                )
            return True
        if scaler is None:
            raise RuntimeError(
                'a GradScaler steps this KFACOptimizer but its '
                'preconditioner has no grad_scaler; build it with '
                'KFACPreconditioner(..., grad_scaler=scaler, '
                'update_factors_in_hook=False)',
            )
        grad_scale: torch.Tensor | None = getattr(self, 'grad_scale', None)
        if grad_scale is not None:
            inv_scale = grad_scale.double().reciprocal().float()
            grads = [
                p.grad
                for group in self.param_groups
                for p in group['params']
                if p.grad is not None
            ]
            for grad in grads:
                grad.mul_(inv_scale.to(grad.device))
        return not bool(found_inf.item())

    def _discard(self) -> None:
        """Forget a skipped step's statistics; the step count stays."""
        self.preconditioner.reset_batch()
        self._backwards = 0

    def _check_accumulation(self) -> None:
        expected = self.preconditioner.options.accumulation_steps
        if self._counting and not 0 < self._backwards <= expected:
            raise ValueError(
                f'KFACOptimizer: {self._backwards} backward passes since the '
                f'last step but the preconditioner has accumulation_steps='
                f"{expected}; set accumulation_steps to the trainer's "
                'gradient accumulation (accumulate_grad_batches, '
                'gradient_accumulation_steps)',
            )
        if self._counting:  # raises on every short step missing a divisor
            self.preconditioner.short_step_ratio(self._backwards)

    def _count(self, param: torch.Tensor) -> None:
        self._backwards += 1

    @contextlib.contextmanager
    def _stepping(self) -> Iterator[None]:
        self._in_step = True
        try:
            yield
        finally:
            self._in_step = False

    def _guard(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if not self._in_step:
            raise RuntimeError(
                f'{type(optimizer).__name__}, a base optimizer of a '
                'KFACOptimizer, was stepped directly, without K-FAC; step '
                'the KFACOptimizer (pass it, not its base optimizer, to the '
                'trainer and to scaler.step)',
            )

    def remove(self) -> None:
        """Remove the wrapper's hooks (the base optimizers step alone
        again); the preconditioner keeps its own (see its `remove()`).
        """
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._counting = False


def _check_base_optimizers(value: object) -> list[torch.optim.Optimizer]:
    """`base_optimizer` as a list of distinct optimizers, no parameter in
    two of them.

    Raises:
        TypeError: not an optimizer or a non-empty sequence of them, or a
            `KFACOptimizer` among them.
        ValueError: an optimizer given twice, or a parameter in two.
    """
    allowed = 'a torch.optim.Optimizer or a non-empty sequence of them'
    if isinstance(value, torch.optim.Optimizer):
        optimizers = [value]
    elif (
        isinstance(value, Sequence)
        and value
        and all(isinstance(o, torch.optim.Optimizer) for o in value)
    ):
        optimizers = list(value)
    else:
        raise TypeError(
            f'base_optimizer must be {allowed}; got {value!r} of type '
            f'{type(value).__name__}',
        )
    if any(isinstance(o, KFACOptimizer) for o in optimizers):
        raise TypeError('base_optimizer is already a KFACOptimizer')
    owner: dict[int, int] = {}
    for index, optimizer in enumerate(optimizers):
        for group in optimizer.param_groups:
            for param in group['params']:
                first = owner.setdefault(id(param), index)
                if first != index:
                    raise ValueError(
                        f'base_optimizer: a parameter of shape '
                        f'{tuple(param.shape)} is in base optimizers {first} '
                        f'and {index} ({type(optimizers[first]).__name__}, '
                        f'{type(optimizer).__name__}); each parameter must '
                        'be trained by one',
                    )
    return optimizers


def _base_states(state_dict: object) -> list[Any]:
    """The base optimizers' states of a `KFACOptimizer.state_dict()`.

    Raises:
        ValueError: not such a state.
    """
    if isinstance(state_dict, Mapping):
        keys = set(state_dict)
        if keys == {'base_optimizer', 'preconditioner'}:
            return [state_dict['base_optimizer']]
        if keys == {'base_optimizers', 'preconditioner'} and isinstance(
            state_dict['base_optimizers'], list
        ):
            return list(state_dict['base_optimizers'])
    found = (
        sorted(state_dict) if isinstance(state_dict, Mapping) else state_dict
    )
    raise ValueError(
        'KFACOptimizer.load_state_dict: expected the keys '
        "'base_optimizer' and 'preconditioner' (with several base "
        "optimizers 'base_optimizers', a list, and 'preconditioner'); "
        f'got {found!r}',
    )
