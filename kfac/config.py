"""The validated, non-schedulable options of a K-FAC preconditioner.

[`KFACConfig`][kfac.config.KFACConfig] holds those of
[`KFACPreconditioner`][kfac.preconditioner.KFACPreconditioner]: the
original KAISA code's options flat, and those added since grouped by
subject in small frozen dataclasses given where they apply:

* the method's own options with the method (`compute_method`: a name, or
  a [`CurvatureConfig`][kfac.layers.curvature.base.CurvatureConfig] such
  as `EigenConfig(basis_refresh='qr', factor_rank=32)`);
* the statistics' ([`StatisticsConfig`][kfac.config.StatisticsConfig]:
  how the loss averages, the input layout, expand or reduce, factor-size
  limit, sampled positions, compiled running averages);
* the Fisher's ([`FisherConfig`][kfac.config.FisherConfig]: empirical or
  Monte Carlo, samples, seed);
* the sharding's ([`ShardingConfig`][kfac.config.ShardingConfig]: FSDP2's
  lossless or local mode).

[`EngineOptions`][kfac.config.EngineOptions] are those the engine,
[`BaseKFACPreconditioner`][kfac.base_preconditioner.BaseKFACPreconditioner],
needs for a step, derived from a `KFACConfig`.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from kfac.enums import AccumulationDivisor
from kfac.enums import AssignmentStrategy
from kfac.enums import ComputeMethod
from kfac.enums import DistributedStrategy
from kfac.enums import FisherType
from kfac.enums import KFACApprox
from kfac.enums import LossAverage
from kfac.enums import ShardMode
from kfac.enums import parse_enum
from kfac.layers.attention import convert_attention
from kfac.layers.base import KFACBaseLayer
from kfac.layers.curvature.base import CurvatureConfig
from kfac.layers.curvature.eigen import EigenConfig
from kfac.layers.curvature.eigen_adam import EigenAdamConfig
from kfac.layers.curvature.ekfac import EKFACConfig
from kfac.layers.curvature.inverse import InverseConfig
from kfac.layers.curvature.one_sided import OneSidedConfig
from kfac.layers.factory import make_layer
from kfac.layers.helper import ModuleHelper
from kfac.layers.options import DEFAULT_MAX_FACTOR_DIM
from kfac.layers.options import ModuleOptions
from kfac.layers.options import check_module_options
from kfac.layers.register import Registration
from kfac.layers.register import compile_patterns
from kfac.layers.register import register_model
from kfac.layers.sampling import SampleKey
from kfac.layers.sampling import check_position_sample
from kfac.layers.sampling import check_seed
from kfac.layers.statistics import check_loss_average
from kfac.placement import parse_grad_worker_fraction
from kfac.validation import check_bool
from kfac.validation import check_dtype
from kfac.validation import check_instance
from kfac.validation import validate_float
from kfac.validation import validate_int

__all__ = [
    'EngineOptions',
    'FisherConfig',
    'FractionLike',
    'KFACConfig',
    'ShardingConfig',
    'StatisticsConfig',
]


FractionLike = float | DistributedStrategy | str
"""A gradient worker fraction in (0, 1] (0, the original KAISA code's
spelling of `1 / world_size`, is `MEM_OPT`), a
[`DistributedStrategy`][kfac.enums.DistributedStrategy], or its name."""


def check_limit(name: str, value: object) -> int | None:
    """A limit on failures in a row: None (no limit) or an `int >= 0`.

    Raises:
        TypeError: `value` is neither None nor an int (a bool is not).
        ValueError: `value` is negative.

    Examples:
        >>> check_limit('max_decomposition_failures', 3)
        3
    """
    if value is None:
        return None
    return validate_int(name, value, minimum=0)


def _divisor(value: object) -> AccumulationDivisor | None:
    """`accumulation_divisor` as an
    [`AccumulationDivisor`][kfac.enums.AccumulationDivisor], or None.
    """
    if value is None:
        return None
    return parse_enum(AccumulationDivisor, value, 'accumulation_divisor')


def _set(config: object, name: str, value: object) -> None:
    """Store a normalised field of a frozen dataclass."""
    object.__setattr__(config, name, value)


@dataclasses.dataclass(frozen=True)
class StatisticsConfig:
    """How the factors `A` and `G` are formed from the hook data.

    Attributes:
        loss_average: how the loss averages its terms: `'batch'` (a mean
            over the `N` examples, PyTorch's default reduction),
            `'batch+sequence'` (a mean over examples and positions, as
            language-model losses are) or None (a summed loss); see
            [`kfac.math`][kfac.math] for the factors of each.
        accumulation_divisor: what the trainer divided each backward
            pass's loss by on a *short* step, one after fewer backward
            passes than `accumulation_steps` (the last batches of an epoch
            the accumulation does not divide):
            `'accumulation_steps'` (Lightning, and a loop dividing every
            loss by `accumulation_steps`) or `'passes'` (the Hugging Face
            `Trainer`: the passes the step had, or their item count). `G`
            is then formed from the unscaled gradients of the passes seen.
            None (the default): a short step raises `ValueError`, since
            the divisor cannot be read from the gradients. Not needed
            with a summed loss or the Monte Carlo Fisher.
        batch_first: the model-wide layout of module inputs: `(N, ...)`,
            or with False `(T, N, ...)` (sequence-first); modules inside an
            `nn.MultiheadAttention` or `nn.Transformer*` follow its own
            `batch_first` (see [`kfac.layers.options`][kfac.layers.options]).
        kfac_approx: how weight-sharing positions enter the factors:
            `'expand'` or `'reduce'` (Eschenhagen et al., NeurIPS 2023; `T`
            times cheaper for `T` positions).
        max_factor_dim: the largest side of a dense factor kept whole
            (default 8192: every factor of ResNet-50 and BERT-Large); a
            layer with a longer one is preconditioned in tiles with
            block-diagonal factors of at most this side (see
            [`kfac.layers.blocks`][kfac.layers.blocks]); None: no limit.
        position_sample: form `A` and `G` from a sample of each example's
            weight-sharing positions: an int (positions per example) or a
            float in (0, 1] (a fraction of them); None: all. Unbiased; see
            [`kfac.layers.sampling`][kfac.layers.sampling].
        position_sample_seed: the seed of those draws (saved in the
            state).
        compile_arithmetic: fold each factor's batch into its running
            average with one kernel compiled by `torch.compile` instead of
            several eager ones (equal up to rounding; the first factor
            update compiles it, a few seconds). Off by default: on CPUs it
            is slower below factors of about 1000 rows (see the compile
            guide).
        max_nonfinite_statistics: how many factor updates in a row may
            be discarded for non-finite statistics (NaN/Inf on some rank)
            before `step()` raises
            [`FailureLimitError`][kfac.tracing.FailureLimitError] on every
            rank; None (the default): no limit, each is discarded and
            counted.
        max_decomposition_failures: how many decompositions in a row of
            one factor may fail in every attempt (float64, jitter) before
            the next factor update raises
            [`FailureLimitError`][kfac.tracing.FailureLimitError] on every
            rank; None (the default): no limit, the last good
            decomposition is kept.

    `batch_first`, `kfac_approx`, `max_factor_dim` and `position_sample`
    are the model-wide values of per-module options (`module_options`).

    Raises:
        TypeError, ValueError: a field of the wrong type or value.

    Examples:
        >>> StatisticsConfig(kfac_approx='Reduce').kfac_approx
        <KFACApprox.REDUCE: 'reduce'>
    """

    loss_average: LossAverage | str | None = LossAverage.BATCH
    accumulation_divisor: AccumulationDivisor | str | None = None
    batch_first: bool = True
    kfac_approx: KFACApprox | str = KFACApprox.EXPAND
    max_factor_dim: int | None = DEFAULT_MAX_FACTOR_DIM
    position_sample: int | float | None = None
    position_sample_seed: int = 0
    compile_arithmetic: bool = False
    max_nonfinite_statistics: int | None = None
    max_decomposition_failures: int | None = None

    def __post_init__(self) -> None:
        _set(self, 'loss_average', check_loss_average(self.loss_average))
        _set(self, 'accumulation_divisor', _divisor(self.accumulation_divisor))
        for limit in (
            'max_nonfinite_statistics',
            'max_decomposition_failures',
        ):
            _set(self, limit, check_limit(limit, getattr(self, limit)))
        approx = parse_enum(KFACApprox, self.kfac_approx, 'kfac_approx')
        _set(self, 'kfac_approx', approx)
        if self.max_factor_dim is not None:
            _set(
                self,
                'max_factor_dim',
                validate_int('max_factor_dim', self.max_factor_dim),
            )
        _set(
            self,
            'position_sample',
            check_position_sample(self.position_sample),
        )
        _set(
            self,
            'position_sample_seed',
            check_seed(self.position_sample_seed),
        )
        for name in ('batch_first', 'compile_arithmetic'):
            _set(self, name, check_bool(name, getattr(self, name)))

    def module_defaults(self) -> ModuleOptions:
        """The model-wide values of the per-module options."""
        return ModuleOptions(
            batch_first=self.batch_first,
            kfac_approx=self.kfac_approx,
            max_factor_dim=self.max_factor_dim,
            position_sample=self.position_sample,
        )


@dataclasses.dataclass(frozen=True)
class FisherConfig:
    """Where `G`'s output gradients come from.

    Attributes:
        fisher_type: `'empirical'` (the backward pass of the training
            loss) or `'mc'` (the Monte Carlo Fisher of Martens & Grosse: a
            backward pass of the loss at targets sampled from the model,
            run by
            [`sample_fisher`][kfac.preconditioner.KFACPreconditioner.sample_fisher]
            on factor-update steps; see
            [`kfac.math.fisher`][kfac.math.fisher]).
        mc_samples: `'mc'`: sampled backward passes per forward pass.
        mc_seed: `'mc'`: the seed of the sampling (saved in the state).

    Raises:
        TypeError, ValueError: a field of the wrong type or value.
    """

    fisher_type: FisherType | str = FisherType.EMPIRICAL
    mc_samples: int = 1
    mc_seed: int = 0

    def __post_init__(self) -> None:
        kind = parse_enum(FisherType, self.fisher_type, 'fisher_type')
        _set(self, 'fisher_type', kind)
        _set(self, 'mc_samples', validate_int('mc_samples', self.mc_samples))
        seed = validate_int('mc_seed', self.mc_seed, minimum=0)
        if seed >= 1 << 63:
            raise ValueError(f'mc_seed must be < 2**63; got {seed}')
        _set(self, 'mc_seed', seed)


@dataclasses.dataclass(frozen=True)
class ShardingConfig:
    """How a model sharded with FSDP2 `fully_shard` is preconditioned.

    Attributes:
        shard_mode: `'lossless'` (each layer's whole gradient is gathered,
            preconditioned and returned to the shards; equal to one
            process) or `'local'` (each rank preconditions its own rows
            with the factor on the sharded side made block-diagonal by
            shard; no gradient communication; needs
            `grad_worker_fraction='comm_opt'`; an approximation). See the
            distributed guide.

    Raises:
        TypeError, ValueError: a field of the wrong type or value.
    """

    shard_mode: ShardMode | str = ShardMode.LOSSLESS

    def __post_init__(self) -> None:
        mode = parse_enum(ShardMode, self.shard_mode, 'shard_mode')
        _set(self, 'shard_mode', mode)


@dataclasses.dataclass(frozen=True)
class KFACConfig:
    """The non-schedulable options of a K-FAC preconditioner, validated.

    See [`KFACPreconditioner`][kfac.preconditioner.KFACPreconditioner] for
    each field's meaning (the original's keywords, `module_options`, and
    the groups [`StatisticsConfig`][kfac.config.StatisticsConfig],
    [`FisherConfig`][kfac.config.FisherConfig] and
    [`ShardingConfig`][kfac.config.ShardingConfig]). Fields take what the
    preconditioner's keyword arguments take and hold it normalised once
    constructed: names become enum members, a numeric
    `grad_worker_fraction` a `float` (a strategy name a
    [`DistributedStrategy`][kfac.enums.DistributedStrategy]),
    `allreduce_bucket_cap_mb` a `float` and `skip_layers` a tuple of
    patterns.

    Raises:
        TypeError: a field has the wrong type.
        ValueError: a field has a disallowed value, EIGEN's
            `compute_eigenvalue_outer_product` is asked for without
            `colocate_factors`, or Monte Carlo options no method takes.

    Examples:
        >>> KFACConfig(compute_method='Inverse').compute_method
        <ComputeMethod.INVERSE: 'inverse'>
    """

    accumulation_steps: int = 1
    allreduce_bucket_cap_mb: float = 25.0
    assignment_strategy: AssignmentStrategy | str = AssignmentStrategy.COMPUTE
    colocate_factors: bool = True
    compute_method: ComputeMethod | CurvatureConfig | str = (
        ComputeMethod.INVERSE
    )
    compute_eigenvalue_outer_product: bool = True
    grad_worker_fraction: FractionLike = DistributedStrategy.COMM_OPT
    symmetry_aware: bool = False
    factor_dtype: torch.dtype | None = None
    inv_dtype: torch.dtype | None = None
    skip_layers: str | Iterable[str] | None = ()
    update_factors_in_hook: bool = True
    loglevel: int = logging.DEBUG
    module_options: Mapping[str, Mapping[str, Any]] | None = None
    statistics: StatisticsConfig = dataclasses.field(
        default_factory=StatisticsConfig
    )
    fisher: FisherConfig = dataclasses.field(default_factory=FisherConfig)
    sharding: ShardingConfig = dataclasses.field(
        default_factory=ShardingConfig
    )

    def __post_init__(self) -> None:
        for name, value in self._checked().items():
            _set(self, name, value)
        method = self.curvature()
        if (
            isinstance(self.compute_method, CurvatureConfig)
            and not self.compute_eigenvalue_outer_product
        ):
            raise ValueError(
                'compute_eigenvalue_outer_product=False beside compute_method='
                f'{self.compute_method!r}: give the method its '
                'prediv_eigenvalues in its config object',
            )
        if (
            isinstance(method, EigenConfig)
            and method.prediv_eigenvalues
            and not self.colocate_factors
        ):
            raise ValueError(
                'compute_eigenvalue_outer_product=True needs '
                'colocate_factors=True (both eigendecompositions on one rank)',
            )
        if (
            self.fisher.fisher_type == 'mc'
            and self.fisher.mc_samples > 1
            and isinstance(method, EKFACConfig)
        ):
            raise ValueError(
                f'mc_samples={self.fisher.mc_samples} is not supported with '
                "compute_method='ekfac' (its per-example scaling needs one "
                'gradient per example); use mc_samples=1',
            )
        if self.fisher.fisher_type == 'mc' and _source(method) == 'gradient':
            raise ValueError(
                f"fisher_type='mc' beside compute_method={method!r}: the "
                "gradient's own factors (source='gradient') use no output "
                "gradients; sample the Fisher with source='kfac'",
            )

    def _checked(self) -> dict[str, object]:
        """Every field, validated and normalised."""
        checked: dict[str, object] = {
            'accumulation_steps': validate_int(
                'accumulation_steps', self.accumulation_steps
            ),
            'allreduce_bucket_cap_mb': validate_float(
                'allreduce_bucket_cap_mb',
                self.allreduce_bucket_cap_mb,
                low=0.0,
                low_open=False,
            ),
            'assignment_strategy': parse_enum(
                AssignmentStrategy,
                self.assignment_strategy,
                'assignment_strategy',
            ),
            'compute_method': _parse_method(self.compute_method),
            'grad_worker_fraction': parse_grad_worker_fraction(
                self.grad_worker_fraction
            ),
            'factor_dtype': check_dtype('factor_dtype', self.factor_dtype),
            'inv_dtype': check_dtype('inv_dtype', self.inv_dtype),
            'skip_layers': tuple(compile_patterns(self.skip_layers)),
            'loglevel': validate_int('loglevel', self.loglevel, minimum=0),
            'module_options': {
                pattern: dict(options)
                for pattern, options in check_module_options(
                    self.module_options
                )
            },
        }
        for name in (
            'colocate_factors',
            'compute_eigenvalue_outer_product',
            'symmetry_aware',
            'update_factors_in_hook',
        ):
            checked[name] = check_bool(name, getattr(self, name))
        for name, kind in (
            ('statistics', StatisticsConfig),
            ('fisher', FisherConfig),
            ('sharding', ShardingConfig),
        ):
            check_instance(
                name, getattr(self, name), kind, f'a kfac.{kind.__name__}'
            )
        return checked

    def register(
        self, model: nn.Module, sample_key: SampleKey | None = None
    ) -> Registration:
        """Register the modules of `model` (unwrapped) under these options;
        `sample_key` keys the draws of `position_sample`.

        Raises:
            ValueError: no module can be preconditioned.
        """
        convert_attention(model)
        registration = register_model(
            model,
            skip_layers=self.skip_layers,
            defaults=self.statistics.module_defaults(),
            module_options=self.module_options,
            sample_key=sample_key,
        )
        if not registration.helpers:
            raise ValueError(
                'model has no module K-FAC can precondition: it needs an '
                'nn.Linear, a convolution, an nn.Embedding or an attention '
                'module whose weight requires grad and that skip_layers '
                'does not exclude (see describe() for the reasons)',
            )
        return registration

    def engine_options(self) -> EngineOptions:
        """The options of the engine's step these settings imply."""
        return EngineOptions(
            accumulation_steps=self.accumulation_steps,
            update_factors_in_hook=self.update_factors_in_hook,
            bucketed=self.allreduce_bucket_cap_mb > 0,
            shard_mode=self.sharding.shard_mode,
            compile_arithmetic=self.statistics.compile_arithmetic,
            position_sample_seed=self.statistics.position_sample_seed,
            max_nonfinite_statistics=self.statistics.max_nonfinite_statistics,
            max_decomposition_failures=(
                self.statistics.max_decomposition_failures
            ),
            accumulation_divisor=self.statistics.accumulation_divisor,
        )

    def curvature(self) -> CurvatureConfig:
        """The method with its options: `compute_method` itself when it is
        a [`CurvatureConfig`][kfac.layers.curvature.base.CurvatureConfig],
        else the named method's config, with
        `compute_eigenvalue_outer_product` (EIGEN, EKFAC).
        """
        method = self.compute_method
        if isinstance(method, CurvatureConfig):
            return method
        prediv = self.compute_eigenvalue_outer_product
        if method is ComputeMethod.EIGEN:
            return EigenConfig(prediv_eigenvalues=prediv)
        if method is ComputeMethod.EKFAC:
            return EKFACConfig(prediv_eigenvalues=prediv)
        if method is ComputeMethod.EIGEN_ADAM:
            return EigenAdamConfig()
        if method is ComputeMethod.ONE_SIDED:
            return OneSidedConfig()
        return InverseConfig()

    def method(self, options: ModuleOptions) -> CurvatureConfig:
        """The method of a module with resolved `options`: its own
        `compute_method` (from `module_options`) or the model-wide one.
        """
        return options.compute_method or self.curvature()

    def make_layer(
        self, name: str, helper: ModuleHelper, options: ModuleOptions
    ) -> KFACBaseLayer:
        """The layer of module `name`: its own `compute_method` (from
        `module_options`) or the model-wide one (see
        [`make_layer`][kfac.layers.factory.make_layer]).
        """
        return make_layer(
            name,
            helper,
            method=self.method(options),
            factor_dtype=self.factor_dtype,
            inv_dtype=self.inv_dtype,
            loss_average=self.statistics.loss_average,
        )


def _source(method: CurvatureConfig) -> object:
    """The method's factor source (`source`), None without one."""
    return getattr(method, 'source', None)


def _parse_method(method: object) -> ComputeMethod | CurvatureConfig:
    """`compute_method` as a [`ComputeMethod`][kfac.enums.ComputeMethod]
    (from a name) or the
    [`CurvatureConfig`][kfac.layers.curvature.base.CurvatureConfig] given.
    """
    if isinstance(method, CurvatureConfig):
        return method
    if not isinstance(method, str):
        raise TypeError(
            'compute_method must be a ComputeMethod, one of the strings '
            "'eigen', 'inverse', 'ekfac', 'eigen_adam', 'one_sided', or a "
            'CurvatureConfig (such as '
            f'kfac.EigenConfig(...)); got {method!r} of type '
            f'{type(method).__name__}',
        )
    return parse_enum(ComputeMethod, method, 'compute_method')


@dataclasses.dataclass(frozen=True)
class EngineOptions:
    """How the engine runs a step, validated.

    Attributes:
        accumulation_steps: micro-batches (forward/backward passes) per
            `step()`; divide each micro-batch's mean loss by it, as for
            ordinary gradient accumulation.
        update_factors_in_hook: compute factor statistics inside the hooks
            (and start their allreduce after the last micro-batch) instead
            of keeping activations until `step()`.
        bucketed: allreduce factors in buckets.
        shard_mode: for parameters sharded by FSDP2 (DTensors), see
            [`ShardingConfig`][kfac.config.ShardingConfig].
        compile_arithmetic: fold each factor's batch into its running
            average with one kernel compiled by `torch.compile` (see
            [`KroneckerFactor.update`][kfac.layers.statistics.KroneckerFactor.update]).
        position_sample_seed: the seed of the positions drawn for
            `position_sample` (see
            [`kfac.layers.sampling`][kfac.layers.sampling]).
        max_nonfinite_statistics, max_decomposition_failures: the limits
            on failures in a row (see
            [`StatisticsConfig`][kfac.config.StatisticsConfig]).
        accumulation_divisor: what a short step's losses were divided by
            (see [`StatisticsConfig`][kfac.config.StatisticsConfig]).

    Raises:
        TypeError: a field has the wrong type.
        ValueError: a field has a disallowed value.
    """

    accumulation_steps: int = 1
    update_factors_in_hook: bool = True
    bucketed: bool = True
    shard_mode: ShardMode | str = ShardMode.LOSSLESS
    compile_arithmetic: bool = False
    position_sample_seed: int = 0
    max_nonfinite_statistics: int | None = None
    max_decomposition_failures: int | None = None
    accumulation_divisor: AccumulationDivisor | str | None = None

    def __post_init__(self) -> None:
        validate_int('accumulation_steps', self.accumulation_steps)
        _set(self, 'accumulation_divisor', _divisor(self.accumulation_divisor))
        check_bool('update_factors_in_hook', self.update_factors_in_hook)
        check_bool('bucketed', self.bucketed)
        _set(
            self,
            'shard_mode',
            parse_enum(ShardMode, self.shard_mode, 'shard_mode'),
        )
        check_bool('compile_arithmetic', self.compile_arithmetic)
        check_seed(self.position_sample_seed)
        for limit in (
            'max_nonfinite_statistics',
            'max_decomposition_failures',
        ):
            check_limit(limit, getattr(self, limit))

    def saved(self) -> dict[str, str | int]:
        """The options a `state_dict()` keeps: `position_sample_seed`."""
        return {'position_sample_seed': self.position_sample_seed}

    def restored(self, saved: Mapping[str, str | int]) -> EngineOptions:
        """These options with the saved ones of a (parsed) state; a state
        without `position_sample_seed` (none before format 4) keeps this
        one.
        """
        return dataclasses.replace(
            self,
            position_sample_seed=int(
                saved.get('position_sample_seed', self.position_sample_seed)
            ),
        )
