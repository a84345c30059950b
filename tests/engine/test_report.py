"""The registration report: every module with parameters is accounted for."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kfac.preconditioner import KFACPreconditioner

F64 = torch.float64


class _Mixed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 8, max_norm=1.0)
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
        self.conv1d = nn.Conv1d(8, 8, 3, padding=1)
        self.depthwise = nn.Conv2d(4, 4, 3, groups=4)
        self.norm = nn.LayerNorm(8)
        self.frozen = nn.Linear(8, 8)
        self.frozen.requires_grad_(False)
        self.skipped = nn.Linear(8, 8)
        self.fc = nn.Linear(8, 3)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        h = h + self.attn(h, h, h, need_weights=False)[0]
        h = self.conv1d(h.transpose(1, 2)).transpose(1, 2)
        h = self.skipped(self.frozen(self.norm(h)))
        out: torch.Tensor = self.fc(h.mean(1))
        return out


def test_report_lists_every_module_with_parameters(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Defects 7 and 8: out_proj was registered and never updated; the
    modules K-FAC leaves alone were not named.
    """
    model = _Mixed()
    with caplog.at_level(logging.DEBUG, logger='kfac'):
        precon = KFACPreconditioner(
            model, skip_layers='skip', loglevel=logging.DEBUG
        )
    report = precon.describe()
    names = [
        'attn.out_proj',
        'attn.q_proj',
        'attn.k_proj',
        'attn.v_proj',
        'conv1d',
        'depthwise.group0',
        'depthwise.group1',
        'depthwise.group2',
        'depthwise.group3',
        'fc',
    ]
    assert [e['name'] for e in report['preconditioned']] == names
    assert list(precon.layers) == names
    fc = report['preconditioned'][-1]
    assert (fc['A'], fc['G']) == ((9, 9), (3, 3))
    assert fc['factor_bytes'] == (81 + 9) * 4
    reasons = {e['name']: e['reason'] for e in report['not_preconditioned']}
    assert reasons == {
        'embed': 'embedding with max_norm=1.0 (rows renormalised in the '
        'forward pass)',
        'norm': 'unsupported type (trained with the plain gradient)',
        'frozen': 'frozen at construction (weight.requires_grad is False)',
        'skipped': "skipped by the skip_layers pattern 'skip'",
    }
    # Accounts for every parameter of the model.
    named = {
        f'{e["name"]}.{p}'
        for e in report['not_preconditioned']
        for p in e['parameters']
    }
    covered = {
        f'{name}.{p}'
        for name in ('attn.out_proj', 'conv1d', 'depthwise', 'fc')
        for p in ('weight', 'bias')
    } | {'attn.in_proj_weight', 'attn.in_proj_bias'}
    assert named | covered == set(dict(model.named_parameters()))
    # One message, at loglevel, and nothing louder.
    logged = [
        r
        for r in caplog.records
        if r.getMessage().startswith('K-FAC preconditions')
    ]
    assert [r.levelno for r in logged] == [logging.DEBUG]
    assert not [r for r in caplog.records if r.levelno >= logging.INFO]
    assert 'K-FAC preconditions 10 modules' in logged[0].getMessage()
    assert 'embed (Embedding; weight): embedding with max_norm' in (
        logged[0].getMessage()
    )
    report['preconditioned'].clear()  # a copy
    assert precon.describe()['preconditioned']


def test_freezing_and_unfreezing_after_construction_are_reported(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Defect 7: a layer frozen later kept capturing and was reported as
    not running; a layer unfrozen later trained without K-FAC silently.
    """
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    model = model.double()
    model[2].requires_grad_(False)
    stays = nn.Linear(2, 2).double().requires_grad_(False)
    model.append(stays)  # frozen at construction and after
    precon = KFACPreconditioner(model)
    x = torch.randn(6, 4, dtype=F64)
    y = torch.randint(0, 2, (6,))
    model[0].requires_grad_(False)  # frozen after construction
    model[2].requires_grad_(True)  # unfrozen after construction
    with caplog.at_level(logging.WARNING, logger='kfac'):
        for _ in range(2):
            F.cross_entropy(model(x), y).backward()
            precon.step()
    text = caplog.text
    assert text.count('module 0 was frozen after the preconditioner') == 1
    assert text.count('module 2 was frozen when the preconditioner') == 1
    assert 'module 3 was frozen' not in text
    assert 'did not run forward and backward' not in text
    assert precon.layers['0'].captures == (0, 0)
    assert not precon.layers['0'].has_factors
