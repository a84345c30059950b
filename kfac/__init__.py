"""K-FAC gradient preconditioning for PyTorch, distributed as in KAISA.

The names a user needs are here:

```python
import kfac

preconditioner = kfac.KFACPreconditioner(model, factor_update_steps=10)
```

`import kfac` also imports the public submodules, so
`kfac.preconditioner.KFACPreconditioner(model)` works after it, as in the
original KAISA package. Importing has no side effects: no process group,
no hook, no log message and no warning.
"""

from __future__ import annotations

from kfac import assignment
from kfac import base_preconditioner
from kfac import checkpoint
from kfac import config
from kfac import distributed
from kfac import enums
from kfac import hyperparams
from kfac import layers
from kfac import math
from kfac import optimizer
from kfac import placement
from kfac import preconditioner
from kfac import scheduler
from kfac import state
from kfac import tracing
from kfac import validation
from kfac.base_preconditioner import BaseKFACPreconditioner
from kfac.checkpoint import dcp_state
from kfac.checkpoint import load_dcp
from kfac.config import FisherConfig
from kfac.config import KFACConfig
from kfac.config import ShardingConfig
from kfac.config import StatisticsConfig
from kfac.distributed import KFACDistributedError
from kfac.enums import AccumulationDivisor
from kfac.enums import AllreduceMethod
from kfac.enums import AssignmentStrategy
from kfac.enums import BasisRefresh
from kfac.enums import ComputeMethod
from kfac.enums import DampingMode
from kfac.enums import DistributedStrategy
from kfac.enums import FactorSource
from kfac.enums import FisherType
from kfac.enums import KFACApprox
from kfac.enums import LossAverage
from kfac.enums import MCLoss
from kfac.enums import MomentRefresh
from kfac.enums import ShardMode
from kfac.enums import Side
from kfac.hyperparams import ORIGINAL_DEFAULTS
from kfac.layers.curvature import Curvature
from kfac.layers.curvature import CurvatureConfig
from kfac.layers.curvature import Decomposed
from kfac.layers.curvature import EigenAdamConfig
from kfac.layers.curvature import EigenConfig
from kfac.layers.curvature import EKFACConfig
from kfac.layers.curvature import InverseConfig
from kfac.layers.curvature import OneSidedConfig
from kfac.layers.curvature import method_config
from kfac.optimizer import KFACOptimizer
from kfac.preconditioner import KFACPreconditioner
from kfac.scheduler import LambdaParamScheduler
from kfac.tracing import FailureLimitError
from kfac.tracing import PhaseTimer

__version__ = '0.5.0'

__all__ = [
    'ORIGINAL_DEFAULTS',
    'AccumulationDivisor',
    'AllreduceMethod',
    'AssignmentStrategy',
    'BaseKFACPreconditioner',
    'BasisRefresh',
    'ComputeMethod',
    'Curvature',
    'CurvatureConfig',
    'DampingMode',
    'Decomposed',
    'DistributedStrategy',
    'EKFACConfig',
    'EigenAdamConfig',
    'EigenConfig',
    'FactorSource',
    'FailureLimitError',
    'FisherConfig',
    'FisherType',
    'InverseConfig',
    'KFACApprox',
    'KFACConfig',
    'KFACDistributedError',
    'KFACOptimizer',
    'KFACPreconditioner',
    'LambdaParamScheduler',
    'LossAverage',
    'MCLoss',
    'MomentRefresh',
    'OneSidedConfig',
    'PhaseTimer',
    'ShardMode',
    'ShardingConfig',
    'Side',
    'StatisticsConfig',
    '__version__',
    'assignment',
    'base_preconditioner',
    'checkpoint',
    'config',
    'dcp_state',
    'distributed',
    'enums',
    'hyperparams',
    'layers',
    'load_dcp',
    'math',
    'method_config',
    'optimizer',
    'placement',
    'preconditioner',
    'scheduler',
    'state',
    'tracing',
    'validation',
]
