"""KFACBaseLayer and its two methods, used directly."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kfac.base_preconditioner import BaseKFACPreconditioner
from kfac.distributed import TorchDistributedCommunicator
from kfac.layers.base import KFACBaseLayer
from kfac.layers.eigen import KFACEigenLayer
from kfac.layers.inverse import KFACInverseLayer
from kfac.layers.modules import LinearModuleHelper
from kfac.preconditioner import KFACPreconditioner
from testing.asserts import assert_rel_close
from testing.reference import eigen_reference
from testing.reference import linear_factors

F64 = torch.float64


def layer_with_data(
    cls: type[KFACBaseLayer] = KFACEigenLayer,
    **kwargs: object,
) -> tuple[KFACBaseLayer, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    module = nn.Linear(4, 3).double()
    layer = cls(LinearModuleHelper(module), **kwargs)  # type: ignore[arg-type]
    x = torch.randn(6, 4, dtype=F64)
    gout = torch.randn(6, 3, dtype=F64)
    layer.save_layer_input(x, now=True)
    layer.save_layer_grad_output(gout, now=False)
    return layer, x, gout


def test_layer_rejects_unknown_loss_reduction() -> None:
    with pytest.raises(ValueError, match='loss_reduction must be one of'):
        KFACEigenLayer(
            LinearModuleHelper(nn.Linear(2, 2)), loss_reduction='avg'
        )


def test_factor_lookup() -> None:
    layer, _, _ = layer_with_data()
    assert layer.factor('A') is layer.a
    assert layer.factor('G') is layer.g
    with pytest.raises(ValueError, match='factor name must be "A" or "G"'):
        layer.factor('B')


def test_batch_mixes_immediate_and_deferred_statistics() -> None:
    layer, x, gout = layer_with_data()
    assert layer.update_factors(0.5)
    a_ref, g_ref = linear_factors(x, gout, bias=True)
    assert layer.a.value is not None and layer.g.value is not None
    assert_rel_close(layer.a.value, a_ref, label='layer factors')
    assert_rel_close(layer.g.value, g_ref, label='layer factors')
    # nothing captured: no update, values kept
    before = layer.a.value
    assert not layer.update_factors(0.5)
    assert layer.a.value is before
    assert layer.a.batch() is None


def test_half_captured_batch_is_dropped() -> None:
    layer, _, _ = layer_with_data()
    layer.reset_batch()
    layer.save_layer_input(torch.randn(2, 4, dtype=F64), now=True)
    assert not layer.update_factors(0.9)
    assert layer.a.value is None
    assert layer.memory_usage()['a_batch'] == 0


@pytest.mark.parametrize('cls', [KFACEigenLayer, KFACInverseLayer])
def test_decomposing_without_factors_raises(cls: type[KFACBaseLayer]) -> None:
    layer = cls(LinearModuleHelper(nn.Linear(2, 2)))
    with pytest.raises(RuntimeError, match='no'):
        layer.compute_decomposition('A', 0.1)


def test_outer_product_needs_a_first() -> None:
    layer, _, _ = layer_with_data(prediv_eigenvalues=True)
    layer.update_factors(0.9)
    with pytest.raises(
        RuntimeError, match='decomposed on the same rank before G'
    ):
        layer.compute_decomposition('G', 0.1)


@pytest.mark.parametrize('prediv', [True, False])
def test_layouts_match_decompositions(prediv: bool) -> None:
    layer, _, _ = layer_with_data(prediv_eigenvalues=prediv)
    layer.update_factors(0.9)
    for name in ('A', 'G'):
        layer.compute_decomposition(name, 0.1)
    for name in ('A', 'G'):
        tensors = layer.factor(name).decomposition
        assert tensors is not None
        layout = layer.decomposition_layout(name)
        assert [tuple(t.shape) for t in tensors] == [s for s, _ in layout]
        assert not any(sym for _, sym in layout)
    inverse, _, _ = layer_with_data(KFACInverseLayer)
    assert inverse.decomposition_layout('G') == (((3, 3), True),)


def test_set_decomposition_and_clear() -> None:
    layer, _, _ = layer_with_data()
    layer.update_factors(0.9)
    assert layer.compute_decomposition('A', 0.1)
    q, d = torch.eye(5, dtype=F64), torch.ones(5, dtype=F64)
    layer.set_decomposition('A', (q, d))
    assert layer.a.decomposition is not None
    assert layer.a.decomposition[0] is q
    layer.set_decomposition('A', None)
    assert layer.a.decomposition is None
    layer.compute_decomposition('A', 0.1)
    layer.clear_decompositions()
    assert not layer.has_decomposition


def test_precondition_without_gradient_and_write_back() -> None:
    layer, x, gout = layer_with_data(prediv_eigenvalues=False)
    layer.update_factors(0.9)
    for name in ('A', 'G'):
        layer.compute_decomposition(name, 0.1)
    assert layer.precondition_grad(0.1) is None  # the module has no .grad
    layer.write_grad(None)  # nothing to write
    module = layer.module.module
    assert module.weight.grad is None
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
    got = got.clone()  # write_grad scales the layer's tensor in place
    layer.write_grad(torch.tensor(0.5, dtype=F64))
    assert layer.grad is None
    written = layer.module.get_grad()
    assert written is not None
    assert_rel_close(written, 0.5 * got, label='layer precondition')


def test_inverse_dtype_and_factor_dtype_options() -> None:
    layer, _, _ = layer_with_data(
        KFACInverseLayer,
        factor_dtype=torch.float32,
        inv_dtype=torch.float32,
    )
    layer.update_factors(0.9)
    layer.compute_decomposition('A', 0.1)
    assert layer.a.value is not None and layer.a.decomposition is not None
    assert layer.a.value.dtype == torch.float32
    assert layer.a.decomposition[0].dtype == torch.float32
    assert layer.decomposition_dtype == torch.float32


def test_base_preconditioner_validates_its_arguments() -> None:
    model = nn.Linear(2, 2)
    precon = KFACPreconditioner(model)
    with pytest.raises(
        ValueError, match='layers must contain at least one layer'
    ):
        BaseKFACPreconditioner({}, assignment=precon.assignment)
    with pytest.raises(
        TypeError, match='update_factors_in_hook must be a bool'
    ):
        BaseKFACPreconditioner(
            dict(precon.layers),
            assignment=precon.assignment,
            update_factors_in_hook='yes',  # type: ignore[arg-type]
        )
    assert precon.kl_clip == 0.001


class Detached(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x).detach()


def test_output_without_grad_captures_only_inputs() -> None:
    model = nn.Sequential(Detached(3, 3), nn.Linear(3, 2)).double()
    precon = KFACPreconditioner(model)
    model(torch.randn(4, 3, dtype=F64)).sum().backward()
    precon.step()
    assert not precon.layers['0'].has_factors
    assert precon.layers['1'].has_factors


def test_factor_update_without_batch_and_reduce_before_update() -> None:
    layer = KFACEigenLayer(LinearModuleHelper(nn.Linear(2, 2)))
    assert not layer.a.update(0.9)
    assert layer.a.value is None
    with pytest.raises(RuntimeError, match='reduce_factors before update'):
        list(
            layer.reduce_factors(
                TorchDistributedCommunicator(),
                None,
                bucketed=False,
            ),
        )


def test_rollback_without_update_is_a_no_op() -> None:
    layer, _, _ = layer_with_data()
    layer.update_factors(0.9)
    layer.commit_factors()
    kept = layer.a.value
    layer.rollback_factors()  # nothing provisional to undo
    assert layer.a.value is kept


def test_inverse_needs_both_factors() -> None:
    layer, _, _ = layer_with_data(KFACInverseLayer)
    layer.update_factors(0.9)
    layer.g.value = None
    with pytest.raises(RuntimeError, match='has no factors yet'):
        layer.compute_decomposition('A', 0.1)
