"""What the unit tests of the engine's phases share: a `(4 -> 3)` Linear
layer, its hook data, a one-rank assignment and a phase timer that does
nothing.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from kfac.assignment import KAISAAssignment
from kfac.assignment import decomposition_work
from kfac.layers.base import KFACBaseLayer
from kfac.layers.eigen import KFACEigenLayer
from kfac.layers.modules import LinearModuleHelper

F64 = torch.float64


def no_phase(name: str) -> contextlib.AbstractContextManager[None]:
    """A phase timer that times nothing."""
    return contextlib.nullcontext()


def captured(layer: KFACBaseLayer, seed: int = 0) -> None:
    """One batch of a `(4 -> 3)` Linear's hook data."""
    gen = torch.Generator().manual_seed(seed)
    layer.save_layer_input(
        torch.randn(5, 4, generator=gen, dtype=F64), now=True
    )
    layer.save_layer_grad_output(
        torch.randn(5, 3, generator=gen, dtype=F64), now=True
    )


def linear_layer() -> KFACBaseLayer:
    """An EIGEN layer of a float64 `(4 -> 3)` Linear."""
    return KFACEigenLayer(LinearModuleHelper(nn.Linear(4, 3).double()))


def assignment(layers: dict[str, KFACBaseLayer]) -> KAISAAssignment:
    """The assignment of `layers` to the one rank of a world of one."""
    return KAISAAssignment(
        decomposition_work(layers, 'compute'),
        local_rank=0,
        world_size=1,
        grad_worker_fraction=1.0,
        colocate_factors=True,
    )
