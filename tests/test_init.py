"""`import kfac`: public submodules reachable, no side effects."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import logging
import sys
import warnings

records = []
logging.getLogger().addHandler(logging.Handler())
logging.getLogger().handlers[-1].emit = records.append
logging.getLogger().setLevel(logging.DEBUG)
with warnings.catch_warnings():
    warnings.simplefilter('error')
    import kfac
at_import = len(records)
import torch
model = torch.nn.Linear(3, 2)
precon = kfac.preconditioner.KFACPreconditioner(model)
names = [
    kfac.base_preconditioner.BaseKFACPreconditioner,
    kfac.layers.eigen.KFACEigenLayer,
    kfac.layers.modules.LinearModuleHelper,
    kfac.layers.register.register_modules,
    kfac.assignment.KAISAAssignment,
    kfac.distributed.TorchDistributedCommunicator,
    kfac.distributed._exchange.FactorReduction,
    kfac._engine.capture.Capture,
    kfac.state.parse_state,
    kfac.enums.ComputeMethod,
    kfac.scheduler.LambdaParamScheduler,
]
assert all(names)
print(at_import, torch.distributed.is_initialized())
"""


def test_import_kfac_reaches_submodules_without_side_effects() -> None:
    result = subprocess.run(
        [sys.executable, '-c', SCRIPT],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    logged, initialized = result.stdout.split()
    assert (logged, initialized) == ('0', 'False')
