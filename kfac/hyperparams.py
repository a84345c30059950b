"""K-FAC hyperparameters: constants or schedules `step -> value`.

Every hyperparameter of the preconditioner is either a constant or a
callable of the preconditioner's step count.
[`Hyperparameters`][kfac.hyperparams.Hyperparameters] keeps them together,
validated: constants when constructed, a schedule's value at each step it is
used; [`HyperparameterValues`][kfac.hyperparams.HyperparameterValues] holds
the values at one step. The learning rate may come from the optimizer:
[`OptimizerLR`][kfac.hyperparams.OptimizerLR] reads it, per layer, from the
param group holding each layer's weight, at every step.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any
from typing import Final
from typing import TypedDict

import torch

from kfac.validation import validate_float
from kfac.validation import validate_int

IntParam = int | Callable[[int], int]
"""An int hyperparameter, or a schedule `step -> int`."""
FloatParam = float | Callable[[int], float]
"""A float hyperparameter, or a schedule `step -> float`."""
OptionalFloatParam = float | None | Callable[[int], float | None]
"""A float hyperparameter that None disables, or a schedule returning one."""

__all__ = [
    'ORIGINAL_DEFAULTS',
    'HyperparameterValues',
    'Hyperparameters',
    'OptimizerLR',
    'OriginalDefaults',
    'check_optimizers',
    'exp_decay_factor_averaging',
]


class OriginalDefaults(TypedDict):
    """The keyword arguments of `ORIGINAL_DEFAULTS`."""

    factor_update_steps: int
    inv_update_steps: int
    damping: float
    kl_clip: float
    relative_clip: None
    compute_method: str


ORIGINAL_DEFAULTS: Final[OriginalDefaults] = {
    'factor_update_steps': 1,
    'inv_update_steps': 1,
    'damping': 0.001,
    'kl_clip': 0.001,
    'relative_clip': None,
    'compute_method': 'eigen',
}
"""The original KAISA code's defaults that differ from this library's:
`KFACPreconditioner(model, **ORIGINAL_DEFAULTS)` behaves as the original's
constructor with nothing set (its KL clip alone, no relative cap). The
factors here are per-example averages, so these values do not mean what
they meant in the original (see the tuning guide's migration section).
Change a copy, not the mapping itself:
`ORIGINAL_DEFAULTS | {'damping': 0.01}`."""

OptimizerLike = torch.optim.Optimizer | Sequence[torch.optim.Optimizer]
"""An optimizer, or a sequence of them (say Muon on the matrices and AdamW
on the rest)."""


@dataclasses.dataclass(frozen=True)
class HyperparameterValues:
    """The hyperparameters' values at one step, schedules called.

    Returned by [`Hyperparameters.at`][kfac.hyperparams.Hyperparameters.at];
    the fields are those of
    [`Hyperparameters`][kfac.hyperparams.Hyperparameters].
    """

    factor_update_steps: int
    inv_update_steps: int
    damping: float
    factor_decay: float
    kl_clip: float | None
    lr: float
    relative_clip: float | None
    lrs: Mapping[str, float] | None = None
    """Per layer, the learning rate of the param group holding its weight
    (an [`OptimizerLR`][kfac.hyperparams.OptimizerLR]); None when one `lr`
    applies to every layer."""


def _check(name: str, value: object, *, schedulable: bool) -> object:
    """Validate one hyperparameter's value.

    `schedulable`: the value was given as the hyperparameter (where a
    callable is accepted too), not returned by a schedule.
    """
    if name in ('factor_update_steps', 'inv_update_steps'):
        return validate_int(name, value, schedulable=schedulable)
    if name in ('kl_clip', 'relative_clip') and value is None:
        return None
    low_open, high = name != 'lr', 1.0 if name == 'factor_decay' else math.inf
    return validate_float(
        name,
        value,
        low=0.0,
        high=high,
        low_open=low_open,
        schedulable=schedulable,
    )


@dataclasses.dataclass(frozen=True)
class Hyperparameters:
    """The schedulable K-FAC hyperparameters, validated.

    Attributes:
        factor_update_steps: steps between running-average updates (>= 1).
        inv_update_steps: steps between decompositions (>= 1).
        damping: `λ` > 0 (see [`kfac.math`][kfac.math] for its meaning per
            method).
        factor_decay: `ξ` in (0, 1] of the running average.
        kl_clip: `κ` > 0 of the original's KL clip, or None (no KL clip).
        lr: the optimizer's learning rate (>= 0), used by the KL clip only.
        relative_clip: `ρ` > 0, the largest ratio of the preconditioned to
            the raw gradient's norm, or None (no such cap); see
            [`kfac.math`][kfac.math] for how the two clips combine.

    Each may be a callable `step -> value`; its values are validated when
    used.

    Examples:
        >>> Hyperparameters(damping=0.01).at(0).damping
        0.01
        >>> schedule = Hyperparameters(inv_update_steps=lambda s: s + 1)
        >>> schedule.at(9).inv_update_steps
        10

    """

    factor_update_steps: IntParam = 10
    inv_update_steps: IntParam = 100
    damping: FloatParam = 0.003
    factor_decay: FloatParam = 0.95
    kl_clip: OptionalFloatParam = None
    lr: FloatParam = 0.1
    relative_clip: OptionalFloatParam = 1.0

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if not callable(value):
                checked = _check(field.name, value, schedulable=True)
                object.__setattr__(self, field.name, checked)

    def at(self, step: int) -> HyperparameterValues:
        """Values at `step`; schedules are called and their values checked.

        Raises:
            TypeError: a schedule returned a value of the wrong type.
            ValueError: a schedule returned a disallowed value.

        """
        values: dict[str, Any] = {}
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if callable(value):
                value = _check(field.name, value(step), schedulable=False)
            values[field.name] = value
        lrs = self.lr.by_layer() if isinstance(self.lr, OptimizerLR) else None
        return HyperparameterValues(**values, lrs=lrs)

    def replace(self, **values: Any) -> Hyperparameters:
        """A copy with `values` replaced (validated).

        Raises:
            ValueError: a name that is no hyperparameter, or a disallowed
                value.
            TypeError: a value of the wrong type.
        """
        allowed = [f.name for f in dataclasses.fields(self)]
        unknown = sorted(set(values) - set(allowed))
        if unknown:
            raise ValueError(
                f'unknown hyperparameters {unknown}; allowed: '
                f'{", ".join(allowed)}',
            )
        return dataclasses.replace(self, **values)

    def restored(self, saved: Mapping[str, object]) -> Hyperparameters:
        """A copy taking the saved constants of `saved` (a loaded state's
        hyperparameters) wherever this one is not a schedule; names it
        does not know are ignored.
        """
        return self.replace(
            **{
                key: value
                for key, value in saved.items()
                if key in self.__dataclass_fields__
                and not callable(getattr(self, key))
            }
        )

    def constants(self) -> dict[str, float | int | None]:
        """The hyperparameters that are not schedules, by name."""
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if not callable(getattr(self, f.name))
        }


def check_optimizers(optimizers: object) -> list[torch.optim.Optimizer]:
    """`optimizers` (an optimizer or a non-empty sequence of them) as a
    list.

    Raises:
        TypeError: anything else.
    """
    if isinstance(optimizers, torch.optim.Optimizer):
        return [optimizers]
    if (
        isinstance(optimizers, Sequence)
        and optimizers
        and all(isinstance(o, torch.optim.Optimizer) for o in optimizers)
    ):
        return list(optimizers)
    raise TypeError(
        'optimizer must be a torch.optim.Optimizer or a non-empty sequence '
        f'of them; got {optimizers!r} of type {type(optimizers).__name__}',
    )


class OptimizerLR:
    """The learning rate read from the optimizer(s) at every step.

    As a schedule (`step -> lr`) it gives the learning rate of the param
    group holding the first registered weight; per layer
    ([`by_layer`][kfac.hyperparams.OptimizerLR.by_layer]) that of the
    group holding each layer's weight. An LR scheduler stepping the
    optimizer therefore reaches K-FAC too.

    Args:
        optimizers: an optimizer or a sequence of them.
        weights: per registered layer name, its weight.

    Raises:
        TypeError: `optimizers` is not an optimizer or a sequence of them.
        ValueError: a weight is in no param group of the optimizers.
    """

    def __init__(
        self,
        optimizers: OptimizerLike,
        weights: Mapping[str, torch.Tensor],
    ) -> None:
        optimizers = check_optimizers(optimizers)
        self.optimizers = optimizers
        self._weights = dict(weights)
        where = self._where()
        missing = [n for n, w in weights.items() if id(w) not in where]
        if missing:
            raise ValueError(
                f'optimizer: the weights of {", ".join(missing)} are in no '
                'param group of the optimizer(s) given; pass every optimizer '
                'that trains a preconditioned layer',
            )

    def __repr__(self) -> str:
        names = ', '.join(type(o).__name__ for o in self.optimizers)
        return f'OptimizerLR({names})'

    def _where(self) -> dict[int, dict[str, Any]]:
        """The param group holding each parameter, by `id`, looked up
        afresh (`load_state_dict` replaces an optimizer's groups).
        """
        where: dict[int, dict[str, Any]] = {}
        for optimizer in self.optimizers:
            for group in optimizer.param_groups:
                for param in group['params']:
                    where.setdefault(id(param), group)
        return where

    def __call__(self, step: int) -> float:
        """The learning rate of the first registered weight's group (of
        the first group when no layer is registered).
        """
        lrs = self.by_layer()
        if not lrs:
            return float(self.optimizers[0].param_groups[0]['lr'])
        return next(iter(lrs.values()))

    def by_layer(self) -> dict[str, float]:
        """Per layer, the current learning rate of its weight's group."""
        where = self._where()
        return {
            name: float(where[id(w)]['lr'])
            for name, w in self._weights.items()
        }


def exp_decay_factor_averaging(
    min_value: float = 0.95,
) -> Callable[[int], float]:
    """Return the schedule `ξ(step) = min(min_value, s / (s + 1))`.

    Here `s = max(step, 1)`. The first update replaces the factor whatever
    `ξ` is, so with factors updated every step the running average is the
    exact mean of all batches seen so far, until the decay reaches
    `min_value` and the average becomes exponential. Use it as
    `factor_decay`.

    Examples:
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
