"""kfac._engine.decompositions, the decomposition phase, at world size 1
without a process group.
"""

from __future__ import annotations

from typing import ClassVar

import pytest
import torch
from torch import nn

from kfac._engine.decompositions import decompose
from kfac.distributed import TorchDistributedCommunicator
from kfac.layers.base import KFACBaseLayer
from kfac.layers.base import LinAlgError
from kfac.layers.curvature import Curvature
from kfac.layers.curvature import CurvatureConfig
from kfac.layers.curvature import Decomposed
from kfac.layers.curvature.base import Layout
from kfac.layers.modules import LinearModuleHelper
from testing.phases import assignment
from testing.phases import captured
from testing.phases import linear_layer
from testing.phases import no_phase


class Failing(Curvature):
    """Every attempt at factor `A` raises; `G` decomposes to its diagonal."""

    format = 'failing'

    def layout(self, name: str) -> Layout:
        return (((self.layer.factor(name).dim,), False),)

    def decompose(
        self,
        name: str,
        matrix: torch.Tensor,
        dtype: torch.dtype,
        damping: float,
    ) -> Decomposed:
        if name == 'A':
            raise LinAlgError('no')
        return Decomposed((torch.diagonal(matrix).clone(),), None)

    def precondition(self, grad: torch.Tensor, damping: float) -> torch.Tensor:
        return grad


class FailingConfig(CurvatureConfig):
    name: ClassVar[str] = 'failing'

    def make(self, layer: KFACBaseLayer) -> Failing:
        return Failing(layer)


def test_decompositions_of_the_layers_with_factors_failures_logged_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    good = linear_layer()
    bad = KFACBaseLayer(
        LinearModuleHelper(nn.Linear(4, 3).double()), curvature=FailingConfig()
    )
    unfed = linear_layer()
    layers = {'good': good, 'bad': bad, 'unfed': unfed}
    for layer in (good, bad):
        captured(layer)
        layer.update_factors(0.9)
    plan = assignment(layers)
    messages = []
    done = decompose(
        layers,
        layers,
        plan,
        TorchDistributedCommunicator(),
        0.1,
        phase=no_phase,
        log_once=lambda key, name, msg, *args: messages.append(msg % args),
    )
    assert done == ['good', 'bad']  # the layers with factors
    assert good.has_decomposition
    assert (
        bad.decomposition('A') is None and bad.decomposition('G') is not None
    )
    assert bad.counters['decomposition_failures'] == 1
    assert len(messages) == 1 and 'decomposing a factor of bad' in messages[0]
