"""Argument checks shared by the public constructors and methods.

Every check raises `TypeError` (wrong type) or `ValueError` (wrong value)
with a message naming the argument, the value given and what is allowed,
and returns the value, normalised (an `int` for an integer, a `float` for a
real number), so that a constructor reads as one line per argument:

```python
self.steps = validate_int('steps', steps)
```

Booleans are never accepted as numbers, although `bool` is a subclass of
`int`: `damping=True` is a mistake, not `1.0`. Integers and reals are
recognised by the abstract types of `numbers`, so NumPy scalars and
`fractions.Fraction` are accepted too.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from typing import TypeGuard

import torch

__all__ = [
    'check_bool',
    'check_callable',
    'check_dtype',
    'check_instance',
    'is_int',
    'is_real',
    'type_error',
    'validate_float',
    'validate_int',
]

_SCHEDULE = ' or a callable of the step'


def is_int(value: object) -> TypeGuard[numbers.Integral]:
    """Return whether `value` is an integer (an `int`, not a `bool`).

    Examples:
        >>> is_int(3), is_int(True), is_int(3.0)
        (True, False, False)

    """
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_real(value: object) -> TypeGuard[numbers.Real]:
    """Return whether `value` is a real number (not a `bool`).

    Examples:
        >>> is_real(0.5), is_real(2), is_real(False), is_real('0.5')
        (True, True, False, False)

    """
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def type_error(name: str, value: object, allowed: str) -> TypeError:
    """Return the `TypeError` of an argument of the wrong type.

    Args:
        name: the argument's name.
        value: the value given.
        allowed: what is allowed, e.g. `'a bool'`.

    Examples:
        >>> type_error('lr', '0.1', 'a real number')
        TypeError("lr must be a real number; got '0.1' of type str")

    """
    return TypeError(
        f'{name} must be {allowed}; got {value!r} of type '
        f'{type(value).__name__}',
    )


def validate_int(
    name: str,
    value: object,
    minimum: int = 1,
    *,
    schedulable: bool = False,
) -> int:
    """Return `value` as an `int` if it is an integer `>= minimum`.

    Args:
        name: the argument's name.
        value: the value given.
        minimum: the smallest value allowed.
        schedulable: the argument also accepts a callable of the step (a
            hyperparameter); the type error says so.

    Raises:
        TypeError: `value` is not an integer.
        ValueError: `value` is below `minimum`.

    Examples:
        >>> validate_int('accumulation_steps', 0)
        Traceback (most recent call last):
        ...
        ValueError: accumulation_steps must be >= 1; got 0

    """
    if not is_int(value):
        allowed = f'an int >= {minimum}' + (_SCHEDULE if schedulable else '')
        raise type_error(name, value, allowed)
    if value < minimum:
        raise ValueError(f'{name} must be >= {minimum}; got {value!r}')
    return int(value)


def validate_float(
    name: str,
    value: object,
    *,
    low: float,
    high: float = math.inf,
    low_open: bool = True,
    schedulable: bool = False,
) -> float:
    """Return `value` as a `float` if it is a finite real number in range.

    The range is `(low, high]` (`low_open`) or `[low, high]`.

    Args:
        name: the argument's name.
        value: the value given.
        low: the lower bound.
        high: the upper bound, included.
        low_open: exclude `low` itself.
        schedulable: the argument also accepts a callable of the step (a
            hyperparameter); the type error says so.

    Raises:
        TypeError: `value` is not a real number.
        ValueError: `value` is out of range, NaN or infinite.

    Examples:
        >>> validate_float('factor_decay', 1, low=0.0, high=1.0)
        1.0
        >>> validate_float('lr', -0.1, low=0.0, low_open=False)
        Traceback (most recent call last):
        ...
        ValueError: lr must be a finite number >= 0.0; got -0.1

    """
    if not is_real(value):
        allowed = 'a real number' + (_SCHEDULE if schedulable else '')
        raise type_error(name, value, allowed)
    result = float(value)
    above = result > low if low_open else result >= low
    if not (above and result <= high and math.isfinite(result)):
        allowed = f'> {low}' if low_open else f'>= {low}'
        if high < math.inf:
            allowed += f' and <= {high}'
        raise ValueError(
            f'{name} must be a finite number {allowed}; got {value!r}',
        )
    return result


def check_bool(name: str, value: object) -> bool:
    """Return `value` if it is a `bool`.

    Raises:
        TypeError: `value` is not a `bool` (`0` and `1` are not).

    """
    if not isinstance(value, bool):
        raise type_error(name, value, 'a bool')
    return value


def check_callable(
    name: str, value: object, *, optional: bool = False
) -> None:
    """Raise `TypeError` unless `value` is callable (or None if `optional`).

    Examples:
        >>> check_callable('group_func', 3, optional=True)
        Traceback (most recent call last):
        ...
        TypeError: group_func must be None or callable; got 3 of type int

    """
    if optional and value is None:
        return
    if not callable(value):
        raise type_error(
            name, value, 'None or callable' if optional else 'callable'
        )


def check_dtype(name: str, value: object) -> torch.dtype | None:
    """Return `value` if it is None or a floating-point `torch.dtype`.

    Raises:
        TypeError: `value` is another object, or an integer or boolean
            dtype.

    """
    if value is None:
        return None
    if not (isinstance(value, torch.dtype) and value.is_floating_point):
        raise TypeError(
            f'{name} must be None or a floating torch.dtype; got {value!r}',
        )
    return value


def check_instance(
    name: str, value: object, kind: type | tuple[type, ...], what: str
) -> None:
    """Raise `TypeError` unless `value` is an instance of `kind`.

    Args:
        name: the argument's name.
        value: the value given.
        kind: the class required, or a tuple of allowed classes.
        what: how the message names it, e.g. `'a dict'`.

    """
    if not isinstance(value, kind):
        raise type_error(name, value, what)


def check_mapping(name: str, value: object, kind: type, what: str) -> None:
    """Raise unless `value` is a non-empty mapping of `str` to `kind`.

    Args:
        name: the argument's name.
        value: the value given.
        kind: the class of the values.
        what: how the message names the values, e.g. `'KFACBaseLayer'`.

    Raises:
        TypeError: not a mapping, or a key or value of the wrong type.
        ValueError: an empty mapping.
    """
    if not isinstance(value, Mapping):
        raise type_error(name, value, f'a mapping of str names to {what}')
    if not value:
        raise ValueError(f'{name} must contain at least one {what}')
    for key, item in value.items():
        if not isinstance(key, str) or not isinstance(item, kind):
            raise TypeError(
                f'{name} must map str names to {what} instances; got '
                f'{key!r}: {type(item).__name__}',
            )
