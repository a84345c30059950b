"""The full KAISA K-FAC preconditioner, built from a model."""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from collections.abc import Iterable
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from kfac._engine.fsdp import check_model
from kfac._engine.report import describe_registration
from kfac._engine.report import format_report
from kfac._engine.wrappers import unwrap_model as _unwrap
from kfac.assignment import KAISAAssignment
from kfac.assignment import decomposition_work
from kfac.base_preconditioner import BaseKFACPreconditioner
from kfac.base_preconditioner import GradScalerLike
from kfac.config import EngineOptions
from kfac.config import FractionLike
from kfac.config import KFACConfig
from kfac.distributed import TorchDistributedCommunicator
from kfac.distributed import get_rank
from kfac.distributed import get_world_size
from kfac.enums import AssignmentStrategy
from kfac.enums import ComputeMethod
from kfac.enums import DistributedStrategy
from kfac.hyperparams import Hyperparameters
from kfac.hyperparams import OptimizerLike
from kfac.hyperparams import OptimizerLR
from kfac.hyperparams import check_optimizers
from kfac.layers.attention import convert_attention
from kfac.layers.base import KFACBaseLayer
from kfac.layers.eigen import KFACEigenLayer
from kfac.layers.ekfac import KFACEKFACLayer
from kfac.layers.helper import ModuleHelper
from kfac.layers.inverse import KFACInverseLayer
from kfac.layers.options import DEFAULT_MAX_FACTOR_DIM
from kfac.layers.options import ModuleOptions
from kfac.layers.register import Registration
from kfac.layers.register import register_model
from kfac.layers.sampling import SampleKey
from kfac.layers.tied import KFACTiedEigenLayer
from kfac.layers.tied import KFACTiedEKFACLayer
from kfac.layers.tied import KFACTiedInverseLayer
from kfac.layers.tied import TiedHelper
from kfac.validation import check_instance

__all__ = ['FractionLike', 'KFACConfig', 'KFACPreconditioner']

logger = logging.getLogger(__name__)


_EIGENBASES = {
    ComputeMethod.EIGEN: (KFACEigenLayer, KFACTiedEigenLayer),
    ComputeMethod.EKFAC: (KFACEKFACLayer, KFACTiedEKFACLayer),
}


def _make_layer(helper: ModuleHelper, config: KFACConfig) -> KFACBaseLayer:
    tied = isinstance(helper, TiedHelper)
    if config.compute_method in _EIGENBASES:
        kinds = _EIGENBASES[ComputeMethod(config.compute_method)]
        return kinds[tied](
            helper,
            prediv_eigenvalues=config.compute_eigenvalue_outer_product,
            basis_refresh=config.basis_refresh,
            factor_dtype=config.factor_dtype,
            inv_dtype=config.inv_dtype,
            loss_average=config.loss_average,
        )
    return (KFACTiedInverseLayer if tied else KFACInverseLayer)(
        helper,
        factor_dtype=config.factor_dtype,
        inv_dtype=config.inv_dtype,
        loss_average=config.loss_average,
    )


class KFACPreconditioner(BaseKFACPreconditioner):
    """K-FAC preconditioning of a model's layers (KAISA).

    Call [`step`][kfac.base_preconditioner.BaseKFACPreconditioner.step]
    between `loss.backward()` and `optimizer.step()`. Works on one process
    without `torch.distributed` and, initialised, with a DDP-wrapped model
    on any number of ranks. The options are validated by
    [`Hyperparameters`][kfac.hyperparams.Hyperparameters] (the schedulable
    ones) and [`KFACConfig`][kfac.config.KFACConfig] (the others),
    which `config` holds.

    Args:
        model: the model (`DistributedDataParallel` and `torch.compile`
            wrappers are looked through, so layer names and checkpoints are
            the same with and without them).
        factor_update_steps: steps between factor updates.
        inv_update_steps: steps between decompositions.
        damping: `λ` (EIGEN: added to the Kronecker product exactly;
            EKFAC: added to the scaling `S`; INVERSE: split between the
            factors with the π correction).
        factor_decay: `ξ` in (0, 1] of the factors' running average.
        kl_clip: `κ` of the clip (its meaning per `kl_clip_rule`), or
            None to disable it.
        lr: the optimizer's learning rate, used by the `'kl'` clip rule
            only; None (the default) means 0.1, or the optimizer's with
            `optimizer`. Pass `optimizer` instead, so that the value
            follows the optimizer's schedule.
        accumulation_steps: micro-batches per step (divide each micro-batch
            loss by it).
        allreduce_bucket_cap_mb: bucket size of the factor allreduce in MiB;
            0 disables bucketing.
        assignment_strategy: cost model balancing inverse workers.
        colocate_factors: decompose a layer's two factors on one rank.
        compute_method: `'eigen'`, `'inverse'` or `'ekfac'` (EIGEN's
            eigenbases with the scaling re-estimated from each example's
            gradient on every factor update; see
            [`kfac.layers.ekfac`][kfac.layers.ekfac]).
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
        loss_average: how the loss averages its terms: `'batch'` (the
            default: a mean over the `N` examples, PyTorch's default
            reduction), `'batch+sequence'` (a mean over examples and
            positions, as language-model losses are) or `None` (a summed
            loss); see [`kfac.math`][kfac.math] for the factors of each.
        batch_first: the model-wide layout of module inputs: `(N, ...)`, or
            with False `(T, N, ...)` (sequence-first); modules inside an
            `nn.MultiheadAttention` or `nn.Transformer*` follow its own
            `batch_first` (see [`kfac.layers.options`][kfac.layers.options]).
        kfac_approx: how weight-sharing positions enter the factors:
            `'expand'` (the default) or `'reduce'` (Eschenhagen et al.,
            NeurIPS 2023; `T` times cheaper for `T` positions).
        max_factor_dim: the largest side of a dense factor kept whole
            (default 8192: every factor of ResNet-50 and BERT-Large); a
            layer with a longer one is preconditioned in tiles with
            block-diagonal factors of at most this side (see
            [`kfac.layers.blocks`][kfac.layers.blocks]); None: no limit.
        module_options: per-module overrides of the options above that are
            per module (`batch_first`, `kfac_approx`, `max_factor_dim`,
            `position_sample`):
            `{pattern: {option: value}}`, a pattern selecting modules by
            dotted name or class name.
        shard_mode: how gradients of a model sharded with FSDP2
            `fully_shard` are preconditioned: `'lossless'` (the default:
            each layer's whole gradient is gathered, preconditioned and
            returned to the shards; equal to one process) or `'local'`
            (each rank preconditions its own rows with the factor on the
            sharded side made block-diagonal by shard; no gradient
            communication; needs `grad_worker_fraction='comm_opt'`; an
            approximation). See the distributed guide.
        optimizer: the optimizer (or a sequence of them, such as Muon on
            the matrices and AdamW on the rest) that trains the model; the
            learning rate is then read at every step from the param group
            holding each registered weight (see
            [`OptimizerLR`][kfac.hyperparams.OptimizerLR]). Not with `lr`.
        kl_clip_rule: `'kl'` (the original rule: the step's KL divergence
            is at most `κ/2`; once active, the step no longer depends on
            the learning rate) or `'relative'` (the preconditioned
            gradient is at most `κ` times as long as the raw one, so the
            step always scales with the learning rate); the formulas are in
            [`kfac.math`][kfac.math].
        basis_refresh: how EIGEN and EKFAC refresh their eigenbases:
            `'eigh'` (a full eigendecomposition) or `'qr'` (a few steps of
            orthogonal iteration from the previous basis; see
            [`kfac.layers.eigen`][kfac.layers.eigen]).
        compile_arithmetic: fold each factor's batch into its running
            average with one kernel compiled by `torch.compile` instead of
            several eager ones (equal up to rounding; the first factor
            update compiles it, a few seconds). Off by default: on CPUs it
            is slower below factors of about 1000 rows (see the compile
            guide).
        position_sample: form `A` and `G` from a sample of each example's
            weight-sharing positions: an int (positions per example) or a
            float in (0, 1] (a fraction of them); None: all. Unbiased; see
            [`kfac.layers.sampling`][kfac.layers.sampling].
        position_sample_seed: the seed of those draws (saved in the state).

    Every hyperparameter (`factor_update_steps` to `lr`) may also be a
    callable `step -> value`.

    """

    def __init__(
        self,
        model: nn.Module,
        *,
        factor_update_steps: int | Callable[[int], int] = 1,
        inv_update_steps: int | Callable[[int], int] = 1,
        damping: float | Callable[[int], float] = 0.001,
        factor_decay: float | Callable[[int], float] = 0.95,
        kl_clip: float | Callable[[int], float | None] | None = 0.001,
        lr: float | Callable[[int], float] | None = None,
        accumulation_steps: int = 1,
        allreduce_bucket_cap_mb: float = 25.0,
        assignment_strategy: AssignmentStrategy | str = 'compute',
        colocate_factors: bool = True,
        compute_method: ComputeMethod | str = 'eigen',
        compute_eigenvalue_outer_product: bool = True,
        grad_worker_fraction: FractionLike = DistributedStrategy.COMM_OPT,
        symmetry_aware: bool = False,
        grad_scaler: GradScalerLike | None = None,
        factor_dtype: torch.dtype | None = None,
        inv_dtype: torch.dtype | None = None,
        skip_layers: str | Iterable[str] | None = None,
        update_factors_in_hook: bool = True,
        loglevel: int = logging.DEBUG,
        loss_average: str | None = 'batch',
        batch_first: bool = True,
        kfac_approx: str = 'expand',
        module_options: Mapping[str, Mapping[str, Any]] | None = None,
        max_factor_dim: int | None = DEFAULT_MAX_FACTOR_DIM,
        shard_mode: str = 'lossless',
        optimizer: OptimizerLike | None = None,
        kl_clip_rule: str = 'kl',
        basis_refresh: str = 'eigh',
        compile_arithmetic: bool = False,
        position_sample: int | float | None = None,
        position_sample_seed: int = 0,
    ) -> None:
        check_instance('model', model, nn.Module, 'a torch.nn.Module')
        hyperparameters = Hyperparameters(
            factor_update_steps=factor_update_steps,
            inv_update_steps=inv_update_steps,
            damping=damping,
            factor_decay=factor_decay,
            kl_clip=kl_clip,
            lr=0.1 if lr is None else lr,
        )
        optimizers = None if optimizer is None else check_optimizers(optimizer)
        if optimizers is not None and lr is not None:
            raise ValueError(
                'pass optimizer or lr, not both: with optimizer the learning '
                'rate is read from its param groups',
            )
        config = KFACConfig(
            accumulation_steps=accumulation_steps,
            allreduce_bucket_cap_mb=allreduce_bucket_cap_mb,
            assignment_strategy=assignment_strategy,
            colocate_factors=colocate_factors,
            compute_method=compute_method,
            compute_eigenvalue_outer_product=compute_eigenvalue_outer_product,
            grad_worker_fraction=grad_worker_fraction,
            symmetry_aware=symmetry_aware,
            factor_dtype=factor_dtype,
            inv_dtype=inv_dtype,
            skip_layers=skip_layers,
            update_factors_in_hook=update_factors_in_hook,
            loglevel=loglevel,
            loss_average=loss_average,
            batch_first=batch_first,
            kfac_approx=kfac_approx,
            module_options=module_options,
            max_factor_dim=max_factor_dim,
            shard_mode=shard_mode,
            kl_clip_rule=kl_clip_rule,
            basis_refresh=basis_refresh,
            compile_arithmetic=compile_arithmetic,
            position_sample=position_sample,
            position_sample_seed=position_sample_seed,
        )
        check_model(_unwrap(model))
        self.config = config
        self.model = model
        key = SampleKey(
            lambda: (self.options.position_sample_seed, self._steps)
        )
        key.rank = get_rank()
        self.registration = self._register(model, config, key)
        modules = dict(_unwrap(model).named_modules())
        self._frozen = {
            entry.name: modules[entry.name].weight
            for entry in self.registration.skipped
            if entry.reason.startswith('frozen')
        }
        layers = {
            name: _make_layer(helper, config)
            for name, helper in self.registration.helpers.items()
        }
        assignment = KAISAAssignment(
            decomposition_work(layers, config.assignment_strategy),
            local_rank=get_rank(),
            world_size=get_world_size(),
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
            options=EngineOptions(
                accumulation_steps=config.accumulation_steps,
                update_factors_in_hook=config.update_factors_in_hook,
                bucketed=config.allreduce_bucket_cap_mb > 0,
                shard_mode=config.shard_mode,
                kl_clip_rule=config.kl_clip_rule,
                compile_arithmetic=config.compile_arithmetic,
                position_sample_seed=config.position_sample_seed,
            ),
            grad_scaler=grad_scaler,
            communicator=TorchDistributedCommunicator(
                bucket_cap_mb=config.allreduce_bucket_cap_mb,
                symmetry_aware=config.symmetry_aware,
            ),
            aliases={
                name: [modules[alias] for alias in names]
                for name, names in self.registration.aliases.items()
            },
        )
        self._report = describe_registration(self.registration, layers)
        logger.info('%s', format_report(self._report))
        logger.log(config.loglevel, 'K-FAC: %s; %s', config, assignment)

    @staticmethod
    def _register(
        model: nn.Module, config: KFACConfig, key: SampleKey
    ) -> Registration:
        convert_attention(_unwrap(model))
        registration = register_model(
            _unwrap(model),
            skip_layers=config.skip_layers,
            defaults=ModuleOptions(
                batch_first=config.batch_first,
                kfac_approx=config.kfac_approx,
                max_factor_dim=config.max_factor_dim,
                position_sample=config.position_sample,
            ),
            module_options=config.module_options,
            sample_key=key,
        )
        if not registration.helpers:
            raise ValueError(
                'model has no module K-FAC can precondition: it needs an '
                'nn.Linear, a convolution, an nn.Embedding or an attention '
                'module whose weight requires grad and that skip_layers '
                'does not exclude (see describe() for the reasons)',
            )
        return registration

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
