"""kfac.layers.base: KFACBaseLayer's capture, factors, gradients and dtypes.

What is common to both methods is tested here, on either layer; what each
method decomposes is in test_eigen.py and test_inverse.py.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from kfac.layers.base import KFACBaseLayer
from kfac.layers.eigen import KFACEigenLayer
from kfac.layers.inverse import KFACInverseLayer
from kfac.layers.modules import LinearModuleHelper
from testing.asserts import assert_rel_close
from testing.reference import eigen_reference
from testing.reference import inverse_reference
from testing.reference import linear_factors

F64 = torch.float64
METHODS = [KFACEigenLayer, KFACInverseLayer]


def layer_with_data(
    cls: type[KFACBaseLayer] = KFACEigenLayer,
    **kwargs: object,
) -> tuple[KFACBaseLayer, torch.Tensor, torch.Tensor]:
    """A layer on a float64 ``Linear(4, 3)`` that captured one batch of 6:
    its input now, its output gradient deferred.
    """
    torch.manual_seed(0)
    module = nn.Linear(4, 3).double()
    layer = cls(LinearModuleHelper(module), **kwargs)  # type: ignore[arg-type]  # keyword options of the layer
    x = torch.randn(6, 4, dtype=F64)
    gout = torch.randn(6, 3, dtype=F64)
    layer.save_layer_input(x, now=True)
    layer.save_layer_grad_output(gout, now=False)
    return layer, x, gout


def decomposed(
    cls: type[KFACBaseLayer], damping: float = 0.1
) -> tuple[KFACBaseLayer, torch.Tensor, torch.Tensor]:
    """:func:`layer_with_data` with factors and both decompositions."""
    layer, x, gout = layer_with_data(cls)
    layer.update_factors(0.9)
    for name in ('A', 'G'):
        assert layer.compute_decomposition(name, damping)
    return layer, x, gout


def test_layer_validates_loss_average() -> None:
    helper = LinearModuleHelper(nn.Linear(2, 2))
    with pytest.raises(ValueError, match='loss_average must be None'):
        KFACEigenLayer(helper, loss_average='mean')
    layer = KFACEigenLayer(helper, loss_average=None)
    assert layer.statistics.loss_average is None


def test_unknown_factor_name_is_rejected() -> None:
    layer, _, _ = layer_with_data()
    layer.update_factors(0.9)
    message = 'factor name must be "A" or "G"'
    with pytest.raises(ValueError, match=message):
        layer.compute_decomposition('B', 0.1)
    with pytest.raises(ValueError, match=message):
        layer.set_decomposition('a', None)


def test_batch_mixes_immediate_and_deferred_statistics() -> None:
    layer, x, gout = layer_with_data()
    assert layer.update_factors(0.5)
    a_ref, g_ref = linear_factors(x, gout, bias=True)
    assert layer.a.value is not None and layer.g.value is not None
    assert_rel_close(layer.a.value, a_ref, label='layer factors')
    assert_rel_close(layer.g.value, g_ref, label='layer factors')
    # nothing captured: no update, values kept
    before = layer.a.value
    assert layer.update_factors(0.5) is None
    assert layer.a.value is before
    assert layer.a.batch() is None


def test_half_captured_batch_is_dropped() -> None:
    layer, _, _ = layer_with_data()
    layer.reset_batch()
    layer.save_layer_input(torch.randn(2, 4, dtype=F64), now=True)
    assert layer.update_factors(0.9) is None
    assert layer.a.value is None
    assert layer.memory_usage()['a_batch'] == 0


def test_non_finite_batch_rolls_back_both_factors() -> None:
    """A NaN in G's batch: the update says so, and rolling back restores
    A as well, whose own batch was finite.
    """
    layer, _, _ = layer_with_data()
    assert layer.update_factors(0.9)
    layer.commit_factors()
    a, g = layer.a.value, layer.g.value
    layer.save_layer_input(torch.randn(6, 4, dtype=F64), now=True)
    bad = torch.randn(6, 3, dtype=F64)
    bad[2, 1] = math.nan
    layer.save_layer_grad_output(bad, now=True)
    finite = layer.update_factors(0.9)
    assert finite is not None and not bool(finite)
    assert layer.a.value is not a  # A's finite batch was folded in
    layer.rollback_factors()
    assert layer.a.value is a and layer.g.value is g


@pytest.mark.parametrize('cls', METHODS)
def test_decomposing_without_factors_raises(cls: type[KFACBaseLayer]) -> None:
    layer = cls(LinearModuleHelper(nn.Linear(2, 2)))
    with pytest.raises(RuntimeError, match='factor A of .* has no value yet'):
        layer.compute_decomposition('A', 0.1)


@pytest.mark.parametrize('cls', METHODS)
def test_received_decomposition_preconditions_like_its_source(
    cls: type[KFACBaseLayer],
) -> None:
    """A gradient worker that only received the decompositions (no factors
    of its own) computes the same preconditioned gradient.
    """
    source, _, _ = decomposed(cls)
    receiver = cls(LinearModuleHelper(source.module.module))
    assert not receiver.has_factors and not receiver.has_decomposition
    for name in ('A', 'G'):
        receiver.set_decomposition(name, source.factor(name).decomposition)
    assert receiver.has_decomposition
    source.module.set_grad(torch.randn(3, 5, dtype=F64))
    expected = source.precondition_grad(0.1)
    got = receiver.precondition_grad(0.1)
    assert expected is not None and got is not None
    assert torch.equal(got, expected)
    assert receiver.counters['unpreconditioned_steps'] == 0


@pytest.mark.parametrize('cls', METHODS)
def test_without_both_decompositions_the_raw_gradient_stands_in(
    cls: type[KFACBaseLayer],
) -> None:
    layer, x, gout = decomposed(cls)
    v = torch.randn(3, 5, dtype=F64)
    layer.module.set_grad(v)
    layer.set_decomposition('A', None)  # received "no valid one"
    got = layer.precondition_grad(0.1)
    assert got is not None
    assert torch.equal(got, v)
    assert layer.counters['unpreconditioned_steps'] == 1
    # with A decomposed again the gradient is preconditioned
    assert layer.compute_decomposition('A', 0.1)
    got = layer.precondition_grad(0.1)
    assert got is not None
    a_ref, g_ref = linear_factors(x, gout, bias=True)
    solve = eigen_reference if cls is KFACEigenLayer else inverse_reference
    assert_rel_close(
        got, solve(a_ref, g_ref, v, 0.1), rtol=1e-9, label='layer precondition'
    )
    # a rank that is no gradient worker drops both
    layer.clear_decompositions()
    got = layer.precondition_grad(0.1)
    assert got is not None
    assert torch.equal(got, v)
    assert layer.counters['unpreconditioned_steps'] == 2


def test_precondition_without_gradient_and_write_back() -> None:
    layer, _, _ = decomposed(KFACEigenLayer)
    assert layer.precondition_grad(0.1) is None  # the module has no .grad
    layer.write_grad(None)  # nothing to write
    module = layer.module.module
    assert module.weight.grad is None
    layer.module.set_grad(torch.randn(3, 5, dtype=F64))
    got = layer.precondition_grad(0.1)  # equals the dense solve: test_eigen
    assert got is not None
    got = got.clone()  # write_grad scales the layer's tensor in place
    layer.write_grad(torch.tensor(0.5, dtype=F64))
    assert layer.grad is None
    written = layer.module.get_grad()
    assert written is not None
    assert_rel_close(written, 0.5 * got, label='layer precondition')


def test_float32_factor_and_inverse_dtypes_on_a_float64_module() -> None:
    """Factors and preconditioning in float32 agree with the float64
    definitions to float32 rounding; the write-back keeps float64.
    """
    layer, x, gout = layer_with_data(
        KFACInverseLayer,
        factor_dtype=torch.float32,
        inv_dtype=torch.float32,
    )
    layer.update_factors(0.9)
    a_ref, g_ref = linear_factors(x, gout, bias=True)
    for factor, ref in zip(layer.factors, (a_ref, g_ref)):
        assert factor.value is not None
        assert factor.value.dtype == torch.float32
        assert_rel_close(factor.value, ref, rtol=1e-6, label='float32')
    for name in ('A', 'G'):
        assert layer.compute_decomposition(name, 0.1)
    v = torch.randn(3, 5, dtype=F64)
    layer.module.set_grad(v)
    got = layer.precondition_grad(0.1)
    assert got is not None
    assert got.dtype == torch.float32
    expected = inverse_reference(a_ref, g_ref, v, 0.1)
    assert_rel_close(got, expected, rtol=1e-5, label='float32')
    layer.write_grad(None)
    written = layer.module.get_grad()
    assert written is not None
    assert written.dtype == F64
    assert_rel_close(written, expected, rtol=1e-5, label='float32')
