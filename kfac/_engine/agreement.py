"""The setup every data-parallel rank must share, described for comparison.

The collectives of a K-FAC step match across ranks only when every rank
built the same preconditioner. At construction,
[`KFACPreconditioner`][kfac.preconditioner.KFACPreconditioner] describes
its setup with `describe_setup` and compares it across ranks with
[`gather_if_different`][kfac.distributed.gather_if_different];
`setup_difference` names the first item that differs. The description
lists, as `(item, value)` strings in a fixed order:

1. the options of the whole preconditioner that change what is
   communicated, when, or where (`GLOBAL_OPTIONS`: the gradient worker
   fraction resolved against the world size, then the others as they
   are), and the factor and decomposition intervals (a schedule counts
   as `'a schedule'`);
2. the registered modules, by name;
3. per module: its type and helper, the global shapes of its weight and
   factors, how each of its parameters is laid out over ranks (FSDP2 and
   HSDP: placements and mesh shape), the dtypes of its factors and
   decompositions, its resolved per-module options with its method (the
   method's class and fields), and the modules sharing its weight.

Options set through patterns (`skip_layers`, `module_options`) and the
model-wide values of per-module options are compared through what they
resolve to (`RESOLVED_OPTIONS`); the `LOCAL_OPTIONS` change nothing
another rank sees and are not compared, nor are the hyperparameters
other than the intervals. Everything here is pure: no collective.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from collections.abc import Sequence

from kfac.config import KFACConfig
from kfac.distributed._sharding import layout
from kfac.enums import DistributedStrategy
from kfac.hyperparams import Hyperparameters
from kfac.layers.base import KFACBaseLayer
from kfac.layers.options import OPTION_NAMES
from kfac.layers.register import Registration

__all__ = [
    'GLOBAL_OPTIONS',
    'LOCAL_OPTIONS',
    'RESOLVED_OPTIONS',
    'canonical',
    'describe_setup',
    'setup_difference',
]

GLOBAL_OPTIONS = (
    'grad_worker_fraction',
    'colocate_factors',
    'assignment_strategy',
    'allreduce_bucket_cap_mb',
    'symmetry_aware',
    'accumulation_steps',
    'update_factors_in_hook',
    'statistics.loss_average',
    'statistics.accumulation_divisor',
    'statistics.position_sample_seed',
    'statistics.max_nonfinite_statistics',
    'statistics.max_decomposition_failures',
    'fisher.fisher_type',
    'fisher.mc_samples',
    'fisher.mc_seed',
    'sharding.shard_mode',
)
"""The [`KFACConfig`][kfac.config.KFACConfig] fields compared as they are
(dotted: a field of an option group)."""

RESOLVED_OPTIONS = (
    'compute_method',
    'compute_eigenvalue_outer_product',
    'factor_dtype',
    'inv_dtype',
    'skip_layers',
    'module_options',
    'statistics.batch_first',
    'statistics.kfac_approx',
    'statistics.max_factor_dim',
    'statistics.position_sample',
)
"""The fields compared through what they resolve to: the registered
modules, each module's options, method and dtypes."""

LOCAL_OPTIONS = ('loglevel', 'statistics.compile_arithmetic')
"""The fields not compared: they change nothing another rank sees (the
log level, how a rank computes its own running averages)."""

_ABSENT = '(absent)'


def canonical(value: object) -> str:
    """`value` as text that is equal on every rank for equal values.

    An enum member is its value's `repr`; a dataclass (a method's
    config) its class name and fields; a list or tuple its items; an
    object without a `repr` of its own (or a function), its type's name
    (never its address); anything else its `repr`.

    Examples:
        >>> from kfac.layers.curvature import InverseConfig
        >>> canonical(InverseConfig())
        "InverseConfig(damping_mode='absolute', factor_rank=None)"
        >>> canonical([(7, 7), None, print])
        '[(7, 7), None, <print>]'
    """
    if isinstance(value, enum.Enum):
        return repr(value.value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = ', '.join(
            f'{field.name}={canonical(getattr(value, field.name))}'
            for field in dataclasses.fields(value)
        )
        return f'{type(value).__qualname__}({fields})'
    if isinstance(value, list | tuple):
        items = ', '.join(canonical(item) for item in value)
        if isinstance(value, list):
            return f'[{items}]'
        return f'({items},)' if len(value) == 1 else f'({items})'
    if callable(value) or type(value).__repr__ is object.__repr__:
        name = getattr(value, '__qualname__', type(value).__qualname__)
        return f'<{name}>'
    return repr(value)


def _option(config: KFACConfig, dotted: str) -> object:
    value: object = config
    for part in dotted.split('.'):
        value = getattr(value, part)
    return value


def _fraction(value: object, world_size: int) -> float:
    """The fraction of ranks that precondition each layer: a strategy
    resolved against `world_size` (`'comm_opt'` is 1.0, `'mem_opt'`
    `1 / world_size`, `'hybrid_opt'` 0.5), a number as it is.
    """
    if value is DistributedStrategy.COMM_OPT:
        return 1.0
    if value is DistributedStrategy.MEM_OPT:
        return 1 / world_size
    if value is DistributedStrategy.HYBRID_OPT:
        return 0.5
    assert isinstance(value, float)  # normalised by KFACConfig
    return value


def _interval(value: object) -> str:
    return 'a schedule' if callable(value) else canonical(value)


def _global_items(
    config: KFACConfig, hyperparameters: Hyperparameters, world_size: int
) -> list[tuple[str, str]]:
    fraction = _fraction(config.grad_worker_fraction, world_size)
    items = [('grad_worker_fraction', canonical(fraction))]
    items += [
        (name, canonical(_option(config, name))) for name in GLOBAL_OPTIONS[1:]
    ]
    for name in ('factor_update_steps', 'inv_update_steps'):
        items.append((name, _interval(getattr(hyperparameters, name))))
    return items


def _module_items(
    config: KFACConfig,
    registration: Registration,
    name: str,
    layer: KFACBaseLayer,
) -> list[tuple[str, str]]:
    helper = layer.module
    options = registration.options[name]
    params = dict(zip(('weight', 'bias'), helper.parameters()))
    values = {
        'type': f'{type(helper.module).__name__} ({type(helper).__name__})',
        'weight shape': canonical(tuple(helper.weight.shape)),
        **{f'{f.name} shape': canonical(f.shape) for f in layer.factors},
        **{f'{role} sharding': layout(p) for role, p in params.items()},
        'factor_dtype': str(layer.factor_dtype),
        'inv_dtype': str(layer.inv_dtype),
        **{
            option: canonical(getattr(options, option))
            for option in OPTION_NAMES
            if option != 'compute_method'
        },
        'compute_method': canonical(config.method(options)),  # resolved
        'shares weight with': canonical(registration.aliases.get(name, [])),
    }
    return [(f'module {name!r} {key}', value) for key, value in values.items()]


def describe_setup(
    config: KFACConfig,
    hyperparameters: Hyperparameters,
    registration: Registration,
    layers: Mapping[str, KFACBaseLayer],
    world_size: int,
) -> list[tuple[str, str]]:
    """This rank's setup, as `(item, value)` strings in a fixed order
    (see the module docstring for what is described).

    Args:
        config: the preconditioner's options.
        hyperparameters: its hyperparameters (the factor and
            decomposition intervals are described).
        registration: what registration decided.
        layers: the registered layers, by name.
        world_size: the number of data-parallel ranks.
    """
    items = _global_items(config, hyperparameters, world_size)
    items.append(('registered modules', canonical(list(layers))))
    for name, layer in layers.items():
        items += _module_items(config, registration, name, layer)
    return items


def _by_value(values: Sequence[str]) -> str:
    ranks: dict[str, list[int]] = {}
    for rank, value in enumerate(values):
        ranks.setdefault(value, []).append(rank)
    return ', '.join(
        f'{value} on ranks {found}' for value, found in ranks.items()
    )


def setup_difference(
    descriptions: Sequence[Sequence[tuple[str, str]]],
) -> str | None:
    """The error message naming the first item that is not the same in
    every rank's description (None: they are all equal).

    Items are taken in the order they first appear, rank 0's first; an
    item a rank does not describe is `'(absent)'` there. The message
    names the item, each value and the ranks holding it.

    Examples:
        >>> message = setup_difference([[('a', '1')], [('a', '2')]])
        >>> print(message.split(';')[0])
        K-FAC setup differs across ranks: a: 1 on ranks [0], 2 on ranks [1]
        >>> setup_difference([[('a', '1')], [('a', '1')]]) is None
        True
    """
    tables = [dict(description) for description in descriptions]
    keys = dict.fromkeys(key for d in descriptions for key, _ in d)
    for key in keys:
        values = [table.get(key, _ABSENT) for table in tables]
        if len(set(values)) > 1:
            return (
                f'K-FAC setup differs across ranks: {key}: '
                f'{_by_value(values)}; every rank must build the '
                'preconditioner from the same model with the same options'
            )
    return None
