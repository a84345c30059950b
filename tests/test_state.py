"""state_dict / load_state_dict: safe format, exact resume, clear errors."""

from __future__ import annotations

import copy
import io
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kfac.config import StatisticsConfig
from kfac.layers.curvature import EigenConfig
from kfac.layers.curvature import EKFACConfig
from kfac.layers.curvature import InverseConfig
from kfac.preconditioner import KFACPreconditioner
from kfac.state import STATE_VERSION
from kfac.state import LayerSpec
from kfac.state import parse_state
from kfac.state import serialize_state
from testing.models import TinyCNN
from testing.models import TinyMLP
from testing.models import classification_data


def run_steps(
    model: nn.Module,
    precon: KFACPreconditioner,
    optimizer: torch.optim.Optimizer,
    steps: range,
) -> None:
    for step in steps:
        x, y = classification_data(
            8, (2, 8, 8), seed=step, dtype=torch.float32
        )
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        precon.step()
        optimizer.step()


def roundtrip(obj: Any) -> Any:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


KWARGS = [
    {'compute_method': 'eigen'},
    {'compute_method': 'eigen', 'compute_eigenvalue_outer_product': False},
    {'compute_method': 'inverse'},
    # a decomposition at step 3 without a factor update restarts S
    {'compute_method': 'ekfac'},
    {
        'compute_method': EKFACConfig(
            prediv_eigenvalues=False, basis_refresh='qr'
        ),
    },
    {'compute_method': EigenConfig(basis_refresh='qr')},
]
COST_KWARGS = [
    # the low-rank form (warm-started from a loaded (n, k) basis at step
    # 6) and relative damping, resumed between decompositions only
    {
        'compute_method': EigenConfig(
            factor_rank=8, basis_refresh='qr', damping_mode='relative'
        ),
    },
    {'compute_method': InverseConfig(factor_rank=8)},
]


@pytest.mark.parametrize(
    ('kwargs', 'stop'),
    [(k, stop) for stop in (3, 5) for k in KWARGS]
    + [(k, 5) for k in COST_KWARGS],
)
def test_resume_is_bit_identical(kwargs: dict[str, Any], stop: int) -> None:
    torch.manual_seed(0)
    options = dict(
        factor_update_steps=2,
        inv_update_steps=3,
        factor_decay=0.8,
        lr=0.05,
        **kwargs,
    )
    model = TinyCNN()
    resumed_model = copy.deepcopy(model)
    precon = KFACPreconditioner(model, **options)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    run_steps(model, precon, optimizer, range(stop))
    checkpoint = roundtrip(
        {
            'model': model.state_dict(),
            'optimizer': optimizer.state_dict(),
            'kfac': precon.state_dict(),
        },
    )
    run_steps(model, precon, optimizer, range(stop, 8))

    precon2 = KFACPreconditioner(resumed_model, **options)
    optimizer2 = torch.optim.SGD(
        resumed_model.parameters(), lr=0.05, momentum=0.9
    )
    resumed_model.load_state_dict(checkpoint['model'])
    optimizer2.load_state_dict(checkpoint['optimizer'])
    precon2.load_state_dict(checkpoint['kfac'])
    assert precon2.steps == stop
    run_steps(resumed_model, precon2, optimizer2, range(stop, 8))
    for p, q in zip(model.parameters(), resumed_model.parameters()):
        assert torch.equal(p, q)


def test_state_dict_contents() -> None:
    model = TinyMLP().double()
    precon = KFACPreconditioner(model, damping=lambda s: 0.1, kl_clip=None)
    x, y = classification_data(4, (6,))
    F.cross_entropy(model(x), y).backward()
    precon.step()
    state = roundtrip(precon.state_dict())
    assert state['version'] == STATE_VERSION
    assert state['steps'] == 1
    assert 'damping' not in state['hyperparameters']  # a callable
    assert state['hyperparameters']['kl_clip'] is None
    assert state['hyperparameters']['factor_decay'] == 0.95
    assert set(state['layers']) == {'fc1', 'fc2'}
    assert state['layers']['fc1']['A'].shape == (7, 7)
    assert state['decompositions']['fc1']['format'] == 'inverse'  # default
    assert 'decompositions' not in precon.state_dict(
        include_decompositions=False
    )


def test_state_dict_returns_copies() -> None:
    model = TinyMLP().double()
    precon = KFACPreconditioner(model)
    x, y = classification_data(4, (6,))
    F.cross_entropy(model(x), y).backward()
    precon.step()
    state = precon.state_dict()
    state['layers']['fc1']['A'].zero_()
    assert precon.layers['fc1'].a.value.abs().sum() > 0  # type: ignore[union-attr]  # a step above formed the factors


def trained(**kwargs: Any) -> tuple[nn.Module, KFACPreconditioner]:
    model = TinyMLP().double()
    precon = KFACPreconditioner(model, **kwargs)
    x, y = classification_data(4, (6,))
    F.cross_entropy(model(x), y).backward()
    precon.step()
    return model, precon


def test_load_restores_hyperparameter_constants() -> None:
    _, precon = trained(damping=0.5, factor_decay=0.5)
    _, other = trained()
    other.load_state_dict(precon.state_dict())
    assert other.damping == 0.5
    assert other.factor_decay == 0.5
    _, scheduled = trained(damping=lambda s: 0.2)
    scheduled.load_state_dict(precon.state_dict())
    assert scheduled.damping == 0.2  # a callable stays in charge


def test_load_recomputes_decompositions_when_absent_or_incompatible() -> None:
    _, precon = trained(compute_method='eigen')
    _, other = trained(compute_method='inverse')
    other.load_state_dict(precon.state_dict())  # eigen format: recomputed
    for name, layer in other.layers.items():
        assert layer.a.decomposition is not None
        assert torch.equal(layer.a.value, precon.layers[name].a.value)  # type: ignore[arg-type]  # a step above formed the factors
    _, third = trained(compute_method='eigen')
    third.load_state_dict(precon.state_dict(include_decompositions=False))
    for name, layer in third.layers.items():
        mine, theirs = (
            layer.g.decomposition,
            precon.layers[name].g.decomposition,
        )
        assert mine is not None and theirs is not None
        assert torch.equal(mine[0], theirs[0])


def test_load_before_any_step_and_factorless_layers() -> None:
    _, fresh = trained()
    model = TinyMLP().double()
    empty = KFACPreconditioner(model)
    fresh.load_state_dict(empty.state_dict())
    assert fresh.steps == 0
    assert not fresh.layers['fc1'].has_factors
    assert not fresh.layers['fc1'].has_decomposition


def test_mismatched_checkpoint_names_every_problem() -> None:
    _, precon = trained()
    state = precon.state_dict()
    state['layers']['extra'] = {}
    del state['layers']['fc2']
    state['layers']['fc1']['A'] = torch.zeros(3, 3)
    state['layers']['fc1']['B'] = torch.zeros(3, 3)
    _, other = trained()
    before = other.layers['fc1'].a.value.clone()  # type: ignore[union-attr]  # a step above formed the factors
    with pytest.raises(ValueError) as info:
        other.load_state_dict(state)
    message = str(info.value)
    assert 'missing layers: fc2' in message
    assert 'unexpected layers: extra' in message
    assert 'layers.fc1.A has shape (3, 3), expected (7, 7)' in message
    assert 'unexpected entry layers.fc1.B' in message
    assert torch.equal(other.layers['fc1'].a.value, before)  # type: ignore[arg-type]  # a step above formed the factors


def test_non_strict_load_skips_missing_and_unexpected_layers() -> None:
    _, precon = trained()
    state = precon.state_dict()
    state['layers']['extra'] = {}
    del state['layers']['fc2']
    _, other = trained()
    other.load_state_dict(state, strict=False)
    assert torch.equal(
        other.layers['fc1'].a.value,  # type: ignore[arg-type]  # a step above formed the factors
        precon.layers['fc1'].a.value,  # type: ignore[arg-type]  # a step above formed the factors
    )
    assert not other.layers['fc2'].has_factors
    state['layers']['fc1']['A'] = torch.zeros(2, 2)
    with pytest.raises(ValueError, match='layers.fc1.A has shape'):
        other.load_state_dict(state, strict=False)


@pytest.mark.parametrize(
    ('mutate', 'error', 'match'),
    [
        (lambda s: s.update(version=99), ValueError, 'format version 99'),
        (lambda s: s.pop('version'), ValueError, 'format version None'),
        (lambda s: s.update(version=True), ValueError, 'versions 1, 2, 3, 4'),
        (lambda s: s.pop('steps'), ValueError, "missing the entry 'steps'"),
        (lambda s: s.pop('layers'), ValueError, "missing the entry 'layers'"),
    ],
)
def test_bad_state_headers(mutate: Any, error: type, match: str) -> None:
    _, precon = trained()
    state = precon.state_dict()
    mutate(state)
    with pytest.raises(error, match=match):
        precon.load_state_dict(state)


def test_version_1_states_load() -> None:
    """Version 2 only adds the per-use factors of tied weights."""
    _, precon = trained()
    state = precon.state_dict()
    state['version'] = 1
    _, other = trained()
    other.load_state_dict(state)
    for name, layer in precon.layers.items():
        for factor in layer.factors:
            loaded = other.layers[name].factor(factor.name).value
            assert loaded is not None and factor.value is not None
            assert torch.equal(loaded, factor.value)


def test_version_2_states_load_without_a_scale() -> None:
    """Version 3 adds EKFAC's `S`; without it the scaling restarts."""
    _, precon = trained(compute_method='ekfac')
    state = precon.state_dict()
    assert state['layers']['fc1']['S'].shape == (5, 7)
    for entry in state['layers'].values():
        del entry['S']
    state['version'] = 2
    _, other = trained(compute_method='ekfac')
    other.load_state_dict(state)
    for name, layer in other.layers.items():
        assert getattr(layer.curvature, 'scale', 0) is None
        loaded = layer.factor('A').value
        assert loaded is not None
        assert torch.equal(loaded, precon.layers[name].factor('A').value)  # type: ignore[arg-type]


def test_scale_entries_are_checked() -> None:
    _, precon = trained(compute_method='ekfac')
    state = precon.state_dict()
    state['layers']['fc1']['S'] = torch.zeros(7, 5)
    with pytest.raises(
        ValueError, match=r'layers.fc1.S has shape \(7, 5\), expected \(5, 7\)'
    ):
        precon.load_state_dict(state)
    _, eigen = trained()
    with pytest.raises(ValueError, match='unexpected entry layers.fc1.S'):
        eigen.load_state_dict(precon.state_dict())


def test_state_must_be_a_mapping() -> None:
    _, precon = trained()
    with pytest.raises(TypeError, match='state_dict must be a mapping'):
        precon.load_state_dict([1, 2])  # type: ignore[arg-type]  # wrong on purpose


def test_unknown_hyperparameters_in_state_are_ignored() -> None:
    _, precon = trained()
    state = precon.state_dict()
    state['hyperparameters']['mystery'] = 1.0
    precon.load_state_dict(state)
    assert precon.steps == 1


def test_tampered_decomposition_is_recomputed() -> None:
    _, precon = trained()
    state = precon.state_dict()
    state['decompositions']['fc1']['A'] = [torch.zeros(2, 2)]
    _, other = trained()
    other.load_state_dict(state)
    mine = other.layers['fc1'].a.decomposition
    theirs = precon.layers['fc1'].a.decomposition
    assert mine is not None and theirs is not None
    assert torch.equal(mine[0], theirs[0])


# The pure format functions --------------------------------------------------

SPEC = {
    'fc': LayerSpec(
        {'A': 2, 'G': 1},
        'inverse',
        {'A': ((2, 2),), 'G': ((1, 1),)},
    ),
}


def _state(**changes: Any) -> dict[str, Any]:
    state: dict[str, Any] = {
        'version': STATE_VERSION,
        'steps': 3,
        'hyperparameters': {'damping': 0.1},
        'layers': {'fc': {'A': torch.eye(2), 'G': torch.ones(1, 1)}},
        'decompositions': {
            'fc': {
                'format': 'inverse',
                'A': [torch.eye(2)],
                'G': [torch.ones(1, 1)],
            },
        },
    }
    state.update(changes)
    return state


def test_parse_and_serialize_round_trip() -> None:
    saved = parse_state(_state(), SPEC, strict=True)
    assert saved.steps == 3
    assert saved.hyperparameters == {'damping': 0.1}
    layer = saved.layers['fc']
    assert layer.decomposition is not None
    assert layer.decomposition.format == 'inverse'
    again = serialize_state(saved, include_decompositions=True)
    assert again['steps'] == 3
    assert torch.equal(again['layers']['fc']['A'], torch.eye(2))
    assert torch.equal(again['decompositions']['fc']['G'][0], torch.ones(1, 1))
    assert again['layers']['fc']['A'] is not layer.factors['A']  # a copy


@pytest.mark.parametrize(
    ('changes', 'error', 'match'),
    [
        ({'steps': -1}, ValueError, "'steps' must be an int >= 0"),
        ({'steps': True}, ValueError, "'steps' must be an int >= 0"),
        ({'layers': [1]}, TypeError, "'layers' must be a mapping"),
        ({'hyperparameters': 2}, TypeError, "'hyperparameters' must be a"),
        ({'layers': {'fc': 3}}, ValueError, 'layers.fc is not a mapping'),
        (
            {'layers': {'fc': {'A': [[1.0]]}}},
            ValueError,
            r'layers.fc.A has shape \(\), expected \(2, 2\)',
        ),
    ],
)
def test_parse_rejects_malformed_entries(
    changes: dict[str, Any], error: type, match: str
) -> None:
    with pytest.raises(error, match=match):
        parse_state(_state(**changes), SPEC, strict=True)


@pytest.mark.parametrize(
    'decompositions',
    [
        None,
        {'fc': 'eigen'},
        {'fc': {'format': 'eigen', 'A': [], 'G': []}},
        {'fc': {'format': 'inverse', 'A': 'x', 'G': []}},
        {'fc': {'format': 'inverse', 'A': [torch.eye(3)], 'G': []}},
    ],
)
def test_parse_drops_decompositions_that_do_not_fit(
    decompositions: Any,
) -> None:
    saved = parse_state(
        _state(decompositions=decompositions), SPEC, strict=True
    )
    assert saved.layers['fc'].decomposition is None
    assert torch.equal(saved.layers['fc'].factors['A'], torch.eye(2))


def test_the_clips_are_saved_and_restored() -> None:
    _, original = trained(kl_clip=0.001)
    state = roundtrip(original.state_dict())
    assert state['version'] == STATE_VERSION == 6
    assert state['options'] == {'position_sample_seed': 0}
    assert state['hyperparameters']['kl_clip'] == 0.001
    assert state['hyperparameters']['relative_clip'] is None
    _, other = trained()
    assert (other.kl_clip, other.relative_clip) == (None, 1.0)  # defaults
    other.load_state_dict(state)
    assert (other.kl_clip, other.relative_clip) == (0.001, None)


@pytest.mark.parametrize(
    ('rule', 'clips'), [('kl', (0.5, None)), ('relative', (None, 0.5))]
)
def test_a_version_4_state_reads_its_rule_into_the_clips(
    rule: str, clips: tuple[float | None, float | None]
) -> None:
    """Before version 5 one `kl_clip` was read by `options.kl_clip_rule`:
    under `'relative'` it is the relative clip.
    """
    _, original = trained(kl_clip=0.5)
    state = roundtrip(original.state_dict())
    del state['hyperparameters']['relative_clip']
    state['options']['kl_clip_rule'] = rule
    state['version'] = 4
    _, other = trained(relative_clip=2.0)
    other.load_state_dict(state)
    assert (other.kl_clip, other.relative_clip) == clips
    assert 'kl_clip_rule' not in other.state_dict()['options']


def test_a_scheduled_clip_is_not_saved_and_stays() -> None:
    _, scheduled = trained(relative_clip=lambda s: 0.25)
    state = scheduled.state_dict()
    assert 'relative_clip' not in state['hyperparameters']
    _, other = trained()
    other.load_state_dict(state)
    assert other.relative_clip == 1.0  # not overwritten by a guess


def test_resume_with_sampled_positions_restores_the_seed() -> None:
    """A run resumed by a preconditioner built with another seed draws
    the saved run's positions: bit-identical parameters.
    """
    torch.manual_seed(0)
    options: dict[str, Any] = dict(factor_decay=0.8)

    def sampled(seed: int = 0) -> StatisticsConfig:
        return StatisticsConfig(position_sample=0.5, position_sample_seed=seed)

    model = TinyCNN()
    resumed_model = copy.deepcopy(model)
    precon = KFACPreconditioner(model, **options, statistics=sampled(9))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    run_steps(model, precon, optimizer, range(2))
    checkpoint = roundtrip(
        {'model': model.state_dict(), 'kfac': precon.state_dict()}
    )
    assert checkpoint['kfac']['options']['position_sample_seed'] == 9
    run_steps(model, precon, optimizer, range(2, 5))
    precon2 = KFACPreconditioner(
        resumed_model, **options, statistics=sampled()
    )
    resumed_model.load_state_dict(checkpoint['model'])
    precon2.load_state_dict(checkpoint['kfac'])
    assert precon2.options.position_sample_seed == 9
    optimizer2 = torch.optim.SGD(resumed_model.parameters(), lr=0.05)
    run_steps(resumed_model, precon2, optimizer2, range(2, 5))
    for p, q in zip(model.parameters(), resumed_model.parameters()):
        assert torch.equal(p, q)
    # and the seed matters: a run with another one ends elsewhere
    torch.manual_seed(0)
    other_model = TinyCNN()
    other = KFACPreconditioner(other_model, **options, statistics=sampled(1))
    optimizer3 = torch.optim.SGD(other_model.parameters(), lr=0.05)
    run_steps(other_model, other, optimizer3, range(5))
    assert not torch.equal(flat(other_model), flat(model))


def flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def test_a_version_3_state_keeps_the_loading_seed() -> None:
    _, precon = trained()
    state = dict(precon.state_dict())
    state['options'] = {'kl_clip_rule': 'kl'}
    state['version'] = 3
    _, seeded = trained(statistics=StatisticsConfig(position_sample_seed=4))
    seeded.load_state_dict(state)
    assert seeded.options.position_sample_seed == 4


def test_a_version_2_state_loads_with_the_kl_rule() -> None:
    """Before version 3 there was one rule, the KL clip."""
    _, precon = trained(kl_clip=0.5)
    state: dict[str, Any] = dict(precon.state_dict())
    del state['options']
    del state['hyperparameters']['relative_clip']
    state['version'] = 2
    _, relative = trained()
    relative.load_state_dict(state)
    assert (relative.kl_clip, relative.relative_clip) == (0.5, None)


@pytest.mark.parametrize(
    ('options', 'error', 'match'),
    [
        ([], TypeError, "entry 'options' must map names to strings"),
        ({'kl_clip_rule': 3.0}, TypeError, 'must map names to strings'),
        ({'kl_clip_rule': 'tr'}, ValueError, "kl_clip_rule 'tr'; allowed"),
        ({'position_sample_seed': -1}, ValueError, 'position_sample_seed'),
        ({'position_sample_seed': 2**31 - 1}, ValueError, 'seed 2147483647'),
        ({'position_sample_seed': True}, ValueError, 'seed True'),
        ({'position_sample_seed': '1'}, ValueError, "seed '1'"),
    ],
)
def test_bad_saved_options(options: Any, error: type, match: str) -> None:
    _, precon = trained()
    state = dict(precon.state_dict())
    state['options'] = options
    with pytest.raises(error, match=match):
        precon.load_state_dict(state)
