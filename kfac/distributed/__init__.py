"""Every collective K-FAC issues, and the process groups it uses.

The public names are the communicator and the helpers that work without
an initialised process group:

* the communicator,
  [`TorchDistributedCommunicator`][kfac.distributed.TorchDistributedCommunicator]:
  allreduce (plain and bucketed), broadcast, all-gather and scatter as
  handles with `wait()`;
* [`get_rank`][kfac.distributed.get_rank] and
  [`get_world_size`][kfac.distributed.get_world_size]: rank 0 of 1 without
  `torch.distributed`;
* [`get_triu`][kfac.distributed.get_triu] and
  [`fill_triu`][kfac.distributed.fill_triu]: a symmetric matrix as its
  packed upper triangle and back;
* [`default_group_func`][kfac.distributed.default_group_func]: the process
  groups of a KAISA assignment;
* [`gather_if_different`][kfac.distributed.gather_if_different]: the check,
  at construction, that every rank built the same setup (one all-gather of
  a digest; the descriptions only when they differ);
* the original KAISA code's names:
  [`AllreduceTensorBucket`][kfac.distributed.AllreduceTensorBucket], its
  explicit bucket, and [`Future`][kfac.distributed.Future], its name of
  what the communicator returns.

The private modules hold the machinery: handles, buckets, packing, the
exchanges of one step (factors, decompositions, gradients), the gathers
and scatters of sharded gradients, and the setup check. No module of
`kfac` outside this package issues a collective
(`torch.distributed.checkpoint` in [`kfac.checkpoint`][kfac.checkpoint]
excepted).
"""

from __future__ import annotations

from kfac.distributed._agreement import gather_if_different
from kfac.distributed._bucket import AllreduceTensorBucket
from kfac.distributed._communicator import Handle
from kfac.distributed._communicator import NonSquareTensorError
from kfac.distributed._communicator import TorchDistributedCommunicator
from kfac.distributed._communicator import fill_triu
from kfac.distributed._communicator import get_triu
from kfac.distributed._exchange import KFACDistributedError
from kfac.distributed._groups import GroupFunc
from kfac.distributed._groups import default_group_func
from kfac.distributed._groups import get_rank
from kfac.distributed._groups import get_world_size

Future = Handle
"""The original's name of a value in flight (it returned
`torch.futures.Future`): here the [`Handle`][kfac.distributed.Handle],
with `wait()` and `done()` (no `then()` or `value()`)."""

__all__ = [
    'AllreduceTensorBucket',
    'Future',
    'GroupFunc',
    'Handle',
    'KFACDistributedError',
    'NonSquareTensorError',
    'TorchDistributedCommunicator',
    'default_group_func',
    'fill_triu',
    'gather_if_different',
    'get_rank',
    'get_triu',
    'get_world_size',
]
