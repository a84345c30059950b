"""The engine's state through its layers: each layer saves and loads its
own part; these pure functions assemble and apply the whole (format:
[`kfac.state`][kfac.state]).
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Mapping
from typing import Protocol

from kfac.state import LayerSpec
from kfac.state import SavedLayer
from kfac.state import SavedState
from kfac.state import StateDict
from kfac.state import parse_state
from kfac.state import serialize_state

__all__ = ['StatefulLayer', 'load_layers', 'save_layers']


class StatefulLayer(Protocol):
    """What `save_layers` and `load_layers` need of a layer (a
    [`KFACBaseLayer`][kfac.layers.base.KFACBaseLayer] has it).
    """

    @property
    def has_factors(self) -> bool: ...

    def state_spec(self) -> LayerSpec: ...

    def saved_state(self, include_decompositions: bool) -> SavedLayer: ...

    def load_saved_state(self, saved: SavedLayer, keep: bool) -> bool: ...


def save_layers(
    steps: int,
    hyperparameters: Mapping[str, float | int | None],
    layers: Mapping[str, StatefulLayer],
    *,
    options: Mapping[str, str | int],
    include_decompositions: bool,
) -> StateDict:
    """The state of a preconditioner at `steps` with these constant
    hyperparameters, engine options and layers, each saving its own.
    """
    saved = {
        name: layer.saved_state(include_decompositions)
        for name, layer in layers.items()
    }
    return serialize_state(
        SavedState(steps, dict(hyperparameters), saved, dict(options)),
        include_decompositions=include_decompositions,
    )


def load_layers(
    state: object,
    layers: Mapping[str, StatefulLayer],
    keep: Callable[[str], bool],
    *,
    strict: bool,
) -> tuple[SavedState, list[str], list[str]]:
    """Check `state` against `layers`, then load each layer's part.

    Args:
        state: what `state_dict()` returned.
        layers: the loading preconditioner's layers.
        keep: whether this rank keeps a layer's saved decompositions (it
            is a gradient worker of that layer).
        strict: missing or unexpected layers are errors.

    Returns:
        The parsed state; the layers whose decompositions must be
        recomputed (none saved); those whose saved ones were restored.

    Raises:
        TypeError, ValueError: see
            [`parse_state`][kfac.state.parse_state]; nothing is loaded then.
    """
    specs = {name: layer.state_spec() for name, layer in layers.items()}
    saved = parse_state(state, specs, strict=strict)
    recompute, restored = [], []
    for name, layer in layers.items():
        entry = saved.layers.get(name, SavedLayer({}))
        if not layer.load_saved_state(entry, keep=keep(name)):
            recompute.append(name)
        elif layer.has_factors:
            restored.append(name)
    return saved, recompute, restored
