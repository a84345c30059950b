"""Parameters shared by several modules: one set of factors (those left
to the optimizer are in test_sharing.py).
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from kfac.layers.register import register_model
from kfac.preconditioner import KFACPreconditioner
from testing.asserts import assert_rel_close

F64 = torch.float64


class _Tied(nn.Module):
    """Two Linear modules sharing one weight and bias."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(4, 4)
        self.second = nn.Linear(4, 4)
        self.second.weight = self.first.weight
        self.second.bias = self.first.bias
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.second(torch.tanh(self.first(x))))
        return out


class _CalledTwice(nn.Module):
    def __init__(self, tied: _Tied) -> None:
        super().__init__()
        self.first = copy.deepcopy(tied.first)
        self.head = copy.deepcopy(tied.head)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.first(torch.tanh(self.first(x))))
        return out


def test_a_parameter_shared_by_two_modules_is_one_module_called_twice() -> (
    None
):
    torch.manual_seed(0)
    tied = _Tied().double()
    twice = _CalledTwice(tied).double()
    precon = KFACPreconditioner(tied, kl_clip=None)
    reference = KFACPreconditioner(twice, kl_clip=None)
    assert list(precon.layers) == ['first', 'head']
    entry = precon.describe()['preconditioned'][0]
    assert entry['shares_weight_with'] == ['second']
    for step in range(2):
        x = torch.randn(
            6, 4, dtype=F64, generator=torch.Generator().manual_seed(step)
        )
        y = torch.randint(
            0, 2, (6,), generator=torch.Generator().manual_seed(step)
        )
        for model, kfac in ((tied, precon), (twice, reference)):
            model.zero_grad()
            F.cross_entropy(model(x), y).backward()
            kfac.step()
    for name in ('first', 'head'):
        for mine, theirs in zip(
            precon.layers[name].factors, reference.layers[name].factors
        ):
            assert mine.value is not None and theirs.value is not None
            assert_rel_close(
                mine.value, theirs.value, rtol=1e-12, label='tied'
            )
    for p, q in zip(tied.parameters(), twice.parameters()):
        assert p.grad is not None and q.grad is not None
        assert_rel_close(p.grad, q.grad, rtol=1e-10, label='tied')


class _TiedHead(nn.Module):
    """A language-model head tied to its embedding (transposed roles)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 6)
        self.mix = nn.Linear(6, 6)
        self.head = nn.Linear(6, 11, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(torch.tanh(self.mix(self.embed(tokens))))
        return out


def test_a_weight_tied_in_transposed_roles_is_one_layer() -> None:
    """One layer, the first name's, combining both uses (the oracles are
    in test_tied_transposed.py); the head's calls feed it.
    """
    model = _TiedHead().double()
    precon = KFACPreconditioner(model)
    assert list(precon.layers) == ['embed', 'mix']
    assert precon.describe()['not_preconditioned'] == []
    tokens = torch.randint(0, 11, (3, 5))
    F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten()).backward()
    raw = model.embed.weight.grad
    assert raw is not None
    raw = raw.clone()
    precon.step()
    assert not torch.equal(model.embed.weight.grad, raw)  # type: ignore[arg-type]


def test_a_tied_head_with_a_bias_is_left_to_the_optimizer() -> None:
    """Never preconditioned with the factors of one use alone."""
    model = _TiedHead()
    model.head = nn.Linear(6, 11)
    model.head.weight = model.embed.weight
    registration = register_model(model)
    assert list(registration.helpers) == ['mix']
    reasons = {s.name: s.reason for s in registration.skipped}
    assert reasons == {
        'embed': 'weight shared with head in another role: left to the '
        'optimizer',
        'head': 'weight shared with embed in another role: left to the '
        'optimizer',
    }
