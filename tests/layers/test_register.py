from __future__ import annotations

import pytest
from torch import nn

from kfac.layers.modules import Conv2dModuleHelper
from kfac.layers.modules import LinearModuleHelper
from kfac.layers.register import get_module_helper
from kfac.layers.register import register_model
from kfac.layers.register import register_modules
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
    found = register_modules(model(), skip_layers=patterns)  # type: ignore[arg-type]  # every accepted type, and wrong ones
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
