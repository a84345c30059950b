"""The check, at construction, that every rank built the same setup.

The collectives of a K-FAC step match across ranks only when every rank
registered the same layers, with the same shapes and options: otherwise
buffers of different layouts meet in one collective, which fails, hangs,
or (NCCL) reduces unrelated tensors into each other. Each rank describes
its setup as a list of `(item, value)` strings (the description is built
by the caller, see `kfac._engine.agreement`); `gather_if_different`
exchanges a SHA-256 digest of it (one all-gather of 32 bytes per rank)
and, only when the digests differ, the descriptions themselves, so that
every rank can name the same difference.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import cast

import torch
import torch.distributed as dist

from kfac.distributed._communicator import TorchDistributedCommunicator
from kfac.distributed._exchange import KFACDistributedError
from kfac.distributed._exchange import wait
from kfac.distributed._groups import get_rank
from kfac.distributed._groups import get_world_size

__all__ = ['Description', 'digest', 'gather_if_different']

Description = Sequence[tuple[str, str]]
"""A rank's setup: `(item, value)` pairs, in a fixed order."""


def digest(description: Description) -> torch.Tensor:
    """The SHA-256 of `description` as a tensor of four int64 (32 bytes).

    Equal descriptions give equal digests on every rank and in every
    process (the text hashed is `description` as canonical JSON).
    """
    text = json.dumps([list(item) for item in description])
    value = hashlib.sha256(text.encode()).digest()
    return torch.frombuffer(bytearray(value), dtype=torch.int64)


def gather_if_different(
    comm: TorchDistributedCommunicator,
    description: Description,
    *,
    device: torch.device,
) -> list[list[tuple[str, str]]] | None:
    """Every rank's description if they are not all equal, else None.

    Every rank of the default group calls this once, at the same point of
    its sequence of collectives (at construction, before any other K-FAC
    collective), with its own description. The digests travel in one
    all-gather on `device` (counted as `'agreement'` in the
    communicator's statistics); only when they differ do the
    descriptions themselves follow (`all_gather_object`), so every rank
    returns the same list. Without a process group, or with one rank,
    nothing is communicated.

    Args:
        comm: the communicator.
        description: this rank's setup.
        device: where the digest travels (a device the default group's
            backend communicates on: the layers' device).

    Returns:
        None when every rank's description is this one; else the
            descriptions of all ranks, in rank order.

    Raises:
        KFACDistributedError: a collective failed.
    """
    size = get_world_size()
    if size == 1:
        return None
    mine = digest(description).to(device)
    handle = comm.all_gather(mine, kind='agreement')
    digests = wait(handle, 'setup agreement')
    if bool((digests == mine).all()):
        return None
    gathered: list[object] = [None] * size
    try:
        dist.all_gather_object(gathered, list(description))
    except RuntimeError as err:
        raise KFACDistributedError(
            f'K-FAC setup agreement failed on rank {get_rank()}: {err}',
        ) from err
    return cast('list[list[tuple[str, str]]]', gathered)  # as each sent
