"""The full KAISA K-FAC preconditioner, built from a model."""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from collections.abc import Iterable
from collections.abc import Mapping
from typing import Any
from typing import Literal

import torch
from torch import nn

from kfac._engine.fisher import FisherSampler
from kfac._engine.fsdp import check_model
from kfac._engine.report import describe_registration
from kfac._engine.report import format_report
from kfac._engine.wrappers import unwrap
from kfac.assignment import KAISAAssignment
from kfac.assignment import decomposition_work
from kfac.base_preconditioner import BaseKFACPreconditioner
from kfac.base_preconditioner import GradScalerLike
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
from kfac.layers.curvature import CurvatureConfig
from kfac.layers.options import DEFAULT_MAX_FACTOR_DIM
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
    on any number of ranks. The options are validated by
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
            factors with the π correction); see `damping_mode`.
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
        factor_rank: keep a dense factor longer than this as its top
            `factor_rank` eigenpairs plus one value for the rest of its
            spectrum (EIGEN and INVERSE; see
            [`kfac.math.lowrank`][kfac.math.lowrank]); None: whole.
        module_options: per-module overrides of the options above that are
            per module (`batch_first`, `kfac_approx`, `max_factor_dim`,
            `factor_rank`, `position_sample`):
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
        relative_clip: `ρ`: the preconditioned gradient is at most `ρ`
            times as long as the raw one, so the step always scales with
            the learning rate; None: no such cap. `'auto'` (the default)
            is 1.0 without `kl_clip` and None with it, so that `kl_clip`
            alone is the original's clip; with both set the smaller
            scale applies (the formulas are in [`kfac.math`][kfac.math]).
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
        fisher_type: where `G`'s output gradients come from: `'empirical'`
            (the default: the backward pass of the training loss) or
            `'mc'` (the Monte Carlo Fisher of Martens & Grosse: a backward
            pass of the loss at targets sampled from the model, run by
            [`sample_fisher`][kfac.preconditioner.KFACPreconditioner.sample_fisher]
            on factor-update steps; see
            [`kfac.math.fisher`][kfac.math.fisher]).
        mc_samples: `'mc'`: sampled backward passes per forward pass.
        mc_seed: `'mc'`: the seed of the sampling (saved in `state_dict()`).
        damping_mode: `'absolute'` (`λ` as given) or `'relative'` (`λ`
            times each layer's mean eigenvalue of `A ⊗ G`, so one value
            suits layers and models of any scale; EIGEN and INVERSE).
        position_sample: form `A` and `G` from a sample of each example's
            weight-sharing positions: an int (positions per example) or a
            float in (0, 1] (a fraction of them); None: all. Unbiased; see
            [`kfac.layers.sampling`][kfac.layers.sampling].
        position_sample_seed: the seed of those draws (saved in the state).

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
        loss_average: str | None = 'batch',
        batch_first: bool = True,
        kfac_approx: str = 'expand',
        module_options: Mapping[str, Mapping[str, Any]] | None = None,
        max_factor_dim: int | None = DEFAULT_MAX_FACTOR_DIM,
        shard_mode: str = 'lossless',
        optimizer: OptimizerLike | None = None,
        relative_clip: float
        | Callable[[int], float | None]
        | Literal['auto']
        | None = 'auto',
        basis_refresh: str = 'eigh',
        compile_arithmetic: bool = False,
        fisher_type: str = 'empirical',
        mc_samples: int = 1,
        mc_seed: int = 0,
        factor_rank: int | None = None,
        damping_mode: str = 'absolute',
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
            relative_clip=_relative_clip(relative_clip, kl_clip),
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
            basis_refresh=basis_refresh,
            compile_arithmetic=compile_arithmetic,
            fisher_type=fisher_type,
            mc_samples=mc_samples,
            mc_seed=mc_seed,
            factor_rank=factor_rank,
            damping_mode=damping_mode,
            position_sample=position_sample,
            position_sample_seed=position_sample_seed,
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
            options=config.engine_options(),
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
        self.fisher = FisherSampler(
            self._capture,
            fisher_type=config.fisher_type,
            samples=config.mc_samples,
            seed=config.mc_seed,
            steps=lambda: self._steps,
            accumulation_steps=config.accumulation_steps,
            loss_average=config.loss_average,
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


def _relative_clip(
    relative_clip: object, kl_clip: object
) -> float | Callable[[int], float | None] | None:
    """`relative_clip` with `'auto'` resolved: 1.0 without a KL clip, None
    (the original's clip alone) with one.
    """
    if relative_clip == 'auto':
        return 1.0 if kl_clip is None else None
    return relative_clip  # type: ignore[return-value]  # checked by Hyperparameters
