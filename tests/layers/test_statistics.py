"""kfac.layers.statistics: expand/reduce and loss_average on a Linear."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kfac.config import StatisticsConfig
from kfac.preconditioner import KFACPreconditioner
from testing.asserts import assert_rel_close
from testing.reference import layer_factors

F64 = torch.float64


@pytest.mark.parametrize('loss_average', [None, 'batch', 'batch+sequence'])
@pytest.mark.parametrize('approx', ['expand', 'reduce'])
@pytest.mark.parametrize('batch_first', [True, False])
def test_sequence_linear_factors_equal_their_definition(
    loss_average: str | None, approx: str, batch_first: bool
) -> None:
    torch.manual_seed(0)
    linear = nn.Linear(4, 3).double()
    n, t = 5, 6
    x = torch.randn(n, t, 4, dtype=F64)
    statistics = StatisticsConfig(
        kfac_approx=approx, loss_average=loss_average, batch_first=batch_first
    )
    precon = KFACPreconditioner(
        linear, relative_clip=None, statistics=statistics
    )
    data = x if batch_first else x.transpose(0, 1)
    out = linear(data)
    out.retain_grad()
    terms = {None: 1, 'batch': n, 'batch+sequence': n * t}[loss_average]
    (out.tanh().sum() / terms).backward()
    precon.step()
    assert out.grad is not None
    grad = out.grad if batch_first else out.grad.transpose(0, 1)
    a, g = layer_factors(
        x, grad, bias=True, loss_average=loss_average, approx=approx
    )
    layer = precon.layers['']
    assert layer.a.value is not None and layer.g.value is not None
    label = f'linear {approx} {loss_average}'
    assert_rel_close(layer.a.value, a, rtol=1e-12, label=label)
    assert_rel_close(layer.g.value, g, rtol=1e-12, label=label)


def test_reduce_is_expand_without_sharing() -> None:
    """On `(N, in)` inputs both approximations give the same factors."""
    torch.manual_seed(0)
    x = torch.randn(7, 4, dtype=F64)
    values = []
    for approx in ('expand', 'reduce'):
        torch.manual_seed(1)
        linear = nn.Linear(4, 3).double()
        precon = KFACPreconditioner(
            linear, statistics=StatisticsConfig(kfac_approx=approx)
        )
        linear(x).tanh().mean().backward()
        precon.step()
        values.append([f.value for f in precon.layers[''].factors])
    for mine, theirs in zip(*values):
        assert mine is not None and theirs is not None
        assert torch.equal(mine, theirs)
