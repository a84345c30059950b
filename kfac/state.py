"""Saving and restoring a preconditioner's state.

The state is a plain dictionary of tensors, numbers, strings, lists and
dicts, so ``torch.load(path, weights_only=True)`` reads it::

    {
        'version': 1,
        'steps': int,
        'hyperparameters': {name: value},   # the non-callable ones
        'layers': {module name: {'A': tensor, 'G': tensor}},
        'decompositions': {                 # optional
            module name: {'format': str, 'A': [tensor, ...], 'G': [...]},
        },
    }

Factors are what a run cannot recompute. Decompositions are saved too (for
the layers whose decompositions this rank holds) so that a resumed run uses
exactly the decompositions the uninterrupted run would have used until the
next inverse update; a layer without a compatible saved decomposition has it
recomputed on load by its inverse workers and broadcast to its gradient
workers.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING
from typing import Any

import torch

if TYPE_CHECKING:
    from kfac.base_preconditioner import BaseKFACPreconditioner
    from kfac.layers.base import KFACBaseLayer

STATE_VERSION = 1


def preconditioner_state(
    precon: BaseKFACPreconditioner,
    include_decompositions: bool,
) -> dict[str, Any]:
    """Return the state of ``precon`` (see the module docstring)."""
    layers: dict[str, dict[str, torch.Tensor]] = {}
    decompositions: dict[str, dict[str, Any]] = {}
    for name, layer in precon.layers.items():
        layers[name] = {
            f.name: f.value.detach().clone()
            for f in layer.factors
            if f.value is not None
        }
        if include_decompositions and layer.has_decomposition:
            entry: dict[str, Any] = {'format': layer.decomposition_format}
            for f in layer.factors:
                entry[f.name] = [
                    t.detach().clone() for t in f.decomposition or ()
                ]
            decompositions[name] = entry
    state: dict[str, Any] = {
        'version': STATE_VERSION,
        'steps': precon.steps,
        'hyperparameters': precon.hyperparameters.constants(),
        'layers': layers,
    }
    if include_decompositions:
        state['decompositions'] = decompositions
    return state


def _check_header(state: Mapping[str, Any]) -> None:
    if not isinstance(state, Mapping):
        raise TypeError(
            f'state_dict must be a mapping; got {type(state).__name__}',
        )
    version = state.get('version')
    if version != STATE_VERSION:
        raise ValueError(
            f'state_dict has format version {version!r}; this version of '
            f'kfac reads version {STATE_VERSION}',
        )
    for key in ('steps', 'layers', 'hyperparameters'):
        if key not in state:
            raise ValueError(f'state_dict is missing the entry {key!r}')


def _factor_problems(
    precon: BaseKFACPreconditioner,
    saved: Mapping[str, Any],
) -> list[str]:
    """Wrongly shaped or unexpected factor entries, as messages."""
    problems = []
    for name in saved.keys() & precon.layers.keys():
        layer = precon.layers[name]
        for key, tensor in saved[name].items():
            if key not in ('A', 'G'):
                problems.append(f'unexpected entry layers.{name}.{key}')
                continue
            dim = layer.factor(key).dim
            shape = tuple(getattr(tensor, 'shape', ()))
            if shape != (dim, dim):
                problems.append(
                    f'layers.{name}.{key} has shape {shape}, expected '
                    f'{(dim, dim)}',
                )
    return problems


def _check_layers(
    precon: BaseKFACPreconditioner,
    saved: Mapping[str, Any],
    strict: bool,
) -> None:
    missing = sorted(precon.layers.keys() - saved.keys())
    unexpected = sorted(saved.keys() - precon.layers.keys())
    problems = _factor_problems(precon, saved)
    if strict and missing:
        problems.insert(0, f'missing layers: {", ".join(missing)}')
    if strict and unexpected:
        problems.insert(0, f'unexpected layers: {", ".join(unexpected)}')
    if problems:
        raise ValueError(
            'cannot load the K-FAC state_dict: ' + '; '.join(problems),
        )


def _saved_decomposition(
    layer: KFACBaseLayer,
    entry: Mapping[str, Any] | None,
) -> dict[str, tuple[torch.Tensor, ...]] | None:
    """The saved decomposition if it fits ``layer`` exactly, else None."""
    if entry is None or entry.get('format') != layer.decomposition_format:
        return None
    result = {}
    for f in layer.factors:
        tensors = entry.get(f.name, [])
        shapes = [tuple(t.shape) for t in tensors]
        layout = [shape for shape, _ in layer.decomposition_layout(f.name)]
        if shapes != layout:
            return None
        result[f.name] = tuple(
            t.to(device=layer.device, dtype=layer.inv_dtype) for t in tensors
        )
    return result


def load_preconditioner_state(
    precon: BaseKFACPreconditioner,
    state: Mapping[str, Any],
    *,
    strict: bool,
) -> None:
    """Restore ``precon`` from ``state``; see the module docstring.

    Every rank must call this with the same ``state``: layers whose
    decompositions are recomputed take part in broadcasts.

    Raises:
        TypeError: ``state`` is not a mapping.
        ValueError: wrong version, missing entries, wrongly shaped factors,
            and (``strict``) missing or unexpected layers; nothing is
            changed then.

    """
    _check_header(state)
    saved = state['layers']
    _check_layers(precon, saved, strict)
    current = precon.hyperparameters
    restore = {
        key: value
        for key, value in state['hyperparameters'].items()
        if key in current.__dataclass_fields__
        and not callable(getattr(current, key))
    }
    precon.set_hyperparameters(**restore)
    precon.reset_batch()
    precon._steps = int(state['steps'])
    decompositions = state.get('decompositions', {})
    recompute = []
    for name, layer in precon.layers.items():
        layer.clear_decompositions()
        for f in layer.factors:
            tensor = saved.get(name, {}).get(f.name)
            f.value = (
                None
                if tensor is None
                else tensor.to(device=layer.device, dtype=f.dtype).clone()
            )
        restored = _saved_decomposition(layer, decompositions.get(name))
        if restored is None:
            recompute.append(name)
        elif precon.assignment.is_grad_worker(name):
            for f in layer.factors:
                f.decomposition = restored[f.name]
        precon._decomposed.discard(name)
        if restored is not None and layer.has_factors:
            precon._decomposed.add(name)
    precon._update_decompositions(precon.damping, recompute)
