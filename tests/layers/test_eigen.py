"""kfac.layers.eigen: eigendecompositions and ``(A ⊗ G + λI)⁻¹``."""

from __future__ import annotations

import pytest
import torch

from kfac.layers.base import KFACBaseLayer
from kfac.layers.curvature.eigen import WARM_START_STEPS
from kfac.layers.eigen import KFACEigenLayer
from kfac.math import subspace_iteration
from testing.asserts import assert_rel_close
from testing.reference import eigen_reference
from testing.reference import linear_factors
from tests.layers.test_base import layer_with_data

F64 = torch.float64


@pytest.mark.parametrize('prediv', [True, False])
def test_preconditioned_gradient_equals_dense_solve(prediv: bool) -> None:
    """With or without eigenvalues pre-divided on the inverse worker."""
    layer, x, gout = layer_with_data(KFACEigenLayer, prediv_eigenvalues=prediv)
    layer.update_factors(0.9)
    for name in ('A', 'G'):
        assert layer.compute_decomposition(name, 0.1)
    v = torch.randn(3, 5, dtype=F64)
    layer.module.set_grad(v)
    got = layer.precondition_grad(0.1)
    assert got is not None
    a_ref, g_ref = linear_factors(x, gout, bias=True)
    assert_rel_close(
        got,
        eigen_reference(a_ref, g_ref, v, 0.1),
        rtol=1e-9,
        label='layer precondition',
    )


def test_outer_product_needs_a_first() -> None:
    layer, _, _ = layer_with_data(KFACEigenLayer, prediv_eigenvalues=True)
    layer.update_factors(0.9)
    with pytest.raises(
        RuntimeError, match='decomposed on the same rank before G'
    ):
        layer.compute_decomposition('G', 0.1)


@pytest.mark.parametrize('prediv', [True, False])
def test_layout_describes_the_decomposition(prediv: bool) -> None:
    """The layout the broadcasts allocate from has the decomposition's
    shapes; eigenvectors are not symmetric, so none is sent as a triangle.
    """
    layer, _, _ = layer_with_data(KFACEigenLayer, prediv_eigenvalues=prediv)
    layer.update_factors(0.9)
    for name in ('A', 'G'):
        layer.compute_decomposition(name, 0.1)
    for name in ('A', 'G'):
        tensors = layer.factor(name).decomposition
        assert tensors is not None
        layout = layer.decomposition_layout(name)
        assert [tuple(t.shape) for t in tensors] == [s for s, _ in layout]
        assert not any(sym for _, sym in layout)
        assert not torch.equal(tensors[0], tensors[0].T)


@pytest.mark.parametrize('prediv', [True, False])
def test_qr_refresh_starts_from_the_previous_basis(prediv: bool) -> None:
    """The first decomposition is `eigh`'s; the next ones are orthogonal
    iteration from the basis held, with or without pre-divided eigenvalues.
    """
    qr, _, _ = layer_with_data(
        KFACEigenLayer, prediv_eigenvalues=prediv, basis_refresh='qr'
    )
    eigh, _, _ = layer_with_data(KFACEigenLayer, prediv_eigenvalues=prediv)
    for layer in (qr, eigh):
        layer.update_factors(0.9)
        for name in ('A', 'G'):
            assert layer.compute_decomposition(name, 0.1)

    def basis(layer: KFACBaseLayer, name: str) -> torch.Tensor:
        tensors = layer.factor(name).decomposition
        assert tensors is not None
        return tensors[0]

    for name in ('A', 'G'):
        assert torch.equal(basis(qr, name), basis(eigh, name))
    torch.manual_seed(5)
    x, gout = torch.randn(6, 4, dtype=F64), torch.randn(6, 3, dtype=F64)
    qr.save_layer_input(x, now=True)
    qr.save_layer_grad_output(gout, now=True)
    qr.update_factors(0.5)
    previous = {n: basis(qr, n) for n in ('A', 'G')}
    for name in ('A', 'G'):
        assert qr.compute_decomposition(name, 0.1)
        value = qr.factor(name).value
        assert value is not None
        q, d = subspace_iteration(value, previous[name], WARM_START_STEPS)
        assert torch.equal(basis(qr, name), q)
    if not prediv:
        assert qr.g.decomposition is not None
        assert torch.equal(qr.g.decomposition[1], d)
