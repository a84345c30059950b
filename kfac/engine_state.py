"""The engine's state as users read and save it.

Hyperparameter values at the current step, fault counters, memory, and
`state_dict()`/`load_state_dict()`. These are methods of
[`BaseKFACPreconditioner`][kfac.base_preconditioner.BaseKFACPreconditioner]
(this class is one of its bases), acting on the engine's own attributes;
the format of the saved state is [`kfac.state`][kfac.state].
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from typing import TYPE_CHECKING
from typing import Any

from kfac.hyperparams import Hyperparameters
from kfac.hyperparams import HyperparameterValues
from kfac.layers.base import FACTOR_NAMES
from kfac.state import LayerSpec
from kfac.state import SavedDecomposition
from kfac.state import SavedLayer
from kfac.state import SavedState
from kfac.state import StateDict
from kfac.state import parse_state
from kfac.state import serialize_state
from kfac.validation import check_bool

if TYPE_CHECKING:
    from collections.abc import Iterable

    from kfac.assignment import WorkAssignment
    from kfac.layers.base import KFACBaseLayer


class EngineState:
    """Reading and saving the state of a
    [`BaseKFACPreconditioner`][kfac.base_preconditioner.BaseKFACPreconditioner].
    """

    hyperparameters: Hyperparameters
    """The schedulable hyperparameters."""
    assignment: WorkAssignment
    """Where each decomposition and preconditioning happens."""
    counters: Counter[str]
    """Preconditioner-wide fault counters (see `metrics`)."""
    _layers: dict[str, KFACBaseLayer]
    _steps: int
    _values: tuple[int, HyperparameterValues] | None
    _decomposed: set[str]

    if TYPE_CHECKING:

        def reset_batch(self) -> None: ...  # noqa: D102  # stub

        def _update_decompositions(
            self, damping: float, names: Iterable[str] | None = None
        ) -> None: ...

    def hyperparameter_values(
        self,
    ) -> HyperparameterValues:
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
        allowed = Hyperparameters.__dataclass_fields__
        unknown = sorted(set(values) - set(allowed))
        if unknown:
            raise ValueError(
                f'unknown hyperparameters {unknown}; allowed: '
                f'{", ".join(allowed)}',
            )
        self.hyperparameters = Hyperparameters(
            **{**self.hyperparameters.__dict__, **values},
        )
        self._values = None

    def metrics(self) -> dict[str, Any]:
        """Fault counters: totals and per layer.

        `nonfinite_statistics_steps`: factor updates discarded because a
        statistic was NaN/Inf on some rank. Per layer (and summed):
        `decomposition_retries` (float64 or jitter attempts that
        succeeded), `decomposition_failures` (all attempts failed),
        `unpreconditioned_steps` (raw gradient used for lack of a
        decomposition) and `nonfinite_gradients` (original gradient kept).
        """
        totals: Counter[str] = Counter(self.counters)
        per_layer = {}
        for name, layer in self._layers.items():
            totals.update(layer.counters)
            per_layer[name] = dict(layer.counters)
        return {**dict(totals), 'layers': per_layer}

    def memory_usage(self) -> dict[str, int]:
        """Bytes held by K-FAC on this rank, by kind, and `'total'`.

        Kinds: `a_factors`, `g_factors`, `a_batch`, `g_batch` (captured
        statistics or activations not yet folded in), `a_inverses`,
        `g_inverses` (decompositions held here) and `grad`.
        """
        usage: dict[str, int] = {}
        for layer in self._layers.values():
            for key, value in layer.memory_usage().items():
                usage[key] = usage.get(key, 0) + value
        usage['total'] = sum(usage.values())
        return usage

    def state_dict(self, include_decompositions: bool = True) -> StateDict:
        """The preconditioner's state (format: [`kfac.state`][kfac.state])."""
        check_bool('include_decompositions', include_decompositions)
        layers = {}
        for name, layer in self._layers.items():
            decomposition = None
            if include_decompositions and layer.has_decomposition:
                decomposition = SavedDecomposition(
                    layer.decomposition_format,
                    {f: layer.decomposition(f) or () for f in FACTOR_NAMES},
                )
            layers[name] = SavedLayer(
                {
                    f.name: f.value
                    for f in layer.factors
                    if f.value is not None
                },
                decomposition,
            )
        state = SavedState(
            self._steps, self.hyperparameters.constants(), layers
        )
        return serialize_state(
            state, include_decompositions=include_decompositions
        )

    def load_state_dict(
        self,
        state_dict: Mapping[str, Any],
        strict: bool = True,
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
        specs = {
            name: LayerSpec(
                {f.name: f.dim for f in layer.factors},
                layer.decomposition_format,
                {
                    f: tuple(s for s, _ in layer.decomposition_layout(f))
                    for f in FACTOR_NAMES
                },
                frozenset(f.name for f in layer.factors if f.diagonal),
            )
            for name, layer in self._layers.items()
        }
        saved = parse_state(state_dict, specs, strict=strict)
        current = self.hyperparameters
        self.set_hyperparameters(
            **{
                key: value
                for key, value in saved.hyperparameters.items()
                if key in current.__dataclass_fields__
                and not callable(getattr(current, key))
            }
        )
        self.reset_batch()
        self._steps = saved.steps
        recompute = []
        for name, layer in self._layers.items():
            entry = saved.layers.get(name, SavedLayer({}))
            for factor in layer.factors:
                layer.set_factor(factor.name, entry.factors.get(factor.name))
            layer.clear_decompositions()
            self._decomposed.discard(name)
            restored = entry.decomposition
            if restored is None:
                recompute.append(name)
                continue
            if self.assignment.is_grad_worker(name):
                for f in FACTOR_NAMES:
                    layer.set_decomposition(f, restored.tensors[f])
            if layer.has_factors:
                self._decomposed.add(name)
        self._update_decompositions(self.damping, recompute)
