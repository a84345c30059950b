"""Low-rank factors (`factor_rank`) and relative damping: each layer's
preconditioned gradient against a dense solve on the explicit damped matrices.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kfac.layers.base import KFACBaseLayer
from kfac.layers.curvature import CurvatureConfig
from kfac.layers.curvature import EigenConfig
from kfac.layers.curvature import InverseConfig
from kfac.layers.eigen import KFACEigenLayer
from kfac.layers.embedding import EmbeddingModuleHelper
from kfac.layers.factory import make_layer
from kfac.layers.inverse import KFACInverseLayer
from kfac.layers.modules import LinearModuleHelper
from testing.asserts import assert_rel_close
from testing.reference import eigen_reference
from testing.reference import inverse_reference
from testing.reference import linear_factors
from testing.reference import lowrank_plus_constant
from testing.reference import mean_eigenvalue
from tests.layers.test_base import layer_with_data

F64 = torch.float64
DAMPING = 0.1


def precondition(layer: object) -> tuple[torch.Tensor, torch.Tensor]:
    """Decompose both factors, precondition a random `V`: `(V', V)`."""
    assert isinstance(layer, (KFACEigenLayer, KFACInverseLayer))
    layer.update_factors(0.9)
    for name in ('A', 'G'):
        assert layer.compute_decomposition(name, DAMPING)
    v = torch.randn(3, 5, dtype=F64)
    layer.module.set_grad(v)
    got = layer.precondition_grad(DAMPING)
    assert got is not None
    return got, v


@pytest.mark.parametrize('rank', [1, 2, 4])
@pytest.mark.parametrize('method', ['eigen', 'inverse'])
def test_low_rank_equals_the_dense_solve(rank: int, method: str) -> None:
    """A (5 x 5) always and G (3 x 3) below rank 3 kept at low rank."""
    cls = KFACEigenLayer if method == 'eigen' else KFACInverseLayer
    layer, x, gout = layer_with_data(cls, factor_rank=rank)
    got, v = precondition(layer)
    a, g = linear_factors(x, gout, bias=True)
    a_hat, g_hat = (
        lowrank_plus_constant(a, rank),
        lowrank_plus_constant(g, rank),
    )
    reference = eigen_reference if method == 'eigen' else inverse_reference
    want = reference(a_hat, g_hat, v, DAMPING)
    assert_rel_close(got, want, rtol=1e-9, label=f'low-rank {method} layer')
    for name in ('A', 'G'):
        tensors = layer.factor(name).decomposition
        assert tensors is not None
        layout = layer.decomposition_layout(name)
        assert [tuple(t.shape) for t in tensors] == [s for s, _ in layout]
    assert layer.decomposition_format == f'{method}_lowrank'


def test_qr_refresh_iterates_the_kept_vectors() -> None:
    """The second decomposition starts from the `(n, k)` basis held."""
    layer, _, _ = layer_with_data(
        KFACEigenLayer, factor_rank=2, basis_refresh='qr'
    )
    precondition(layer)
    held = layer.factor('A').decomposition
    assert held is not None
    assert layer.compute_decomposition('A', DAMPING)
    again = layer.factor('A').decomposition
    assert again is not None and again[0].shape == (5, 2)
    # the factor did not change: the kept subspace stays (up to signs)
    assert_rel_close(
        (again[0].T @ held[0]).abs(), torch.eye(2, dtype=F64), rtol=1e-6
    )


@pytest.mark.parametrize(
    ('cls', 'kwargs'),
    [
        (KFACEigenLayer, {'prediv_eigenvalues': True}),
        (KFACEigenLayer, {'prediv_eigenvalues': False}),
        (KFACInverseLayer, {}),
        (KFACEigenLayer, {'factor_rank': 2}),
        (KFACInverseLayer, {'factor_rank': 2}),
    ],
)
def test_relative_damping_is_lambda_times_the_mean_eigenvalues(
    cls: type[KFACEigenLayer | KFACInverseLayer], kwargs: dict[str, object]
) -> None:
    layer, x, gout = layer_with_data(cls, damping_mode='relative', **kwargs)
    got, v = precondition(layer)
    a, g = linear_factors(x, gout, bias=True)
    rank = kwargs.get('factor_rank')
    if isinstance(rank, int):
        a, g = lowrank_plus_constant(a, rank), lowrank_plus_constant(g, rank)
    lam = DAMPING * mean_eigenvalue(a) * mean_eigenvalue(g)
    eigen = issubclass(cls, KFACEigenLayer)
    want = (eigen_reference if eigen else inverse_reference)(a, g, v, lam)
    assert_rel_close(got, want, rtol=1e-9, label='relative damping layer')


def test_layers_refuse_bad_ranks_and_modes() -> None:
    helper = LinearModuleHelper(nn.Linear(4, 3))
    with pytest.raises(ValueError, match='factor_rank'):
        KFACEigenLayer(helper, factor_rank=0)
    with pytest.raises(ValueError, match="damping_mode='scaled' is not a"):
        KFACEigenLayer(helper, damping_mode='scaled')


def build(helper: object, method: CurvatureConfig) -> str:
    """The decomposition format of the layer the factory builds."""
    layer = make_layer(
        'm',
        helper,  # type: ignore[arg-type]  # a helper
        method=method,
    )
    assert type(layer) is KFACBaseLayer
    return layer.decomposition_format


def test_factory_gives_the_method_the_rank() -> None:
    helper = LinearModuleHelper(nn.Linear(4, 3))
    eigen, inverse = EigenConfig, InverseConfig
    assert build(helper, eigen(factor_rank=5)) == 'eigen_outer'  # none longer
    assert build(helper, eigen(factor_rank=4)) == 'eigen_lowrank'
    assert build(helper, inverse(factor_rank=2)) == 'inverse_lowrank'
    assert build(helper, inverse()) == 'inverse'
    embedding = EmbeddingModuleHelper(nn.Embedding(10, 4))
    assert build(embedding, eigen(factor_rank=4)) == 'eigen_outer'
    # G (4 x 4) at rank 3; the diagonal A stays whole
    assert build(embedding, eigen(factor_rank=3)) == 'eigen_lowrank'
