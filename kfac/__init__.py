"""K-FAC gradient preconditioning for PyTorch, distributed as in KAISA.

`import kfac` imports the public submodules, so
`kfac.preconditioner.KFACPreconditioner(model)` works after it, as in the
original KAISA package. Importing has no side effects: no process group,
no hook, no log message and no warning.
"""

from __future__ import annotations

from kfac import assignment
from kfac import base_preconditioner
from kfac import capture
from kfac import checkpoint
from kfac import config
from kfac import distributed
from kfac import enums
from kfac import exchange
from kfac import hyperparams
from kfac import layers
from kfac import math
from kfac import placement
from kfac import preconditioner
from kfac import report
from kfac import scheduler
from kfac import sharding
from kfac import state
from kfac import tracing
from kfac import validation

__version__ = '0.1.0'

__all__ = [
    '__version__',
    'assignment',
    'base_preconditioner',
    'capture',
    'checkpoint',
    'config',
    'distributed',
    'enums',
    'exchange',
    'hyperparams',
    'layers',
    'math',
    'placement',
    'preconditioner',
    'report',
    'scheduler',
    'sharding',
    'state',
    'tracing',
    'validation',
]
