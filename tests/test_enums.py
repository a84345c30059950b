from __future__ import annotations

import pytest

from kfac.enums import AllreduceMethod
from kfac.enums import AssignmentStrategy
from kfac.enums import ComputeMethod
from kfac.enums import DistributedStrategy
from kfac.enums import parse_enum


@pytest.mark.parametrize(
    ('enum_type', 'text', 'member'),
    [
        (
            AllreduceMethod,
            'ALLREDUCE_BUCKETED',
            AllreduceMethod.ALLREDUCE_BUCKETED,
        ),
        (AllreduceMethod, 'allreduce', AllreduceMethod.ALLREDUCE),
        (AssignmentStrategy, 'Memory', AssignmentStrategy.MEMORY),
        (ComputeMethod, ' eigen ', ComputeMethod.EIGEN),
        (DistributedStrategy, 'hybrid-opt', DistributedStrategy.HYBRID_OPT),
    ],
)
def test_strings_are_case_insensitive(
    enum_type: type, text: str, member: object
) -> None:
    assert enum_type(text) is member
    assert parse_enum(enum_type, text, 'arg') is member


def test_unknown_names() -> None:
    with pytest.raises(
        ValueError, match="compute_method='qr' is not a ComputeMethod"
    ):
        parse_enum(ComputeMethod, 'qr', 'compute_method')
    with pytest.raises(TypeError, match='got 1 of type int'):
        parse_enum(ComputeMethod, 1, 'compute_method')
    with pytest.raises(ValueError):
        ComputeMethod(3)
