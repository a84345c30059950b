from __future__ import annotations

import pytest
import torch
from torch import nn

from kfac.layers.eigen import KFACEigenLayer
from kfac.layers.inverse import KFACInverseLayer
from kfac.layers.modules import Conv2dModuleHelper
from kfac.layers.modules import LinearModuleHelper
from kfac.layers.register import any_match
from kfac.layers.register import get_flattened_modules
from kfac.layers.register import get_module_helper
from kfac.layers.register import register_model
from kfac.layers.register import register_modules
from kfac.layers.register import requires_grad
from testing.models import AttentionNet
from testing.models import TinyCNN


class Custom(nn.Linear):
    pass


def model() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 4, 3),
        nn.ReLU(),
        nn.Sequential(nn.Linear(4, 4), Custom(4, 4)),
        nn.BatchNorm1d(4),
        nn.EmbeddingBag(3, 4),
    )


def test_finds_supported_modules_in_order() -> None:
    found = register_modules(model())
    assert list(found) == ['0', '2.0', '2.1']
    assert isinstance(found['0'], Conv2dModuleHelper)
    assert isinstance(found['2.1'], LinearModuleHelper)


@pytest.mark.parametrize(
    ('patterns', 'expected'),
    [
        ('Custom', ['0', '2.0']),
        (['^2\\.'], ['0']),
        (('Conv2d', '2.0'), ['2.1']),
        ([], ['0', '2.0', '2.1']),
        # class names are matched as they are: Custom(nn.Linear) survives
        ('Linear', ['0', '2.1']),
    ],
)
def test_skip_patterns(patterns: object, expected: list[str]) -> None:
    found = register_modules(model(), skip_layers=patterns)  # type: ignore[call-overload]  # every accepted type, and wrong ones
    assert list(found) == expected


def test_modules_without_trainable_weight_are_skipped() -> None:
    m = model()
    m[2][0].weight.requires_grad_(False)  # type: ignore[index]  # model()[2] is an nn.Sequential
    assert list(register_modules(m)) == ['0', '2.1']


def test_grouped_convolution_has_one_layer_per_group() -> None:
    m = nn.Sequential(nn.Conv2d(4, 4, 3, groups=2), nn.Conv2d(4, 2, 1))
    registration = register_model(m)
    assert list(registration.helpers) == ['0.group0', '0.group1', '1']
    assert registration.skipped == ()
    assert get_module_helper(nn.Conv2d(4, 4, 3, groups=4)) is None
    assert get_module_helper(nn.ReLU()) is None


def test_attention_projection_is_not_registered() -> None:
    """`out_proj` is used by its parent without being called."""
    registration = register_model(AttentionNet())
    assert list(registration.helpers) == ['embed', 'head']
    skipped = {s.name: s.reason for s in registration.skipped}
    assert skipped['attn.out_proj'] == (
        'called functionally by its parent MultiheadAttention'
    )


def test_cnn_registration() -> None:
    assert list(register_modules(TinyCNN())) == ['conv1', 'conv2', 'fc']


@pytest.mark.parametrize(
    ('query', 'patterns', 'expected'),
    [
        ('block.fc1', [], False),
        ('block.fc1', ['fc2'], False),
        ('block.fc1', ['^fc'], False),
        ('block.fc1', ['^fc', r'fc1$'], True),
        ('block.fc1', ['block'], True),
    ],
)
def test_any_match(query: str, patterns: list[str], expected: bool) -> None:
    assert any_match(query, patterns) is expected


def test_get_flattened_modules_lists_the_leaves_in_order() -> None:
    inner = nn.Sequential(nn.ReLU(), nn.Linear(3, 1))
    model = nn.Sequential(nn.Linear(2, 3), inner)
    leaves = get_flattened_modules(model)
    assert [name for name, _ in leaves] == ['0', '1.0', '1.1']
    assert [module for _, module in leaves] == [model[0], inner[0], inner[1]]


def test_requires_grad_needs_every_parameter() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    assert requires_grad(model)
    model[1].bias.requires_grad_(False)
    assert not requires_grad(model)
    assert requires_grad(model[0])


def test_register_modules_in_the_original_form() -> None:
    net = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    layers = register_modules(net, KFACEigenLayer, factor_dtype=torch.float64)
    assert list(layers) == [net[0], net[2]]
    for module, (name, layer) in layers.items():
        assert isinstance(layer, KFACEigenLayer)
        assert layer.module.module is module
        assert net.get_submodule(name) is module
        assert layer.factor_dtype == torch.float64
    inverse = register_modules(net, KFACInverseLayer, skip_layers='^2$')
    assert [name for name, _ in inverse.values()] == ['0']


@pytest.mark.parametrize(
    'keyword', ['allreduce_method', 'grad_scaler', 'symmetry_aware', 'tdc']
)
def test_register_modules_warns_of_keywords_without_effect(
    keyword: str,
) -> None:
    with pytest.warns(
        DeprecationWarning,
        match=rf'^register_modules\({keyword}=\.\.\.\) has no effect',
    ):
        layers = register_modules(
            nn.Linear(2, 2), KFACInverseLayer, **{keyword: None}
        )
    assert len(layers) == 1


def test_register_modules_argument_errors() -> None:
    net = nn.Linear(2, 2)
    with pytest.raises(TypeError, match=r"unknown keywords \['bogus'\]"):
        register_modules(net, KFACEigenLayer, bogus=1)
    with pytest.raises(TypeError, match='need kfac_layer_type'):
        register_modules(net, inv_dtype=torch.float64)  # type: ignore[call-overload]  # the wrong use tested
    with pytest.raises(TypeError, match='^kfac_layer_type must be a sub'):
        register_modules(net, nn.Linear)  # type: ignore[type-var]  # the wrong type tested
    grouped = nn.Sequential(nn.Conv2d(4, 4, 1, groups=2))
    with pytest.raises(ValueError, match="^'0.group0' is preconditioned as"):
        register_modules(grouped, KFACEigenLayer)
