"""`metrics()` for plotting: factor traces, damping, K-FAC's time share."""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kfac.preconditioner import KFACPreconditioner
from kfac.tracing import PhaseTimer
from testing.models import TinyMLP
from testing.models import classification_data

F64 = torch.float64


def test_factor_traces_equal_their_definitions() -> None:
    model = TinyMLP().double()
    precon = KFACPreconditioner(model, damping=lambda s: 0.01 / (s + 1))
    assert 'trace_A' not in precon.metrics()['layers']['fc1']
    x, y = classification_data(8, (6,), seed=0)
    outputs: list[torch.Tensor] = []
    model.fc2.register_forward_hook(lambda m, i, o: outputs.append(o))
    logits = model(x)
    outputs[0].retain_grad()
    F.cross_entropy(logits, y).backward()
    precon.step()
    metrics = precon.metrics()
    # A = (1/N) Σ ã ãᵀ with ã = [a, 1]: tr A = mean ‖a‖² + 1.
    want_a = (x.square().sum(1) + 1).mean().item()
    assert metrics['layers']['fc1']['trace_A'] == pytest.approx(want_a)
    # G = (1/N) Σ g gᵀ with g_n = N · grad_output_n.
    grad = outputs[0].grad
    assert grad is not None
    want_g = (8 * grad).square().sum(1).mean().item()
    assert metrics['layers']['fc2']['trace_G'] == pytest.approx(want_g)
    assert metrics['damping'] == 0.005  # the schedule's value now (step 1)
    assert 'kfac_time_share' not in metrics


def test_a_diagonal_factor_reports_its_sum() -> None:
    model = nn.Sequential(nn.Embedding(5, 4), nn.Linear(4, 3)).double()
    precon = KFACPreconditioner(model)
    tokens = torch.tensor([0, 1, 1, 4])
    F.cross_entropy(model(tokens), torch.tensor([0, 1, 2, 0])).backward()
    precon.step()
    # A of an embedding: the tokens' frequencies, one token per example.
    assert precon.metrics()['layers']['0']['trace_A'] == pytest.approx(1.0)


def test_time_share_is_the_timed_fraction_of_wall_time() -> None:
    timer = PhaseTimer()
    timer.started = time.perf_counter() - 2.0
    timer.seconds = {'precondition': 0.5}
    assert 0.24 < timer.share() <= 0.25
    timer.reset()
    assert timer.share() == 0.0
    model = TinyMLP()
    precon = KFACPreconditioner(model)
    precon.timer = timer
    x, y = classification_data(8, (6,), seed=0, dtype=torch.float32)
    F.cross_entropy(model(x), y).backward()
    precon.step()
    share = precon.metrics()['kfac_time_share']
    assert 0.0 < share < 1.0
