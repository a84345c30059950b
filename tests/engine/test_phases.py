"""Each phase of the engine's step on its own, at world size 1 without a
process group: the factor update (`kfac._engine.factors`), the
decompositions (`kfac._engine.decompositions`) and the curvatures' own
statistics (`kfac._engine.curvature_updates`). The preconditioning phase
(`kfac._engine.preconditioning`) is tested in `test_preconditioning.py`.
"""

from __future__ import annotations

import contextlib
import logging
from typing import ClassVar

import pytest
import torch
from torch import nn

from kfac._engine.curvature_updates import CurvatureUpdates
from kfac._engine.decompositions import decompose
from kfac._engine.factors import FactorUpdates
from kfac.assignment import KAISAAssignment
from kfac.assignment import decomposition_work
from kfac.distributed import TorchDistributedCommunicator
from kfac.layers.base import KFACBaseLayer
from kfac.layers.base import LinAlgError
from kfac.layers.curvature import Curvature
from kfac.layers.curvature import CurvatureConfig
from kfac.layers.curvature import Decomposed
from kfac.layers.curvature.base import Layout
from kfac.layers.eigen import KFACEigenLayer
from kfac.layers.modules import LinearModuleHelper
from kfac.tracing import Faults

F64 = torch.float64
LOG = logging.getLogger('kfac.test_phases')


def no_phase(name: str) -> contextlib.AbstractContextManager[None]:
    return contextlib.nullcontext()


def captured(layer: KFACBaseLayer, seed: int = 0) -> None:
    """One batch of a `(4 -> 3)` Linear's hook data."""
    gen = torch.Generator().manual_seed(seed)
    layer.save_layer_input(
        torch.randn(5, 4, generator=gen, dtype=F64), now=True
    )
    layer.save_layer_grad_output(
        torch.randn(5, 3, generator=gen, dtype=F64), now=True
    )


def linear_layer() -> KFACBaseLayer:
    return KFACEigenLayer(LinearModuleHelper(nn.Linear(4, 3).double()))


def assignment(layers: dict[str, KFACBaseLayer]) -> KAISAAssignment:
    return KAISAAssignment(
        decomposition_work(layers, 'compute'),
        local_rank=0,
        world_size=1,
        grad_worker_fraction=1.0,
        colocate_factors=True,
    )


def test_factor_update_folds_the_batch_and_logs_the_missing_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    ran, idle = linear_layer(), linear_layer()
    layers = {'ran': ran, 'idle': idle}
    updates = FactorUpdates(
        layers,
        TorchDistributedCommunicator(),
        bucketed=True,
        phase=no_phase,
        faults=Faults(LOG),
        assignment=assignment(layers),
    )
    captured(ran)
    with caplog.at_level(logging.WARNING, logger=LOG.name):
        updates.update(0.9, step=0)
        updates.update(0.9, step=1)  # idle again: logged once
    assert ran.has_factors and not idle.has_factors
    assert caplog.text.count('module idle did not run forward') == 1
    # more passes than accumulation_steps: the extra one is dropped
    captured(ran, seed=1)
    updates.finish('ran', 0.9, step=2)
    captured(ran, seed=2)
    with caplog.at_level(logging.WARNING, logger=LOG.name):
        updates.update(0.9, step=2)
    assert 'more backward passes than accumulation_steps' in caplog.text
    assert ran.captures == (0, 0)


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


class Counting(Curvature):
    """Reduces one statistic per step (`ones`), counts its updates."""

    format = 'counting'
    reduces_statistics: ClassVar[bool] = True

    def __init__(self, layer: KFACBaseLayer) -> None:
        super().__init__(layer)
        self.seen: list[tuple[float, bool]] = []
        self.restarts = 0

    def layout(self, name: str) -> Layout:
        return (((1,), False),)

    def decompose(
        self,
        name: str,
        matrix: torch.Tensor,
        dtype: torch.dtype,
        damping: float,
    ) -> Decomposed:
        return Decomposed((torch.ones(1, dtype=dtype),), None)

    def precondition(self, grad: torch.Tensor, damping: float) -> torch.Tensor:
        return grad

    def batch_statistics(self) -> dict[str, torch.Tensor]:
        return {'ones': torch.full((2,), 3.0, dtype=F64)}

    def update_statistics(
        self,
        averaged: dict[str, torch.Tensor],
        decay: float,
        damping: float,
        *,
        preconditions: bool,
    ) -> None:
        assert torch.equal(averaged['ones'], torch.full((2,), 3.0, dtype=F64))
        self.seen.append((decay, preconditions))

    def restart(self) -> None:
        self.restarts += 1


class CountingConfig(CurvatureConfig):
    name: ClassVar[str] = 'counting'

    def make(self, layer: KFACBaseLayer) -> Counting:
        return Counting(layer)


def test_curvature_statistics_reach_only_the_curvatures_that_reduce() -> None:
    counting = KFACBaseLayer(
        LinearModuleHelper(nn.Linear(4, 3).double()),
        curvature=CountingConfig(),
    )
    plain = linear_layer()
    layers = {'counting': counting, 'plain': plain}
    updates = CurvatureUpdates(
        layers,
        assignment(layers),
        TorchDistributedCommunicator(),
        bucketed=False,
        phase=no_phase,
    )
    assert list(updates.layers) == ['counting']
    updates.restart(['counting', 'plain'])
    updates.update(0.9, 0.1)
    curvature = counting.curvature
    assert isinstance(curvature, Counting)
    assert curvature.restarts == 1
    assert curvature.seen == [(0.9, True)]
    empty = CurvatureUpdates(
        {'plain': plain},
        assignment({'plain': plain}),
        TorchDistributedCommunicator(),
        bucketed=True,
        phase=no_phase,
    )
    empty.update(0.9, 0.1)  # nothing to reduce: no collective
    assert empty.layers == {}
