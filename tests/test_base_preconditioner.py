"""BaseKFACPreconditioner: hyperparameter values, counters, memory, loading."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kfac.preconditioner import KFACPreconditioner
from testing.models import TinyMLP
from testing.models import classification_data


def _step(precon: KFACPreconditioner, model: torch.nn.Module) -> None:
    x, y = classification_data(4, (6,))
    F.cross_entropy(model(x), y).backward()
    precon.step()


def test_hyperparameter_values_follow_schedules_per_step() -> None:
    model = TinyMLP().double()
    precon = KFACPreconditioner(
        model,
        damping=lambda s: 0.1 * (s + 1),
        kl_clip=lambda s: None if s else 0.5,
        lr=0.2,
        factor_decay=0.7,
        factor_update_steps=1,
        inv_update_steps=lambda s: 3,
    )
    first = precon.hyperparameter_values()
    assert (precon.damping, precon.kl_clip, precon.lr) == (0.1, 0.5, 0.2)
    assert (precon.factor_decay, precon.inv_update_steps) == (0.7, 3)
    assert precon.factor_update_steps == 1
    assert precon.hyperparameter_values() is first  # resolved once a step
    _step(precon, model)
    assert precon.damping == pytest.approx(0.2)
    assert precon.kl_clip is None


def test_saved_decomposition_without_factors_is_not_used() -> None:
    model = TinyMLP().double()
    precon = KFACPreconditioner(
        model, factor_update_steps=10, inv_update_steps=10
    )
    _step(precon, model)
    state = precon.state_dict()
    state['layers']['fc1'] = {}  # factors lost, decomposition kept
    model2 = TinyMLP().double()
    other = KFACPreconditioner(
        model2, factor_update_steps=10, inv_update_steps=10
    )
    other.load_state_dict(state)
    assert not other.layers['fc1'].has_factors
    assert other.layers['fc2'].has_decomposition
    x, y = classification_data(4, (6,))
    F.cross_entropy(model2(x), y).backward()
    raw = {n: p.grad.clone() for n, p in model2.named_parameters()}  # type: ignore[union-attr]  # backward() above set it
    other.step()  # step 1: neither a factor nor a decomposition step
    grads = dict(model2.named_parameters())
    assert torch.equal(grads['fc1.weight'].grad, raw['fc1.weight'])  # type: ignore[arg-type]  # backward() above set it
    assert not torch.equal(grads['fc2.weight'].grad, raw['fc2.weight'])  # type: ignore[arg-type]  # backward() above set it


def test_grad_statistics_need_a_preconditioned_gradient() -> None:
    precon = KFACPreconditioner(TinyMLP().double())
    with pytest.raises(RuntimeError, match='no preconditioned gradient'):
        precon.layers['fc1'].grad_statistics()
