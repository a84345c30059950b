"""The model inside the wrappers a preconditioner looks through."""

from __future__ import annotations

import sys
from typing import cast

from torch import nn


def _compiled(model: nn.Module) -> bool:
    """Whether `model` is the wrapper `torch.compile(module)` returns
    (without importing the compiler: no such wrapper exists before it is
    imported).
    """
    frames = sys.modules.get('torch._dynamo.eval_frame')
    wrapper = getattr(frames, 'OptimizedModule', None)
    return wrapper is not None and isinstance(model, wrapper)


def unwrap_model(model: nn.Module) -> nn.Module:
    """The model inside its `DistributedDataParallel` and `torch.compile`
    wrappers (in any order), so that layer names do not depend on them.
    """
    while True:
        if isinstance(model, nn.parallel.DistributedDataParallel):
            model = model.module
        elif _compiled(model):
            model = cast(nn.Module, model._orig_mod)
        else:
            return model
