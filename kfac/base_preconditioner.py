"""The K-FAC engine: the step's phases, state and introspection.

[`BaseKFACPreconditioner`][kfac.base_preconditioner.BaseKFACPreconditioner]
combines capture (hooks pairing each forward with its backward), the
layers' mathematics ([`kfac.layers`][kfac.layers]), the placement of work
([`WorkAssignment`][kfac.assignment.WorkAssignment]) and communication
([`kfac.distributed`][kfac.distributed]); a gradient placement chosen at
construction (replicated, FSDP2 lossless or local) lets every model take
the same step. [`KFACPreconditioner`][kfac.preconditioner.KFACPreconditioner]
builds it all from a model and keyword arguments.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any

from torch import nn

from kfac._engine.capture import Capture
from kfac._engine.capture import GradScalerLike
from kfac._engine.capture import check_grad_scaler
from kfac._engine.grad_placement import make_placement
from kfac._engine.phases import FactorUpdates
from kfac._engine.phases import Faults
from kfac._engine.phases import decompose
from kfac._engine.phases import precondition
from kfac._engine.scales import ScaleUpdates
from kfac.assignment import WorkAssignment
from kfac.distributed import TorchDistributedCommunicator
from kfac.hyperparams import Hyperparameters
from kfac.hyperparams import HyperparameterValues
from kfac.layers.base import KFACBaseLayer
from kfac.state import StateDict
from kfac.state import load_layers
from kfac.state import save_layers
from kfac.tracing import PhaseTimer
from kfac.tracing import fault_counts
from kfac.tracing import memory_totals
from kfac.validation import check_bool
from kfac.validation import check_choice
from kfac.validation import check_instance
from kfac.validation import check_mapping
from kfac.validation import validate_int

__all__ = ['SHARD_MODES', 'BaseKFACPreconditioner', 'GradScalerLike']

SHARD_MODES = ('lossless', 'local')
"""How gradients of FSDP2-sharded parameters are preconditioned."""

logger = logging.getLogger(__name__)


class BaseKFACPreconditioner:
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
            (no gradient communication; an approximation).

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
        self._placement = make_placement(
            self.shard_mode,
            self._layers,
            assignment,
            self.communicator,
            self._phase,
        )
        self._decomposed: set[str] = set()
        self._faults = Faults(logger)
        self.counters = self._faults.counters
        """Preconditioner-wide fault counters (see `metrics`)."""
        self._log_once = self._faults.once
        self._factors = FactorUpdates(
            self._layers,
            self.communicator,
            bucketed=bucketed,
            phase=self._phase,
            faults=self._faults,
        )
        self._scales = ScaleUpdates(
            self._layers, assignment, self.communicator, bucketed, self._phase
        )
        self.timer: PhaseTimer | None = None
        """Set a [`PhaseTimer`][kfac.tracing.PhaseTimer] to time the
        step's phases."""
        self._capture = Capture(
            self._layers,
            active=lambda: self._steps % self.factor_update_steps == 0,
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

    def _on_captured(self, name: str) -> None:
        # Capture reports a layer once per step: its tally and our set of
        # finished layers are reset together at every factor update.
        self._factors.finish(name, self.factor_decay, self._steps)

    # Hyperparameters and state ---------------------------------------------

    def hyperparameter_values(self) -> HyperparameterValues:
        """The hyperparameters' values at the current step (resolved once
        per step; a schedule's value is validated then).
        """
        if self._values is None or self._values[0] != self._steps:
            values = self.hyperparameters.at(self._steps)
            self._values = (self._steps, values)
        return self._values[1]

    @property
    def factor_update_steps(self) -> int:
        """Current steps between factor updates."""
        return self.hyperparameter_values().factor_update_steps

    @property
    def inv_update_steps(self) -> int:
        """Current steps between decompositions."""
        return self.hyperparameter_values().inv_update_steps

    @property
    def damping(self) -> float:
        """Current damping `λ`."""
        return self.hyperparameter_values().damping

    @property
    def factor_decay(self) -> float:
        """Current running-average decay `ξ`."""
        return self.hyperparameter_values().factor_decay

    @property
    def kl_clip(self) -> float | None:
        """Current KL clip `κ` (None: disabled)."""
        return self.hyperparameter_values().kl_clip

    @property
    def lr(self) -> float:
        """Current learning rate used by KL clipping."""
        return self.hyperparameter_values().lr

    def set_hyperparameters(self, **values: Any) -> None:
        """Replace hyperparameters (validated), e.g. from a scheduler."""
        self.hyperparameters = self.hyperparameters.replace(**values)
        self._values = None

    def metrics(self) -> dict[str, Any]:
        """Fault counters, totals and per layer: `nonfinite_statistics_steps`
        (factor updates discarded because a
        statistic was NaN/Inf on some rank); per layer (and summed):
        `decomposition_retries` (float64 or jitter attempts that
        succeeded), `decomposition_failures` (all attempts failed),
        `unpreconditioned_steps` (raw gradient used for lack of a
        decomposition) and `nonfinite_gradients` (original gradient kept).
        """
        return fault_counts(self.counters, self._layers)

    def memory_usage(self) -> dict[str, int]:
        """Bytes held by K-FAC on this rank, by kind, and `'total'`.

        Kinds: `a_factors`, `g_factors`, `a_batch`, `g_batch` (captured
        statistics or activations not yet folded in), `a_inverses`,
        `g_inverses` (decompositions held here), `grad`; EKFAC's `scale`
        and `example_rows`.
        """
        return memory_totals(self._layers.values())

    def state_dict(self, include_decompositions: bool = True) -> StateDict:
        """The preconditioner's state (format: [`kfac.state`][kfac.state])."""
        check_bool('include_decompositions', include_decompositions)
        return save_layers(
            self._steps,
            self.hyperparameters.constants(),
            self._layers,
            include_decompositions=include_decompositions,
        )

    def load_state_dict(
        self, state_dict: Mapping[str, Any], strict: bool = True
    ) -> None:
        """Load `state_dict()` output; inverses are recomputed where needed.

        Every rank calls this with the same state: layers whose
        decompositions are recomputed take part in broadcasts.

        Raises:
            TypeError: `state_dict` is not a mapping.
            ValueError: wrong version, missing entries, wrongly shaped
                factors, and (`strict`) missing or unexpected layers;
                nothing is changed then.
        """
        check_bool('strict', strict)
        saved, recompute, restored = load_layers(
            state_dict,
            self._layers,
            self.assignment.holds_decomposition,
            strict=strict,
        )
        self.reset_batch()
        self.hyperparameters = self.hyperparameters.restored(
            saved.hyperparameters
        )
        self._values = None
        self._steps = saved.steps
        self._decomposed = set(restored)
        self._update_decompositions(self.damping, recompute)

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
        factors = self._steps % values.factor_update_steps == 0
        if factors:
            self._update_factors()
        if self._steps % values.inv_update_steps == 0:
            self._scales.restart(self._update_decompositions(values.damping))
        if factors:  # EKFAC: in the bases in force from now on
            self._scales.update(values.factor_decay, values.damping)
        precondition(
            self._placement,
            self._active(),
            values,
            self._steps,
            phase=self._phase,
            log_once=self._log_once,
        )
        self._steps += 1
        self._capture.next_step()

    def _update_factors(self) -> None:
        """Fold the captured statistics in; allreduce the factors."""
        self._capture.flush()
        self._factors.update(self.factor_decay, self._steps)
        self._capture.reset()

    def _update_decompositions(
        self, damping: float, names: Iterable[str] | None = None
    ) -> list[str]:
        """Decompose factors on their inverse workers, broadcast them and
        return the layers decomposed. Every rank calls this for the same
        `names` (default: all layers).
        """
        done = decompose(
            self._layers,
            self._layers if names is None else names,
            self.assignment,
            self.communicator,
            damping,
            phase=self._phase,
            log_once=self._log_once,
        )
        self._decomposed.update(done)
        return done

    def _active(self) -> list[str]:
        """Layers with a decomposition and a gradient, in layer order."""
        done = self._decomposed
        return [n for n, x in self._layers.items() if n in done and x.has_grad]

    # Housekeeping ------------------------------------------------------------

    def reset_batch(self) -> None:
        """Drop the statistics captured since the last factor update."""
        for layer in self._layers.values():
            layer.reset_batch()
        self._factors.reset()
        self._capture.reset()

    def remove(self) -> None:
        """Remove every hook and drop captured data; `step()` then raises."""
        self._capture.remove()
        self.reset_batch()
