"""kfac.layers.inverse: damped inverses with factored Tikhonov damping."""

from __future__ import annotations

import pytest
import torch

from kfac.layers.inverse import KFACInverseLayer
from testing.asserts import assert_rel_close
from testing.reference import inverse_reference
from testing.reference import linear_factors
from tests.layers.test_base import layer_with_data

F64 = torch.float64


@pytest.mark.parametrize('damping', [1e-3, 0.1, 10.0])
def test_preconditioned_gradient_equals_dense_solve(damping: float) -> None:
    layer, x, gout = layer_with_data(KFACInverseLayer)
    layer.update_factors(0.9)
    for name in ('A', 'G'):
        assert layer.compute_decomposition(name, damping)
    v = torch.randn(3, 5, dtype=F64)
    layer.module.set_grad(v)
    got = layer.precondition_grad(damping)
    assert got is not None
    a_ref, g_ref = linear_factors(x, gout, bias=True)
    assert_rel_close(
        got,
        inverse_reference(a_ref, g_ref, v, damping),
        rtol=1e-9,
        label='layer precondition',
    )


def test_layout_describes_the_decomposition() -> None:
    """One inverse per factor; it is symmetric, so the broadcast may send
    its triangle only.
    """
    layer, _, _ = layer_with_data(KFACInverseLayer)
    layer.update_factors(0.9)
    for name in ('A', 'G'):
        layer.compute_decomposition(name, 0.1)
        tensors = layer.factor(name).decomposition
        assert tensors is not None
        layout = layer.decomposition_layout(name)
        assert [tuple(t.shape) for t in tensors] == [s for s, _ in layout]
        for tensor, (_, symmetric) in zip(tensors, layout):
            assert symmetric
            assert torch.equal(tensor, tensor.T)


def test_inverse_needs_both_factors() -> None:
    layer, _, _ = layer_with_data(KFACInverseLayer)
    layer.update_factors(0.9)
    layer.g.value = None
    with pytest.raises(RuntimeError, match='has no factors yet'):
        layer.compute_decomposition('A', 0.1)
