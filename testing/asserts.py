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


def assert_same_state(
    actual: object, expected: object, path: str = ''
) -> None:
    """Assert two nested state dicts are identical, tensors bitwise.

    Dicts must have the same keys, lists and tuples the same length;
    tensors are compared with ``torch.equal`` (dtype included), anything
    else with ``==``. The failure message names the first differing entry.
    """
    where = path or '<root>'
    if isinstance(expected, dict):
        assert isinstance(actual, dict), f'{where}: {type(actual)} vs dict'
        assert actual.keys() == expected.keys(), (
            f'{where}: keys {sorted(map(str, actual))} vs '
            f'{sorted(map(str, expected))}'
        )
        for key in expected:
            assert_same_state(actual[key], expected[key], f'{path}/{key}')
    elif isinstance(expected, list | tuple):
        assert isinstance(actual, type(expected)), (
            f'{where}: {type(actual)} vs {type(expected)}'
        )
        assert len(actual) == len(expected), f'{where}: length differs'
        for i, (a, e) in enumerate(zip(actual, expected)):
            assert_same_state(a, e, f'{path}[{i}]')
    elif isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), f'{where}: not a tensor'
        assert actual.dtype == expected.dtype, f'{where}: dtype differs'
        assert actual.shape == expected.shape, f'{where}: shape differs'
        assert torch.equal(actual, expected), (
            f'{where}: tensors differ by up to '
            f'{float((actual.double() - expected.double()).abs().max()):.3e}'
        )
    else:
        assert actual == expected, f'{where}: {actual!r} != {expected!r}'
