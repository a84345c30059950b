"""kfac.layers.base: the retry policy's matrices."""

from __future__ import annotations

import torch

from kfac.layers.base import JITTER
from kfac.layers.base import all_finite
from kfac.layers.base import prepare

F64 = torch.float64


def test_prepare_casts_and_adds_relative_jitter() -> None:
    value = torch.diag(torch.tensor([2.0, 4.0], dtype=torch.float32))
    plain = prepare(value, F64, 0.0)
    assert plain.dtype == F64
    assert torch.equal(plain, value.double())
    jittered = prepare(value, F64, JITTER)
    shift = JITTER * (3.0 + 1e-30)  # |mean of the diagonal| = 3
    expected = value.double() + shift * torch.eye(2, dtype=F64)
    torch.testing.assert_close(jittered, expected, rtol=0, atol=1e-15)


def test_prepare_jitters_a_zero_matrix() -> None:
    jittered = prepare(torch.zeros(2, 2), F64, JITTER)
    expected = JITTER * 1e-30 * torch.eye(2, dtype=F64)
    torch.testing.assert_close(jittered, expected, rtol=1e-12, atol=0)


def test_all_finite() -> None:
    ok = (torch.ones(2), torch.zeros(3, 3))
    assert bool(all_finite(ok))
    assert not bool(all_finite((*ok, torch.tensor([1.0, float('inf')]))))
    assert not bool(all_finite((torch.tensor(float('nan')),)))
