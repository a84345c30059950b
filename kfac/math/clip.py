"""The clip of the step: the scale `ν` of every preconditioned gradient.

The two bounds (`kl_clip`, `relative_clip`) are described in
[`kfac.math`][kfac.math] under "Clipping the step".
"""

from __future__ import annotations

import torch

__all__ = ['kl_clip_scale', 'relative_clip_scale']


def kl_clip_scale(
    vg_sum: torch.Tensor,
    lr: float,
    kl_clip: float,
) -> torch.Tensor:
    """Return `ν = min(1, sqrt(κ / |lr² · vg_sum|))` as a 0-d tensor.

    A zero `vg_sum` gives `ν = 1`. Computed without a host
    synchronisation.

    Args:
        vg_sum: `Σ V' ⊙ V` over all preconditioned layers (0-d tensor).
        lr: the optimizer's learning rate.
        kl_clip: `κ`.

    """
    denom = (vg_sum * (lr * lr)).abs()
    scale: torch.Tensor = torch.sqrt(kl_clip / denom).clamp(max=1.0)
    return scale


def relative_clip_scale(
    raw_sq: torch.Tensor, preconditioned_sq: torch.Tensor, bound: float
) -> torch.Tensor:
    """Return `ν = min(1, κ sqrt(raw_sq / preconditioned_sq))` (0-d).

    A zero `preconditioned_sq` gives `ν = 1`. Computed without a host
    synchronisation.

    Args:
        raw_sq: `Σ ‖V‖²` over the preconditioned layers (0-d tensor).
        preconditioned_sq: `Σ ‖V'‖²` over the same layers (0-d tensor).
        bound: `κ`, the largest ratio of the preconditioned to the raw
            gradient norm.

    Examples:
        >>> relative_clip_scale(torch.tensor(1.0), torch.tensor(16.0), 2.0)
        tensor(0.5000)
        >>> relative_clip_scale(torch.tensor(1.0), torch.tensor(0.0), 2.0)
        tensor(1.)

    """
    ratio = torch.sqrt(raw_sq / preconditioned_sq) * bound
    scale: torch.Tensor = torch.where(
        preconditioned_sq > 0, ratio, torch.ones_like(ratio)
    ).clamp(max=1.0)
    return scale
