"""Enumerations of the choices K-FAC offers.

Every choice is a `str` enum: a member equals its value
(`ComputeMethod.EIGEN == 'eigen'`), and every place that takes one also
takes its name or value as a string, case-insensitively (`'eigen'`,
`'EIGEN'` and `ComputeMethod.EIGEN` are the same choice); see
[`parse_enum`][kfac.enums.parse_enum]. A summed loss is `loss_average=None`
(no member of [`LossAverage`][kfac.enums.LossAverage]).
"""

from __future__ import annotations

import enum
from typing import TypeVar

from kfac.validation import type_error

FACTOR_NAMES = ('A', 'G')
"""The names of a layer's two Kronecker factors, in the order they are
handled: `A` (input side) and `G` (output-gradient side)."""


class _ChoiceEnum(str, enum.Enum):
    """Base of the K-FAC enums: string values, case-insensitive lookup."""

    def __str__(self) -> str:
        return str(self.value)

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
    scaling re-estimated from each example's gradient (George et al., 2018);
    `EIGEN_ADAM`: Adam's second moments kept in the factors' eigenbases
    (as SOAP keeps them in Shampoo's); `ONE_SIDED`: one factor's damped
    inverse only (the input factor's for Muon, as Newton-Muon).
    """

    EIGEN = 'eigen'
    INVERSE = 'inverse'
    EKFAC = 'ekfac'
    EIGEN_ADAM = 'eigen_adam'
    ONE_SIDED = 'one_sided'


class DistributedStrategy(_ChoiceEnum):
    """Named gradient worker fractions of KAISA.

    `COMM_OPT` makes every rank a gradient worker (fraction 1),
    `HYBRID_OPT` half of the ranks (fraction 0.5) and `MEM_OPT` one rank
    per layer (fraction `1 / world_size`).
    """

    COMM_OPT = 'comm_opt'
    MEM_OPT = 'mem_opt'
    HYBRID_OPT = 'hybrid_opt'


class BasisRefresh(_ChoiceEnum):
    """How EIGEN and EKFAC refresh their eigenbases.

    `EIGH`: a full eigendecomposition; `QR`: a few steps of orthogonal
    iteration from the previous basis (see
    [`kfac.layers.curvature.eigen`][kfac.layers.curvature.eigen]).
    """

    EIGH = 'eigh'
    QR = 'qr'


class DampingMode(_ChoiceEnum):
    """What `damping` is: `ABSOLUTE` (`λ` as given) or `RELATIVE` (`λ`
    times each layer's mean eigenvalue of `A ⊗ G`).
    """

    ABSOLUTE = 'absolute'
    RELATIVE = 'relative'


class FactorSource(_ChoiceEnum):
    """Where a method's factors come from: `KFAC` (`A` and `G` from the
    layer's inputs and output gradients, captured by hooks) or `GRADIENT`
    (the gradient's own, `G = E[V Vᵀ]` and `A = E[Vᵀ V]` as Shampoo's and
    SOAP's, from the averaged gradient: no hooks, no factor allreduce).
    """

    KFAC = 'kfac'
    GRADIENT = 'gradient'


class FisherType(_ChoiceEnum):
    """Where `G`'s output gradients come from: `EMPIRICAL` (the training
    loss's backward pass) or `MC` (a backward pass at targets sampled from
    the model, the Monte Carlo Fisher).
    """

    EMPIRICAL = 'empirical'
    MC = 'mc'


class KFACApprox(_ChoiceEnum):
    """How weight-sharing positions enter the factors: `EXPAND` (each
    position a further example) or `REDUCE` (one row per example;
    Eschenhagen et al., NeurIPS 2023).
    """

    EXPAND = 'expand'
    REDUCE = 'reduce'


class LossAverage(_ChoiceEnum):
    """How the loss averages its terms: `BATCH` (over the `N` examples) or
    `BATCH_SEQUENCE` (over examples and positions, `'batch+sequence'`); a
    summed loss is `None`.
    """

    BATCH = 'batch'
    BATCH_SEQUENCE = 'batch+sequence'


class AccumulationDivisor(_ChoiceEnum):
    """What each backward pass's loss was divided by on a *short* step,
    one after fewer backward passes than `accumulation_steps` (a trainer's
    last batches of an epoch): `ACCUMULATION_STEPS` (the configured number,
    as Lightning and a loop dividing by `accumulation_steps` do) or
    `PASSES` (the passes the step actually had, as the Hugging Face
    `Trainer` does).
    """

    ACCUMULATION_STEPS = 'accumulation_steps'
    PASSES = 'passes'


class MCLoss(_ChoiceEnum):
    """The loss whose predictive distribution the Monte Carlo Fisher
    samples: `CROSS_ENTROPY` (a categorical) or `MSE` (a Gaussian).
    """

    CROSS_ENTROPY = 'cross_entropy'
    MSE = 'mse'


class MomentRefresh(_ChoiceEnum):
    """What EIGEN_ADAM does with its second moments `E` when the bases are
    refreshed: `CARRY` (rotate them into the new bases) or `RESTART` (start
    them afresh).
    """

    CARRY = 'carry'
    RESTART = 'restart'


class Side(_ChoiceEnum):
    """Which factor ONE_SIDED preconditions with: `INPUT` (`A`, on the
    right: `V (A + λ_A I)⁻¹`) or `OUTPUT` (`G`, on the left).
    """

    INPUT = 'input'
    OUTPUT = 'output'


class ShardMode(_ChoiceEnum):
    """How gradients of a model sharded with FSDP2 are preconditioned:
    `LOSSLESS` (each layer's whole gradient, equal to one process) or
    `LOCAL` (each rank its own rows; an approximation).
    """

    LOSSLESS = 'lossless'
    LOCAL = 'local'


E = TypeVar('E', bound=enum.Enum)


def parse_enum(enum_type: type[E], value: object, argument: str) -> E:
    """Return `value` as a member of `enum_type`.

    Args:
        enum_type: the enum class.
        value: a member of `enum_type` or its value as a string (for the
            library's enums also its name, case-insensitive).
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
    name = enum_type.__name__
    article = 'an' if name[0] in 'AEIOU' else 'a'
    if not isinstance(value, str):
        what = f'{article} {name} or one of the strings {allowed}'
        raise type_error(argument, value, what)
    try:
        return enum_type(value)
    except ValueError:
        loose = issubclass(enum_type, _ChoiceEnum)
        raise ValueError(
            f'{argument}={value!r} is not {article} {name}; allowed'
            f'{" (case-insensitive)" if loose else ""}: {allowed}',
        ) from None
