"""The validated, non-schedulable options of a K-FAC preconditioner.

[`KFACConfig`][kfac.config.KFACConfig] holds those of
[`KFACPreconditioner`][kfac.preconditioner.KFACPreconditioner] (how
layers are registered and placed); [`EngineOptions`][kfac.config.EngineOptions]
those of the engine,
[`BaseKFACPreconditioner`][kfac.base_preconditioner.BaseKFACPreconditioner]
(how a step runs).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from kfac.enums import AssignmentStrategy
from kfac.enums import ComputeMethod
from kfac.enums import DistributedStrategy
from kfac.enums import parse_enum
from kfac.layers.attention import convert_attention
from kfac.layers.base import KFACBaseLayer
from kfac.layers.curvature.base import CurvatureConfig
from kfac.layers.curvature.eigen import BASIS_REFRESHES
from kfac.layers.curvature.eigen import EigenConfig
from kfac.layers.curvature.ekfac import EKFACConfig
from kfac.layers.curvature.inverse import InverseConfig
from kfac.layers.factory import make_layer
from kfac.layers.helper import ModuleHelper
from kfac.layers.options import DEFAULT_MAX_FACTOR_DIM
from kfac.layers.options import KFAC_APPROXIMATIONS
from kfac.layers.options import ModuleOptions
from kfac.layers.options import check_module_options
from kfac.layers.register import Registration
from kfac.layers.register import compile_patterns
from kfac.layers.register import register_model
from kfac.layers.sampling import SampleKey
from kfac.layers.sampling import check_position_sample
from kfac.layers.sampling import check_seed
from kfac.layers.statistics import check_loss_average
from kfac.math.fisher import FISHER_TYPES
from kfac.math.lowrank import DAMPING_MODES
from kfac.placement import parse_grad_worker_fraction
from kfac.validation import check_bool
from kfac.validation import check_choice
from kfac.validation import check_dtype
from kfac.validation import validate_float
from kfac.validation import validate_int

__all__ = [
    'SHARD_MODES',
    'EngineOptions',
    'FractionLike',
    'KFACConfig',
]

SHARD_MODES = ('lossless', 'local')
"""How gradients of FSDP2-sharded parameters are preconditioned."""


FractionLike = float | DistributedStrategy | str
"""A gradient worker fraction in (0, 1], a
[`DistributedStrategy`][kfac.enums.DistributedStrategy], or its name."""


@dataclasses.dataclass(frozen=True)
class KFACConfig:
    """The non-schedulable options of a K-FAC preconditioner, validated.

    See [`KFACPreconditioner`][kfac.preconditioner.KFACPreconditioner] for
    each field's meaning. Fields take what the preconditioner's keyword
    arguments take and hold it normalised once constructed: enum names
    become [`ComputeMethod`][kfac.enums.ComputeMethod] and
    [`AssignmentStrategy`][kfac.enums.AssignmentStrategy] members, a
    numeric `grad_worker_fraction` a `float` (a strategy name a
    [`DistributedStrategy`][kfac.enums.DistributedStrategy]),
    `allreduce_bucket_cap_mb` a `float` and `skip_layers` a tuple of
    patterns.

    Raises:
        TypeError: a field has the wrong type.
        ValueError: a field has a disallowed value, EIGEN's
            `compute_eigenvalue_outer_product` is asked for without
            `colocate_factors`, `basis_refresh='qr'` with INVERSE (which
            has no eigenbasis), or `damping_mode='relative'` with EKFAC.

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
    loss_average: str | None = 'batch'
    batch_first: bool = True
    kfac_approx: str = 'expand'
    module_options: Mapping[str, Mapping[str, Any]] | None = None
    max_factor_dim: int | None = DEFAULT_MAX_FACTOR_DIM
    shard_mode: str = 'lossless'
    basis_refresh: str = 'eigh'
    compile_arithmetic: bool = False
    fisher_type: str = 'empirical'
    mc_samples: int = 1
    mc_seed: int = 0
    factor_rank: int | None = None
    damping_mode: str = 'absolute'
    position_sample: int | float | None = None
    position_sample_seed: int = 0

    def __post_init__(self) -> None:
        checked = {
            'accumulation_steps': validate_int(
                'accumulation_steps',
                self.accumulation_steps,
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
            'loss_average': check_loss_average(self.loss_average),
            'kfac_approx': check_choice(
                'kfac_approx', self.kfac_approx, KFAC_APPROXIMATIONS
            ),
            'max_factor_dim': None
            if self.max_factor_dim is None
            else validate_int('max_factor_dim', self.max_factor_dim),
            'shard_mode': check_choice(
                'shard_mode', self.shard_mode, SHARD_MODES
            ),
            'basis_refresh': check_choice(
                'basis_refresh', self.basis_refresh, BASIS_REFRESHES
            ),
            'fisher_type': check_choice(
                'fisher_type', self.fisher_type, FISHER_TYPES
            ),
            'mc_samples': validate_int('mc_samples', self.mc_samples),
            'mc_seed': validate_int('mc_seed', self.mc_seed, minimum=0),
            'factor_rank': None
            if self.factor_rank is None
            else validate_int('factor_rank', self.factor_rank),
            'damping_mode': check_choice(
                'damping_mode', self.damping_mode, DAMPING_MODES
            ),
            'position_sample': check_position_sample(self.position_sample),
            'position_sample_seed': check_seed(self.position_sample_seed),
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
            'batch_first',
            'compile_arithmetic',
        ):
            checked[name] = check_bool(name, getattr(self, name))
        for name, value in checked.items():
            object.__setattr__(self, name, value)
        _check_method_options(self)
        method = self.curvature()
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
            self.compute_method is ComputeMethod.EKFAC
            and self.damping_mode != 'absolute'
        ):
            raise ValueError(
                f'damping_mode={self.damping_mode!r} needs '
                "compute_method='eigen' or 'inverse'; EKFAC adds λ to its "
                "scaling as given (leave damping_mode='absolute')",
            )
        if (
            self.compute_method is ComputeMethod.INVERSE
            and self.basis_refresh != 'eigh'
        ):
            raise ValueError(
                f'basis_refresh={self.basis_refresh!r} refreshes eigenbases: '
                "it needs compute_method='eigen' or 'ekfac'; INVERSE has "
                "none (leave basis_refresh='eigh')",
            )
        _check_mc(self)

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
            defaults=ModuleOptions(
                batch_first=self.batch_first,
                kfac_approx=self.kfac_approx,
                max_factor_dim=self.max_factor_dim,
                factor_rank=self.factor_rank,
                position_sample=self.position_sample,
            ),
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
            shard_mode=self.shard_mode,
            compile_arithmetic=self.compile_arithmetic,
            position_sample_seed=self.position_sample_seed,
        )

    def curvature(self) -> CurvatureConfig:
        """The method with its options: `compute_method` itself when it is
        a [`CurvatureConfig`][kfac.layers.curvature.base.CurvatureConfig],
        else the named method's config from `compute_eigenvalue_outer_product`,
        `basis_refresh` and `damping_mode`.
        """
        method = self.compute_method
        if isinstance(method, CurvatureConfig):
            return method
        prediv = self.compute_eigenvalue_outer_product
        if method is ComputeMethod.EIGEN:
            return EigenConfig(
                prediv_eigenvalues=prediv,
                basis_refresh=self.basis_refresh,
                damping_mode=self.damping_mode,
            )
        if method is ComputeMethod.EKFAC:
            return EKFACConfig(
                prediv_eigenvalues=prediv, basis_refresh=self.basis_refresh
            )
        return InverseConfig(damping_mode=self.damping_mode)

    def make_layer(
        self, name: str, helper: ModuleHelper, options: ModuleOptions
    ) -> KFACBaseLayer:
        """The layer of `compute_method` for module `name` (see
        [`make_layer`][kfac.layers.factory.make_layer]).
        """
        return make_layer(
            name,
            helper,
            options,
            method=self.curvature(),
            factor_dtype=self.factor_dtype,
            inv_dtype=self.inv_dtype,
            loss_average=self.loss_average,
        )


def _parse_method(method: object) -> ComputeMethod | CurvatureConfig:
    """`compute_method` as a [`ComputeMethod`][kfac.enums.ComputeMethod]
    (from a name) or the
    [`CurvatureConfig`][kfac.layers.curvature.base.CurvatureConfig] given.
    """
    if isinstance(method, CurvatureConfig):
        return method
    return parse_enum(ComputeMethod, method, 'compute_method')


def _check_method_options(config: KFACConfig) -> None:
    """Raise `ValueError` for a method's flat option set beside a method
    object (whose own fields hold its options).
    """
    if not isinstance(config.compute_method, CurvatureConfig):
        return
    for name, default in (
        ('basis_refresh', 'eigh'),
        ('damping_mode', 'absolute'),
    ):
        value = getattr(config, name)
        if value != default:
            raise ValueError(
                f'{name}={value!r} beside compute_method='
                f'{config.compute_method!r}: give the method its options '
                f'in its config object, not as keywords',
            )


def _check_mc(config: KFACConfig) -> None:
    """Raise `ValueError` for Monte Carlo options no code path takes."""
    if config.mc_seed >= 1 << 63:
        raise ValueError(f'mc_seed must be < 2**63; got {config.mc_seed}')
    if (
        config.fisher_type == 'mc'
        and config.mc_samples > 1
        and isinstance(config.curvature(), EKFACConfig)
    ):
        raise ValueError(
            f'mc_samples={config.mc_samples} is not supported with '
            "compute_method='ekfac' (its per-example scaling needs one "
            'gradient per example); use mc_samples=1',
        )


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
        shard_mode: for parameters sharded by FSDP2 (DTensors):
            `'lossless'` gathers each layer's whole gradient and equals one
            process; `'local'` preconditions each rank's rows alone, with
            the factor on the sharded side made block-diagonal by shard (no
            gradient communication; an approximation).
        compile_arithmetic: fold each factor's batch into its running
            average with one kernel compiled by `torch.compile` (see
            [`KroneckerFactor.update`][kfac.layers.factor.KroneckerFactor.update]).
        position_sample_seed: the seed of the positions drawn for
            `position_sample` (see
            [`kfac.layers.sampling`][kfac.layers.sampling]).

    Raises:
        TypeError: a field has the wrong type.
        ValueError: a field has a disallowed value.
    """

    accumulation_steps: int = 1
    update_factors_in_hook: bool = True
    bucketed: bool = True
    shard_mode: str = 'lossless'
    compile_arithmetic: bool = False
    position_sample_seed: int = 0

    def __post_init__(self) -> None:
        validate_int('accumulation_steps', self.accumulation_steps)
        check_bool('update_factors_in_hook', self.update_factors_in_hook)
        check_bool('bucketed', self.bucketed)
        check_choice('shard_mode', self.shard_mode, SHARD_MODES)
        check_bool('compile_arithmetic', self.compile_arithmetic)
        check_seed(self.position_sample_seed)

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
