"""kfac.layers.compat: the deprecated collective methods still work."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kfac.distributed import TorchDistributedCommunicator
from kfac.layers.eigen import KFACEigenLayer
from kfac.layers.modules import LinearModuleHelper

F64 = torch.float64


def test_deprecated_collectives_warn_and_forward() -> None:
    torch.manual_seed(0)
    layer = KFACEigenLayer(LinearModuleHelper(nn.Linear(3, 2).double()))
    layer.save_layer_input(torch.randn(4, 3, dtype=F64), now=True)
    layer.save_layer_grad_output(torch.randn(4, 2, dtype=F64), now=True)
    layer.update_factors(0.9)
    comm = TorchDistributedCommunicator()
    with pytest.warns(DeprecationWarning, match='kfac.exchange.start_factor'):
        pairs = list(layer.reduce_factors(comm, None, bucketed=True))
    assert [(f.name, h.wait() is f.value) for f, h in pairs] == [
        ('A', True),
        ('G', True),
    ]
    with pytest.warns(DeprecationWarning, match='start_decomposition_broad'):
        handles = layer.broadcast_decomposition('A', comm, src=0, group=None)
    assert all(torch.isnan(h.wait()).all() for h in handles)  # none yet
    layer.module.module.weight.grad = torch.ones(2, 3, dtype=F64)
    assert layer.compute_decomposition('A', 0.1)
    assert layer.compute_decomposition('G', 0.1)
    expected = layer.precondition_grad(0.1)
    with pytest.warns(DeprecationWarning, match='start_grad_broadcast'):
        handle = layer.broadcast_grad(comm, src=0, group=None)
    assert handle.wait() is expected
