"""Ranks and process groups, with a one-process path.

`get_rank` and `get_world_size` answer without an initialised process
group (rank 0 of 1); `default_group_func` creates the process groups a
[`KAISAAssignment`][kfac.assignment.KAISAAssignment] asks for. Every
process-group creation of K-FAC happens here.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING
from typing import TypeVar

import torch.distributed as dist

from kfac.validation import is_int
from kfac.validation import type_error

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = [
    'GroupFunc',
    'check_src',
    'default_group_func',
    'get_rank',
    'get_world_size',
    'group_key',
    'group_ranks',
    'group_size',
]

GroupFunc = Callable[[list[int]], 'ProcessGroup | None']
"""Makes a process group from a list of global ranks (None: no group)."""


def _initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def get_rank(group: ProcessGroup | None = None) -> int:
    """Return this process's rank in `group` (the default group if None).

    0 when `torch.distributed` is unavailable or not initialised; -1 on a
    rank that is not a member of `group` (as `torch.distributed`).
    """
    return dist.get_rank(group) if _initialized() else 0


def get_world_size(group: ProcessGroup | None = None) -> int:
    """Return the number of ranks in `group` (the default group if None).

    1 when `torch.distributed` is unavailable or not initialised; -1 on a
    rank that is not a member of `group` (as `torch.distributed`).
    """
    return dist.get_world_size(group) if _initialized() else 1


def group_size(group: ProcessGroup | None) -> int:
    """Return the size of `group`; raise if this rank is not in it."""
    size = get_world_size(group)
    if size < 1:
        raise ValueError(
            f'rank {get_rank()} is not a member of the process group it '
            f"called a collective on; only the group's ranks may call it",
        )
    return size


def group_key(group: ProcessGroup | None) -> ProcessGroup:
    """Return `group`, with None resolved to the default group object."""
    key = dist.group.WORLD if group is None else group
    if key is None:
        raise RuntimeError(
            'no default process group: call '
            'torch.distributed.init_process_group first'
        )
    return key


def check_src(src: object, group: ProcessGroup | None) -> int:
    """Return `src` if it is the global rank of a member of `group`."""
    if not is_int(src):
        raise type_error('src', src, 'an int (a global rank)')
    ranks = group_ranks(group)
    if src not in ranks:
        raise ValueError(
            f'src={src} is not a member of the process group; its global '
            f'ranks are {ranks}',
        )
    return int(src)


_T = TypeVar('_T')
_GROUPS: dict[tuple[int, ...], Callable[[], ProcessGroup | None]] = {}
_GROUPS_WORLD: list[Callable[[], ProcessGroup | None]] = [lambda: None]


def _reference(value: _T) -> Callable[[], _T | None]:
    """Return a weak reference to `value`, or a strong one if it takes none.

    The group cache holds process groups weakly: it never keeps a group
    alive once `torch.distributed` has let it go
    (`destroy_process_group()`) and no assignment uses it, so the group is
    freed then rather than during interpreter shutdown. What takes no weak
    reference (the marker `new_group` returns on ranks outside the group)
    holds no resources and is kept as it is.
    """
    try:
        return weakref.ref(value)
    except TypeError:
        return lambda: value


def _shared_group(ranks: list[int]) -> ProcessGroup | None:
    """`new_group(ranks)`, made once per set of ranks and default group.

    The whole world is the default group itself; other sets are created
    once and reused by later assignments while the group lives (every rank
    decides the same way, so the collective `new_group` calls still match
    across ranks). The cache holds the groups weakly (see `_reference`).
    """
    world = dist.group.WORLD
    if _GROUPS_WORLD[0]() is not world:
        _GROUPS.clear()
        _GROUPS_WORLD[0] = _reference(world)
    key = tuple(ranks)
    if key == tuple(range(dist.get_world_size())):
        return world
    group = _GROUPS[key]() if key in _GROUPS else None
    if group is None:
        group = dist.new_group(ranks)
        _GROUPS[key] = _reference(group)
    return group


def default_group_func(world_size: int) -> GroupFunc:
    """Return a `torch.distributed.new_group` wrapper if usable, else a no-op.

    The wrapper is used when `torch.distributed` is available and
    initialised and `world_size > 1`: it returns the default group for all
    ranks and creates every other group once per default group (and reuses
    it in later assignments while it lives, without keeping it alive
    itself); otherwise the function returned makes no group and returns
    None.
    """
    if world_size > 1 and dist.is_available() and dist.is_initialized():
        return _shared_group
    return lambda ranks: None


def group_ranks(group: ProcessGroup | None) -> list[int]:
    """The global ranks of `group` (the default group when None), in
    `torch.distributed`'s order; `[0]` without a process group.

    None is resolved here: `dist.get_process_group_ranks` takes no None
    before torch 2.8.
    """
    if not _initialized():
        return [0]
    return dist.get_process_group_ranks(group or dist.group.WORLD)
