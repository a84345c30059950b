"""Skipping a test on a torch release older than the one it needs.

The suite runs on every release from the floor in `pyproject.toml` up
(`make test-torch TORCH_SPEC='torch==X.Y.Z'`). A test of a feature that
came later is marked with the release it needs, and its skip says so:

    @requires_torch('2.9', 'torch.optim.Muon')
    def test_composes_with_muon() -> None: ...

The marks of the features met so far are below (`MUON` is that one). A
test that skips on a CPU for any other reason is a bug of the test (the
device-aware tests skip what only CUDA runs).
"""

from __future__ import annotations

import pytest
import torch

from kfac._engine.taps import COMPILE_RELEASE
from kfac._engine.taps import parse_release

__all__ = [
    'COMPILED',
    'FSDP2_ON_CPU',
    'HSDP_ON_CPU',
    'MUON',
    'parse_release',
    'requires_torch',
    'torch_release',
]


def torch_release() -> tuple[int, int]:
    """`(major, minor)` of the torch that runs the tests."""
    return parse_release(torch.__version__)


def requires_torch(release: str, feature: str) -> pytest.MarkDecorator:
    """Skip the marked test on a torch older than `release`.

    Args:
        release: the first release with `feature`, `'major.minor'`.
        feature: what the test needs, named in the skip's reason.
    """
    return pytest.mark.skipif(
        torch_release() < parse_release(release),
        reason=f'needs torch>={release} ({feature}); '
        f'this is torch {torch.__version__}',
    )


COMPILED = requires_torch(
    COMPILE_RELEASE, "K-FAC's custom operators in torch.compile graphs"
)
"""A model compiled with K-FAC's hooks (`kfac._engine.taps`)."""

MUON = requires_torch('2.9', 'torch.optim.Muon')
"""`torch.optim.Muon`."""

FSDP2_ON_CPU = requires_torch(
    '2.7', 'FSDP2 on the CPU: torch.cpu.Stream.record_event'
)
"""Training a `fully_shard` model on CPU tensors (gloo): torch 2.6's
FSDP2 calls a method its CPU stream lacks."""

HSDP_ON_CPU = requires_torch(
    '2.8', "HSDP on the CPU: FSDP2's all-reduce of replicas on gloo"
)
"""HSDP (`fully_shard` on a 2-D mesh) on CPU tensors: torch 2.7's FSDP2
all-reduces the replicas with `ReduceOp.AVG`, which gloo refuses."""
