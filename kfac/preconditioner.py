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
from kfac.enums import AllreduceMethod
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

    Built from a model, it registers the model's supported layers, hooks
    them to form each layer's Kronecker factors `A` and `G`, and at every
    [`step`][kfac.base_preconditioner.BaseKFACPreconditioner.step] (called
    between `loss.backward()` and `optimizer.step()`) replaces their
    gradients with preconditioned ones, so that any `torch.optim`
    optimizer follows the K-FAC direction. It works on one process
    without `torch.distributed` and, initialised, with a DDP- or
    FSDP2-wrapped model on any number of ranks: factors are allreduced,
    each factor's decomposition is computed by one assigned rank, and
    `grad_worker_fraction` chooses how many ranks precondition each
    layer. Every rank builds it from the same model with the same
    options; the constructor compares the ranks' setups (one all-gather
    of a digest) and raises a `ValueError` on every rank, naming the first
    difference, if they differ.

    The keywords are the original KAISA code's twenty, meaning what they
    meant (`kl_clip` included), plus `module_options`, `optimizer`,
    `relative_clip` and three option groups (`statistics`, `fisher`,
    `sharding`), or all of the non-schedulable options at once as a
    [`KFACConfig`][kfac.config.KFACConfig] (`config`). Each keyword, its
    default and its meaning are in the options tables of the
    hyperparameters guide (`docs/guide/hyperparameters.md`, "The
    schedulable hyperparameters" and "Options fixed at construction"),
    and each error the constructor raises in the troubleshooting guide;
    tests hold both tables to this signature. The schedulable ones
    (`factor_update_steps` to `lr`, `relative_clip`) may be callables
    `step -> value` and are validated by
    [`Hyperparameters`][kfac.hyperparams.Hyperparameters]. The defaults
    are the time-to-target study's;
    [`ORIGINAL_DEFAULTS`][kfac.hyperparams.ORIGINAL_DEFAULTS] holds the
    original's (`KFACPreconditioner(model, **ORIGINAL_DEFAULTS)`).

    Examples:
        >>> import torch
        >>> from torch import nn
        >>> model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> preconditioner = KFACPreconditioner(model, optimizer=optimizer)
        >>> list(preconditioner.layers)
        ['0', '2']
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
        self._kaisa = assignment
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
        logger.log(config.loglevel, '%s', format_report(self._report))
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
        """The registration report (logged at `loglevel` at construction).

        Returns:
            `{'preconditioned': [...], 'not_preconditioned': [...]}`: see
                `describe_registration`.
        """
        return copy.deepcopy(self._report)

    # The original KAISA code's attributes, read from `config` (the
    # settings it holds, normalised) and the placement.

    @property
    def allreduce_bucket_cap_mb(self) -> float:
        """Bucket size of the factor allreduce in MB (0: not bucketed)."""
        return self.config.allreduce_bucket_cap_mb

    @property
    def allreduce_method(self) -> AllreduceMethod:
        """`ALLREDUCE_BUCKETED`, or `ALLREDUCE` with a bucket size of 0."""
        if self.config.allreduce_bucket_cap_mb > 0:
            return AllreduceMethod.ALLREDUCE_BUCKETED
        return AllreduceMethod.ALLREDUCE

    @property
    def assignment_strategy(self) -> AssignmentStrategy:
        """The cost model that balances the inverse workers."""
        return AssignmentStrategy(self.config.assignment_strategy)

    @property
    def colocate_factors(self) -> bool:
        """Whether a layer's factors are decomposed on one rank."""
        return self.config.colocate_factors

    @property
    def compute_eigenvalue_outer_product(self) -> bool:
        """EIGEN's option of the same name (see `KFACConfig`)."""
        return self.config.compute_eigenvalue_outer_product

    @property
    def compute_method(self) -> ComputeMethod | CurvatureConfig:
        """The model-wide method: a name, or its config object."""
        return self.config.compute_method  # type: ignore[return-value]  # normalised by KFACConfig

    @property
    def distributed_strategy(self) -> DistributedStrategy:
        """The strategy the gradient workers per layer amount to:
        `COMM_OPT` (every rank, one process included), `MEM_OPT` (one rank)
        or `HYBRID_OPT` (between).
        """
        workers, size = self._kaisa.grad_workers, self._kaisa.plan.world_size
        if workers == size:
            return DistributedStrategy.COMM_OPT
        if workers == 1:
            return DistributedStrategy.MEM_OPT
        return DistributedStrategy.HYBRID_OPT

    @property
    def grad_worker_fraction(self) -> float:
        """Gradient workers per layer over the world size (1.0 on one
        process, whatever fraction was given).
        """
        return self._kaisa.grad_worker_fraction

    @property
    def factor_dtype(self) -> torch.dtype | None:
        """The dtype of the factors (None: the layer's, float32 at least)."""
        return self.config.factor_dtype

    @property
    def inv_dtype(self) -> torch.dtype | None:
        """The dtype of the decompositions (None: the factors')."""
        return self.config.inv_dtype

    @property
    def skip_layers(self) -> list[str]:
        """The patterns of module names and types left to the optimizer."""
        return list(self.config.skip_layers)  # type: ignore[arg-type]  # a tuple once normalised

    @property
    def symmetry_aware(self) -> bool:
        """Whether factors travel as packed triangles."""
        return self.config.symmetry_aware

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
