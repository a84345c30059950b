"""The sharded gradient distributors on plain (unsharded) layers, without a
process group: the branches a partly sharded model takes for its plain
layers, and a step where no layer was preconditioned.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from kfac._engine.distributor import Local
from kfac._engine.distributor import Lossless
from kfac.distributed._groups import group_ranks
from kfac.distributed._sharding import owned_entries
from kfac.layers.helper import Grads
from kfac.preconditioner import KFACPreconditioner


def _phase(name: str) -> contextlib.AbstractContextManager[None]:
    return contextlib.nullcontext()


def test_no_preconditioned_layer_gives_no_statistics() -> None:
    precon = KFACPreconditioner(nn.Linear(2, 2))
    args = (precon.layers, precon.assignment, precon.communicator, _phase)
    assert Lossless(*args).statistics() == ([], None)
    group = None  # never used: no statistics to sum
    local = Local(*args, group)  # type: ignore[arg-type]  # no process group here
    assert local.statistics() == ([], None)


def test_a_plain_layer_gets_its_whole_gradient_back() -> None:
    precon = KFACPreconditioner(nn.Linear(2, 2))
    layer = precon.layers['']
    assert owned_entries(layer) is None  # no sharded parameter
    place = Lossless(
        precon.layers, precon.assignment, precon.communicator, _phase
    )
    grad = torch.ones(2, 3)
    place._kept[''] = grad
    place._restore('', Grads())
    assert layer.grad is grad


def test_group_ranks_without_a_process_group() -> None:
    assert group_ranks(None) == [0]
