"""K-FAC hyperparameters: constants or schedules ``step -> value``.

Every hyperparameter of the preconditioner is either a constant or a
callable of the preconditioner's step count. :class:`Hyperparameters` keeps
them together, validated: constants when constructed, a schedule's value at
each step it is used.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from kfac.validation import validate_float
from kfac.validation import validate_int

IntParam = int | Callable[[int], int]
"""An int hyperparameter, or a schedule ``step -> int``."""
FloatParam = float | Callable[[int], float]
"""A float hyperparameter, or a schedule ``step -> float``."""
OptionalFloatParam = float | None | Callable[[int], float | None]
"""A float hyperparameter that None disables, or a schedule returning one."""

__all__ = [
    'Hyperparameters',
    'Resolved',
    'exp_decay_factor_averaging',
    'validate_float',
    'validate_int',
]


@dataclasses.dataclass(frozen=True)
class Resolved:
    """The hyperparameters' values at one step."""

    factor_update_steps: int
    inv_update_steps: int
    damping: float
    factor_decay: float
    kl_clip: float | None
    lr: float


def _check(name: str, value: object) -> object:
    """Validate one hyperparameter's (constant) value."""
    if name in ('factor_update_steps', 'inv_update_steps'):
        return validate_int(name, value)
    if name == 'factor_decay':
        return validate_float(name, value, low=0.0, high=1.0)
    if name == 'lr':
        return validate_float(name, value, low=0.0, low_open=False)
    if name == 'kl_clip' and value is None:
        return None
    return validate_float(name, value, low=0.0)


@dataclasses.dataclass(frozen=True)
class Hyperparameters:
    """The schedulable K-FAC hyperparameters, validated.

    Attributes:
        factor_update_steps: steps between running-average updates (>= 1).
        inv_update_steps: steps between decompositions (>= 1).
        damping: ``λ`` > 0 (see :mod:`kfac.math` for its meaning per method).
        factor_decay: ``ξ`` in (0, 1] of the running average.
        kl_clip: ``κ`` > 0, or None to disable KL clipping.
        lr: the optimizer's learning rate (>= 0), used by KL clipping only.

    Each may be a callable ``step -> value``; its values are validated when
    used.

    >>> Hyperparameters(damping=0.01).at(0).damping
    0.01

    """

    factor_update_steps: IntParam = 1
    inv_update_steps: IntParam = 1
    damping: FloatParam = 0.001
    factor_decay: FloatParam = 0.95
    kl_clip: OptionalFloatParam = 0.001
    lr: FloatParam = 0.1

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if not callable(value):
                object.__setattr__(self, field.name, _check(field.name, value))

    def at(self, step: int) -> Resolved:
        """Values at ``step``; schedules are called and their values checked.

        Raises:
            ValueError, TypeError: a schedule returned an invalid value.

        """
        values: dict[str, Any] = {}
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if callable(value):
                value = _check(field.name, value(step))
            values[field.name] = value
        return Resolved(**values)

    def constants(self) -> dict[str, float | int | None]:
        """The hyperparameters that are not schedules, by name."""
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if not callable(getattr(self, f.name))
        }


def exp_decay_factor_averaging(
    min_value: float = 0.95,
) -> Callable[[int], float]:
    """Return the schedule ``ξ(step) = min(min_value, s / (s + 1))``.

    Here ``s = max(step, 1)``. The first update replaces the factor whatever
    ``ξ`` is, so with factors updated every step the running average is the
    exact mean of all batches seen so far, until the decay reaches
    ``min_value`` and the average becomes exponential. Use it as
    ``factor_decay``.

    >>> schedule = exp_decay_factor_averaging(0.9)
    >>> [round(schedule(s), 3) for s in (0, 1, 3, 100)]
    [0.5, 0.5, 0.75, 0.9]
    """
    min_value = validate_float('min_value', min_value, low=0.0, high=1.0)

    def schedule(step: int) -> float:
        if step < 0:
            raise ValueError(f'step must be >= 0; got {step}')
        s = max(step, 1)
        return min(min_value, s / (s + 1))

    return schedule
