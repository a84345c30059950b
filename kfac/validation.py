"""Argument checks shared by the public constructors and methods.

Each raises ``TypeError`` (wrong type) or ``ValueError`` (wrong value) with
a message naming the argument, the value given and what is allowed.
"""

from __future__ import annotations

import math

import torch


def validate_int(name: str, value: object, minimum: int = 1) -> int:
    """Return ``value`` if it is an ``int >= minimum`` (not a bool)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(
            f'{name} must be an int >= {minimum} or a callable of the step; '
            f'got {value!r} of type {type(value).__name__}',
        )
    if value < minimum:
        raise ValueError(f'{name} must be >= {minimum}; got {value!r}')
    return value


def validate_float(
    name: str,
    value: object,
    *,
    low: float,
    high: float = math.inf,
    low_open: bool = True,
) -> float:
    """Return ``value`` as a float if it is a real number in the range.

    The range is ``(low, high]`` (``low_open``) or ``[low, high]``; values
    must be finite.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(
            f'{name} must be a real number or a callable of the step; got '
            f'{value!r} of type {type(value).__name__}',
        )
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
    """Return ``value`` if it is a bool."""
    if not isinstance(value, bool):
        raise TypeError(f'{name} must be a bool; got {value!r}')
    return value


def check_dtype(name: str, value: object) -> torch.dtype | None:
    """Return ``value`` if it is None or a floating-point torch.dtype."""
    if value is None:
        return None
    if not (isinstance(value, torch.dtype) and value.is_floating_point):
        raise TypeError(
            f'{name} must be None or a floating torch.dtype; got {value!r}',
        )
    return value


def check_instance(name: str, value: object, kind: type, what: str) -> None:
    """Raise ``TypeError`` unless ``value`` is an instance of ``kind``."""
    if not isinstance(value, kind):
        raise TypeError(
            f'{name} must be {what}; got {value!r} of type '
            f'{type(value).__name__}',
        )
