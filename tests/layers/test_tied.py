"""A weight tied in transposed roles: an embedding and its output head."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kfac.layers.register import register_model
from kfac.preconditioner import KFACPreconditioner


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
    assert not torch.equal(model.embed.weight.grad, raw)  # type: ignore[arg-type]  # backward() above set it


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
