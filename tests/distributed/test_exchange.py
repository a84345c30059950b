"""kfac.distributed._exchange at world size 1 (no process group): storage
and protocol.

The same functions run across ranks in tests/system/test_ddp_oracle.py and
tests/system/test_distributed*.py.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kfac.distributed import Handle
from kfac.distributed import TorchDistributedCommunicator
from kfac.distributed._exchange import FactorReduction
from kfac.distributed._exchange import KFACDistributedError
from kfac.distributed._exchange import decomposition_payload
from kfac.distributed._exchange import start_decomposition_broadcast
from kfac.distributed._exchange import start_factor_allreduce
from kfac.distributed._exchange import start_grad_broadcast
from kfac.distributed._exchange import wait
from kfac.layers.base import KFACBaseLayer
from kfac.layers.eigen import KFACEigenLayer
from kfac.layers.inverse import KFACInverseLayer
from kfac.layers.modules import LinearModuleHelper

F64 = torch.float64


def _layer(cls: type[KFACBaseLayer] = KFACEigenLayer) -> KFACBaseLayer:
    torch.manual_seed(0)
    layer = cls(LinearModuleHelper(nn.Linear(3, 2).double()))
    x = torch.randn(5, 3, dtype=F64)
    layer.save_layer_input(x, now=True)
    layer.save_layer_grad_output(torch.randn(5, 2, dtype=F64), now=True)
    return layer


def test_allreduce_before_the_first_update_raises() -> None:
    layer = KFACEigenLayer(LinearModuleHelper(nn.Linear(2, 2)))
    with pytest.raises(RuntimeError, match='allreduced before its first'):
        start_factor_allreduce(
            TorchDistributedCommunicator(), layer, bucketed=False
        )


@pytest.mark.parametrize('bucketed', [True, False])
def test_factor_allreduce_returns_the_factors_at_world_size_one(
    bucketed: bool,
) -> None:
    layer = _layer()
    layer.update_factors(0.9)
    comm = TorchDistributedCommunicator()
    handles = start_factor_allreduce(comm, layer, name='fc', bucketed=bucketed)
    for handle, factor in zip(handles, layer.factors, strict=True):
        assert handle.wait() is factor.value  # one rank: the input itself
    assert all(h.labels == () for h in handles)  # nothing travelled


@pytest.mark.parametrize('detailed', [True, False])
@pytest.mark.parametrize('finite', [True, False])
def test_factor_reduction_stores_factors_and_counts_faults(
    finite: bool, detailed: bool
) -> None:
    layer = _layer()
    flag = layer.update_factors(0.9)
    assert flag is not None
    reduction = FactorReduction(TorchDistributedCommunicator(), bucketed=True)
    expected = [f.value for f in layer.factors]
    reduction.start('fc', layer, flag if finite else ~flag)
    health = reduction.finish([0.0, 2.5] if detailed else None)
    assert health.reduced
    assert health.bad_count == (0 if finite else 1)
    if detailed:  # the layers are named; shared values summed (one rank)
        assert health.nonfinite == (() if finite else ('fc',))
        assert health.shared == (0.0, 2.5)
    else:
        assert health.nonfinite == ()
        assert health.shared == ()
    if finite:  # committed: a rollback has nothing provisional to undo
        layer.rollback_factors()
        for factor, value in zip(layer.factors, expected):
            assert factor.value is value
    else:  # every update of the step rolled back (the first: to None)
        assert all(f.value is None for f in layer.factors)
    assert reduction.finish([1.0]) == (False, 0, (), ())  # nothing left


def test_zeros_shared_with_the_health_count_travel() -> None:
    layer = _layer()
    flag = layer.update_factors(0.9)
    assert flag is not None
    reduction = FactorReduction(TorchDistributedCommunicator(), bucketed=True)
    reduction.start('fc', layer, flag)
    assert reduction.finish([0.0, 0.0]).shared == (0.0, 0.0)


def test_payload_is_nan_without_a_decomposition() -> None:
    layer = _layer()
    layer.update_factors(0.9)
    payload = decomposition_payload(layer, 'A')
    shapes = [shape for shape, _ in layer.decomposition_layout('A')]
    assert [tuple(t.shape) for t in payload] == shapes
    assert all(torch.isnan(t).all() for t in payload)
    assert layer.compute_decomposition('A', 0.1)
    assert decomposition_payload(layer, 'A') is layer.decomposition('A')


def test_world_size_one_broadcasts_return_their_inputs() -> None:
    comm = TorchDistributedCommunicator()
    layer = _layer(KFACInverseLayer)
    layer.update_factors(0.9)
    assert layer.compute_decomposition('G', 0.1)
    handles = start_decomposition_broadcast(
        comm, layer, 'G', src=0, group=None
    )
    g = layer.decomposition('G')
    assert g is not None
    assert [h.wait() for h in handles] == list(g)
    buffer = start_grad_broadcast(comm, layer, src=0, group=None).wait()
    assert buffer.shape == layer.module.grad_shape  # a receive buffer
    assert layer.grad is None


class _Failing(Handle):
    def __init__(self, labels: tuple[str, ...] = ()) -> None:
        self._labels = labels

    def wait(self) -> torch.Tensor:
        raise RuntimeError('peer vanished')

    def done(self) -> bool:
        return True

    @property
    def labels(self) -> tuple[str, ...]:
        return self._labels or super().labels


def test_wait_names_the_operation() -> None:
    with pytest.raises(KFACDistributedError, match='K-FAC x failed on rank 0'):
        wait(_Failing(), 'x')


def test_wait_names_the_phase_and_the_layers() -> None:
    with pytest.raises(KFACDistributedError) as info:
        wait(_Failing(), 'x', phase='grad_broadcast', layers=('fc',))
    assert info.value.phase == 'grad_broadcast'
    assert info.value.layers == ('fc',)
    assert str(info.value) == (
        'K-FAC x failed on rank 0 in phase grad_broadcast (it carried '
        'layers fc): peer vanished'
    )
    bucket = _Failing(('b', 'a', 'b'))  # a bucket's labels win, once each
    with pytest.raises(KFACDistributedError) as info:
        wait(bucket, 'x', phase='factor_allreduce', layers=('fc',))
    assert info.value.layers == ('b', 'a')
