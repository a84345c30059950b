"""kfac._engine.factors, the factor-update phase, at world size 1 without
a process group.
"""

from __future__ import annotations

import logging

import pytest

from kfac._engine.factors import FactorUpdates
from kfac.distributed import TorchDistributedCommunicator
from kfac.tracing import Faults
from testing.phases import assignment
from testing.phases import captured
from testing.phases import linear_layer
from testing.phases import no_phase

LOG = logging.getLogger('kfac.test_factors')


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
