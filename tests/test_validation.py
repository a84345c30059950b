"""Every invalid argument raises a clear ValueError or TypeError.

The first half checks the public boundaries (each message names the
argument, the value and what is allowed); the second the vocabulary of
kfac.validation they all use.
"""

from __future__ import annotations

import dataclasses
import fractions
import math
from collections.abc import Callable
from typing import Any
from typing import cast

import numpy as np
import pytest
import torch
from torch import nn

from kfac import validation
from kfac.assignment import KAISAAssignment
from kfac.base_preconditioner import BaseKFACPreconditioner
from kfac.config import EngineOptions
from kfac.config import FisherConfig
from kfac.config import ShardingConfig
from kfac.config import StatisticsConfig
from kfac.distributed import TorchDistributedCommunicator
from kfac.enums import AssignmentStrategy
from kfac.enums import ComputeMethod
from kfac.enums import DistributedStrategy
from kfac.hyperparams import exp_decay_factor_averaging
from kfac.layers.curvature import EigenConfig
from kfac.layers.curvature import EKFACConfig
from kfac.layers.curvature.eigen import EigenCurvature
from kfac.layers.curvature.ekfac import EKFACCurvature
from kfac.layers.curvature.inverse import InverseCurvature
from kfac.layers.eigen import KFACEigenLayer
from kfac.layers.inverse import KFACInverseLayer
from kfac.layers.modules import LinearModuleHelper
from kfac.layers.register import register_modules
from kfac.preconditioner import KFACConfig
from kfac.preconditioner import KFACPreconditioner
from kfac.scheduler import LambdaParamScheduler
from kfac.tracing import PhaseTimer
from kfac.validation import check_bool
from kfac.validation import check_callable
from kfac.validation import check_dtype
from kfac.validation import check_instance
from kfac.validation import validate_float
from kfac.validation import validate_int
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
        'factor_update_steps must be an int >= 1 or a callable of the step; got 1.5 of type float',
    ),
    ({'factor_update_steps': True}, TypeError, 'factor_update_steps'),
    ({'inv_update_steps': -2}, ValueError, 'inv_update_steps must be >= 1'),
    ({'damping': 0.0}, ValueError, 'damping must be a finite number > 0'),
    ({'damping': -1e-3}, ValueError, 'damping'),
    ({'damping': float('nan')}, ValueError, 'damping'),
    ({'damping': float('inf')}, ValueError, 'damping'),
    (
        {'damping': '0.1'},
        TypeError,
        "damping must be a real number or a callable of the step; got '0.1' of type str",
    ),
    (
        {'factor_decay': 0.0},
        ValueError,
        'factor_decay must be a finite number > 0.0 and <= 1.0',
    ),
    ({'factor_decay': 1.01}, ValueError, 'factor_decay'),
    ({'kl_clip': 0.0}, ValueError, 'kl_clip must be a finite number > 0'),
    ({'kl_clip': 'none'}, TypeError, 'kl_clip'),
    (
        {'relative_clip': 0.0},
        ValueError,
        'relative_clip must be a finite number > 0',
    ),
    ({'relative_clip': 'auto!'}, TypeError, 'relative_clip'),
    ({'lr': -0.1}, ValueError, 'lr must be a finite number >= 0'),
    ({'accumulation_steps': 0}, ValueError, 'accumulation_steps must be >= 1'),
    (
        {'accumulation_steps': 2.0},
        TypeError,
        'accumulation_steps must be an int >= 1; got 2.0 of type float',
    ),
    (
        {'allreduce_bucket_cap_mb': -1},
        ValueError,
        'allreduce_bucket_cap_mb must be a finite number >= 0',
    ),
    (
        {'allreduce_bucket_cap_mb': None},
        TypeError,
        'allreduce_bucket_cap_mb must be a real number; got None',
    ),
    (
        {'assignment_strategy': 'fastest'},
        ValueError,
        "assignment_strategy='fastest' is not an AssignmentStrategy",
    ),
    (
        {'assignment_strategy': 3},
        TypeError,
        'assignment_strategy must be an AssignmentStrategy',
    ),
    (
        {'compute_method': 'cholesky'},
        ValueError,
        "allowed (case-insensitive): 'eigen', 'inverse'",
    ),
    ({'compute_method': ComputeMethod}, TypeError, 'compute_method'),
    ({'grad_worker_fraction': 'half'}, ValueError, 'grad_worker_fraction'),
    (
        {'grad_worker_fraction': -0.5},
        ValueError,
        'grad_worker_fraction must be a finite number > 0.0 and <= 1.0',
    ),
    ({'grad_worker_fraction': 1.5}, ValueError, 'grad_worker_fraction'),
    (
        {'grad_worker_fraction': None},
        TypeError,
        'grad_worker_fraction must be a float in [0, 1], a DistributedStrategy or its name; got None',
    ),
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
    (
        {'loglevel': 'DEBUG'},
        TypeError,
        "loglevel must be an int >= 0; got 'DEBUG' of type str",
    ),
    (
        {'statistics': StatisticsConfig},
        TypeError,
        'statistics must be a kfac.StatisticsConfig',
    ),
    ({'fisher': 'mc'}, TypeError, 'fisher must be a kfac.FisherConfig'),
    ({'sharding': {}}, TypeError, 'sharding must be a kfac.ShardingConfig'),
    (
        {'grad_scaler': 3.0},
        TypeError,
        'grad_scaler must be None, a GradScaler or a callable',
    ),
    (
        {'module_options': [('fc1', {})]},
        TypeError,
        'module_options must be None or a mapping',
    ),
    (
        {'module_options': {'fc1': {'batch_major': False}}},
        ValueError,
        "unknown options ['batch_major']; allowed: batch_first",
    ),
    (
        {'compute_method': 'eigen', 'colocate_factors': False},
        ValueError,
        'compute_eigenvalue_outer_product=True needs colocate_factors=True',
    ),
    ({'compute_method': 'ekfac_x'}, ValueError, "'eigen', 'inverse', 'ekfac'"),
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
        KFACPreconditioner('model')  # type: ignore[arg-type]  # wrong on purpose


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
    ('value', 'expected'),
    [
        ('comm_opt', DistributedStrategy.COMM_OPT),
        ('COMM-OPT', DistributedStrategy.COMM_OPT),
        ('Mem_Opt', DistributedStrategy.MEM_OPT),
        ('hybrid_opt', DistributedStrategy.HYBRID_OPT),
        (1, 1.0),
        (fractions.Fraction(1, 2), 0.5),
    ],
)
def test_config_normalises_fractions(
    value: float | str, expected: float | DistributedStrategy
) -> None:
    config = KFACConfig(grad_worker_fraction=value)
    assert config.grad_worker_fraction == expected
    assert type(config.grad_worker_fraction) is type(expected)


def test_config_normalises_what_it_accepts() -> None:
    config = KFACConfig(
        allreduce_bucket_cap_mb=1,
        assignment_strategy='Memory',
        compute_method='INVERSE',
        skip_layers='fc1',
        accumulation_steps=cast('int', np.int64(2)),
    )
    assert config.allreduce_bucket_cap_mb == 1.0
    assert isinstance(config.allreduce_bucket_cap_mb, float)
    assert config.assignment_strategy is AssignmentStrategy.MEMORY
    assert config.compute_method is ComputeMethod.INVERSE
    assert config.skip_layers == ('fc1',)
    assert type(config.accumulation_steps) is int
    assert KFACConfig(skip_layers=None).skip_layers == ()


@pytest.mark.parametrize('method', ['eigen', 'ekfac'])
def test_basis_refresh_reaches_the_layers(method: str) -> None:
    config = (EigenConfig if method == 'eigen' else EKFACConfig)(
        basis_refresh='qr'
    )
    precon = KFACPreconditioner(TinyMLP(), compute_method=config)
    assert precon.config.compute_method is config
    curvature = precon.layers['fc1'].curvature
    assert isinstance(curvature, EigenCurvature)
    assert curvature.config.basis_refresh == 'qr'
    assert isinstance(curvature, EKFACCurvature) == (method == 'ekfac')


def test_ekfac_outer_product_needs_no_colocation() -> None:
    """EKFAC's `1 / (S + λ)` is formed where `S` is updated, on ranks that
    hold both bases: `colocate_factors=False` is fine.
    """
    precon = KFACPreconditioner(
        TinyMLP(), compute_method='ekfac', colocate_factors=False
    )
    curvature = precon.layers['fc1'].curvature
    assert isinstance(curvature, EKFACCurvature)
    assert curvature.ekfac.prediv_eigenvalues
    assert not curvature.prediv_eigenvalues  # plain bases are broadcast


def test_outer_product_without_colocation_is_fine_for_inverse() -> None:
    precon = KFACPreconditioner(
        TinyMLP(),
        compute_method='inverse',
        colocate_factors=False,
    )
    assert precon.config.compute_method is ComputeMethod.INVERSE
    assert isinstance(precon.layers['fc1'].curvature, InverseCurvature)


def test_config_is_frozen() -> None:
    config = KFACConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.accumulation_steps = 3  # type: ignore[misc]  # refused
    assert config.accumulation_steps == 1


def test_valid_dtypes_are_used() -> None:
    precon = KFACPreconditioner(
        TinyMLP(),
        factor_dtype=torch.float64,
        inv_dtype=torch.float64,
    )
    layer = precon.layers['fc1']
    assert layer.factor_dtype == torch.float64
    assert layer.inv_dtype == torch.float64


def _any(value: object) -> Any:
    """An invalid argument, typed so that mypy lets the test pass it."""
    return value


def _layers() -> dict[str, Any]:
    return dict(KFACPreconditioner(TinyMLP()).layers)


def _assignment() -> Any:
    return KFACPreconditioner(TinyMLP()).assignment


BOUNDARIES: list[tuple[str, Callable[[], object], type[Exception], str]] = [
    (
        'BaseKFACPreconditioner layers type',
        lambda: BaseKFACPreconditioner(_any([1]), assignment=_assignment()),
        TypeError,
        'layers must be a mapping',
    ),
    (
        'BaseKFACPreconditioner layers empty',
        lambda: BaseKFACPreconditioner({}, assignment=_assignment()),
        ValueError,
        'layers must contain at least one KFACBaseLayer',
    ),
    (
        'BaseKFACPreconditioner layers values',
        lambda: BaseKFACPreconditioner(
            _any({'a': 1}), assignment=_assignment()
        ),
        TypeError,
        'KFACBaseLayer instances',
    ),
    (
        'BaseKFACPreconditioner assignment',
        lambda: BaseKFACPreconditioner(_layers(), assignment=_any(None)),
        TypeError,
        'assignment must be a kfac.assignment.WorkAssignment',
    ),
    (
        'BaseKFACPreconditioner hyperparameters',
        lambda: BaseKFACPreconditioner(
            _layers(), assignment=_assignment(), hyperparameters=_any({})
        ),
        TypeError,
        'hyperparameters must be None or',
    ),
    (
        'BaseKFACPreconditioner communicator',
        lambda: BaseKFACPreconditioner(
            _layers(), assignment=_assignment(), communicator=_any(1)
        ),
        TypeError,
        'communicator must be None or',
    ),
    (
        'BaseKFACPreconditioner options',
        lambda: BaseKFACPreconditioner(
            _layers(), assignment=_assignment(), options=_any({})
        ),
        TypeError,
        'options must be None or a kfac.config.EngineOptions',
    ),
    (
        'EngineOptions bucketed',
        lambda: EngineOptions(bucketed=_any(1)),
        TypeError,
        'bucketed must be a bool',
    ),
    (
        'EngineOptions shard_mode',
        lambda: EngineOptions(shard_mode=_any(1)),
        TypeError,
        'shard_mode must be',
    ),
    (
        'EngineOptions accumulation_steps',
        lambda: EngineOptions(accumulation_steps=0),
        ValueError,
        'accumulation_steps must be >= 1',
    ),
    (
        'state_dict include_decompositions',
        lambda: KFACPreconditioner(TinyMLP()).state_dict(_any('yes')),
        TypeError,
        'include_decompositions must be a bool',
    ),
    (
        'load_state_dict strict',
        lambda: KFACPreconditioner(TinyMLP()).load_state_dict(
            {}, strict=_any(None)
        ),
        TypeError,
        'strict must be a bool',
    ),
    (
        'set_hyperparameters unknown',
        lambda: KFACPreconditioner(TinyMLP()).set_hyperparameters(
            dampening=1.0
        ),
        ValueError,
        "unknown hyperparameters ['dampening']",
    ),
    (
        'set_hyperparameters invalid',
        lambda: KFACPreconditioner(TinyMLP()).set_hyperparameters(
            damping=-1.0
        ),
        ValueError,
        'damping must be a finite number > 0',
    ),
    (
        'layer module',
        lambda: KFACEigenLayer(_any(nn.Linear(2, 2))),
        TypeError,
        'module must be a kfac.layers.modules.ModuleHelper',
    ),
    (
        'layer factor_dtype',
        lambda: KFACInverseLayer(
            LinearModuleHelper(nn.Linear(2, 2)), factor_dtype=torch.int64
        ),
        TypeError,
        'factor_dtype must be None or a floating torch.dtype',
    ),
    (
        'layer inv_dtype',
        lambda: KFACInverseLayer(
            LinearModuleHelper(nn.Linear(2, 2)), inv_dtype=_any('float')
        ),
        TypeError,
        'inv_dtype must be None',
    ),
    (
        'layer prediv_eigenvalues',
        lambda: KFACEigenLayer(
            LinearModuleHelper(nn.Linear(2, 2)), prediv_eigenvalues=_any(1)
        ),
        TypeError,
        'prediv_eigenvalues must be a bool',
    ),
    (
        'helper module',
        lambda: LinearModuleHelper(nn.ReLU()),
        TypeError,
        'module must be a torch.nn.Module with a weight tensor',
    ),
    (
        'register_modules model',
        lambda: register_modules(_any('model')),
        TypeError,
        'model must be a torch.nn.Module',
    ),
    (
        'PhaseTimer sync',
        lambda: PhaseTimer(sync=_any(3)),
        TypeError,
        'sync must be None or callable',
    ),
    (
        'scheduler preconditioner',
        lambda: LambdaParamScheduler(_any(None)),
        TypeError,
        'preconditioner must be a BaseKFACPreconditioner',
    ),
    (
        'scheduler step',
        lambda: LambdaParamScheduler(KFACPreconditioner(TinyMLP())).step(-1),
        ValueError,
        'step must be >= 0',
    ),
    (
        'scheduler state type',
        lambda: LambdaParamScheduler(
            KFACPreconditioner(TinyMLP())
        ).load_state_dict(_any([])),
        TypeError,
        'state_dict must be a dict',
    ),
    (
        'scheduler state entries',
        lambda: LambdaParamScheduler(
            KFACPreconditioner(TinyMLP())
        ).load_state_dict({}),
        ValueError,
        "missing the entry 'last_step'",
    ),
    (
        'exp_decay min_value',
        lambda: exp_decay_factor_averaging(0.0),
        ValueError,
        'min_value must be a finite number > 0.0 and <= 1.0',
    ),
    (
        'communicator bucket cap',
        lambda: TorchDistributedCommunicator(bucket_cap_mb=-1.0),
        ValueError,
        'allreduce_bucket_cap_mb must be a finite number >= 0.0; got -1.0',
    ),
    (
        'communicator symmetry_aware',
        lambda: TorchDistributedCommunicator(symmetry_aware=_any(1)),
        TypeError,
        'symmetry_aware must be a bool; got 1 of type int',
    ),
    (
        'communicator broadcast src',
        lambda: TorchDistributedCommunicator().broadcast(
            torch.zeros(1), src=_any(0.0)
        ),
        TypeError,
        'src must be an int (a global rank); got 0.0 of type float',
    ),
    (
        'scheduler lambda',
        lambda: LambdaParamScheduler(
            KFACPreconditioner(TinyMLP()), lr_lambda=_any(0.5)
        ),
        TypeError,
        'lr_lambda must be callable; got 0.5 of type float',
    ),
    (
        'KAISAAssignment fraction',
        lambda: KAISAAssignment(
            {'l': {'A': 1.0, 'G': 1.0}},
            local_rank=0,
            world_size=4,
            grad_worker_fraction=0.3,
        ),
        ValueError,
        'grad_worker_fraction',
    ),
]


@pytest.mark.parametrize(
    ('label', 'call', 'error', 'match'),
    BOUNDARIES,
    ids=[b[0] for b in BOUNDARIES],
)
def test_public_boundary_rejects_bad_input(
    label: str,
    call: Callable[[], object],
    error: type[Exception],
    match: str,
) -> None:
    with pytest.raises(error) as info:
        call()
    assert match in str(info.value), label


# --------------------------------------------------------------------------
# The vocabulary itself.


def test_validate_int_returns_an_int() -> None:
    assert validate_int('n', 3) == 3
    assert validate_int('n', 0, minimum=0) == 0
    value = validate_int('n', np.int64(5))
    assert value == 5
    assert type(value) is int
    with pytest.raises(ValueError, match=r'^n must be >= 2; got 1$'):
        validate_int('n', 1, minimum=2)


@pytest.mark.parametrize('value', [True, 2.0, '2', None, np.float64(2)])
def test_validate_int_type_errors(value: object) -> None:
    message = f'n must be an int >= 1; got {value!r} of type'
    with pytest.raises(TypeError) as info:
        validate_int('n', value)
    assert str(info.value).startswith(message)
    assert 'callable' not in str(info.value)
    with pytest.raises(TypeError) as info:
        validate_int('n', value, schedulable=True)
    assert 'n must be an int >= 1 or a callable of the step; got' in str(
        info.value
    )


@pytest.mark.parametrize(
    ('value', 'kwargs', 'message'),
    [
        (0.0, {'low': 0.0}, 'x must be a finite number > 0.0; got 0.0'),
        (
            -1.0,
            {'low': 0.0, 'low_open': False},
            'x must be a finite number >= 0.0; got -1.0',
        ),
        (
            1.5,
            {'low': 0.0, 'high': 1.0},
            'x must be a finite number > 0.0 and <= 1.0; got 1.5',
        ),
        (math.inf, {'low': 0.0}, 'x must be a finite number > 0.0; got inf'),
        (math.nan, {'low': 0.0}, 'x must be a finite number > 0.0; got nan'),
    ],
)
def test_validate_float_ranges(
    value: float, kwargs: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError) as info:
        validate_float('x', value, **kwargs)
    assert str(info.value) == message


def test_validate_float_returns_a_float() -> None:
    assert validate_float('x', 1, low=0.0, high=1.0) == 1.0
    assert validate_float('x', 0, low=0.0, low_open=False) == 0.0
    value = validate_float('x', fractions.Fraction(1, 4), low=0.0)
    assert value == 0.25
    assert type(value) is float
    assert type(validate_float('x', np.float32(2.0), low=0.0)) is float


@pytest.mark.parametrize('value', [True, '0.1', None, 1j])
def test_validate_float_type_errors(value: object) -> None:
    with pytest.raises(TypeError) as info:
        validate_float('x', value, low=0.0)
    assert str(info.value).startswith(
        f'x must be a real number; got {value!r} of type'
    )
    with pytest.raises(TypeError, match='or a callable of the step'):
        validate_float('x', value, low=0.0, schedulable=True)


def test_check_bool() -> None:
    assert check_bool('flag', False) is False
    with pytest.raises(TypeError, match=r'^flag must be a bool; got 0 of'):
        check_bool('flag', 0)


def test_check_callable() -> None:
    check_callable('fn', len)
    check_callable('fn', None, optional=True)
    with pytest.raises(TypeError, match=r'^fn must be callable; got None'):
        check_callable('fn', None)
    with pytest.raises(TypeError, match=r'^fn must be None or callable; got'):
        check_callable('fn', 3, optional=True)


def test_check_dtype_and_instance() -> None:
    assert check_dtype('dtype', None) is None
    assert check_dtype('dtype', torch.bfloat16) is torch.bfloat16
    with pytest.raises(TypeError, match='dtype must be None or a floating'):
        check_dtype('dtype', torch.bool)
    check_instance('state', {}, dict, 'a dict')
    with pytest.raises(TypeError) as info:
        check_instance('state', [], dict, 'a dict')
    assert str(info.value) == 'state must be a dict; got [] of type list'


def test_booleans_are_not_numbers() -> None:
    assert validation.is_int(3) and not validation.is_int(True)
    assert validation.is_real(0.5) and not validation.is_real(False)
    assert not validation.is_int(3.0)
    assert not validation.is_real('0.5')


@pytest.mark.parametrize(
    ('build', 'error', 'match'),
    [
        (
            lambda: StatisticsConfig(loss_average='mean'),
            ValueError,
            'loss_average must be None \\(a summed loss\\) or one of '
            "'batch', 'batch\\+sequence' \\(case-insensitive\\); got 'mean'",
        ),
        (
            lambda: StatisticsConfig(kfac_approx='merge'),
            ValueError,
            "kfac_approx='merge' is not a KFACApprox",
        ),
        (
            lambda: StatisticsConfig(batch_first=_any(1)),
            TypeError,
            'batch_first must be a bool',
        ),
        (
            lambda: EigenConfig(basis_refresh='lanczos'),
            ValueError,
            "basis_refresh='lanczos' is not a BasisRefresh; allowed "
            "\\(case-insensitive\\): 'eigh', 'qr'",
        ),
        (
            lambda: EigenConfig(basis_refresh=_any(1)),
            TypeError,
            'basis_refresh must be a BasisRefresh',
        ),
        (
            lambda: ShardingConfig(shard_mode='halves'),
            ValueError,
            "shard_mode='halves' is not a ShardMode",
        ),
        (
            lambda: FisherConfig(fisher_type='exact'),
            ValueError,
            "fisher_type='exact' is not a FisherType",
        ),
    ],
)
def test_option_groups_reject_bad_values(
    build: Any, error: type[Exception], match: str
) -> None:
    """Each group validates its own fields: the choices are `str` enums
    (names accepted case-insensitively), the message names the field.
    """
    with pytest.raises(error, match=match):
        build()
