"""`KFACOptimizer` in an Accelerate loop (CPU): `accelerator.prepare`,
`accumulate`, `backward`, `clip_grad_norm_`, then the wrapper's step."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader
from torch.utils.data import TensorDataset

from kfac.config import StatisticsConfig
from kfac.optimizer import KFACOptimizer
from kfac.preconditioner import KFACPreconditioner
from testing.models import TinyMLP
from testing.models import classification_data

accelerate = pytest.importorskip('accelerate')


@pytest.fixture(autouse=True)
def fresh_state() -> Iterator[None]:
    yield
    accelerate.state.AcceleratorState._reset_state(reset_partial_state=True)
    accelerate.state.GradientState._reset_state()


def wrapped(model: nn.Module, **options: Any) -> KFACOptimizer:
    base = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    precon = KFACPreconditioner(
        model,
        damping=0.01,
        relative_clip=1.0,
        accumulation_steps=2,
        **options,
    )
    return KFACOptimizer(base, precon)


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [
        classification_data(4, (6,), seed=s, dtype=torch.float32)
        for s in range(4)
    ]


def test_accelerate_loop_equals_the_plain_loop() -> None:
    torch.manual_seed(0)
    model = TinyMLP()
    ref = copy.deepcopy(model)
    accelerator = accelerate.Accelerator(
        cpu=True, gradient_accumulation_steps=2
    )
    optimizer = wrapped(model)
    prepared, prepared_opt = accelerator.prepare(model, optimizer)
    for x, y in batches():
        with accelerator.accumulate(prepared):
            loss = 20 * F.cross_entropy(prepared(x), y)
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(prepared.parameters(), 1.0)
            prepared_opt.step()
            prepared_opt.zero_grad()
    assert optimizer.preconditioner.steps == 2
    ref_opt = wrapped(ref)
    for i, (x, y) in enumerate(batches()):
        (20 * F.cross_entropy(ref(x), y) / 2).backward()
        if i % 2 == 1:
            nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
            ref_opt.step()
            ref_opt.zero_grad()
    for got, want in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


def test_a_short_accumulation_trains_as_the_plain_loop() -> None:
    """Three batches of a prepared loader, two per step: Accelerate syncs
    after the last batch alone (the end of the loader), its loss divided
    by 2 all the same.
    """
    options: dict[str, Any] = {
        'statistics': StatisticsConfig(
            accumulation_divisor='accumulation_steps'
        ),
        'factor_update_steps': 1,  # the short step updates factors
        'inv_update_steps': 1,
    }
    torch.manual_seed(0)
    model = TinyMLP()
    ref = copy.deepcopy(model)
    x, y = classification_data(12, (6,), seed=5, dtype=torch.float32)
    accelerator = accelerate.Accelerator(
        cpu=True, gradient_accumulation_steps=2
    )
    optimizer = wrapped(model, **options)
    prepared, prepared_opt, loader = accelerator.prepare(
        model, optimizer, DataLoader(TensorDataset(x, y), batch_size=4)
    )
    for xb, yb in loader:
        with accelerator.accumulate(prepared):
            accelerator.backward(F.cross_entropy(prepared(xb), yb))
            prepared_opt.step()
            prepared_opt.zero_grad()
    assert optimizer.preconditioner.steps == 2
    ref_opt = wrapped(ref, **options)
    for rows in ([0, 1], [2]):
        for i in rows:
            part = slice(4 * i, 4 * i + 4)
            (F.cross_entropy(ref(x[part]), y[part]) / 2).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    for got, want in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
