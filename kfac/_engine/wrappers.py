"""The wrappers a model may come in (DDP, `torch.compile`), looked
through so that layer names and checkpoints do not depend on them.
"""

from __future__ import annotations

import sys
from typing import cast

from torch import nn

from kfac._engine.taps import require_operators

__all__ = ['unwrap']


def _compiled(model: nn.Module) -> bool:
    """Whether `model` is the wrapper `torch.compile(module)` returns
    (without importing the compiler: no such wrapper exists before it is
    imported).
    """
    frames = sys.modules.get('torch._dynamo.eval_frame')
    wrapper = getattr(frames, 'OptimizedModule', None)
    return wrapper is not None and isinstance(model, wrapper)


def unwrap(model: nn.Module) -> nn.Module:
    """The model inside its `DistributedDataParallel` and `torch.compile`
    wrappers (in any order), so that layer names do not depend on them.

    Raises:
        RuntimeError: a `torch.compile` wrapper on a torch too old for
            K-FAC's operators (`kfac._engine.taps.COMPILE_RELEASE`).
    """
    while True:
        if isinstance(model, nn.parallel.DistributedDataParallel):
            model = model.module
        elif _compiled(model):
            require_operators()
            model = cast(nn.Module, model._orig_mod)
        else:
            return model
