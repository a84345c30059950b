"""Schedules for K-FAC hyperparameters, in the manner of `LambdaLR`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kfac.base_preconditioner import BaseKFACPreconditioner
from kfac.validation import check_callable
from kfac.validation import check_instance
from kfac.validation import validate_int

_INT_PARAMS = ('factor_update_steps', 'inv_update_steps')
_PARAMS = (*_INT_PARAMS, 'damping', 'factor_decay', 'kl_clip', 'lr')


class LambdaParamScheduler:
    """Set each hyperparameter to `base value · lambda(step)`.

    Modelled on `torch.optim.lr_scheduler.LambdaLR`: the base values
    are the preconditioner's constants when the scheduler is built, the
    values for step 0 are applied at once, and each
    [`step`][kfac.scheduler.LambdaParamScheduler.step] advances
    one step. Update intervals are rounded and never drop below 1.

    Args:
        preconditioner: whose hyperparameters to schedule; a scheduled
            hyperparameter must be a constant there (not a callable).
        factor_update_steps_lambda: multiplier schedule for
            `factor_update_steps`; likewise for the others. None leaves a
            hyperparameter alone.

    Examples:
        ```python
        scheduler = LambdaParamScheduler(
            preconditioner,
            damping_lambda=lambda step: 0.5 ** (step // 1000),
        )
        for batch in loader:
            ...
            preconditioner.step()
            optimizer.step()
            scheduler.step()
        ```

    """

    def __init__(
        self,
        preconditioner: BaseKFACPreconditioner,
        *,
        factor_update_steps_lambda: Callable[[int], float] | None = None,
        inv_update_steps_lambda: Callable[[int], float] | None = None,
        damping_lambda: Callable[[int], float] | None = None,
        factor_decay_lambda: Callable[[int], float] | None = None,
        kl_clip_lambda: Callable[[int], float] | None = None,
        lr_lambda: Callable[[int], float] | None = None,
    ) -> None:
        given = dict(
            zip(
                _PARAMS,
                (
                    factor_update_steps_lambda,
                    inv_update_steps_lambda,
                    damping_lambda,
                    factor_decay_lambda,
                    kl_clip_lambda,
                    lr_lambda,
                ),
            ),
        )
        check_instance(
            'preconditioner',
            preconditioner,
            BaseKFACPreconditioner,
            'a BaseKFACPreconditioner',
        )
        self.preconditioner = preconditioner
        self.lambdas: dict[str, Callable[[int], float]] = {}
        self.base_values: dict[str, float] = {}
        constants = preconditioner.hyperparameters.constants()
        for name, fn in given.items():
            if fn is None:
                continue
            check_callable(f'{name}_lambda', fn)
            base = constants.get(name)
            if base is None:
                current = getattr(preconditioner.hyperparameters, name)
                raise ValueError(
                    f'{name}_lambda needs {name} to be a constant in the '
                    f'preconditioner; it is {current!r}',
                )
            self.lambdas[name] = fn
            self.base_values[name] = base
        self.last_step = 0
        self._apply()

    def _apply(self) -> None:
        values: dict[str, Any] = {}
        for name, fn in self.lambdas.items():
            value = self.base_values[name] * fn(self.last_step)
            if name in _INT_PARAMS:
                value = max(1, round(value))
            values[name] = value
        self.preconditioner.set_hyperparameters(**values)

    def step(self, step: int | None = None) -> None:
        """Advance to `step` (default: the next step) and apply."""
        if step is not None:
            validate_int('step', step, minimum=0)
        self.last_step = self.last_step + 1 if step is None else step
        self._apply()

    def state_dict(self) -> dict[str, Any]:
        """`last_step` and the base values (the lambdas are code)."""
        return {'last_step': self.last_step, 'base_values': self.base_values}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what `state_dict()` returned, and apply it."""
        check_instance('state_dict', state_dict, dict, 'a dict')
        for key in ('last_step', 'base_values'):
            if key not in state_dict:
                raise ValueError(f'state_dict is missing the entry {key!r}')
        unknown = set(state_dict['base_values']) - set(self.lambdas)
        if unknown:
            raise ValueError(
                'scheduler state has base values for hyperparameters this '
                f'scheduler does not schedule: {sorted(unknown)}',
            )
        self.last_step = int(state_dict['last_step'])
        self.base_values.update(state_dict['base_values'])
        self._apply()
