from __future__ import annotations

import pytest
import torch.nn.functional as F

from kfac.preconditioner import KFACPreconditioner
from kfac.scheduler import LambdaParamScheduler
from testing.models import TinyMLP
from testing.models import classification_data


def test_values_are_base_times_lambda_like_lambda_lr() -> None:
    precon = KFACPreconditioner(
        TinyMLP(),
        damping=0.1,
        factor_update_steps=4,
        inv_update_steps=10,
        lr=0.5,
    )
    scheduler = LambdaParamScheduler(
        precon,
        damping_lambda=lambda s: 0.5**s,
        factor_update_steps_lambda=lambda s: 1 / (s + 1),
        inv_update_steps_lambda=lambda s: 0.0,
        lr_lambda=lambda s: 2.0,
    )
    assert precon.damping == pytest.approx(0.1)
    assert precon.factor_update_steps == 4
    assert precon.inv_update_steps == 1  # never below 1
    assert precon.lr == 1.0
    scheduler.step()
    assert precon.damping == pytest.approx(0.05)
    assert precon.factor_update_steps == 2
    scheduler.step(3)
    assert precon.damping == pytest.approx(0.0125)
    assert precon.factor_update_steps == 1
    assert precon.factor_decay == 0.95  # not scheduled


def test_state_dict_round_trip() -> None:
    precon = KFACPreconditioner(TinyMLP(), damping=0.1)
    scheduler = LambdaParamScheduler(precon, damping_lambda=lambda s: 0.5**s)
    scheduler.step()
    scheduler.step()
    state = scheduler.state_dict()
    assert state == {'last_step': 2, 'base_values': {'damping': 0.1}}
    other_precon = KFACPreconditioner(TinyMLP(), damping=0.1)
    other = LambdaParamScheduler(other_precon, damping_lambda=lambda s: 0.5**s)
    other.load_state_dict(state)
    assert other_precon.damping == pytest.approx(0.025)
    with pytest.raises(ValueError, match="does not schedule: \\['lr'\\]"):
        other.load_state_dict({'last_step': 0, 'base_values': {'lr': 1.0}})


def test_invalid_lambdas() -> None:
    precon = KFACPreconditioner(
        TinyMLP(), damping=lambda s: 0.1, relative_clip=None
    )
    with pytest.raises(
        ValueError, match='damping_lambda needs damping to be a constant'
    ):
        LambdaParamScheduler(precon, damping_lambda=lambda s: 1.0)
    with pytest.raises(ValueError, match='kl_clip_lambda needs kl_clip'):
        LambdaParamScheduler(precon, kl_clip_lambda=lambda s: 1.0)
    with pytest.raises(TypeError, match='lr_lambda must be callable'):
        LambdaParamScheduler(precon, lr_lambda=0.5)  # type: ignore[arg-type]  # wrong on purpose


def test_scheduled_values_are_validated() -> None:
    precon = KFACPreconditioner(TinyMLP(), factor_decay=0.9)
    with pytest.raises(ValueError, match='factor_decay'):
        LambdaParamScheduler(precon, factor_decay_lambda=lambda s: 2.0)


def test_schedule_drives_training_steps() -> None:
    model = TinyMLP().double()
    precon = KFACPreconditioner(model, inv_update_steps=1)
    scheduler = LambdaParamScheduler(
        precon,
        inv_update_steps_lambda=lambda s: 1 if s < 2 else 3,
    )
    layer = precon.layers['fc1']
    recomputed = []
    for step in range(6):
        model.zero_grad()
        x, y = classification_data(4, (6,), seed=step)
        F.cross_entropy(model(x), y).backward()
        before = layer.g.decomposition
        precon.step()
        recomputed.append(layer.g.decomposition is not before)
        scheduler.step()
    # steps 0 and 1 every step; from step 2 on every third step (3).
    assert recomputed == [True, True, False, True, False, False]
