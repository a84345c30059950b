"""The Monte Carlo Fisher's sampling rule (`kfac.math.fisher`) against
a plain-Python reimplementation (`testing.reference`).
"""

from __future__ import annotations

import math

import pytest
import torch

from kfac.math.fisher import gaussian_noise
from kfac.math.fisher import sample_classes
from kfac.math.fisher import splitmix64
from kfac.math.fisher import uniforms
from testing.reference import MASK64
from testing.reference import py_class
from testing.reference import py_splitmix64
from testing.reference import py_uniform

F64 = torch.float64


def test_splitmix64_and_the_uniforms_equal_a_python_reference() -> None:
    seeds = [0, 1, 12345, (1 << 63) - 1]
    values = torch.tensor([*seeds, -1, -(1 << 63)])
    expected = [py_splitmix64(v & MASK64) for v in values.tolist()]
    got = [v & MASK64 for v in splitmix64(values).tolist()]
    assert got == expected
    indices = torch.tensor([0, 7, 1 << 40])
    u = uniforms(99, 5, indices, sample=2, positions=3, draws=2)
    for n, index in enumerate(indices.tolist()):
        for t in range(3):
            for d in range(2):
                counter = (2 * 3 + t) * 2 + d
                assert u[n, t, d].item() == py_uniform(99, 5, index, counter)


def test_classes_follow_the_inverse_transform() -> None:
    logits = torch.randn(50, 4, dtype=F64)
    u = torch.rand(50, dtype=F64)
    probs = torch.softmax(logits, -1)
    expected = [py_class(row, v) for row, v in zip(probs.tolist(), u.tolist())]
    assert sample_classes(logits, u).tolist() == expected
    # a uniform above every cumulative probability (rounding) takes the last
    assert sample_classes(logits[:1], torch.ones(1, dtype=F64)).item() == 3


def test_gaussian_noise_is_box_muller() -> None:
    u = torch.tensor([[0.25, 0.125], [0.0, 0.5]], dtype=F64)
    expected = [
        math.sqrt(-2 * math.log(0.75)) * math.cos(2 * math.pi * 0.125),
        0.0,
    ]
    got = gaussian_noise(u).tolist()
    assert got[0] == pytest.approx(expected[0], rel=1e-15)
    assert got[1] == 0.0
