"""The setup ranks compare at construction: its description, the first
difference between ranks and its message, without a process group (the
collective itself: `tests/system/test_agreement.py`).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any
from typing import NamedTuple

import pytest
import torch
from torch import nn

from kfac import preconditioner
from kfac._engine.agreement import GLOBAL_OPTIONS
from kfac._engine.agreement import LOCAL_OPTIONS
from kfac._engine.agreement import RESOLVED_OPTIONS
from kfac._engine.agreement import canonical
from kfac._engine.agreement import describe_setup
from kfac._engine.agreement import setup_difference
from kfac.config import FisherConfig
from kfac.config import KFACConfig
from kfac.config import ShardingConfig
from kfac.config import StatisticsConfig
from kfac.distributed import TorchDistributedCommunicator
from kfac.distributed import gather_if_different
from kfac.distributed._agreement import digest
from kfac.enums import ComputeMethod
from kfac.hyperparams import Hyperparameters
from kfac.layers.base import KFACBaseLayer
from kfac.layers.curvature import EigenConfig
from kfac.layers.curvature import InverseConfig
from kfac.layers.curvature.base import Curvature
from kfac.layers.curvature.base import CurvatureConfig
from kfac.preconditioner import KFACPreconditioner

Description = list[tuple[str, str]]


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3))


def describe(
    model: nn.Module | None = None,
    hyperparameters: dict[str, Any] | None = None,
    world_size: int = 2,
    **options: Any,
) -> Description:
    """The description of `model` (default `_mlp()`) under `options`."""
    config = KFACConfig(**options)
    registration = config.register(_mlp() if model is None else model)
    layers = {
        name: config.make_layer(name, helper, registration.options[name])
        for name, helper in registration.helpers.items()
    }
    return describe_setup(
        config,
        Hyperparameters(**(hyperparameters or {})),
        registration,
        layers,
        world_size,
    )


def test_description_of_one_linear() -> None:
    model = nn.Sequential(nn.Linear(3, 2))
    assert describe(model) == [
        ('grad_worker_fraction', '1.0'),
        ('colocate_factors', 'True'),
        ('assignment_strategy', "'compute'"),
        ('allreduce_bucket_cap_mb', '25.0'),
        ('symmetry_aware', 'False'),
        ('accumulation_steps', '1'),
        ('update_factors_in_hook', 'True'),
        ('statistics.loss_average', "'batch'"),
        ('statistics.accumulation_divisor', 'None'),
        ('statistics.position_sample_seed', '0'),
        ('statistics.max_nonfinite_statistics', 'None'),
        ('statistics.max_decomposition_failures', 'None'),
        ('fisher.fisher_type', "'empirical'"),
        ('fisher.mc_samples', '1'),
        ('fisher.mc_seed', '0'),
        ('sharding.shard_mode', "'lossless'"),
        ('factor_update_steps', '10'),
        ('inv_update_steps', '100'),
        ('registered modules', "['0']"),
        ("module '0' type", 'Linear (LinearModuleHelper)'),
        ("module '0' weight shape", '(2, 3)'),
        ("module '0' A shape", '(4, 4)'),
        ("module '0' G shape", '(2, 2)'),
        ("module '0' weight sharding", 'not sharded'),
        ("module '0' bias sharding", 'not sharded'),
        ("module '0' factor_dtype", 'torch.float32'),
        ("module '0' inv_dtype", 'torch.float32'),
        ("module '0' batch_first", 'True'),
        ("module '0' kfac_approx", "'expand'"),
        ("module '0' max_factor_dim", '8192'),
        ("module '0' position_sample", 'None'),
        (
            "module '0' compute_method",
            "InverseConfig(damping_mode='absolute', factor_rank=None)",
        ),
        ("module '0' shares weight with", '[]'),
    ]


def test_an_embedding_and_a_shared_weight_are_described() -> None:
    embed = nn.Embedding(7, 4)
    head = nn.Linear(4, 4, bias=False)
    model = nn.Sequential(embed, head, nn.Tanh(), head)  # head called twice
    items = dict(describe(model))
    assert items["module '0' A shape"] == '(7,)'  # diagonal
    assert "module '0' bias sharding" not in items
    assert items["module '1' type"] == 'Linear (LinearModuleHelper)'
    assert items['registered modules'] == "['0', '1']"
    assert items["module '1' shares weight with"] == '[]'


class Variant(NamedTuple):
    """One option changed on rank 1, and the difference it must show."""

    field: str
    base: dict[str, Any]
    changed: dict[str, Any]
    shown: str


VARIANTS = [
    Variant(
        'grad_worker_fraction',
        {},
        {'grad_worker_fraction': 0.5},
        'grad_worker_fraction: 1.0 on ranks [0], 0.5 on ranks [1]',
    ),
    Variant(
        'colocate_factors',
        {},
        {'colocate_factors': False},
        'colocate_factors: True on ranks [0], False on ranks [1]',
    ),
    Variant(
        'assignment_strategy',
        {},
        {'assignment_strategy': 'memory'},
        "assignment_strategy: 'compute' on ranks [0], 'memory' on ranks [1]",
    ),
    Variant(
        'allreduce_bucket_cap_mb',
        {},
        {'allreduce_bucket_cap_mb': 0},
        'allreduce_bucket_cap_mb: 25.0 on ranks [0], 0.0 on ranks [1]',
    ),
    Variant(
        'symmetry_aware',
        {},
        {'symmetry_aware': True},
        'symmetry_aware: False on ranks [0], True on ranks [1]',
    ),
    Variant(
        'accumulation_steps',
        {},
        {'accumulation_steps': 2},
        'accumulation_steps: 1 on ranks [0], 2 on ranks [1]',
    ),
    Variant(
        'update_factors_in_hook',
        {},
        {'update_factors_in_hook': False},
        'update_factors_in_hook: True on ranks [0], False on ranks [1]',
    ),
    Variant(
        'statistics.loss_average',
        {},
        {'statistics': StatisticsConfig(loss_average=None)},
        "statistics.loss_average: 'batch' on ranks [0], None on ranks [1]",
    ),
    Variant(
        'statistics.accumulation_divisor',
        {},
        {'statistics': StatisticsConfig(accumulation_divisor='passes')},
        "statistics.accumulation_divisor: None on ranks [0], 'passes' on "
        'ranks [1]',
    ),
    Variant(
        'statistics.position_sample_seed',
        {},
        {'statistics': StatisticsConfig(position_sample_seed=3)},
        'statistics.position_sample_seed: 0 on ranks [0], 3 on ranks [1]',
    ),
    Variant(
        'statistics.max_nonfinite_statistics',
        {},
        {'statistics': StatisticsConfig(max_nonfinite_statistics=2)},
        'statistics.max_nonfinite_statistics: None on ranks [0], 2 on '
        'ranks [1]',
    ),
    Variant(
        'statistics.max_decomposition_failures',
        {'statistics': StatisticsConfig(max_decomposition_failures=0)},
        {},
        'statistics.max_decomposition_failures: 0 on ranks [0], None on '
        'ranks [1]',
    ),
    Variant(
        'fisher.fisher_type',
        {},
        {'fisher': FisherConfig(fisher_type='mc')},
        "fisher.fisher_type: 'empirical' on ranks [0], 'mc' on ranks [1]",
    ),
    Variant(
        'fisher.mc_samples',
        {},
        {'fisher': FisherConfig(mc_samples=2)},
        'fisher.mc_samples: 1 on ranks [0], 2 on ranks [1]',
    ),
    Variant(
        'fisher.mc_seed',
        {},
        {'fisher': FisherConfig(mc_seed=5)},
        'fisher.mc_seed: 0 on ranks [0], 5 on ranks [1]',
    ),
    Variant(
        'sharding.shard_mode',
        {},
        {'sharding': ShardingConfig(shard_mode='local')},
        "sharding.shard_mode: 'lossless' on ranks [0], 'local' on ranks [1]",
    ),
    Variant(
        'compute_method',
        {},
        {'compute_method': 'eigen'},
        "module '0' compute_method: InverseConfig(damping_mode='absolute', "
        'factor_rank=None) on ranks [0], EigenConfig(prediv_eigenvalues='
        "True, basis_refresh='eigh', damping_mode='absolute', "
        'factor_rank=None) on ranks [1]',
    ),
    Variant(
        'compute_eigenvalue_outer_product',
        {'compute_method': 'eigen'},
        {'compute_method': 'eigen', 'compute_eigenvalue_outer_product': False},
        "module '0' compute_method: EigenConfig(prediv_eigenvalues=True, "
        "basis_refresh='eigh', damping_mode='absolute', factor_rank=None) "
        'on ranks [0], EigenConfig(prediv_eigenvalues=False, '
        "basis_refresh='eigh', damping_mode='absolute', factor_rank=None) "
        'on ranks [1]',
    ),
    Variant(
        'factor_dtype',
        {},
        {'factor_dtype': torch.float64},
        "module '0' factor_dtype: torch.float32 on ranks [0], torch.float64 "
        'on ranks [1]',
    ),
    Variant(
        'inv_dtype',
        {},
        {'inv_dtype': torch.float64},
        "module '0' inv_dtype: torch.float32 on ranks [0], torch.float64 on "
        'ranks [1]',
    ),
    Variant(
        'skip_layers',
        {},
        {'skip_layers': ['2']},
        "registered modules: ['0', '2'] on ranks [0], ['0'] on ranks [1]",
    ),
    Variant(
        'module_options',
        {},
        {'module_options': {'2': {'kfac_approx': 'reduce'}}},
        "module '2' kfac_approx: 'expand' on ranks [0], 'reduce' on ranks [1]",
    ),
    Variant(
        'statistics.batch_first',
        {},
        {'statistics': StatisticsConfig(batch_first=False)},
        "module '0' batch_first: True on ranks [0], False on ranks [1]",
    ),
    Variant(
        'statistics.kfac_approx',
        {},
        {'statistics': StatisticsConfig(kfac_approx='reduce')},
        "module '0' kfac_approx: 'expand' on ranks [0], 'reduce' on ranks [1]",
    ),
    Variant(
        'statistics.max_factor_dim',
        {},
        {'statistics': StatisticsConfig(max_factor_dim=100)},
        "module '0' max_factor_dim: 8192 on ranks [0], 100 on ranks [1]",
    ),
    Variant(
        'statistics.position_sample',
        {},
        {'statistics': StatisticsConfig(position_sample=2)},
        "module '0' position_sample: None on ranks [0], 2 on ranks [1]",
    ),
]


@pytest.mark.parametrize('variant', VARIANTS, ids=lambda v: v.field)
def test_a_changed_option_is_named_first(variant: Variant) -> None:
    message = setup_difference(
        [describe(**variant.base), describe(**variant.changed)]
    )
    assert message == (
        f'K-FAC setup differs across ranks: {variant.shown}; every rank '
        'must build the preconditioner from the same model with the same '
        'options'
    )


@pytest.mark.parametrize(
    ('name', 'shown'),
    [
        (
            'factor_update_steps',
            'factor_update_steps: 10 on ranks [0], a schedule on ranks [1]',
        ),
        (
            'inv_update_steps',
            'inv_update_steps: 100 on ranks [0], a schedule on ranks [1]',
        ),
    ],
)
def test_an_update_interval_is_compared(name: str, shown: str) -> None:
    schedule = {name: lambda step: 1}
    message = setup_difference(
        [describe(), describe(hyperparameters=schedule)]
    )
    assert message is not None
    assert message.startswith(f'K-FAC setup differs across ranks: {shown};')
    other = {name: lambda step: 2}  # schedules are not compared further
    assert (
        setup_difference(
            [
                describe(hyperparameters=schedule),
                describe(hyperparameters=other),
            ]
        )
        is None
    )


def _fields(kind: type, prefix: str = '') -> set[str]:
    found: set[str] = set()
    for field in dataclasses.fields(kind):
        default = field.default_factory  # an option group
        if default is not dataclasses.MISSING:
            found |= _fields(type(default()), f'{field.name}.')
        else:
            found.add(prefix + field.name)
    return found


def test_every_option_is_compared_or_declared_local() -> None:
    compared, resolved, local = (
        set(GLOBAL_OPTIONS),
        set(RESOLVED_OPTIONS),
        set(LOCAL_OPTIONS),
    )
    assert not (compared & resolved or compared & local or resolved & local)
    assert compared | resolved | local == _fields(KFACConfig)
    assert {variant.field for variant in VARIANTS} == compared | resolved


@pytest.mark.parametrize(
    'options',
    [
        {'loglevel': logging.INFO},
        {'statistics': StatisticsConfig(compile_arithmetic=True)},
        {'grad_worker_fraction': 'comm_opt'},  # resolved: 1.0
        {'compute_method': EigenConfig()},  # what 'eigen' means
        {'factor_dtype': torch.float32},  # what None resolves to here
        {'skip_layers': ['nothing']},
        {'module_options': {'0': {'kfac_approx': 'expand'}}},
    ],
)
def test_what_changes_no_collective_is_not_a_difference(
    options: dict[str, Any],
) -> None:
    base: dict[str, Any] = {}
    if 'compute_method' in options:
        base['compute_method'] = 'eigen'
    assert describe(**base) == describe(**options)


@pytest.mark.parametrize(
    ('strategy', 'fraction'),
    [('mem_opt', 0.25), ('hybrid_opt', 0.5), ('comm_opt', 1.0)],
)
def test_a_strategy_is_its_fraction(strategy: str, fraction: float) -> None:
    assert describe(world_size=4, grad_worker_fraction=strategy) == describe(
        world_size=4, grad_worker_fraction=fraction
    )


def test_a_methods_class_is_compared_with_its_fields() -> None:
    eigen, ekfac = (
        dict(describe(compute_method=method))["module '0' compute_method"]
        for method in (ComputeMethod.EIGEN, ComputeMethod.EKFAC)
    )
    assert eigen.startswith('EigenConfig(prediv_eigenvalues=True')
    assert ekfac.startswith('EKFACConfig(prediv_eigenvalues=True')


class _Opaque:
    """An object without a `repr` of its own."""


@dataclasses.dataclass(frozen=True)
class _Outside(CurvatureConfig):
    """A method defined outside the library, with an opaque option."""

    name = 'outside'
    table: object = dataclasses.field(default_factory=_Opaque)

    def make(self, layer: KFACBaseLayer) -> Curvature:
        return InverseConfig().make(layer)


def test_canonical_text() -> None:
    assert canonical(ComputeMethod.EIGEN) == "'eigen'"
    assert canonical((7,)) == '(7,)'
    assert canonical([(1, 2), 'a', None, 0.5]) == "[(1, 2), 'a', None, 0.5]"
    assert canonical(torch.float64) == 'torch.float64'
    assert canonical(len) == '<len>'
    assert canonical(_Opaque()) == '<_Opaque>'  # never an address
    assert canonical(_Outside()) == '_Outside(table=<_Opaque>)'
    # Two instances of an outside method describe alike on every rank.
    assert describe(compute_method=_Outside()) == describe(
        compute_method=_Outside()
    )


def test_difference_groups_ranks_and_follows_rank_0s_order() -> None:
    zero = [('a', '1'), ('b', '2'), ('c', '3')]
    one = [('a', '1'), ('c', '4'), ('b', '5')]  # c comes first here
    two = [('a', '1'), ('b', '2')]
    message = setup_difference([zero, one, two, zero])
    assert message is not None
    assert message.split(';')[0] == (
        'K-FAC setup differs across ranks: b: 2 on ranks [0, 2, 3], 5 on '
        'ranks [1]'
    )
    message = setup_difference([zero, two])
    assert message is not None
    assert message.split(';')[0] == (
        'K-FAC setup differs across ranks: c: 3 on ranks [0], (absent) on '
        'ranks [1]'
    )
    assert setup_difference([zero, list(zero), zero]) is None
    assert setup_difference([zero]) is None


def test_digest() -> None:
    description = describe()
    mine = digest(description)
    assert mine.dtype == torch.int64
    assert mine.shape == (4,)  # 32 bytes
    assert torch.equal(mine, digest(describe()))
    assert not torch.equal(mine, digest(describe(symmetry_aware=True)))


def test_one_process_pays_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    comm = TorchDistributedCommunicator()
    device = torch.device('cpu')
    assert gather_if_different(comm, describe(), device=device) is None
    assert not comm.collectives_started

    def fail(*args: object) -> Description:
        raise AssertionError('described without a process group')

    monkeypatch.setattr(preconditioner, 'describe_setup', fail)
    precon = KFACPreconditioner(_mlp())
    assert not precon.communicator.collectives_started
    assert not precon.communicator.bytes_communicated
