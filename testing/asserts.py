"""Relative-error assertions that remember the worst error seen.

``tests/conftest.py`` prints :data:`WORST` at the end of the run, so the
largest relative error across the oracle tests is visible in every run.
"""

from __future__ import annotations

import torch

#: Largest relative error seen per label, in this process.
WORST: dict[str, float] = {}


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """``‖actual - expected‖ / ‖expected‖`` (absolute when expected is 0)."""
    actual, expected = actual.detach().double(), expected.detach().double()
    diff = (actual - expected).norm()
    scale = expected.norm()
    return float(diff / scale) if scale > 0 else float(diff)


def assert_rel_close(
    actual: torch.Tensor,
    expected: torch.Tensor,
    *,
    rtol: float = 1e-10,
    label: str = 'oracle',
) -> float:
    """Assert equal shapes and relative error <= ``rtol``; record it."""
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    err = relative_error(actual, expected)
    WORST[label] = max(WORST.get(label, 0.0), err)
    assert err <= rtol, f'{label}: relative error {err:.3e} > {rtol:.1e}'
    return err
