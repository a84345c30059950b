"""A preconditioner's saved state: its format, and how layers give theirs.

Pure functions between the plain mapping that
[`state_dict()`][kfac.base_preconditioner.BaseKFACPreconditioner.state_dict]
returns and a typed, validated [`SavedState`][kfac.state.SavedState]; the
engine builds the `SavedState` from its layers and applies a parsed one
to them. The mapping holds only tensors, numbers, strings, lists and
dicts, so `torch.load(path, weights_only=True)` reads it:

```python
{
    'version': 6,
    'steps': int,
    'hyperparameters': {name: value},   # the non-callable ones
    'options': {'position_sample_seed': int},
    'layers': {module name: {'A': tensor, 'G': tensor}},  # (n, n) or (n,)
    # a tied layer: {'<use>:A': ..., '<use>:G': ...} per use instead
    # an EKFAC layer: also 'S', its scaling, shaped like the gradient
    # an EIGEN_ADAM layer: also 'E' (its second moments, shaped like the
    # gradient) and 'E_steps' (their update count, 0-d)
    'decompositions': {                 # optional
        module name: {'format': str, 'A': [tensor, ...], 'G': [...]},
    },
    'fisher': {'fisher_type': str, 'mc_samples': int, 'mc_seed': int},
    'faults': {
        'counters': {name: int},        # nonfinite_statistics_steps, ...
        'failures': {module name: {'A': [int, float], 'G': [...]}},
    },
}
```

`'faults'` keeps the preconditioner-wide fault counters (identical on
every rank: `nonfinite_statistics_steps`,
`nonfinite_statistics_in_a_row`) and, per layer and factor, its
decompositions that failed in a row and the trace of the last such matrix
(`[count, trace]`, only for factors with failures), as this rank knows
them: the limits of [`StatisticsConfig`][kfac.config.StatisticsConfig]
count on from there after a resume.

`'fisher'` (written by
[`KFACPreconditioner`][kfac.preconditioner.KFACPreconditioner]) holds the
Monte Carlo Fisher's settings: with the step count they key every sampled
target (see [`kfac.math.fisher`][kfac.math.fisher]), so a resumed run
samples what the uninterrupted run would have.

Factors, and the running statistics kept beside them (EKFAC's scaling `S`,
identical on every rank like the factors; EIGEN_ADAM's second moments `E`,
kept on the layer's gradient workers and gathered from them by
`state_dict()`, which every rank then calls), are what a run cannot
recompute. A diagonal factor (the `A` of an
embedding) is saved as its diagonal, shape `(n,)`. Decompositions are saved too
(for the layers whose decompositions this rank holds) so that a resumed
run uses exactly the decompositions the uninterrupted run would have used
until the next inverse update; a layer without a compatible saved
decomposition has it recomputed on load.

Every change of this layout bumps [`STATE_VERSION`][kfac.state.STATE_VERSION]
and keeps a loader for the previous version (see `CHANGELOG.md`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from collections.abc import Mapping
from typing import Protocol
from typing import TypedDict

import torch

from kfac.math.fisher import FisherState

STATE_VERSION = 6
"""The format version written by this version of kfac."""

READABLE_VERSIONS = (1, 2, 3, 4, 5, 6)
"""The format versions this version of kfac loads. Version 2 adds the
per-use factors of a weight tied in transposed roles (`'<module>:A'`,
`'<module>:G'`, see [`kfac.layers.tied`][kfac.layers.tied]); version 3
the engine's `'options'` (the clip rule) and EKFAC's scaling `'S'` in a
layer's entries (see
[`kfac.layers.curvature.ekfac`][kfac.layers.curvature.ekfac]). An older
state is a newer one without what was added, loaded as it is: a state
without `'options'` loads with `kl_clip_rule='kl'`, the only rule before
version 3, and an EKFAC layer without `'S'` starts its scaling afresh at
its next factor update. Version 4 adds `'fisher'` (the Monte Carlo
Fisher's seed) and `'position_sample_seed'` to `'options'` (see
[`kfac.layers.sampling`][kfac.layers.sampling]); a state without either
keeps the loading preconditioner's seed. Version 5 saves the two clips as
hyperparameters (`kl_clip`, `relative_clip`) instead of one `kl_clip` read
by `'options'`' `kl_clip_rule`; an older state is read as version 5 (its
`kl_clip` under `'relative'` is `relative_clip`). Version 6 adds
`'faults'` (the consecutive failures of each factor's decomposition and
the non-finite statistics in a row; an older state loads with no faults
counted) and EIGEN_ADAM's second moments `'E'` and their count
`'E_steps'` to a layer's entries, gathered from its gradient workers into
every rank's state (see
[`kfac.layers.curvature.eigen_adam`][kfac.layers.curvature.eigen_adam]);
no older state holds an EIGEN_ADAM layer, so one is loaded as it is."""

FACTOR_KEYS = ('A', 'G')
"""The factor entries of a layer."""


class DecompositionEntry(TypedDict):
    """A layer's saved decomposition: its format and each factor's
    tensors.
    """

    format: str
    A: list[torch.Tensor]
    G: list[torch.Tensor]


class _RequiredEntries(TypedDict):
    version: int
    steps: int
    hyperparameters: dict[str, float | int | None]
    layers: dict[str, dict[str, torch.Tensor]]


class StateDict(_RequiredEntries, total=False):
    """The mapping of the module docstring (`decompositions` optional;
    `options` always written from version 3 on).
    """

    options: dict[str, str | int]

    decompositions: dict[str, DecompositionEntry]

    fisher: FisherState

    faults: FaultEntry


class FaultEntry(TypedDict):
    """The saved fault counts (version 6)."""

    counters: dict[str, int]
    failures: dict[str, dict[str, list[float]]]


@dataclasses.dataclass(frozen=True)
class SavedFaults:
    """The fault counts that outlive a resume."""

    counters: Mapping[str, int] = dataclasses.field(default_factory=dict)
    """The preconditioner-wide fault counters."""
    failures: Mapping[str, Mapping[str, tuple[int, float]]] = (
        dataclasses.field(default_factory=dict)
    )
    """Per layer, per factor with failures: its decompositions failed
    in a row, and the trace of the last such matrix."""


@dataclasses.dataclass(frozen=True)
class SavedDecomposition:
    """A layer's decomposition as saved."""

    format: str
    """Layout name, e.g. `'eigen'`; must match the loading layer's."""
    tensors: Mapping[str, tuple[torch.Tensor, ...]]
    """Factor name (`'A'`, `'G'`) to its decomposition's tensors."""


@dataclasses.dataclass(frozen=True)
class SavedLayer:
    """One layer's saved state."""

    factors: Mapping[str, torch.Tensor]
    """The running factors that exist, by name (`'A'`, `'G'`)."""
    decomposition: SavedDecomposition | None = None
    """Its decomposition, if saved (and, when parsed, compatible)."""
    statistics: Mapping[str, torch.Tensor] = dataclasses.field(
        default_factory=dict
    )
    """Other running statistics that exist, by name (EKFAC's `'S'`)."""


@dataclasses.dataclass(frozen=True)
class SavedState:
    """A preconditioner's state, typed."""

    steps: int
    """Completed steps."""
    hyperparameters: Mapping[str, float | int | None]
    """The hyperparameters that are constants, by name."""
    layers: Mapping[str, SavedLayer]
    """Per layer, by module name."""
    options: Mapping[str, str | int] = dataclasses.field(default_factory=dict)
    """The engine's saved options (`position_sample_seed` from version 4;
    version 3 and 4 had `kl_clip_rule` too, read into the
    hyperparameters); empty before version 3."""
    faults: SavedFaults = dataclasses.field(default_factory=SavedFaults)
    """The fault counts (none before version 6)."""


@dataclasses.dataclass(frozen=True)
class LayerSpec:
    """What the state of one layer of the loading preconditioner must look
    like.
    """

    factor_dims: Mapping[str, int]
    """Factor name to its side `n` (the factor is `(n, n)`)."""
    decomposition_format: str
    """The layer's decomposition format."""
    decomposition_shapes: Mapping[str, tuple[tuple[int, ...], ...]]
    """Factor name to the shapes of its decomposition's tensors."""
    diagonal_factors: frozenset[str] = frozenset()
    """The factors kept as their diagonal (shape `(n,)`, not `(n, n)`)."""
    statistic_shapes: Mapping[str, tuple[int, ...]] = dataclasses.field(
        default_factory=dict
    )
    """Other running statistics, by name, and their shapes."""


def serialize_state(
    state: SavedState, *, include_decompositions: bool
) -> StateDict:
    """The mapping of `state` (tensors detached and cloned)."""
    layers: dict[str, dict[str, torch.Tensor]] = {}
    decompositions: dict[str, DecompositionEntry] = {}
    for name, layer in state.layers.items():
        layers[name] = {
            key: value.detach().clone()
            for key, value in {**layer.factors, **layer.statistics}.items()
        }
        saved = layer.decomposition
        if include_decompositions and saved is not None:
            a, g = (
                [t.detach().clone() for t in saved.tensors[key]]
                for key in FACTOR_KEYS
            )
            decompositions[name] = {'format': saved.format, 'A': a, 'G': g}
    result: StateDict = {
        'version': STATE_VERSION,
        'steps': state.steps,
        'hyperparameters': dict(state.hyperparameters),
        'options': dict(state.options),
        'layers': layers,
        'faults': {
            'counters': dict(state.faults.counters),
            'failures': {
                name: {f: [count, trace] for f, (count, trace) in x.items()}
                for name, x in state.faults.failures.items()
            },
        },
    }
    if include_decompositions:
        result['decompositions'] = decompositions
    return result


def _check_header(state: object) -> Mapping[str, object]:
    if not isinstance(state, Mapping):
        raise TypeError(
            f'state_dict must be a mapping; got {type(state).__name__}',
        )
    version = state.get('version')
    if version not in READABLE_VERSIONS or isinstance(version, bool):
        raise ValueError(
            f'state_dict has format version {version!r}; this version of '
            f'kfac reads versions {", ".join(map(str, READABLE_VERSIONS))}',
        )
    for key in ('steps', 'layers', 'hyperparameters'):
        if key not in state:
            raise ValueError(f'state_dict is missing the entry {key!r}')
    for key, kind in (('layers', Mapping), ('hyperparameters', Mapping)):
        if not isinstance(state[key], kind):
            raise TypeError(
                f'state_dict entry {key!r} must be a mapping; got '
                f'{type(state[key]).__name__}',
            )
    steps = state['steps']
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise ValueError(
            f"state_dict entry 'steps' must be an int >= 0; got {steps!r}",
        )
    return state


def _layer_problems(
    specs: Mapping[str, LayerSpec],
    saved: Mapping[str, object],
    strict: bool,
) -> list[str]:
    """Every mismatch between `saved` layers and `specs`, as messages."""
    problems = []
    if strict and (unexpected := sorted(saved.keys() - specs.keys())):
        problems.append(f'unexpected layers: {", ".join(unexpected)}')
    if strict and (missing := sorted(specs.keys() - saved.keys())):
        problems.append(f'missing layers: {", ".join(missing)}')
    for name in saved.keys() & specs.keys():
        entry = saved[name]
        if not isinstance(entry, Mapping):
            problems.append(f'layers.{name} is not a mapping')
            continue
        for key, tensor in entry.items():
            spec = specs[name]
            if key in spec.statistic_shapes:
                expected = tuple(spec.statistic_shapes[key])
            elif key in spec.factor_dims:
                dim = spec.factor_dims[key]
                diagonal = key in spec.diagonal_factors
                expected = (dim,) if diagonal else (dim, dim)
            else:
                problems.append(f'unexpected entry layers.{name}.{key}')
                continue
            shape = tuple(getattr(tensor, 'shape', ()))
            if not isinstance(tensor, torch.Tensor) or shape != expected:
                problems.append(
                    f'layers.{name}.{key} has shape {shape}, expected '
                    f'{expected}',
                )
    return problems


def _decomposition(
    spec: LayerSpec, entry: object
) -> SavedDecomposition | None:
    """The saved decomposition if it fits `spec` exactly, else None."""
    if not isinstance(entry, Mapping):
        return None
    if entry.get('format') != spec.decomposition_format:
        return None
    tensors = {}
    for key in FACTOR_KEYS:
        values = entry.get(key, [])
        if not isinstance(values, (list, tuple)) or not all(
            isinstance(t, torch.Tensor) for t in values
        ):
            return None
        shapes = tuple(tuple(t.shape) for t in values)
        if shapes != spec.decomposition_shapes[key]:
            return None
        tensors[key] = tuple(values)
    return SavedDecomposition(spec.decomposition_format, tensors)


def parse_state(
    state: object,
    specs: Mapping[str, LayerSpec],
    *,
    strict: bool,
) -> SavedState:
    """Validate `state` against the loading preconditioner's layers.

    Args:
        state: what `state_dict()` returned (possibly through
            `torch.save`/`torch.load`).
        specs: the loading preconditioner's layers, by module name.
        strict: missing or unexpected layers are errors (else skipped).

    Returns:
        The state of the layers in `specs` that `state` holds; a saved
        decomposition that does not fit its layer exactly is dropped (it is
        recomputed on load).

    Raises:
        TypeError: `state` is not a mapping, or an entry has the wrong
            type.
        ValueError: wrong version, missing entries, wrongly shaped
            factors, and (`strict`) missing or unexpected layers; every
            problem is named.
    """
    checked = _check_header(state)
    saved = checked['layers']
    assert isinstance(saved, Mapping)  # _check_header checked it
    problems = _layer_problems(specs, saved, strict)
    if problems:
        raise ValueError(
            'cannot load the K-FAC state_dict: ' + '; '.join(problems),
        )
    decompositions = checked.get('decompositions', {})
    if not isinstance(decompositions, Mapping):
        decompositions = {}
    layers = {
        name: SavedLayer(
            factors={
                k: v for k, v in saved[name].items() if k in spec.factor_dims
            },
            decomposition=_decomposition(spec, decompositions.get(name)),
            statistics={
                k: v
                for k, v in saved[name].items()
                if k in spec.statistic_shapes
            },
        )
        for name, spec in specs.items()
        if name in saved
    }
    hyperparameters = checked['hyperparameters']
    assert isinstance(hyperparameters, Mapping)  # _check_header checked it
    options = _options(checked.get('options', {}))
    return SavedState(
        steps=int(checked['steps']),  # type: ignore[call-overload]  # an int: _check_header checked it
        hyperparameters=_clips(
            dict(hyperparameters), options, version=checked['version']
        ),
        layers=layers,
        options=options,
        faults=_faults(checked.get('faults', {}), specs),
    )


def _faults(entry: object, specs: Mapping[str, LayerSpec]) -> SavedFaults:
    """The saved fault counts, checked; those of layers not in `specs`
    are dropped.
    """
    if not isinstance(entry, Mapping):
        raise TypeError(
            f"state_dict entry 'faults' must be a mapping; got {entry!r}"
        )
    counters = entry.get('counters', {})
    failures = entry.get('failures', {})
    if not isinstance(counters, Mapping) or not all(
        isinstance(k, str) and _count(v) for k, v in counters.items()
    ):
        raise TypeError(
            "state_dict entry 'faults.counters' must map names to ints "
            f'>= 0; got {counters!r}'
        )
    if not isinstance(failures, Mapping) or not all(
        isinstance(x, Mapping)
        and all(
            f in FACTOR_KEYS
            and isinstance(v, (list, tuple))
            and len(v) == 2
            and _count(v[0])
            and isinstance(v[1], (int, float))
            for f, v in x.items()
        )
        for x in failures.values()
    ):
        raise TypeError(
            "state_dict entry 'faults.failures' must map layers to "
            "{'A' or 'G': [count, trace]}; got " + repr(failures)
        )
    return SavedFaults(
        dict(counters),
        {
            name: {f: (int(v[0]), float(v[1])) for f, v in x.items()}
            for name, x in failures.items()
            if name in specs
        },
    )


def _count(value: object) -> bool:
    """Whether `value` is an int >= 0 (not a bool)."""
    return (
        isinstance(value, int) and not isinstance(value, bool) and value >= 0
    )


def _clips(
    hyperparameters: dict[str, float | int | None],
    options: dict[str, str | int],
    *,
    version: object,
) -> dict[str, float | int | None]:
    """The hyperparameters of a state before version 5 in the format of
    version 5: the `kl_clip` of a `kl_clip_rule='relative'` state becomes
    `relative_clip` (and `kl_clip` None), that of a `'kl'` state (every
    state before version 3) stays with `relative_clip` None. The rule is
    taken out of `options`.
    """
    rule = options.pop('kl_clip_rule', None)
    if version == STATE_VERSION:
        return hyperparameters
    kappa = hyperparameters.get('kl_clip')
    if rule == 'relative':
        return {**hyperparameters, 'kl_clip': None, 'relative_clip': kappa}
    return {**hyperparameters, 'relative_clip': None}


SEED_LIMIT = 2**31 - 1
"""Saved `position_sample_seed`s are below this (the modulus `P` of
[`kfac.layers.sampling`][kfac.layers.sampling])."""


def _options(options: object) -> dict[str, str | int]:
    """The saved engine options, checked."""
    if not isinstance(options, Mapping) or not all(
        isinstance(k, str) and isinstance(v, (str, int))
        for k, v in options.items()
    ):
        raise TypeError(
            "state_dict entry 'options' must map names to strings or ints; "
            f'got {options!r}',
        )
    rule = options.get('kl_clip_rule', 'kl')
    if rule not in ('kl', 'relative'):
        raise ValueError(
            "state_dict entry 'options' has kl_clip_rule "
            f'{rule!r}; allowed: kl, relative',
        )
    seed = options.get('position_sample_seed', 0)
    if (
        isinstance(seed, bool)
        or not isinstance(seed, int)
        or not 0 <= seed < SEED_LIMIT
    ):
        raise ValueError(
            "state_dict entry 'options' has position_sample_seed "
            f'{seed!r}; allowed: an int in [0, 2**31 - 1)',
        )
    return dict(options)


# Assembling and applying the state of a preconditioner's layers ----------


class StatefulLayer(Protocol):
    """What `save_layers` and `load_layers` need of a layer (a
    [`KFACBaseLayer`][kfac.layers.base.KFACBaseLayer] has it).
    """

    @property
    def has_factors(self) -> bool:
        """Whether the layer's running factors exist."""
        ...

    def state_spec(self) -> LayerSpec:
        """What the layer's saved state must look like."""
        ...

    def saved_state(self, include_decompositions: bool) -> SavedLayer:
        """The layer's state."""
        ...

    def load_saved_state(self, saved: SavedLayer, keep: bool) -> bool:
        """Restore `saved`; whether it had decompositions."""
        ...


def save_layers(
    steps: int,
    hyperparameters: Mapping[str, float | int | None],
    layers: Mapping[str, StatefulLayer],
    *,
    options: Mapping[str, str | int],
    include_decompositions: bool,
    faults: SavedFaults | None = None,
) -> StateDict:
    """The state of a preconditioner at `steps` with these constant
    hyperparameters, engine options, fault counts and layers, each saving
    its own.
    """
    saved = {
        name: layer.saved_state(include_decompositions)
        for name, layer in layers.items()
    }
    return serialize_state(
        SavedState(
            steps,
            dict(hyperparameters),
            saved,
            dict(options),
            faults or SavedFaults(),
        ),
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
