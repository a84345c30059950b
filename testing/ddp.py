"""What the distributed oracles share: parameters compared across ranks
and with the single-process run.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from testing.asserts import relative_error


def flat_params(model: nn.Module) -> torch.Tensor:
    """Every parameter of `model`, flattened into one vector."""
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def compare_ranks(
    model: nn.Module, expected: torch.Tensor
) -> tuple[float, float]:
    """On every rank of the default group (all must call it):
    `(largest relative difference between this rank's parameters and any
    rank's, relative difference to expected)`.
    """
    params = flat_params(model)
    gathered = [torch.empty_like(params) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, params)
    across = max(relative_error(g, params) for g in gathered)
    return across, relative_error(params, expected.to(params.device))
