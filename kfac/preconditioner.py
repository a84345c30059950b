"""The full KAISA K-FAC preconditioner, built from a model."""

from __future__ import annotations

import copy
import inspect
import logging
from collections.abc import Callable
from collections.abc import Iterable
from collections.abc import Mapping
from typing import Any
from typing import Literal

import torch
from torch import nn

from kfac._engine.agreement import describe_setup
from kfac._engine.agreement import setup_difference
from kfac._engine.fisher import FisherSampler
from kfac._engine.fsdp import check_model
from kfac._engine.report import describe_registration
from kfac._engine.report import format_report
from kfac._engine.wrappers import unwrap
from kfac.assignment import KAISAAssignment
from kfac.assignment import decomposition_work
from kfac.base_preconditioner import BaseKFACPreconditioner
from kfac.base_preconditioner import GradScalerLike
from kfac.config import FisherConfig
from kfac.config import FractionLike
from kfac.config import KFACConfig
from kfac.config import ShardingConfig
from kfac.config import StatisticsConfig
from kfac.distributed import TorchDistributedCommunicator
from kfac.distributed import gather_if_different
from kfac.distributed import get_rank
from kfac.distributed import get_world_size
from kfac.enums import AssignmentStrategy
from kfac.enums import ComputeMethod
from kfac.enums import DistributedStrategy
from kfac.hyperparams import Hyperparameters
from kfac.hyperparams import OptimizerLike
from kfac.hyperparams import OptimizerLR
from kfac.hyperparams import check_optimizers
from kfac.layers.base import KFACBaseLayer
from kfac.layers.curvature import CurvatureConfig
from kfac.layers.sampling import SampleKey
from kfac.math.fisher import parse_fisher
from kfac.state import StateDict
from kfac.validation import check_instance

__all__ = ['FractionLike', 'KFACConfig', 'KFACPreconditioner']

logger = logging.getLogger(__name__)


class KFACPreconditioner(BaseKFACPreconditioner):
    """K-FAC preconditioning of a model's layers (KAISA).

    Call [`step`][kfac.base_preconditioner.BaseKFACPreconditioner.step]
    between `loss.backward()` and `optimizer.step()`. Works on one process
    without `torch.distributed` and, initialised, with a DDP-wrapped model
    on any number of ranks, each of which builds it from the same model
    with the same options: the constructor compares the ranks' setups (one
    all-gather of a digest) and raises a `ValueError` on every rank,
    naming the first difference, if they differ (see the distributed
    guide). The options are validated by
    [`Hyperparameters`][kfac.hyperparams.Hyperparameters] (the schedulable
    ones) and [`KFACConfig`][kfac.config.KFACConfig] (the others),
    which `config` holds. The defaults are the time-to-target study's;
    [`ORIGINAL_DEFAULTS`][kfac.hyperparams.ORIGINAL_DEFAULTS] holds the
    original KAISA code's (`KFACPreconditioner(model, **ORIGINAL_DEFAULTS)`).

    Args:
        model: the model (`DistributedDataParallel` and `torch.compile`
            wrappers are looked through, so layer names and checkpoints are
            the same with and without them).
        factor_update_steps: steps between factor updates.
        inv_update_steps: steps between decompositions.
        damping: `λ` (EIGEN: added to the Kronecker product exactly;
            EKFAC: added to the scaling `S`; INVERSE: split between the
            factors with the π correction); see the method's `damping_mode`.
        factor_decay: `ξ` in (0, 1] of the factors' running average.
        kl_clip: `κ` of the original's KL clip (the step's KL divergence
            at most `κ/2`; once active, the step no longer depends on the
            learning rate), or None (the default: no KL clip).
        lr: the optimizer's learning rate, used by the KL clip only; None
            (the default) means 0.1, or the optimizer's with `optimizer`.
            Pass `optimizer` instead, so that the value follows the
            optimizer's schedule.
        accumulation_steps: micro-batches per step (divide each micro-batch
            loss by it).
        allreduce_bucket_cap_mb: bucket size of the factor allreduce in MiB;
            0 disables bucketing.
        assignment_strategy: cost model balancing inverse workers.
        colocate_factors: decompose a layer's two factors on one rank.
        compute_method: `'inverse'` (factored Tikhonov damping; the
            default), `'eigen'` (exact damping; the original's default) or
            `'ekfac'` (EIGEN's eigenbases with the scaling re-estimated
            from each example's gradient on every factor update; see
            [`kfac.layers.curvature.ekfac`][kfac.layers.curvature.ekfac]),
            or a method with its options: a
            [`CurvatureConfig`][kfac.layers.curvature.base.CurvatureConfig]
            such as `EigenConfig(basis_refresh='qr')`, or one defined
            outside the library (see
            [`kfac.layers.curvature.base`][kfac.layers.curvature.base]).
        compute_eigenvalue_outer_product: EIGEN: precompute
            `1 / (d_G d_Aᵀ + λ)` at decomposition time; EKFAC: keep
            `1 / (S + λ)` from each update of `S`; INVERSE: unused.
        grad_worker_fraction: fraction of ranks that precondition each
            layer's gradient: a float or a
            [`DistributedStrategy`][kfac.enums.DistributedStrategy].
        symmetry_aware: communicate symmetric matrices as packed triangles.
        grad_scaler: the `GradScaler` (or a callable returning the loss
            scale) of mixed-precision training.
        factor_dtype: dtype of the running factors.
        inv_dtype: dtype of the decompositions.
        skip_layers: regexes of module names or class names to leave alone.
        update_factors_in_hook: compute statistics in the hooks.
        loglevel: the level at which the construction summary (options
            and placement) is logged; nothing else.
        module_options: per-module overrides: `{pattern: {option:
            value}}`, a pattern selecting modules by dotted name or class
            name; the options are `compute_method` (a
            [`CurvatureConfig`][kfac.layers.curvature.base.CurvatureConfig],
            say `EigenConfig(factor_rank=32)` for a wide layer) and the
            per-module statistics options `batch_first`, `kfac_approx`,
            `max_factor_dim` and `position_sample` (see
            [`kfac.layers.options`][kfac.layers.options]).
        optimizer: the optimizer (or a sequence of them, such as Muon on
            the matrices and AdamW on the rest) that trains the model; the
            learning rate is then read at every step from the param group
            holding each registered weight (see
            [`OptimizerLR`][kfac.hyperparams.OptimizerLR]). Not with `lr`.
        relative_clip: `ρ`: the preconditioned gradient is at most `ρ`
            times as long as the raw one, so the step always scales with
            the learning rate; None: no such cap. `'auto'` (the default)
            is 1.0 without `kl_clip` and None with it, so that `kl_clip`
            alone is the original's clip (a method's config may
            choose otherwise: `default_relative_clip`); with both set
            the smaller scale applies (the formulas are in
            [`kfac.math`][kfac.math]).
        statistics: how `A` and `G` are formed (a
            [`StatisticsConfig`][kfac.config.StatisticsConfig]: how the
            loss averages, the input layout, expand or reduce, the
            factor-size limit, sampled positions, compiled running
            averages).
        fisher: where `G`'s output gradients come from (a
            [`FisherConfig`][kfac.config.FisherConfig]: empirical or Monte
            Carlo).
        sharding: how a model sharded with FSDP2 is preconditioned (a
            [`ShardingConfig`][kfac.config.ShardingConfig]).
        config: every non-schedulable option at once (a
            [`KFACConfig`][kfac.config.KFACConfig]); the keywords it holds
            must then be left at their defaults.

    Every hyperparameter (`factor_update_steps` to `lr`, `relative_clip`)
    may also be a callable `step -> value`.

    """

    def __init__(
        self,
        model: nn.Module,
        *,
        factor_update_steps: int | Callable[[int], int] = 10,
        inv_update_steps: int | Callable[[int], int] = 100,
        damping: float | Callable[[int], float] = 0.003,
        factor_decay: float | Callable[[int], float] = 0.95,
        kl_clip: float | Callable[[int], float | None] | None = None,
        lr: float | Callable[[int], float] | None = None,
        accumulation_steps: int = 1,
        allreduce_bucket_cap_mb: float = 25.0,
        assignment_strategy: AssignmentStrategy | str = 'compute',
        colocate_factors: bool = True,
        compute_method: ComputeMethod | CurvatureConfig | str = 'inverse',
        compute_eigenvalue_outer_product: bool = True,
        grad_worker_fraction: FractionLike = DistributedStrategy.COMM_OPT,
        symmetry_aware: bool = False,
        grad_scaler: GradScalerLike | None = None,
        factor_dtype: torch.dtype | None = None,
        inv_dtype: torch.dtype | None = None,
        skip_layers: str | Iterable[str] | None = None,
        update_factors_in_hook: bool = True,
        loglevel: int = logging.DEBUG,
        module_options: Mapping[str, Mapping[str, Any]] | None = None,
        optimizer: OptimizerLike | None = None,
        relative_clip: float
        | Callable[[int], float | None]
        | Literal['auto']
        | None = 'auto',
        statistics: StatisticsConfig | None = None,
        fisher: FisherConfig | None = None,
        sharding: ShardingConfig | None = None,
        config: KFACConfig | None = None,
    ) -> None:
        check_instance('model', model, nn.Module, 'a torch.nn.Module')
        hyperparameters = Hyperparameters(
            factor_update_steps=factor_update_steps,
            inv_update_steps=inv_update_steps,
            damping=damping,
            factor_decay=factor_decay,
            kl_clip=kl_clip,
            lr=0.1 if lr is None else lr,
            relative_clip=None if relative_clip == 'auto' else relative_clip,
        )
        optimizers = None if optimizer is None else check_optimizers(optimizer)
        if optimizers is not None and lr is not None:
            raise ValueError(
                'pass optimizer or lr, not both: with optimizer the learning '
                'rate is read from its param groups',
            )
        given = {
            'accumulation_steps': accumulation_steps,
            'allreduce_bucket_cap_mb': allreduce_bucket_cap_mb,
            'assignment_strategy': assignment_strategy,
            'colocate_factors': colocate_factors,
            'compute_method': compute_method,
            'compute_eigenvalue_outer_product': (
                compute_eigenvalue_outer_product
            ),
            'grad_worker_fraction': grad_worker_fraction,
            'symmetry_aware': symmetry_aware,
            'factor_dtype': factor_dtype,
            'inv_dtype': inv_dtype,
            'skip_layers': skip_layers,
            'update_factors_in_hook': update_factors_in_hook,
            'loglevel': loglevel,
            'module_options': module_options,
            'statistics': statistics,
            'fisher': fisher,
            'sharding': sharding,
        }
        config = _config(config, given)
        if relative_clip == 'auto':
            hyperparameters = hyperparameters.replace(
                relative_clip=_relative_clip(kl_clip, config.curvature())
            )
        check_model(unwrap(model))
        self.config = config
        self.model = model
        key = SampleKey(rank=get_rank())
        key.source = lambda: (self.options.position_sample_seed, self._steps)
        self.registration = config.register(unwrap(model), key)
        modules = dict(unwrap(model).named_modules())
        self._frozen = {
            entry.name: modules[entry.name].weight
            for entry in self.registration.skipped
            if entry.reason.startswith('frozen')
        }
        layers = {
            name: config.make_layer(
                name, helper, self.registration.options[name]
            )
            for name, helper in self.registration.helpers.items()
        }
        communicator = TorchDistributedCommunicator(
            bucket_cap_mb=config.allreduce_bucket_cap_mb,
            symmetry_aware=config.symmetry_aware,
        )
        world_size = get_world_size()
        if world_size > 1:  # before any other collective of K-FAC
            _check_agreement(
                communicator,
                describe_setup(
                    config,
                    hyperparameters,
                    self.registration,
                    layers,
                    world_size,
                ),
                layers,
            )
        assignment = KAISAAssignment(
            decomposition_work(layers, config.assignment_strategy),
            local_rank=get_rank(),
            world_size=world_size,
            grad_worker_fraction=config.grad_worker_fraction,
            colocate_factors=config.colocate_factors,
            shared_bases=[n for n, x in layers.items() if x.bases_everywhere],
        )
        if optimizers is not None:
            hyperparameters = hyperparameters.replace(
                lr=OptimizerLR(
                    optimizers,
                    {n: layer.module.weight for n, layer in layers.items()},
                )
            )
        super().__init__(
            layers,
            assignment=assignment,
            hyperparameters=hyperparameters,
            options=config.engine_options(),
            grad_scaler=grad_scaler,
            communicator=communicator,
            aliases={
                name: [modules[alias] for alias in names]
                for name, names in self.registration.aliases.items()
            },
        )
        self.fisher = FisherSampler(
            self._capture,
            fisher_type=config.fisher.fisher_type,
            samples=config.fisher.mc_samples,
            seed=config.fisher.mc_seed,
            steps=lambda: self._steps,
            accumulation_steps=config.accumulation_steps,
            loss_average=config.statistics.loss_average,
        )
        """The Monte Carlo Fisher's sampler."""
        self._report = describe_registration(self.registration, layers)
        logger.info('%s', format_report(self._report))
        logger.log(config.loglevel, 'K-FAC: %s; %s', config, assignment)

    def sample_fisher(
        self,
        output: torch.Tensor,
        loss: str = 'cross_entropy',
        *,
        mask: torch.Tensor | None = None,
        indices: torch.Tensor | None = None,
    ) -> None:
        """With `fisher_type='mc'`, on a step that updates factors, run
        `mc_samples` backward passes of `loss` at targets sampled from the
        model's `output`, which feed `G` (no `.grad` is written); else
        nothing. Call after each forward pass, before `loss.backward()`.

        Args:
            output: the model output: logits with classes last, `(N, C)` or
                `(N, ..., C)`, for `'cross_entropy'`; any `(N, ...)` for
                `'mse'` (a Gaussian of the variance the loss implies, see
                [`kfac.math.fisher`][kfac.math.fisher]).
            loss: `'cross_entropy'` or `'mse'`.
            mask: `'cross_entropy'`: bool, `output.shape[:-1]`, the
                positions the loss counts (`target != ignore_index`).
            indices: the global index of each example, `(N,)` (default:
                rank `r`'s `i`-th example of the `m`-th forward pass of the
                step is `(m W + r) N + i`, `W` ranks).

        Raises:
            TypeError, ValueError: a bad argument; at the sampled pass,
                with `mc_samples > 1`, a registered module whose output has
                no batch dimension.
            RuntimeError: (from `loss.backward()`) a factor-update step
                whose forward pass was not sampled.
        """
        self.fisher.sample(output, loss, mask=mask, indices=indices)

    def state_dict(self, include_decompositions: bool = True) -> StateDict:
        """The preconditioner's state, the sampler's settings included."""
        state = super().state_dict(include_decompositions)
        state['fisher'] = self.fisher.state()
        return state

    def load_state_dict(
        self, state_dict: Mapping[str, Any], strict: bool = True
    ) -> None:
        """Load `state_dict()` output (the seed of the sampling too)."""
        fisher = parse_fisher(state_dict)
        super().load_state_dict(state_dict, strict)
        if fisher is not None:
            self.fisher.seed = fisher['mc_seed']

    def describe(self) -> dict[str, list[dict[str, Any]]]:
        """The registration report (logged at `INFO` at construction).

        Returns:
            `{'preconditioned': [...], 'not_preconditioned': [...]}`: see
                `describe_registration`.
        """
        return copy.deepcopy(self._report)

    def _update_factors(self) -> None:
        super()._update_factors()
        for name, weight in self._frozen.items():
            if weight.requires_grad:
                self._log_once(
                    'unfrozen',
                    name,
                    'K-FAC: module %s was frozen when the preconditioner was '
                    'built and now trains without K-FAC; build a new '
                    'preconditioner to precondition it',
                    name,
                )


def _check_agreement(
    communicator: TorchDistributedCommunicator,
    description: list[tuple[str, str]],
    layers: Mapping[str, KFACBaseLayer],
) -> None:
    """Compare this rank's setup with every other rank's (every rank
    calls this, before any other K-FAC collective).

    Raises:
        ValueError: the setups differ (the same message on every rank,
            naming the first difference).
        KFACDistributedError: the collective failed.
    """
    device = next(iter(layers.values())).device
    gathered = gather_if_different(communicator, description, device=device)
    message = None if gathered is None else setup_difference(gathered)
    if message is not None:
        raise ValueError(message)


def _relative_clip(kl_clip: object, method: CurvatureConfig) -> float | None:
    """`relative_clip='auto'` resolved: the model-wide method's
    `default_relative_clip` (1.0 for the library's methods) without a KL
    clip, None (the original's clip alone) with one.
    """
    return method.default_relative_clip if kl_clip is None else None


def _config(config: object, given: dict[str, Any]) -> KFACConfig:
    """The `KFACConfig` of the constructor's keywords, or `config` when
    given (every keyword it holds then left at its default).

    Raises:
        TypeError: `config` is not a `KFACConfig`.
        ValueError: a keyword given beside `config`.
    """
    given = {
        name: value
        for name, value in given.items()
        if not (value is None and name in _GROUPS)
    }
    if config is None:
        return KFACConfig(**given)
    check_instance('config', config, KFACConfig, 'None or a kfac.KFACConfig')
    defaults = inspect.signature(KFACPreconditioner).parameters
    for name, value in given.items():
        if value is not defaults[name].default and value != (
            defaults[name].default
        ):
            raise ValueError(
                f'{name}={value!r} beside config: set it in the '
                'KFACConfig or as a keyword, not both',
            )
    assert isinstance(config, KFACConfig)  # checked above
    return config


_GROUPS = ('statistics', 'fisher', 'sharding')
"""The keywords of option groups (None: the group's defaults)."""
