"""The K-FAC engine: the step's phases, state and introspection.

[`BaseKFACPreconditioner`][kfac.base_preconditioner.BaseKFACPreconditioner]
combines capture (hooks pairing each forward with its backward), the
layers' mathematics ([`kfac.layers`][kfac.layers]), the placement of work
([`WorkAssignment`][kfac.assignment.WorkAssignment]) and communication
([`kfac.distributed`][kfac.distributed]); a gradient distributor chosen at
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
from kfac._engine.curvature_updates import CurvatureUpdates
from kfac._engine.decompositions import decompose
from kfac._engine.distributor import Replicated
from kfac._engine.distributor import make_distributor
from kfac._engine.factors import FactorUpdates
from kfac._engine.gradient_factors import GradientFactors
from kfac._engine.gradient_factors import split_by_source
from kfac._engine.preconditioning import precondition
from kfac.assignment import WorkAssignment
from kfac.config import EngineOptions
from kfac.distributed import TorchDistributedCommunicator
from kfac.distributed._statistics import gather_worker_statistics
from kfac.enums import AccumulationDivisor
from kfac.hyperparams import Hyperparameters
from kfac.hyperparams import HyperparameterValues
from kfac.hyperparams import OptimizerLR
from kfac.layers.base import KFACBaseLayer
from kfac.state import SavedFaults
from kfac.state import StateDict
from kfac.state import load_layers
from kfac.state import save_layers
from kfac.tracing import ClipMonitor
from kfac.tracing import Faults
from kfac.tracing import PhaseTimer
from kfac.tracing import fault_counts
from kfac.tracing import memory_totals
from kfac.tracing import plot_metrics
from kfac.validation import check_bool
from kfac.validation import check_instance
from kfac.validation import check_mapping

__all__ = ['BaseKFACPreconditioner', 'GradScalerLike']

logger = logging.getLogger(__name__)


class BaseKFACPreconditioner:
    """Minimal K-FAC engine over registered layers.

    Args:
        layers: `{module name: layer}`; the hooks are registered on each
            layer's module.
        assignment: where each decomposition and preconditioning happens.
        hyperparameters: the schedulable hyperparameters (the learning
            rate may be an [`OptimizerLR`][kfac.hyperparams.OptimizerLR]).
        options: how a step runs
            ([`EngineOptions`][kfac.config.EngineOptions]: accumulation,
            hooks, bucketing, FSDP2 shard mode).
        grad_scaler: the loss scaler of mixed-precision training, whose
            scale is divided out of output gradients.
        communicator: collectives; default a bucketed
            [`TorchDistributedCommunicator`][kfac.distributed.TorchDistributedCommunicator].
        aliases: per layer name, further modules sharing its weight whose
            calls count as calls of its module.
    """

    def __init__(
        self,
        layers: Mapping[str, KFACBaseLayer],
        *,
        assignment: WorkAssignment,
        hyperparameters: Hyperparameters | None = None,
        options: EngineOptions | None = None,
        grad_scaler: GradScalerLike | None = None,
        communicator: TorchDistributedCommunicator | None = None,
        aliases: Mapping[str, Sequence[nn.Module]] | None = None,
    ) -> None:
        check_mapping('layers', layers, KFACBaseLayer, 'KFACBaseLayer')
        check_instance(
            'assignment',
            assignment,
            WorkAssignment,
            'a kfac.assignment.WorkAssignment',
        )
        for name, value, kind, where in (
            (
                'hyperparameters',
                hyperparameters,
                Hyperparameters,
                'hyperparams',
            ),
            ('options', options, EngineOptions, 'config'),
            (
                'communicator',
                communicator,
                TorchDistributedCommunicator,
                'distributed',
            ),
        ):
            check_instance(
                name,
                value,
                (kind, type(None)),
                f'None or a kfac.{where}.{kind.__name__}',
            )
        check_grad_scaler(grad_scaler)
        self.hyperparameters = hyperparameters or Hyperparameters()
        self.options = options or EngineOptions()
        self._layers = dict(layers)
        self.assignment = assignment
        self.communicator = communicator or TorchDistributedCommunicator()
        self._steps = 0
        self._values: tuple[int, HyperparameterValues] | None = None
        self._distributor = make_distributor(
            self.options.shard_mode,
            self._layers,
            assignment,
            self.communicator,
            self._phase,
        )
        hooked, own = split_by_source(self._layers)
        if own and not isinstance(self._distributor, Replicated):
            raise ValueError(
                "source='gradient' needs the whole averaged gradient on "
                'every rank, which a model sharded with FSDP2 does not '
                f"have (layers {sorted(own)}); use source='kfac'",
            )
        self._gradient_factors = GradientFactors(own, self._phase)
        self._removed = False
        self._decomposed: set[str] = set()
        self._faults = Faults(logger)
        self.counters = self._faults.counters
        """Preconditioner-wide fault counters (see `metrics`)."""
        self._log_once = self._faults.once
        self._factors = FactorUpdates(
            hooked,
            self.communicator,
            bucketed=self.options.bucketed,
            phase=self._phase,
            faults=self._faults,
            assignment=assignment,
            compiled=self.options.compile_arithmetic,
            max_nonfinite_statistics=self.options.max_nonfinite_statistics,
            max_decomposition_failures=(
                self.options.max_decomposition_failures
            ),
        )
        self._clips = ClipMonitor(self._faults)
        self._curvatures = CurvatureUpdates(
            self._layers,
            assignment,
            self.communicator,
            self.options.bucketed,
            self._phase,
        )
        self.timer: PhaseTimer | None = None
        """Set a [`PhaseTimer`][kfac.tracing.PhaseTimer] to time the
        step's phases."""
        self._capture = Capture(
            hooked,
            active=lambda: self._steps % self.factor_update_steps == 0,
            grad_scaler=grad_scaler,
            accumulation_steps=self.options.accumulation_steps,
            in_hook=self.options.update_factors_in_hook,
            on_complete=lambda name: self._factors.finish(  # once a step
                name, self.factor_decay, self._steps
            ),
            phase=self._phase,
            log_once=self._log_once,
            aliases={n: a for n, a in (aliases or {}).items() if n in hooked},
        )

    def __repr__(self) -> str:
        return (
            f'{type(self).__name__}(layers={len(self._layers)}, '
            f'steps={self._steps}, {self.hyperparameters})'
        )

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

    def _phase(self, name: str) -> contextlib.AbstractContextManager[None]:
        timer = self.timer
        return contextlib.nullcontext() if timer is None else timer.phase(name)

    def hyperparameter_values(self) -> HyperparameterValues:
        """The hyperparameters' values at the current step (resolved once
        per step; a schedule's value is validated then).
        """
        if self._values is None or self._values[0] != self._steps:
            self._values = (self._steps, self.hyperparameters.at(self._steps))
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
    def relative_clip(self) -> float | None:
        """Current relative clip `ρ` (None: disabled)."""
        return self.hyperparameter_values().relative_clip

    @property
    def lr(self) -> float:
        """Current learning rate of the clip (`optimizer=`: read now)."""
        lr = self.hyperparameters.lr
        if isinstance(lr, OptimizerLR):
            return lr(self._steps)
        return self.hyperparameter_values().lr

    def set_hyperparameters(self, **values: Any) -> None:
        """Replace hyperparameters (validated), e.g. from a scheduler."""
        self.hyperparameters = self.hyperparameters.replace(**values)
        self._values = None
        self._capture.refresh()

    def metrics(self) -> dict[str, Any]:
        """Fault counters, totals and per layer: `nonfinite_statistics_steps`
        (factor updates discarded because a
        statistic was NaN/Inf on some rank) and
        `nonfinite_statistics_in_a_row` (those since the last update kept;
        absent when none); per layer (and summed):
        `decomposition_retries` (float64 or jitter attempts that
        succeeded), `decomposition_failures` (all attempts failed),
        `unpreconditioned_steps` (raw gradient used for lack of a
        decomposition) and `nonfinite_gradients` (original gradient kept);
        per layer only, `decomposition_failures_in_a_row` (`{factor:
        count}` of the factors whose last decompositions failed in every
        attempt; on a factor's inverse worker as of its last
        decomposition, on the other ranks as of the factor update after
        it; absent when none).
        Of the last preconditioned step (None before one): `kl_clip_scale`
        (the clip's `ν`; 1.0 when it did not clip) and `grad_norm_ratio`
        (`‖ν V'‖ / ‖V‖` over all preconditioned layers), read with the
        step's one host read. To plot: `damping`, per layer `trace_A`,
        `trace_G` (factor traces) and, with a `timer`, `kfac_time_share`
        ([`PhaseTimer.share`][kfac.tracing.PhaseTimer.share]).
        """
        metrics = fault_counts(self.counters, self._layers)
        for name, layer in self._layers.items():
            if layer.failures_in_a_row:
                metrics['layers'][name]['decomposition_failures_in_a_row'] = (
                    dict(layer.failures_in_a_row)
                )
        metrics.update(self._clips.metrics())
        return plot_metrics(metrics, self._layers, self.damping, self.timer)

    def memory_usage(self) -> dict[str, int]:
        """Bytes held by K-FAC on this rank, by kind, and `'total'`.

        Kinds: `a_factors`, `g_factors`, `a_batch`, `g_batch` (captured
        statistics or activations not yet folded in), `a_inverses`,
        `g_inverses` (decompositions held here), `grad`; EKFAC's `scale`
        and `example_rows`; EIGEN_ADAM's `moment` (its second moments and
        the copy of the bases they are kept in).
        """
        return memory_totals(self._layers.values())

    def state_dict(self, include_decompositions: bool = True) -> StateDict:
        """The preconditioner's state (format: [`kfac.state`][kfac.state])."""
        check_bool('include_decompositions', include_decompositions)
        gathered = gather_worker_statistics(
            self.communicator, self.assignment, self._layers
        )
        state = save_layers(
            self._steps,
            self.hyperparameters.constants(),
            self._layers,
            options=self.options.saved(),
            include_decompositions=include_decompositions,
            faults=SavedFaults(
                dict(self.counters),
                {
                    name: {
                        f: (count, layer.failed_traces.get(f, 0.0))
                        for f, count in layer.failures_in_a_row.items()
                    }
                    for name, layer in self._layers.items()
                    if layer.failures_in_a_row
                },
            ),
        )
        for name, statistics in gathered.items():
            entry = state['layers'].setdefault(name, {})
            for key, tensor in statistics.items():
                entry[key] = tensor.detach().clone()
        return state

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
        self._capture.refresh()
        self.options = self.options.restored(saved.options)
        self._restore_faults(saved.faults)
        self._decomposed = set(restored)
        self._update_decompositions(self.damping, recompute)

    def _restore_faults(self, faults: SavedFaults) -> None:
        """Replace the fault counts of the preconditioner and its layers
        with saved ones.
        """
        self.counters.clear()
        self.counters.update(faults.counters)
        for name, layer in self._layers.items():
            saved = faults.failures.get(name, {})
            layer.failures_in_a_row.clear()
            layer.failures_in_a_row.update(
                {f: count for f, (count, _) in saved.items()}
            )
            layer.failed_traces = {f: trace for f, (_, trace) in saved.items()}

    def step(self) -> None:
        """Precondition the gradients of the registered layers.

        Call after `loss.backward()` (after the last micro-batch when
        accumulating) and before `optimizer.step()`. Every rank must call
        it.
        """
        if self._removed:
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
        if self._gradient_factors.layers:  # not entered without them
            self._gradient_factors.follow_modules()
        self._values = None  # read the optimizer's learning rate now
        values = self.hyperparameter_values()
        factors = self._steps % values.factor_update_steps == 0
        if factors:
            self._update_factors()
        if self._steps % values.inv_update_steps == 0:
            self._curvatures.restart(
                self._update_decompositions(values.damping)
            )
        if factors:  # curvature statistics, in the bases now in force
            self._curvatures.update(values.factor_decay, values.damping)
        precondition(
            self._distributor,
            self._active(),
            values,
            self._steps,
            phase=self._phase,
            log_once=self._log_once,
            monitor=self._clips,
        )
        self._steps += 1
        self._capture.next_step()

    def _update_factors(self) -> None:
        """Fold the captured statistics in; allreduce the factors."""
        self._capture.flush()
        self._short_step()
        self._factors.update(self.factor_decay, self._steps)
        if self._gradient_factors.layers:
            self._gradient_factors.update(self.factor_decay)
        self._capture.reset()

    def _short_step(self) -> None:
        """On a step after fewer backward passes than
        `accumulation_steps`, take the output gradients as the unscaled
        loss's (see `short_step_ratio`).
        """
        ratio = self.short_step_ratio(self._capture.passes())
        if ratio != 1.0:  # loss_average is model-wide: every layer's
            for layer in self._layers.values():
                layer.statistics.scale_output_gradients(ratio)

    def short_step_ratio(self, passes: int) -> float:
        """How much larger than the hooks took them a step's output
        gradients are, after `passes` backward passes.

        The hooks multiply each pass's output gradients back by
        `accumulation_steps`; after fewer passes, with
        `accumulation_divisor='passes'`, the trainer divided the losses by
        `passes` instead: the ratio is `passes / accumulation_steps`.
        Otherwise 1, and the divisor does not matter with a summed loss
        (no multiplier) or with a sink of output gradients (the Monte
        Carlo Fisher scales its sampled losses itself).

        Raises:
            ValueError: a short step whose divisor matters, and no
                `accumulation_divisor` was given.
        """
        expected = self.options.accumulation_steps
        averaged = any(
            layer.statistics.loss_average is not None
            for layer in self._layers.values()
        )
        sampled = self._capture.sink is not None
        if not (0 < passes < expected and averaged) or sampled:
            return 1.0
        divisor = self.options.accumulation_divisor
        if divisor is None:
            raise ValueError(
                f'K-FAC: step() after {passes} backward passes, fewer than '
                f'accumulation_steps={expected} (a trainer steps after the '
                'last batches of an epoch); say what each loss was divided '
                'by: KFACPreconditioner(..., statistics=StatisticsConfig('
                "accumulation_divisor='accumulation_steps')) for Lightning "
                'or a loop dividing by accumulation_steps, '
                "accumulation_divisor='passes' for the Hugging Face Trainer",
            )
        if divisor == AccumulationDivisor.PASSES:
            return passes / expected
        return 1.0

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

    def reset_batch(self) -> None:
        """Drop the statistics captured since the last factor update."""
        for layer in self._layers.values():
            layer.reset_batch()
        self._factors.reset()
        self._capture.reset()

    def remove(self) -> None:
        """Remove every hook and drop captured data; `step()` then raises."""
        self._capture.remove()
        self._removed = True
        self.reset_batch()
