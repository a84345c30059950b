"""Checkpoints with `torch.distributed.checkpoint` (DCP), beside the model.

```python
import torch.distributed.checkpoint as dcp
from kfac.checkpoint import dcp_state, load_dcp

state = {'model': ..., 'optim': ..., 'kfac': dcp_state(precon)}
dcp.save(state, checkpoint_id=path)
...  # later, maybe at another world size
dcp.load({'model': ..., 'optim': ...}, checkpoint_id=path)
load_dcp(precon, path)  # every rank
```

[`dcp_state`][kfac.checkpoint.dcp_state] is the preconditioner's
[`state_dict()`][kfac.base_preconditioner.BaseKFACPreconditioner.state_dict]
flattened to one level of keys (DCP saves every tensor and value under
its key; non-tensor values are pickled):

* `version`, `steps`, `hyperparameters.<name>`, `options.<name>`,
  `fisher.<name>` (the Monte Carlo Fisher's settings) and
  `factors.<layer>.<A|G|S>`: the same on every rank (factors and EKFAC's
  scaling `S` are allreduced), so DCP writes each once;
* `decompositions.<layer>.format` and `decompositions.<layer>.<A|G>.<i>`:
  written by the ranks that hold that layer's decomposition. Every rank
  that holds one holds the same tensors (they were computed on one rank
  and broadcast), so DCP keeping any one copy loses nothing, and no rank's
  copy stands in for a different one;
* `faults.counters.<name>` and `faults.failures.<layer>.<A|G>` (`[count,
  trace]`): the fault counts (see [`kfac.state`][kfac.state]), the same
  on every rank but for a factor's decompositions failed since the last
  factor update, which its inverse worker learns first.

[`load_dcp`][kfac.checkpoint.load_dcp] reads the checkpoint's metadata,
loads the factors and the decompositions this rank needs (those of the
layers it holds decompositions of under the loading preconditioner's
assignment, which may differ from the saving one's: another world size or
gradient-worker fraction), and applies them with `load_state_dict`. A
resume at the same world size is therefore bitwise exact, and at another
one uses the very decompositions the saving run would have used.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING
from typing import Any

import torch

from kfac.state import FACTOR_KEYS

if TYPE_CHECKING:
    from torch.distributed.checkpoint.storage import StorageReader

    from kfac.base_preconditioner import BaseKFACPreconditioner

__all__ = ['dcp_state', 'flatten_state', 'load_dcp', 'unflatten_state']

_DECOMPOSITIONS = 'decompositions.'
_FACTORS = 'factors.'
_HYPERPARAMETERS = 'hyperparameters.'
_OPTIONS = 'options.'
_FISHER = 'fisher.'
_COUNTERS = 'faults.counters.'
_FAILURES = 'faults.failures.'


def flatten_state(state: Mapping[str, Any]) -> dict[str, Any]:
    """`state_dict()` output as one level of dotted keys (see the module
    docstring).
    """
    flat: dict[str, Any] = {
        'version': state['version'],
        'steps': state['steps'],
    }
    for key, value in state['hyperparameters'].items():
        flat[_HYPERPARAMETERS + key] = value
    for key, value in state.get('options', {}).items():
        flat[_OPTIONS + key] = value
    for key, value in state.get('fisher', {}).items():
        flat[_FISHER + key] = value
    for name, factors in state['layers'].items():
        for key, tensor in factors.items():
            flat[f'{_FACTORS}{name}.{key}'] = tensor
    faults = state.get('faults', {})
    for key, value in faults.get('counters', {}).items():
        flat[_COUNTERS + key] = value
    for name, failures in faults.get('failures', {}).items():
        for key, value in failures.items():
            flat[f'{_FAILURES}{name}.{key}'] = list(value)
    for name, entry in state.get('decompositions', {}).items():
        flat[f'{_DECOMPOSITIONS}{name}.format'] = entry['format']
        for key in FACTOR_KEYS:
            for index, tensor in enumerate(entry[key]):
                flat[f'{_DECOMPOSITIONS}{name}.{key}.{index}'] = tensor
    return flat


def unflatten_state(flat: Mapping[str, Any]) -> dict[str, Any]:
    """The inverse of [`flatten_state`][kfac.checkpoint.flatten_state].

    Raises:
        ValueError: a key that `flatten_state` does not write.
    """
    faults: dict[str, dict[str, Any]] = {'counters': {}, 'failures': {}}
    state: dict[str, Any] = {
        'hyperparameters': {},
        'layers': {},
        'faults': faults,
    }
    decompositions: dict[str, dict[str, Any]] = {}
    for key, value in flat.items():
        if key in ('version', 'steps'):
            state[key] = value
        elif key.startswith(_HYPERPARAMETERS):
            state['hyperparameters'][key[len(_HYPERPARAMETERS) :]] = value
        elif key.startswith(_OPTIONS):
            state.setdefault('options', {})[key[len(_OPTIONS) :]] = value
        elif key.startswith(_FISHER):
            state.setdefault('fisher', {})[key[len(_FISHER) :]] = value
        elif key.startswith(_COUNTERS):
            faults['counters'][key[len(_COUNTERS) :]] = value
        elif key.startswith(_FAILURES) and key[-2:] in ('.A', '.G'):
            name = key[len(_FAILURES) : -2]
            faults['failures'].setdefault(name, {})[key[-1]] = value
        elif key.startswith(_FACTORS) and key[-2:] in ('.A', '.G', '.S'):
            name = key[len(_FACTORS) : -2]
            state['layers'].setdefault(name, {})[key[-1]] = value
        elif key.startswith(_DECOMPOSITIONS) and key.endswith('.format'):
            name = key[len(_DECOMPOSITIONS) : -len('.format')]
            decompositions.setdefault(name, {})['format'] = value
        elif key.startswith(_DECOMPOSITIONS):
            head, factor, index = key[len(_DECOMPOSITIONS) :].rsplit('.', 2)
            if factor not in FACTOR_KEYS or not index.isdigit():
                raise ValueError(f'unexpected K-FAC checkpoint key {key!r}')
            parts = decompositions.setdefault(head, {}).setdefault(factor, {})
            parts[int(index)] = value
        else:
            raise ValueError(f'unexpected K-FAC checkpoint key {key!r}')
    state['decompositions'] = {
        name: {
            'format': entry.get('format'),
            **{
                f: [entry.get(f, {})[i] for i in sorted(entry.get(f, {}))]
                for f in FACTOR_KEYS
            },
        }
        for name, entry in decompositions.items()
    }
    return state


def dcp_state(precon: BaseKFACPreconditioner) -> dict[str, Any]:
    """The preconditioner's state for `torch.distributed.checkpoint.save`
    (every rank passes its own; see the module docstring).
    """
    return flatten_state(precon.state_dict(include_decompositions=True))


def load_dcp(
    precon: BaseKFACPreconditioner,
    checkpoint_id: str | os.PathLike[str] | None = None,
    *,
    key: str = 'kfac',
    storage_reader: StorageReader | None = None,
    strict: bool = True,
) -> None:
    """Load the state [`dcp_state`][kfac.checkpoint.dcp_state] saved under
    `key` of a DCP checkpoint. Every rank calls it.

    Args:
        precon: the preconditioner to load into.
        checkpoint_id: the checkpoint's path (or give `storage_reader`).
        key: the entry of the saved dict that held `dcp_state(precon)`.
        storage_reader: a DCP storage reader (default: a file system
            reader of `checkpoint_id`).
        strict: as in `load_state_dict`.

    Raises:
        ValueError: neither `checkpoint_id` nor `storage_reader` is given,
            the checkpoint has no entry `key`, or `load_state_dict` refuses
            the state.
    """
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    from torch.distributed.checkpoint.state_dict_loader import load

    if storage_reader is None:
        if checkpoint_id is None:
            raise ValueError('give checkpoint_id or storage_reader')
        storage_reader = FileSystemReader(checkpoint_id)
    prefix = key + '.'
    metadata = storage_reader.read_metadata().state_dict_metadata
    entries = {
        fqn[len(prefix) :]: meta
        for fqn, meta in metadata.items()
        if fqn.startswith(prefix)
    }
    if not entries:
        raise ValueError(
            f'the checkpoint has no K-FAC state under {key!r} (save '
            f'{{{key!r}: dcp_state(precon), ...}})',
        )
    device = next(iter(precon.layers.values())).device
    wanted: dict[str, Any] = {}
    placeholders: dict[str, torch.Tensor] = {}
    for name, meta in entries.items():
        if not isinstance(meta, TensorStorageMetadata):
            wanted[name] = None
            continue
        dtype = meta.properties.dtype
        layer = _decomposition_layer(name)
        if layer is not None and not _needs(precon, layer):
            # Read by no one here: a stand-in of the right shape keeps the
            # layer's decomposition counted as saved on every rank.
            zero = torch.zeros((), dtype=dtype, device=device)
            placeholders[name] = zero.expand(meta.size)
            continue
        wanted[name] = torch.empty(meta.size, dtype=dtype, device=device)
    loaded = {key: wanted}
    load(loaded, storage_reader=storage_reader)
    precon.load_state_dict(
        unflatten_state({**loaded[key], **placeholders}), strict=strict
    )


def _decomposition_layer(name: str) -> str | None:
    if not name.startswith(_DECOMPOSITIONS) or name.endswith('.format'):
        return None
    return name[len(_DECOMPOSITIONS) :].rsplit('.', 2)[0]


def _needs(precon: BaseKFACPreconditioner, layer: str) -> bool:
    return layer in precon.layers and precon.assignment.holds_decomposition(
        layer
    )
