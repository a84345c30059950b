"""kfac.layers.curvature.one_sided: one factor's damped inverse, against
`torch.linalg.solve` on the explicit damped matrix.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kfac.enums import AssignmentStrategy
from kfac.layers.base import KFACBaseLayer
from kfac.layers.curvature.one_sided import OneSidedConfig
from kfac.layers.embedding import EmbeddingModuleHelper
from kfac.layers.modules import LinearModuleHelper
from testing.asserts import assert_rel_close

F64 = torch.float64
DAMPING = 0.3


def spd(n: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    m = torch.randn(n, n, generator=gen, dtype=F64)
    return m @ m.T + 0.1 * torch.eye(n, dtype=F64)


def decomposed(
    helper: LinearModuleHelper | EmbeddingModuleHelper,
    side: str,
    a: torch.Tensor,
    g: torch.Tensor,
) -> KFACBaseLayer:
    layer = KFACBaseLayer(helper, curvature=OneSidedConfig(side=side))
    layer.set_factor('A', a)
    layer.set_factor('G', g)
    for name in ('A', 'G'):
        assert layer.compute_decomposition(name, DAMPING)
    return layer


def damped(f: torch.Tensor) -> torch.Tensor:
    """`F + λ (tr F / dim F) I`."""
    n = f.shape[0]
    return f + DAMPING * torch.trace(f) / n * torch.eye(n, dtype=F64)


@pytest.mark.parametrize('side', ['input', 'output'])
def test_one_side_is_a_solve_with_the_damped_factor(side: str) -> None:
    helper = LinearModuleHelper(nn.Linear(4, 3).double())
    a, g = spd(5, 1), spd(3, 2)
    layer = decomposed(helper, side, a, g)
    v = torch.randn(3, 5, dtype=F64)
    got = layer.curvature.precondition(v, DAMPING)
    if side == 'input':
        want = torch.linalg.solve(damped(a), v.T).T
    else:
        want = torch.linalg.solve(damped(g), v)
    assert_rel_close(got, want, label=f'one-sided {side} vs solve')
    unused = 'G' if side == 'input' else 'A'
    held = layer.factor(unused).decomposition
    assert held is not None
    factor = g if side == 'input' else a
    assert_rel_close(held[0], torch.diagonal(factor).mean().reshape(1))
    assert layer.curvature.cost(unused, AssignmentStrategy.COMPUTE) == 1.0
    used = 'A' if side == 'input' else 'G'
    dim = layer.factor(used).dim
    cost = layer.curvature.cost(used, AssignmentStrategy.COMPUTE)
    assert cost == dim**3
    assert layer.decomposition_format == f'one_sided_{side}'


@pytest.mark.parametrize('side', ['input', 'output'])
def test_an_embedding_keeps_its_diagonal_input_factor(side: str) -> None:
    helper = EmbeddingModuleHelper(nn.Embedding(5, 3).double())
    a, g = torch.tensor([1.0, 2.0, 0.5, 3.0, 4.0], dtype=F64), spd(3, 2)
    layer = decomposed(helper, side, a, g)
    assert layer.decomposition_layout('A') == (
        (((5,), False),) if side == 'input' else (((1,), False),)
    )
    v = torch.randn(3, 5, dtype=F64)
    got = layer.curvature.precondition(v, DAMPING)
    if side == 'input':
        want = torch.linalg.solve(damped(torch.diag(a)), v.T).T
    else:
        want = torch.linalg.solve(damped(g), v)
    assert_rel_close(got, want, label=f'one-sided {side} vs solve')
    assert 'OneSidedCurvature' in repr(layer.curvature)


@pytest.mark.parametrize(
    ('options', 'error', 'text'),
    [
        ({'side': 'both'}, ValueError, 'side'),
        ({'side': 0}, TypeError, 'side'),
        ({'source': None}, TypeError, 'source'),
    ],
)
def test_options_are_validated(
    options: dict[str, object], error: type[Exception], text: str
) -> None:
    with pytest.raises(error, match=text):
        OneSidedConfig(**options)  # type: ignore[arg-type]  # wrong on purpose
