"""K-FAC as a `torch.optim.Optimizer`, for trainers that expect one.

[`KFACOptimizer`][kfac.optimizer.KFACOptimizer] wraps a base optimizer and
a preconditioner: its `step()` runs the closure (if any), preconditions the
gradients, then steps the base optimizer. Lightning, the Hugging Face
`Trainer` and Accelerate take it wherever they take an optimizer, and then
unscale and clip the gradients before its `step()`, so K-FAC sees the
gradients the base optimizer would have seen.

```python
preconditioner = kfac.KFACPreconditioner(model)
sgd = torch.optim.SGD(model.parameters(), lr=0.1)
optimizer = kfac.KFACOptimizer(sgd, preconditioner)
```

Rules (see the trainers guide):

* The learning rate: the wrapper makes the preconditioner read it from
  the base optimizer's param groups at every step (as with
  `KFACPreconditioner(..., optimizer=base_optimizer)`), so LR schedulers
  on the wrapper reach K-FAC.
* Loss scaling: pass the wrapper to the `GradScaler` (`scaler.step(wrapper)`)
  and build the preconditioner with `grad_scaler=scaler` and
  `update_factors_in_hook=False`. On a step the scaler skips (non-finite
  gradients), the wrapper discards that step's K-FAC statistics, does not
  advance the preconditioner's step count and does not step the base
  optimizer. Stepping with scaled gradients (calling `step()` yourself,
  or giving the scaler the base optimizer) raises `RuntimeError`.
* Accumulation: the backward passes between two steps must equal the
  preconditioner's `accumulation_steps` (set it to the trainer's
  `accumulate_grad_batches` or `gradient_accumulation_steps`); a mismatch
  raises `ValueError` at the first step.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Callable
from collections.abc import Iterator
from collections.abc import Mapping
from typing import Any

import torch

from kfac.base_preconditioner import BaseKFACPreconditioner
from kfac.hyperparams import OptimizerLR
from kfac.validation import check_instance

__all__ = ['KFACOptimizer']


class KFACOptimizer(torch.optim.Optimizer):
    """A base optimizer whose steps are preconditioned by K-FAC.

    `param_groups`, `state` and `defaults` are the base optimizer's own
    (so LR schedulers, gradient clipping and loss scalers given the
    wrapper act on the base optimizer); `state_dict()` holds the base
    optimizer's and the preconditioner's state together.

    Args:
        base_optimizer: any `torch.optim` optimizer training the model
            (`torch.optim.Muon` included) holding every registered weight.
        preconditioner: the preconditioner of the same model; its learning
            rate is set to follow `base_optimizer`.

    Raises:
        TypeError: an argument of the wrong type.
        ValueError: a registered weight is in no param group of
            `base_optimizer`; or the preconditioner has a `grad_scaler`
            and `update_factors_in_hook=True` (a skipped step's statistics
            could not be discarded).
    """

    _step_supports_amp_scaling = True
    """`GradScaler.step` calls `step()` on every step, passing
    `found_inf` (and `grad_scale` when it has not unscaled the gradients)
    as attributes, so that the wrapper can discard a skipped step."""

    def __init__(
        self,
        base_optimizer: torch.optim.Optimizer,
        preconditioner: BaseKFACPreconditioner,
    ) -> None:
        check_instance(
            'base_optimizer',
            base_optimizer,
            torch.optim.Optimizer,
            'a torch.optim.Optimizer',
        )
        check_instance(
            'preconditioner',
            preconditioner,
            BaseKFACPreconditioner,
            'a kfac.BaseKFACPreconditioner',
        )
        if isinstance(base_optimizer, KFACOptimizer):
            raise TypeError('base_optimizer is already a KFACOptimizer')
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
        preconditioner.set_hyperparameters(
            lr=OptimizerLR(base_optimizer, weights)
        )
        self.base_optimizer = base_optimizer
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
        self._handles = [base_optimizer.register_step_pre_hook(self._guard)]
        # Backward passes are counted on one trained registered weight
        # (its gradient accumulates once per backward pass).
        trained = [w for w in weights.values() if w.requires_grad]
        self._counting = bool(trained)
        self._handles.extend(
            w.register_post_accumulate_grad_hook(self._count)
            for w in trained[:1]
        )

    def __repr__(self) -> str:
        return (
            f'{type(self).__name__}({type(self.base_optimizer).__name__}, '
            f'{self.preconditioner!r})'
        )

    # What the base optimizer holds -----------------------------------------

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The base optimizer's param groups (the same list)."""
        return self.base_optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.base_optimizer.param_groups = value

    @property
    def state(self) -> Any:
        """The base optimizer's per-parameter state."""
        return self.base_optimizer.state

    @state.setter
    def state(self, value: Any) -> None:
        self.base_optimizer.state = value

    @property
    def defaults(self) -> dict[str, Any]:
        """The base optimizer's defaults."""
        return self.base_optimizer.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self.base_optimizer.defaults = value

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a param group to the base optimizer."""
        self.base_optimizer.add_param_group(param_group)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The base optimizer's `zero_grad`."""
        self.base_optimizer.zero_grad(set_to_none=set_to_none)

    # State -----------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """`{'base_optimizer': ..., 'preconditioner': ...}`: both states,
        loadable with `torch.load(..., weights_only=True)`.
        """
        return {
            'base_optimizer': self.base_optimizer.state_dict(),
            'preconditioner': self.preconditioner.state_dict(),
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load `state_dict()` output into both.

        Raises:
            ValueError: `state_dict` lacks either part (for instance a
                base optimizer's own state).
        """
        keys = {'base_optimizer', 'preconditioner'}
        if not isinstance(state_dict, Mapping) or set(state_dict) != keys:
            found = (
                sorted(state_dict)
                if isinstance(state_dict, Mapping)
                else state_dict
            )
            raise ValueError(
                'KFACOptimizer.load_state_dict: expected the keys '
                f"'base_optimizer' and 'preconditioner'; got {found!r}",
            )
        self.base_optimizer.load_state_dict(state_dict['base_optimizer'])
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
            ValueError: the backward passes since the last step differ
                from the preconditioner's `accumulation_steps`.
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
            self.base_optimizer.step()
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
        if self._counting and self._backwards != expected:
            raise ValueError(
                f'KFACOptimizer: {self._backwards} backward passes since the '
                f'last step but the preconditioner has accumulation_steps='
                f"{expected}; set accumulation_steps to the trainer's "
                'gradient accumulation (accumulate_grad_batches, '
                'gradient_accumulation_steps)',
            )

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
                'the base optimizer of a KFACOptimizer was stepped directly, '
                'without K-FAC; step the KFACOptimizer (pass it, not its '
                'base optimizer, to the trainer and to scaler.step)',
            )

    def remove(self) -> None:
        """Remove the wrapper's hooks (the base optimizer steps alone
        again); the preconditioner keeps its own (see its `remove()`).
        """
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._counting = False
