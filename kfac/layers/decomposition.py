"""Decomposition attempts: their results and the retry policy.

A factor is decomposed first in the layer's decomposition dtype; when that
raises `torch.linalg.LinAlgError` or gives a non-finite result, it is
retried in float64, then in float64 with a small diagonal jitter. Whatever
the curvature, its layer runs each attempt through these functions.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence
from typing import TYPE_CHECKING
from typing import NamedTuple

import torch

from kfac.layers.curvature.base import Decomposed

if TYPE_CHECKING:  # a layer runs its attempts through these functions
    from kfac.layers.base import KFACBaseLayer

LinAlgError: type[Exception] = torch.linalg.LinAlgError  # type: ignore[attr-defined]  # public, but not re-exported in the stubs
"""`torch.linalg.LinAlgError`, raised by a failed decomposition."""

JITTER = 1e-6
"""Relative diagonal jitter of the last decomposition attempt."""


class Attempt(NamedTuple):
    """One decomposition attempt that did not raise."""

    tensors: tuple[torch.Tensor, ...]
    """The decomposition's tensors."""
    valid: torch.Tensor
    """0-d bool tensor on the device (no host synchronisation): whether
    the tensors are finite and the routine reported success."""


def all_finite(tensors: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """0-d bool tensor: whether every entry of every tensor is finite."""
    flags = [torch.isfinite(t).all() for t in tensors]
    return torch.stack(flags).all()


def attempt_plan(dtype: torch.dtype) -> list[tuple[torch.dtype, float]]:
    """`(dtype, relative jitter)` of each attempt, in order.

    Examples:
        >>> attempt_plan(torch.float32)
        [(torch.float32, 0.0), (torch.float64, 0.0), (torch.float64, 1e-06)]
        >>> attempt_plan(torch.float64)
        [(torch.float64, 0.0), (torch.float64, 1e-06)]
    """
    attempts = [(dtype, 0.0)]
    if dtype != torch.float64:
        attempts.append((torch.float64, 0.0))
    attempts.append((torch.float64, JITTER))
    return attempts


def prepare(
    value: torch.Tensor, dtype: torch.dtype, jitter: float
) -> torch.Tensor:
    """`value` in `dtype`, plus `jitter · (|tr F| / n + 1e-30) · I`.

    A diagonal factor (`value` of shape `(n,)`, its diagonal) gets the
    same jitter added to every entry.
    """
    matrix = value.to(dtype)
    if not jitter:
        return matrix
    diagonal = matrix if matrix.dim() == 1 else torch.diagonal(matrix)
    scale = float(diagonal.mean().abs()) + 1e-30
    if matrix.dim() == 1:
        return matrix + jitter * scale
    eye = torch.eye(matrix.shape[0], dtype=dtype, device=matrix.device)
    return matrix + jitter * scale * eye


def try_attempt(
    routine: Callable[[torch.Tensor], Decomposed],
    value: torch.Tensor,
    dtype: torch.dtype,
    jitter: float,
) -> Attempt | None:
    """Run `routine` (one curvature's decomposition) on `value` prepared
    for this attempt (see [`prepare`][kfac.layers.decomposition.prepare]).

    Returns:
        The attempt, or None when the routine raised `LinAlgError`.
    """
    matrix = prepare(value, dtype, jitter)
    try:
        tensors, ok = routine(matrix)
    except LinAlgError:
        return None
    valid = all_finite(tensors)
    return Attempt(tensors, valid if ok is None else valid & ok)


def decompose_all(
    jobs: Sequence[tuple[KFACBaseLayer, str]], damping: float
) -> list[int]:
    """Decompose factor `name` of each `(layer, name)` in `jobs`.

    All first attempts run, then one host synchronisation reads their
    validity flags; only the failed ones are retried (see
    [`compute_decomposition`][kfac.layers.base.KFACBaseLayer.compute_decomposition]).

    Returns:
        The indices of the jobs whose every attempt failed.
    """
    first = [layer.try_decomposition(name, damping) for layer, name in jobs]
    flags = [result.valid for result in first if result is not None]
    valid = iter(torch.stack(flags).tolist() if flags else [])
    failed = []
    for index, ((layer, name), result) in enumerate(zip(jobs, first)):
        ok = result is not None and next(valid)
        if not layer.finish_decomposition(name, damping, result, ok):
            failed.append(index)
    return failed
