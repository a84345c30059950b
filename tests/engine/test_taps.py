"""kfac._engine.taps on a torch without what its operators need.

Before torch 2.11 (`COMPILE_RELEASE`) the operators are not defined:
eager K-FAC works and a compiled model is refused naming the release.
These tests make any torch look so by removing the operators, so that the
refusal is tested on the releases that have them too (`make test-torch`
runs them unpatched on older ones).
"""

from __future__ import annotations

from typing import cast

import pytest
import torch
import torch._dynamo
import torch.nn.functional as F
from torch import nn
from torch._library.custom_ops import CustomOpDef

from kfac._engine import taps
from kfac.preconditioner import KFACPreconditioner
from testing.models import TinyMLP
from testing.models import classification_data
from testing.torch_release import torch_release

SAYS = (
    r'K-FAC in a model compiled by torch.compile needs torch>=2\.11 '
    r'\(for its custom operators\); this is torch '
)


@pytest.fixture
def without_operators(monkeypatch: pytest.MonkeyPatch) -> None:
    """This torch as one before `COMPILE_RELEASE`."""
    monkeypatch.setattr(taps, 'OPERATORS', None)


@pytest.mark.parametrize(
    ('version', 'release'),
    [
        ('2.9', (2, 9)),
        ('2.6.0', (2, 6)),
        ('2.6.0+cu124', (2, 6)),
        ('2.13.0+cpu', (2, 13)),
        ('2.10.0a0+git1234', (2, 10)),
    ],
)
def test_parse_release(version: str, release: tuple[int, int]) -> None:
    assert taps.parse_release(version) == release


def test_parse_release_refuses_what_is_no_release() -> None:
    with pytest.raises(ValueError, match="not a torch release: 'nightly'"):
        taps.parse_release('nightly')


def test_the_operators_exist_from_torch_2_11() -> None:
    """Run on each release (`make test-torch`): the operators exist from
    the release found to compile them (2.10 fails, 2.11 passes).
    """
    expected = torch_release() >= (2, 11)
    assert taps.compile_capture_available() == expected
    assert (taps.OPERATORS is not None) == expected


@pytest.mark.parametrize(
    ('version', 'available'), [('2.10.0', False), ('2.11.0', True)]
)
def test_torch_2_10_is_refused_though_it_has_the_features(
    monkeypatch: pytest.MonkeyPatch, version: str, available: bool
) -> None:
    """torch 2.10 has tags and effects on custom operators, but its
    inductor fails on the graphs.
    """
    if torch_release() < (2, 10):
        monkeypatch.setattr(torch.Tag, 'cudagraph_unsafe', 0, raising=False)
        monkeypatch.setattr(CustomOpDef, 'register_effect', 0, raising=False)
    monkeypatch.setattr(torch, '__version__', version)
    assert taps.compile_capture_available() == available


@pytest.mark.parametrize(
    ('owner', 'name'),
    [(torch.Tag, 'cudagraph_unsafe'), (CustomOpDef, 'register_effect')],
)
def test_either_feature_missing_defines_no_operators(
    monkeypatch: pytest.MonkeyPatch, owner: object, name: str
) -> None:
    monkeypatch.delattr(owner, name, raising=False)
    assert not taps.compile_capture_available()
    assert taps.define_operators() is None


@pytest.mark.usefixtures('without_operators')
def test_the_error_names_the_release_and_this_torch() -> None:
    with pytest.raises(RuntimeError, match=SAYS) as info:
        taps.require_operators()
    assert f'this is torch {torch.__version__}: run the model' in str(
        info.value
    )
    with pytest.raises(RuntimeError, match=SAYS):
        taps.operators()


@pytest.mark.usefixtures('without_operators')
def test_eager_kfac_needs_no_operators() -> None:
    torch.manual_seed(0)
    model = TinyMLP().double()
    precon = KFACPreconditioner(model)
    x, y = classification_data(8, (6,))
    F.cross_entropy(model(x), y).backward()
    precon.step()
    assert all(layer.has_factors for layer in precon.layers.values())


@pytest.mark.usefixtures('without_operators')
def test_a_compiled_model_is_refused_at_construction() -> None:
    compiled = cast(nn.Module, torch.compile(TinyMLP(), backend='eager'))
    with pytest.raises(RuntimeError, match=SAYS):
        KFACPreconditioner(compiled)


@pytest.mark.usefixtures('without_operators')
def test_a_model_compiled_after_construction_is_refused_when_traced() -> None:
    """The hook, traced, raises outside the graph: an error, not a graph
    break after which the hook would run eagerly and capture nothing.
    """
    torch._dynamo.reset()
    model = TinyMLP().double()
    KFACPreconditioner(model)
    compiled = cast(nn.Module, torch.compile(model, backend='eager'))
    x, _ = classification_data(8, (6,))
    with pytest.raises(RuntimeError, match=SAYS):
        compiled(x)
    torch._dynamo.reset()
