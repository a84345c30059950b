from __future__ import annotations

import pytest

from kfac.hyperparams import Hyperparameters
from kfac.hyperparams import exp_decay_factor_averaging
from kfac.hyperparams import validate_float
from kfac.hyperparams import validate_int


def test_defaults_match_the_original_kaisa_defaults() -> None:
    hp = Hyperparameters()
    assert hp.at(0) == hp.at(7)
    resolved = hp.at(0)
    assert (resolved.factor_update_steps, resolved.inv_update_steps) == (1, 1)
    assert (resolved.damping, resolved.factor_decay) == (0.001, 0.95)
    assert (resolved.kl_clip, resolved.lr) == (0.001, 0.1)


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


def test_validators() -> None:
    assert validate_int('n', 3) == 3
    assert validate_int('n', 0, minimum=0) == 0
    assert validate_float('x', 1, low=0.0, high=1.0) == 1.0
    with pytest.raises(ValueError, match='x must be a finite number >= 0.0'):
        validate_float('x', -1.0, low=0.0, low_open=False)


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
