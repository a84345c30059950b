"""The K-FAC engine: the step's phases, state and introspection.

[`BaseKFACPreconditioner`][kfac.base_preconditioner.BaseKFACPreconditioner]
combines the separate parts of the library: capture
([`kfac.capture`][kfac.capture]), the per-layer mathematics
([`kfac.layers`][kfac.layers]), the placement of work
([`WorkAssignment`][kfac.assignment.WorkAssignment]) and communication
([`kfac.exchange`][kfac.exchange] over [`kfac.distributed`][kfac.distributed]).
[`KFACPreconditioner`][kfac.preconditioner.KFACPreconditioner] builds all of
them from a model and keyword arguments.
"""

from __future__ import annotations

import contextlib
import logging
from collections import Counter
from collections.abc import Iterable
from collections.abc import Mapping
from collections.abc import Sequence

import torch
from torch import nn
from torch.distributed import ProcessGroup

from kfac.assignment import WorkAssignment
from kfac.capture import Capture
from kfac.capture import GradScalerLike
from kfac.capture import check_grad_scaler
from kfac.distributed import TorchDistributedCommunicator
from kfac.distributed import get_rank
from kfac.engine_state import EngineState
from kfac.exchange import FactorReduction
from kfac.exchange import broadcast_decompositions
from kfac.exchange import broadcast_grads
from kfac.hyperparams import Hyperparameters
from kfac.hyperparams import HyperparameterValues
from kfac.layers.base import FACTOR_NAMES
from kfac.layers.base import KFACBaseLayer
from kfac.layers.decomposition import decompose_all
from kfac.math import kl_clip_scale
from kfac.sharded_step import ShardedStep
from kfac.sharded_step import is_sharded_model
from kfac.sharded_step import owned_entries
from kfac.sharding import setup_local_mode
from kfac.tracing import PhaseTimer
from kfac.validation import check_bool
from kfac.validation import check_choice
from kfac.validation import check_instance
from kfac.validation import check_mapping
from kfac.validation import validate_int

__all__ = ['SHARD_MODES', 'BaseKFACPreconditioner', 'GradScalerLike']

SHARD_MODES = ('lossless', 'local')
"""How gradients of FSDP2-sharded parameters are preconditioned."""

logger = logging.getLogger(__name__)


class BaseKFACPreconditioner(ShardedStep, EngineState):
    """Minimal K-FAC engine over registered layers.

    Args:
        layers: `{module name: layer}`; the hooks are registered on each
            layer's module.
        assignment: where each decomposition and preconditioning happens.
        hyperparameters: the schedulable hyperparameters.
        accumulation_steps: micro-batches (forward/backward passes) per
            [`step`][kfac.base_preconditioner.BaseKFACPreconditioner.step].
            Divide each micro-batch's mean loss by this number, as for
            ordinary gradient accumulation.
        update_factors_in_hook: compute factor statistics inside the hooks
            (and start their allreduce after the last micro-batch) instead
            of keeping activations until `step()`.
        grad_scaler: the loss scaler of mixed-precision training, whose
            scale is divided out of output gradients.
        communicator: collectives; default a bucketed
            [`TorchDistributedCommunicator`][kfac.distributed.TorchDistributedCommunicator].
        bucketed: allreduce factors in buckets.
        loglevel: level of the preconditioner's informational messages.
        aliases: per layer name, further modules sharing its weight whose
            calls count as calls of its module.
        shard_mode: for parameters sharded by FSDP2 (DTensors):
            `'lossless'` gathers each layer's whole gradient and equals one
            process; `'local'` preconditions each rank's rows alone, with
            the factor on the sharded side made block-diagonal by shard
            (no gradient communication; see [`kfac.sharding`][kfac.sharding]).

    """

    def __init__(
        self,
        layers: Mapping[str, KFACBaseLayer],
        *,
        assignment: WorkAssignment,
        hyperparameters: Hyperparameters | None = None,
        accumulation_steps: int = 1,
        update_factors_in_hook: bool = True,
        grad_scaler: GradScalerLike | None = None,
        communicator: TorchDistributedCommunicator | None = None,
        bucketed: bool = True,
        loglevel: int = logging.DEBUG,
        aliases: Mapping[str, Sequence[nn.Module]] | None = None,
        shard_mode: str = 'lossless',
    ) -> None:
        check_mapping('layers', layers, KFACBaseLayer, 'KFACBaseLayer')
        check_instance(
            'assignment',
            assignment,
            WorkAssignment,
            'a kfac.assignment.WorkAssignment',
        )
        check_instance(
            'hyperparameters',
            hyperparameters,
            (Hyperparameters, type(None)),
            'None or a kfac.hyperparams.Hyperparameters',
        )
        check_instance(
            'communicator',
            communicator,
            (TorchDistributedCommunicator, type(None)),
            'None or a kfac.distributed.TorchDistributedCommunicator',
        )
        check_bool('bucketed', bucketed)
        self.shard_mode = check_choice('shard_mode', shard_mode, SHARD_MODES)
        check_bool('update_factors_in_hook', update_factors_in_hook)
        check_grad_scaler(grad_scaler)
        self.hyperparameters = hyperparameters or Hyperparameters()
        self.accumulation_steps = validate_int(
            'accumulation_steps', accumulation_steps
        )
        self.loglevel = validate_int('loglevel', loglevel, minimum=0)
        self._layers = dict(layers)
        self.assignment = assignment
        self.update_factors_in_hook = update_factors_in_hook
        self.communicator = communicator or TorchDistributedCommunicator()
        self.bucketed = bucketed
        self._steps = 0
        self._values: tuple[int, HyperparameterValues] | None = None
        self._finished: set[str] = set()
        self._reduction = FactorReduction(self.communicator, bucketed=bucketed)
        self._local_group: ProcessGroup | None = None
        if self.shard_mode == 'local':
            self._local_group = setup_local_mode(self._layers, assignment)
        self._sharded = is_sharded_model(self._layers)
        self._owned = {
            name: owned
            for name, layer in self._layers.items()
            if (owned := owned_entries(layer)) is not None
        }
        self._decomposed: set[str] = set()
        self.counters: Counter[str] = Counter()
        """Preconditioner-wide fault counters (see `metrics`)."""
        self._logged: set[tuple[str, str]] = set()
        self.timer: PhaseTimer | None = None
        """Set a [`PhaseTimer`][kfac.tracing.PhaseTimer] to time the
        step's phases."""
        self._capture = Capture(
            self._layers,
            active=self._factor_step,
            grad_scaler=grad_scaler,
            accumulation_steps=self.accumulation_steps,
            in_hook=update_factors_in_hook,
            on_complete=self._on_captured,
            phase=self._phase,
            log_once=self._log_once,
            aliases=aliases,
        )

    def __repr__(self) -> str:
        return (
            f'{type(self).__name__}(layers={len(self._layers)}, '
            f'steps={self._steps}, {self.hyperparameters})'
        )

    # Read-only views --------------------------------------------------------

    @property
    def steps(self) -> int:
        """Number of completed `step()` calls."""
        return self._steps

    @property
    def layers(self) -> Mapping[str, KFACBaseLayer]:
        """The registered layers by module name."""
        return self._layers

    @property
    def grad_scaler(self) -> GradScalerLike | None:
        """The loss scaler whose scale is divided out of output gradients."""
        return self._capture.grad_scaler

    # Plumbing ---------------------------------------------------------------

    def _phase(self, name: str) -> contextlib.AbstractContextManager[None]:
        timer = self.timer
        return contextlib.nullcontext() if timer is None else timer.phase(name)

    def _log_once(self, key: str, name: str, msg: str, *args: object) -> None:
        if (key, name) not in self._logged:
            self._logged.add((key, name))
            logger.warning(msg, *args)

    def _factor_step(self) -> bool:
        """Whether the current step updates factors."""
        values = self.hyperparameter_values()
        return self._steps % values.factor_update_steps == 0

    def _on_captured(self, name: str) -> None:
        # Capture reports a layer once per step: its tally and our set of
        # finished layers are reset together at every factor update.
        self._finish_factors(name, self._layers[name])

    # The step --------------------------------------------------------------

    def step(self) -> None:
        """Precondition the gradients of the registered layers.

        Call after `loss.backward()` (after the last micro-batch when
        accumulating) and before `optimizer.step()`. Every rank must call
        it.
        """
        if not self._capture.attached:
            raise RuntimeError('this preconditioner was removed')
        if not self._capture.take_fresh():
            self._log_once(
                'no-backward',
                '',
                'K-FAC: step() was called with no backward pass since the '
                'last step() (or since construction); no gradient was '
                'preconditioned and the step count stays at %d',
                self._steps,
            )
            return
        self._capture.follow_modules()
        values = self.hyperparameter_values()
        if self._steps % values.factor_update_steps == 0:
            self._update_factors()
        if self._steps % values.inv_update_steps == 0:
            self._update_decompositions(values.damping)
        active = self._active()
        if self._sharded:
            self._precondition_sharded(active, values)
        else:
            self._precondition(values.damping, active)
            self._apply(values)
        self._steps += 1
        self._capture.next_step()

    def _finish_factors(self, name: str, layer: KFACBaseLayer) -> None:
        """Running-average update of one layer; start its allreduce."""
        self._finished.add(name)
        with self._phase('running_average'):
            finite = layer.update_factors(self.factor_decay)
        if finite is not None:
            with self._phase('factor_allreduce'):
                self._reduction.start(name, layer, finite)
        elif not layer.module.weight.requires_grad:
            self._log_once(
                'frozen',
                name,
                'K-FAC: module %s was frozen after the preconditioner was '
                'built; its factors are not updated until it trains again',
                name,
            )
        else:
            self._log_once(
                'no-data',
                name,
                'K-FAC: module %s did not run forward and backward in step '
                '%d; its factors were not updated and its gradient is left '
                'as it is until they exist',
                name,
                self._steps,
            )

    def _update_factors(self) -> None:
        self._capture.flush()
        for name, layer in self._layers.items():
            if name not in self._finished:
                self._finish_factors(name, layer)
            elif any(layer.captures):
                self._log_once(
                    'reuse',
                    name,
                    'K-FAC: module %s got more backward passes than '
                    'accumulation_steps in one step; the extra passes are '
                    'ignored (set accumulation_steps to the number of '
                    'backward passes per step)',
                    name,
                )
                layer.reset_batch()
        with self._phase('factor_allreduce'):
            bad_count = self._reduction.finish()
        self._finished.clear()
        self._capture.reset()
        if bad_count:
            self.counters['nonfinite_statistics_steps'] += 1
            logger.warning(
                'K-FAC: step %d produced non-finite factor statistics (%d '
                "factor updates on all ranks); this step's statistics were "
                'discarded (%d such steps so far)',
                self._steps,
                bad_count,
                self.counters['nonfinite_statistics_steps'],
            )

    def _update_decompositions(
        self,
        damping: float,
        names: Iterable[str] | None = None,
    ) -> None:
        """Decompose factors on their inverse workers; broadcast them.

        Every rank calls this for the same `names` (default: all layers).
        """
        rank = get_rank()
        plan = self.assignment
        ready = [
            name
            for name in (self._layers if names is None else names)
            if self._layers[name].has_factors
        ]
        jobs = [
            (name, f)
            for name in ready
            for f in FACTOR_NAMES
            if plan.inv_worker(name, f) == rank
        ]
        with self._phase('decomposition'):
            layers = [(self._layers[name], f) for name, f in jobs]
            failed = decompose_all(layers, damping)
        for index in failed:
            name = jobs[index][0]
            self._log_once(
                'decomposition',
                name,
                'K-FAC: decomposing a factor of %s failed in every attempt '
                '(float64, jitter); the last good decomposition is kept, and '
                'without one the gradient goes unpreconditioned (counters: '
                '%s)',
                name,
                dict(self._layers[name].counters),
            )
        self._decomposed.update(ready)
        if plan.broadcast_inverses():
            with self._phase('decomposition_broadcast'):
                broadcast_decompositions(
                    self.communicator,
                    plan,
                    {name: self._layers[name] for name in ready},
                )

    def _active(self) -> list[str]:
        """Layers with a decomposition and a gradient, in layer order."""
        return [
            name
            for name, layer in self._layers.items()
            if name in self._decomposed and layer.has_grad
        ]

    def _precondition(
        self,
        damping: float,
        active: list[str],
        broadcast: list[str] | None = None,
    ) -> None:
        """Precondition the `active` layers on their gradient workers and
        broadcast the results of those in `broadcast` (default: all) to
        the other ranks.
        """
        plan = self.assignment
        with self._phase('precondition'):
            for name in active:
                layer = self._layers[name]
                if plan.is_grad_worker(name):
                    layer.precondition_grad(damping)
                    if not layer.has_decomposition:
                        self._log_once(
                            'unpreconditioned',
                            name,
                            'K-FAC: module %s has no valid decomposition; '
                            'its raw gradient is used this step',
                            name,
                        )
        sent = active if broadcast is None else broadcast
        if plan.broadcast_gradients():
            with self._phase('grad_broadcast'):
                broadcast_grads(
                    self.communicator,
                    plan,
                    {name: self._layers[name] for name in sent},
                )

    def _apply(self, values: HyperparameterValues) -> None:
        """KL-clip the preconditioned gradients and write them back.

        A layer whose preconditioned gradient is not finite keeps its
        original gradient (counted, logged once); one host synchronisation.
        """
        layers = [
            (name, layer)
            for name, layer in self._layers.items()
            if layer.grad is not None
        ]
        if not layers:
            return
        with self._phase('kl_clip'):
            vg = torch.stack(
                [layer.grad_inner_product() for _, layer in layers]
            )
            flags, scale = self._clip(vg, values)
        with self._phase('write_back'):
            self._write_back(layers, flags, scale)

    def _clip(
        self, vg: torch.Tensor, values: HyperparameterValues
    ) -> tuple[list[bool], torch.Tensor | None]:
        """Per layer, whether its `Σ V' ⊙ V` is finite; the KL clip's
        scale (None without a clip). One host synchronisation.
        """
        if self._local_group is not None:
            vg = self._sum_over_shards(vg)
        finite = torch.isfinite(vg)
        scale = None
        if values.kl_clip is not None:
            total = torch.where(finite, vg, torch.zeros_like(vg)).sum()
            scale = kl_clip_scale(total, values.lr, values.kl_clip)
        return finite.tolist(), scale

    def _write_back(
        self,
        layers: list[tuple[str, KFACBaseLayer]],
        flags: list[bool],
        scale: torch.Tensor | None,
    ) -> None:
        """Write each finite preconditioned gradient (times `scale`);
        leave the others' original gradients.
        """
        for (name, layer), ok in zip(layers, flags):
            if ok:
                layer.write_grad(scale)
                continue
            layer.discard_grad()
            self._log_once(
                'nonfinite-grad',
                name,
                'K-FAC: the preconditioned gradient of %s is not finite '
                'in step %d; its original gradient is left in place',
                name,
                self._steps,
            )

    def _sum_over_shards(self, vg: torch.Tensor) -> torch.Tensor:
        """Local mode: each rank's inner products cover its own rows; sum
        them over the shard group.
        """
        group = self._local_group
        assert group is not None  # local mode only
        with self._phase('kl_clip_allreduce'):
            return self.communicator.allreduce(
                vg, group=group, average=False
            ).wait()

    # Housekeeping ------------------------------------------------------------

    def reset_batch(self) -> None:
        """Drop the statistics captured since the last factor update."""
        for layer in self._layers.values():
            layer.reset_batch()
        self._finished.clear()
        self._capture.reset()

    def remove(self) -> None:
        """Remove every hook and drop captured data; `step()` then raises."""
        self._capture.remove()
        self.reset_batch()
