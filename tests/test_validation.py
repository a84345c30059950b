"""Every invalid argument raises a clear ValueError or TypeError."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from kfac.enums import ComputeMethod
from kfac.enums import DistributedStrategy
from kfac.preconditioner import KFACConfig
from kfac.preconditioner import KFACPreconditioner
from testing.models import TinyMLP

# (keyword arguments, exception type, text the message must contain)
INVALID: list[tuple[dict[str, Any], type[Exception], str]] = [
    (
        {'factor_update_steps': 0},
        ValueError,
        'factor_update_steps must be >= 1',
    ),
    (
        {'factor_update_steps': 1.5},
        TypeError,
        'factor_update_steps must be an int',
    ),
    ({'factor_update_steps': True}, TypeError, 'factor_update_steps'),
    ({'inv_update_steps': -2}, ValueError, 'inv_update_steps must be >= 1'),
    ({'damping': 0.0}, ValueError, 'damping must be a finite number > 0'),
    ({'damping': -1e-3}, ValueError, 'damping'),
    ({'damping': float('nan')}, ValueError, 'damping'),
    ({'damping': float('inf')}, ValueError, 'damping'),
    ({'damping': '0.1'}, TypeError, 'damping must be a real number'),
    (
        {'factor_decay': 0.0},
        ValueError,
        'factor_decay must be a finite number > 0.0 and <= 1.0',
    ),
    ({'factor_decay': 1.01}, ValueError, 'factor_decay'),
    ({'kl_clip': 0.0}, ValueError, 'kl_clip must be a finite number > 0'),
    ({'kl_clip': 'none'}, TypeError, 'kl_clip'),
    ({'lr': -0.1}, ValueError, 'lr must be a finite number >= 0'),
    ({'accumulation_steps': 0}, ValueError, 'accumulation_steps must be >= 1'),
    ({'accumulation_steps': 2.0}, TypeError, 'accumulation_steps'),
    (
        {'allreduce_bucket_cap_mb': -1},
        ValueError,
        'allreduce_bucket_cap_mb must be a finite number >= 0',
    ),
    ({'allreduce_bucket_cap_mb': None}, TypeError, 'allreduce_bucket_cap_mb'),
    (
        {'assignment_strategy': 'fastest'},
        ValueError,
        "assignment_strategy='fastest' is not a AssignmentStrategy",
    ),
    (
        {'assignment_strategy': 3},
        TypeError,
        'assignment_strategy must be a AssignmentStrategy',
    ),
    (
        {'compute_method': 'cholesky'},
        ValueError,
        "allowed (case-insensitive): 'eigen', 'inverse'",
    ),
    ({'compute_method': ComputeMethod}, TypeError, 'compute_method'),
    ({'grad_worker_fraction': 'half'}, ValueError, 'grad_worker_fraction'),
    (
        {'grad_worker_fraction': 0.0},
        ValueError,
        'grad_worker_fraction must be a finite number > 0.0 and <= 1.0',
    ),
    ({'grad_worker_fraction': 1.5}, ValueError, 'grad_worker_fraction'),
    ({'grad_worker_fraction': None}, TypeError, 'grad_worker_fraction'),
    ({'colocate_factors': 1}, TypeError, 'colocate_factors must be a bool'),
    (
        {'compute_eigenvalue_outer_product': 'yes'},
        TypeError,
        'compute_eigenvalue_outer_product must be a bool',
    ),
    ({'symmetry_aware': None}, TypeError, 'symmetry_aware must be a bool'),
    (
        {'update_factors_in_hook': 0},
        TypeError,
        'update_factors_in_hook must be a bool',
    ),
    (
        {'factor_dtype': torch.int32},
        TypeError,
        'factor_dtype must be None or a floating torch.dtype',
    ),
    (
        {'inv_dtype': 'float64'},
        TypeError,
        'inv_dtype must be None or a floating torch.dtype',
    ),
    (
        {'skip_layers': 3},
        TypeError,
        'skip_layers must be None, a regular expression',
    ),
    (
        {'skip_layers': ['fc1', 2]},
        TypeError,
        'skip_layers entries must be strings',
    ),
    (
        {'skip_layers': '(unclosed'},
        ValueError,
        "skip_layers pattern '(unclosed' is not a valid regular expression",
    ),
    ({'loglevel': -1}, ValueError, 'loglevel must be >= 0'),
    ({'loglevel': 'DEBUG'}, TypeError, 'loglevel'),
    (
        {'loss_reduction': 'avg'},
        ValueError,
        "loss_reduction must be one of ('mean', 'sum')",
    ),
    (
        {'grad_scaler': 3.0},
        TypeError,
        'grad_scaler must be None, a GradScaler or a callable',
    ),
    (
        {'colocate_factors': False},
        ValueError,
        'compute_eigenvalue_outer_product=True needs colocate_factors=True',
    ),
]


@pytest.mark.parametrize(
    ('kwargs', 'error', 'match'),
    INVALID,
    ids=[f'{next(iter(k))}={next(iter(k.values()))!r}' for k, _, _ in INVALID],
)
def test_invalid_argument(
    kwargs: dict[str, Any],
    error: type[Exception],
    match: str,
) -> None:
    with pytest.raises(error) as info:
        KFACPreconditioner(TinyMLP(), **kwargs)
    assert match in str(info.value)


def test_model_must_be_a_module() -> None:
    with pytest.raises(TypeError, match='model must be a torch.nn.Module'):
        KFACPreconditioner('model')  # type: ignore[arg-type]


def test_model_without_supported_layers() -> None:
    with pytest.raises(ValueError, match='no module K-FAC can precondition'):
        KFACPreconditioner(nn.Sequential(nn.ReLU(), nn.BatchNorm1d(3)))
    with pytest.raises(ValueError, match='no module K-FAC can precondition'):
        KFACPreconditioner(TinyMLP(), skip_layers='Linear')
    frozen = TinyMLP().requires_grad_(False)
    with pytest.raises(ValueError, match='no module K-FAC can precondition'):
        KFACPreconditioner(frozen)


@pytest.mark.parametrize(
    ('value', 'expected'),
    [
        ('EIGEN', ComputeMethod.EIGEN),
        ('Inverse', ComputeMethod.INVERSE),
        (ComputeMethod.INVERSE, ComputeMethod.INVERSE),
    ],
)
def test_enum_strings_are_case_insensitive(
    value: Any,
    expected: ComputeMethod,
) -> None:
    precon = KFACPreconditioner(TinyMLP(), compute_method=value)
    assert precon.config.compute_method is expected


@pytest.mark.parametrize(
    'value', ['comm_opt', 'COMM-OPT', 'Mem_Opt', 'hybrid_opt']
)
def test_strategy_strings_parse(value: str) -> None:
    config = KFACConfig(grad_worker_fraction=value)  # type: ignore[arg-type]
    assert isinstance(config.grad_worker_fraction, DistributedStrategy)


def test_outer_product_without_colocation_is_fine_for_inverse() -> None:
    precon = KFACPreconditioner(
        TinyMLP(),
        compute_method='inverse',
        colocate_factors=False,
    )
    assert precon.config.colocate_factors is False


def test_config_is_frozen() -> None:
    config = KFACConfig()
    with pytest.raises(AttributeError):
        config.damping = 3  # type: ignore[attr-defined]


def test_valid_dtypes_are_used() -> None:
    precon = KFACPreconditioner(
        TinyMLP(),
        factor_dtype=torch.float64,
        inv_dtype=torch.float64,
    )
    layer = precon.layers['fc1']
    assert layer.factor_dtype == torch.float64
    assert layer.inv_dtype == torch.float64
