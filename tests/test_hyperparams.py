from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from kfac.hyperparams import ORIGINAL_DEFAULTS
from kfac.hyperparams import Hyperparameters
from kfac.hyperparams import HyperparameterValues
from kfac.hyperparams import exp_decay_factor_averaging


def test_defaults_are_the_studys_choice() -> None:
    # the values the time-to-target study chose (docs/study.md): updates
    # every 10/100 steps, damping 0.003, the relative clip at 1
    hp = Hyperparameters()
    assert hp.at(0) == hp.at(7)
    resolved = hp.at(0)
    assert (resolved.factor_update_steps, resolved.inv_update_steps) == (
        10,
        100,
    )
    assert (resolved.damping, resolved.factor_decay) == (0.003, 0.95)
    assert (resolved.kl_clip, resolved.lr) == (None, 0.1)
    assert resolved.relative_clip == 1.0


def test_original_defaults_give_the_original_kaisa_defaults() -> None:
    assert dict(ORIGINAL_DEFAULTS) == {
        'factor_update_steps': 1,
        'inv_update_steps': 1,
        'damping': 0.001,
        'kl_clip': 0.001,
        'relative_clip': None,
        'compute_method': 'eigen',
    }
    hp = Hyperparameters(
        factor_update_steps=ORIGINAL_DEFAULTS['factor_update_steps'],
        inv_update_steps=ORIGINAL_DEFAULTS['inv_update_steps'],
        damping=ORIGINAL_DEFAULTS['damping'],
        kl_clip=ORIGINAL_DEFAULTS['kl_clip'],
    )
    resolved = hp.at(0)
    assert (resolved.factor_update_steps, resolved.inv_update_steps) == (1, 1)
    assert (resolved.damping, resolved.kl_clip) == (0.001, 0.001)


def test_both_clips_take_none_and_schedules() -> None:
    hp = Hyperparameters(kl_clip=0.01, relative_clip=None)
    assert (hp.at(0).kl_clip, hp.at(0).relative_clip) == (0.01, None)
    scheduled = Hyperparameters(relative_clip=lambda s: None if s else 2.0)
    assert scheduled.at(0).relative_clip == 2.0
    assert scheduled.at(1).relative_clip is None
    with pytest.raises(ValueError, match='relative_clip must be'):
        Hyperparameters(relative_clip=0.0)


def test_constants_excludes_schedules() -> None:
    hp = Hyperparameters(damping=lambda s: 0.1, kl_clip=None)
    constants = hp.constants()
    assert 'damping' not in constants
    assert constants['kl_clip'] is None
    assert hp.at(3).damping == 0.1


def test_schedules_are_validated_when_used() -> None:
    hp = Hyperparameters(inv_update_steps=lambda s: s)
    assert hp.at(2).inv_update_steps == 2
    with pytest.raises(
        ValueError, match='inv_update_steps must be >= 1; got 0'
    ):
        hp.at(0)
    assert Hyperparameters(kl_clip=lambda s: None).at(0).kl_clip is None


def test_ints_are_normalised_to_float() -> None:
    assert Hyperparameters(damping=1).at(0).damping == 1.0
    assert isinstance(Hyperparameters(damping=1).damping, float)


def _returns_a_float(step: int) -> Any:
    return 1.5


def test_messages_say_a_constant_may_be_a_schedule() -> None:
    with pytest.raises(TypeError) as given:
        Hyperparameters(damping='0.1')  # type: ignore[arg-type]  # refused
    assert str(given.value) == (
        "damping must be a real number or a callable of the step; got '0.1' "
        'of type str'
    )
    # A schedule's value may not itself be a callable: no such hint then.
    with pytest.raises(TypeError) as returned:
        Hyperparameters(factor_update_steps=_returns_a_float).at(0)
    assert str(returned.value) == (
        'factor_update_steps must be an int >= 1; got 1.5 of type float'
    )


def test_at_returns_hyperparameter_values() -> None:
    values = Hyperparameters(lr=lambda step: 0.1 * step).at(3)
    assert isinstance(values, HyperparameterValues)
    assert values.lr == pytest.approx(0.3)
    assert dataclasses.asdict(values) == {
        'factor_update_steps': 10,
        'inv_update_steps': 100,
        'damping': 0.003,
        'factor_decay': 0.95,
        'kl_clip': None,
        'lr': values.lr,
        'relative_clip': 1.0,
        'lrs': None,  # one lr for every layer: no OptimizerLR
    }


def test_exp_decay_factor_averaging() -> None:
    schedule = exp_decay_factor_averaging(0.95)
    assert schedule(0) == 0.5
    assert schedule(1) == 0.5
    assert schedule(3) == 0.75
    assert schedule(19) == 0.95
    assert schedule(1000) == 0.95
    with pytest.raises(ValueError, match='step must be >= 0'):
        schedule(-1)
    with pytest.raises(ValueError, match='min_value'):
        exp_decay_factor_averaging(1.5)


def test_exp_decay_running_average_is_the_mean() -> None:
    """With ξ(step) = step/(step+1) the running factor is the plain mean."""
    import torch

    from kfac.math import running_average

    schedule = exp_decay_factor_averaging(1.0)
    batches = [
        torch.full((2, 2), float(v), dtype=torch.float64) for v in (1, 2, 6, 3)
    ]
    value = None
    for step, batch in enumerate(batches):
        value = running_average(value, batch, schedule(step))
    assert value is not None
    assert torch.allclose(value, torch.full((2, 2), 3.0, dtype=torch.float64))
