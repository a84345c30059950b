"""kfac.math.clip: the scale of the KL clip and of the relative cap."""

from __future__ import annotations

import math

import pytest
import torch

from kfac import math as kmath

F64 = torch.float64


@pytest.mark.parametrize(
    ('vg', 'lr', 'kl', 'expected'),
    [
        (4.0, 0.1, 0.001, math.sqrt(0.001 / (4.0 * 0.01))),
        (-4.0, 0.1, 0.001, math.sqrt(0.001 / (4.0 * 0.01))),
        (1e-6, 0.1, 0.001, 1.0),
        (0.0, 0.1, 0.001, 1.0),
        (3.0, 0.0, 0.001, 1.0),
    ],
)
def test_kl_clip_scale(
    vg: float, lr: float, kl: float, expected: float
) -> None:
    got = kmath.kl_clip_scale(torch.tensor(vg, dtype=F64), lr, kl)
    assert got.dim() == 0
    assert float(got) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize(
    ('raw', 'pre', 'bound'),
    [(1.0, 16.0, 2.0), (4.0, 1.0, 1.0), (2.0, 3.0, 0.5), (5.0, 0.0, 1.0)],
)
def test_relative_clip_scale_caps_the_norm_ratio(
    raw: float, pre: float, bound: float
) -> None:
    """After scaling, ‖V'‖ is at most `bound` times ‖V‖ and `ν <= 1`."""
    got = kmath.relative_clip_scale(
        torch.tensor(raw, dtype=F64), torch.tensor(pre, dtype=F64), bound
    )
    assert got.dim() == 0
    if pre == 0.0:
        assert float(got) == 1.0
        return
    scaled_norm = float(got) * math.sqrt(pre)
    assert scaled_norm <= bound * math.sqrt(raw) * (1 + 1e-12)
    assert float(got) <= 1.0
    # either the cap binds (equality) or nothing is scaled
    assert float(got) == 1.0 or scaled_norm == pytest.approx(
        bound * math.sqrt(raw), rel=1e-12
    )
