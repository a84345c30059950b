"""kfac._engine.curvature_updates, the phase of the curvatures' own
statistics, at world size 1 without a process group.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from kfac._engine.curvature_updates import CurvatureUpdates
from kfac.distributed import TorchDistributedCommunicator
from kfac.layers.base import KFACBaseLayer
from kfac.layers.curvature import Curvature
from kfac.layers.curvature import CurvatureConfig
from kfac.layers.curvature import Decomposed
from kfac.layers.curvature.base import Layout
from kfac.layers.modules import LinearModuleHelper
from testing.phases import F64
from testing.phases import assignment
from testing.phases import linear_layer
from testing.phases import no_phase


class Counting(Curvature):
    """Reduces one statistic per step (`ones`), counts its updates."""

    format = 'counting'
    reduces_statistics: ClassVar[bool] = True

    def __init__(self, layer: KFACBaseLayer) -> None:
        super().__init__(layer)
        self.seen: list[tuple[float, bool]] = []
        self.restarts = 0

    def layout(self, name: str) -> Layout:
        return (((1,), False),)

    def decompose(
        self,
        name: str,
        matrix: torch.Tensor,
        dtype: torch.dtype,
        damping: float,
    ) -> Decomposed:
        return Decomposed((torch.ones(1, dtype=dtype),), None)

    def precondition(self, grad: torch.Tensor, damping: float) -> torch.Tensor:
        return grad

    def batch_statistics(self) -> dict[str, torch.Tensor]:
        return {'ones': torch.full((2,), 3.0, dtype=F64)}

    def update_statistics(
        self,
        averaged: dict[str, torch.Tensor],
        decay: float,
        damping: float,
        *,
        preconditions: bool,
    ) -> None:
        assert torch.equal(averaged['ones'], torch.full((2,), 3.0, dtype=F64))
        self.seen.append((decay, preconditions))

    def restart(self) -> None:
        self.restarts += 1


class CountingConfig(CurvatureConfig):
    name: ClassVar[str] = 'counting'

    def make(self, layer: KFACBaseLayer) -> Counting:
        return Counting(layer)


def test_curvature_statistics_reach_only_the_curvatures_that_reduce() -> None:
    counting = KFACBaseLayer(
        LinearModuleHelper(nn.Linear(4, 3).double()),
        curvature=CountingConfig(),
    )
    plain = linear_layer()
    layers = {'counting': counting, 'plain': plain}
    updates = CurvatureUpdates(
        layers,
        assignment(layers),
        TorchDistributedCommunicator(),
        bucketed=False,
        phase=no_phase,
    )
    assert list(updates.layers) == ['counting']
    updates.restart(['counting', 'plain'])
    updates.update(0.9, 0.1)
    curvature = counting.curvature
    assert isinstance(curvature, Counting)
    assert curvature.restarts == 1
    assert curvature.seen == [(0.9, True)]
    empty = CurvatureUpdates(
        {'plain': plain},
        assignment({'plain': plain}),
        TorchDistributedCommunicator(),
        bucketed=True,
        phase=no_phase,
    )
    empty.update(0.9, 0.1)  # nothing to reduce: no collective
    assert empty.layers == {}
