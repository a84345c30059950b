"""Enumerations of the choices K-FAC offers.

Every place that takes one of these enums also takes its name or value as a
string, case-insensitively (`'eigen'`, `'EIGEN'` and `ComputeMethod.EIGEN`
are the same choice); see [`parse_enum`][kfac.enums.parse_enum].
"""

from __future__ import annotations

import enum
from typing import TypeVar

from kfac.validation import type_error

FACTOR_NAMES = ('A', 'G')
"""The names of a layer's two Kronecker factors, in the order they are
handled: `A` (input side) and `G` (output-gradient side)."""


class _ChoiceEnum(enum.Enum):
    """Base of the K-FAC enums: string values, case-insensitive lookup."""

    @classmethod
    def _missing_(cls, value: object) -> _ChoiceEnum | None:
        if isinstance(value, str):
            key = value.strip().lower().replace('-', '_')
            for member in cls:
                if key in (member.value, member.name.lower()):
                    return member
        return None


class AllreduceMethod(_ChoiceEnum):
    """How factors are allreduced across data-parallel ranks."""

    ALLREDUCE = 'allreduce'
    ALLREDUCE_BUCKETED = 'allreduce_bucketed'


class AssignmentStrategy(_ChoiceEnum):
    """Cost model used to balance inverse workers.

    `COMPUTE` weighs an `n x n` factor by `n**3` (time of its
    decomposition); `MEMORY` by `n**2` (bytes it occupies).
    """

    COMPUTE = 'compute'
    MEMORY = 'memory'


class ComputeMethod(_ChoiceEnum):
    """Second-order method used to precondition gradients.

    `EIGEN`: eigendecompositions of the factors, exact damping; `INVERSE`:
    damped inverses of the factors; `EKFAC`: EIGEN's eigenbases with the
    scaling re-estimated from each example's gradient (George et al., 2018).
    """

    EIGEN = 'eigen'
    INVERSE = 'inverse'
    EKFAC = 'ekfac'


class DistributedStrategy(_ChoiceEnum):
    """Named gradient worker fractions of KAISA.

    `COMM_OPT` makes every rank a gradient worker (fraction 1),
    `HYBRID_OPT` half of the ranks (fraction 0.5) and `MEM_OPT` one rank
    per layer (fraction `1 / world_size`).
    """

    COMM_OPT = 'comm_opt'
    MEM_OPT = 'mem_opt'
    HYBRID_OPT = 'hybrid_opt'


E = TypeVar('E', bound=_ChoiceEnum)


def parse_enum(enum_type: type[E], value: object, argument: str) -> E:
    """Return `value` as a member of `enum_type`.

    Args:
        enum_type: the enum class.
        value: a member of `enum_type` or its name or value as a string
            (case-insensitive).
        argument: the name of the argument being parsed, used in errors.

    Raises:
        TypeError: `value` is neither a member nor a string.
        ValueError: `value` is a string naming no member.

    Examples:
        >>> parse_enum(ComputeMethod, 'Inverse', 'compute_method')
        <ComputeMethod.INVERSE: 'inverse'>

    """
    if isinstance(value, enum_type):
        return value
    allowed = ', '.join(repr(m.value) for m in enum_type)
    if not isinstance(value, str):
        what = f'a {enum_type.__name__} or one of the strings {allowed}'
        raise type_error(argument, value, what)
    try:
        return enum_type(value)
    except ValueError:
        raise ValueError(
            f'{argument}={value!r} is not a {enum_type.__name__}; '
            f'allowed (case-insensitive): {allowed}',
        ) from None
