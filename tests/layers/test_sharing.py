"""kfac.layers._sharing: which modules sharing parameters become one
layer, and which are left to the optimizer (the twin oracle of those that
become one layer is in `test_tied_twins.py`, that of a weight tied in
transposed roles in `test_tied.py`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kfac.layers.register import register_model
from kfac.preconditioner import KFACPreconditioner


class _Holder(nn.Module):
    def __init__(self, param: torch.Tensor) -> None:
        super().__init__()
        self.register_parameter('param', param)  # type: ignore[arg-type]  # the Parameter passed


def _reasons(
    model: nn.Module, module_options: object = None
) -> dict[str, str]:
    registration = register_model(model, module_options=module_options)
    return {s.name: s.reason for s in registration.skipped}


def test_shared_weight_with_different_biases_or_unregistered_owner() -> None:
    first, second = nn.Linear(3, 3), nn.Linear(3, 3)
    second.weight = first.weight  # biases differ
    registration = register_model(nn.Sequential(first, second))
    assert registration.helpers == {}
    assert {s.name for s in registration.skipped} == {'0', '1'}
    user = nn.Linear(3, 3)
    holder = _Holder(user.weight)  # a module K-FAC does not precondition
    registration = register_model(nn.Sequential(user, holder))
    assert registration.helpers == {}
    reasons = {s.name: s.reason for s in registration.skipped}
    assert reasons['0'] == (
        'weight shared with 1 in another role: left to the optimizer'
    )
    assert reasons['1'].startswith('unsupported type')


def test_a_tied_head_with_a_bias_is_left_to_the_optimizer() -> None:
    """Never preconditioned with the factors of one use alone."""
    embed, head = nn.Embedding(11, 6), nn.Linear(6, 11)
    head.weight = embed.weight
    model = nn.Sequential(embed, nn.Linear(6, 6), head)
    registration = register_model(model)
    assert list(registration.helpers) == ['1']
    assert _reasons(model) == {
        '0': 'weight shared with 2 in another role: left to the optimizer',
        '2': 'weight shared with 0 in another role: left to the optimizer',
    }


def test_a_shared_bias_alone_is_left_to_the_optimizer() -> None:
    """Two layers would each precondition (and write) the one bias."""
    first, second, third = nn.Linear(3, 3), nn.Linear(3, 3), nn.Linear(3, 3)
    second.bias = first.bias
    third.weight = second.weight  # shares with a module that is left alone
    model = nn.Sequential(first, second, third, nn.Linear(3, 2))
    assert _reasons(model) == {
        '0': 'bias shared with 1 in another role: left to the optimizer',
        '1': 'bias shared with 0 in another role: left to the optimizer',
        '2': 'weight shared with 1 in another role: left to the optimizer',
    }
    assert list(register_model(model).helpers) == ['3']


def test_sharers_called_with_other_settings_are_left_to_the_optimizer() -> (
    None
):
    """A convolution's geometry and the per-module options decide how a
    call enters the factors; the layer would apply its owner's to every
    sharer's calls.
    """
    plain = nn.Conv2d(2, 2, 3, padding=1)
    strided = nn.Conv2d(2, 2, 3, stride=2)
    strided.weight, strided.bias = plain.weight, plain.bias
    assert _reasons(nn.Sequential(plain, strided)) == {
        '0': 'weight shared with 1 called with another stride, padding: '
        'left to the optimizer',
        '1': 'weight shared with 0 called with another stride, padding: '
        'left to the optimizer',
    }
    first, second = nn.Linear(3, 3), nn.Linear(3, 3)
    second.weight, second.bias = first.weight, first.bias
    model = nn.Sequential(first, nn.Tanh(), second)
    assert _reasons(model) == {}
    reasons = _reasons(
        model, module_options={'^2$': {'kfac_approx': 'reduce'}}
    )
    assert reasons['0'] == (
        'weight shared with 2 called with another kfac_approx: left to the '
        'optimizer'
    )
    assert set(reasons) == {'0', '2'}


def test_a_weight_left_to_the_optimizer_keeps_its_gradient() -> None:
    torch.manual_seed(0)
    plain = nn.Conv2d(2, 2, 3, padding=1)
    dilated = nn.Conv2d(2, 2, 3, padding=2, dilation=2)
    dilated.weight, dilated.bias = plain.weight, plain.bias
    model = nn.Sequential(
        plain, nn.Tanh(), dilated, nn.Flatten(), nn.Linear(32, 3)
    )
    precon = KFACPreconditioner(model)
    assert list(precon.layers) == ['4']
    x = torch.randn(5, 2, 4, 4)
    F.cross_entropy(model(x), torch.arange(5) % 3).backward()
    before = _grads(model)
    precon.step()
    after = _grads(model)
    assert [torch.equal(a, b) for a, b in zip(after, before)] == [
        True,  # the shared weight
        True,  # and bias: left as they were
        False,  # the head's weight
        False,  # and bias: preconditioned
    ]


def _grads(model: nn.Module) -> list[torch.Tensor]:
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None for g in grads)
    return [g.clone() for g in grads if g is not None]


def test_grouped_convolutions_sharing_a_weight_are_one_layer_per_group() -> (
    None
):
    """Each group's layer takes the other convolution's calls (the twin
    oracle of their factors and gradients is in test_tied_twins.py).
    """
    first = nn.Conv2d(4, 4, 3, padding=1, groups=2)
    second = nn.Conv2d(4, 4, 3, padding=1, groups=2)
    second.weight, second.bias = first.weight, first.bias
    registration = register_model(nn.Sequential(first, nn.Tanh(), second))
    assert list(registration.helpers) == ['0.group0', '0.group1']
    assert registration.aliases == {'0.group0': ['2'], '0.group1': ['2']}
    assert registration.skipped == ()
