"""kfac.layers.options: per-module options, resolved once."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kfac.config import StatisticsConfig
from kfac.layers.options import ModuleOptions
from kfac.layers.options import check_module_options
from kfac.layers.options import resolve_options
from kfac.preconditioner import KFACPreconditioner

F64 = torch.float64


@pytest.mark.parametrize(
    ('value', 'error', 'match'),
    [
        (3, TypeError, 'module_options must be None or a mapping'),
        ({1: {}}, TypeError, 'module_options pattern must be a str'),
        ({'(': {}}, ValueError, "pattern '\\(' is not a valid regular"),
        ({'fc': 3}, TypeError, r"module_options\['fc'\] must be a mapping"),
        ({'fc': {'colour': 1}}, ValueError, r"unknown options \['colour'\]"),
        ({'fc': {'batch_first': 1}}, TypeError, 'batch_first must be a bool'),
        (
            {'fc': {'kfac_approx': 'x'}},
            ValueError,
            "kfac_approx='x' is not a KFACApprox",
        ),
        (
            {'fc': {'compute_method': 'eigen'}},
            TypeError,
            'compute_method must be None or a CurvatureConfig',
        ),
    ],
)
def test_module_options_are_validated(
    value: Any, error: type, match: str
) -> None:
    with pytest.raises(error, match=match):
        check_module_options(value)
    with pytest.raises(error, match=match):
        KFACPreconditioner(nn.Linear(2, 2), module_options=value)


def test_resolution_order_and_sources() -> None:
    model = nn.ModuleDict(
        {
            'enc': nn.TransformerEncoderLayer(8, 2, 16, batch_first=False),
            'head': nn.Linear(8, 2),
            'tail': nn.Linear(8, 2),
        }
    )
    modules = dict(model.named_modules())
    overrides = check_module_options(
        {
            'head|tail': {'batch_first': False},
            'tail': {'batch_first': True},
            'nothing': {'kfac_approx': 'reduce'},  # selects no module
        }
    )
    defaults = ModuleOptions(batch_first=True)
    resolved = {
        name: resolve_options(modules, name, defaults, overrides)
        for name in ('enc.linear1', 'head', 'tail', 'enc')
    }
    assert resolved['enc.linear1'] == (
        ModuleOptions(batch_first=False),
        {
            'batch_first': 'inherited from enc',
            'kfac_approx': 'model',
            'max_factor_dim': 'model',
            'compute_method': 'model',
            'position_sample': 'model',
        },
    )
    assert resolved['head'] == (
        ModuleOptions(batch_first=False),
        {
            'batch_first': "module_options['head|tail']",
            'kfac_approx': 'model',
            'max_factor_dim': 'model',
            'compute_method': 'model',
            'position_sample': 'model',
        },
    )
    assert resolved['tail'][0] == ModuleOptions(batch_first=True)  # last wins
    assert resolved['enc'][1] == {
        'batch_first': 'model',
        'kfac_approx': 'model',
        'max_factor_dim': 'model',
        'compute_method': 'model',
        'position_sample': 'model',
    }


def _preconditioned_grads(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, **kwargs: Any
) -> dict[str, torch.Tensor]:
    precon = KFACPreconditioner(model, relative_clip=None, **kwargs)
    out = model(x)
    statistics = kwargs.get('statistics', StatisticsConfig())
    if not statistics.batch_first:
        out = out.transpose(0, 1)  # (T, N, c) -> (N, T, c)
    F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1)).backward()
    precon.step()
    return {
        n: p.grad.clone()  # type: ignore[union-attr]  # backward() above set it
        for n, p in model.named_parameters()
    }


def test_sequence_first_input_preconditions_like_batch_first() -> None:
    """Defect 4: a (T, N, d) input was read as N = T examples."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))
    model = model.double()
    twin = copy.deepcopy(model)
    x = torch.randn(2, 7, 4, dtype=F64)  # N = 2 examples, T = 7
    y = torch.randint(0, 3, (2, 7))
    first = _preconditioned_grads(model, x, y)
    second = _preconditioned_grads(
        twin,
        x.transpose(0, 1),
        y,
        statistics=StatisticsConfig(batch_first=False),
    )
    for name, grad in first.items():
        torch.testing.assert_close(second[name], grad, rtol=1e-12, atol=0)


class _Encoder(nn.Module):
    def __init__(self, batch_first: bool) -> None:
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(
            8, 2, 16, dropout=0.0, batch_first=batch_first
        )
        self.head = nn.Linear(8, 3)
        self.batch_first = batch_first

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.layer(x))
        return out if self.batch_first else out.transpose(0, 1)


def test_transformer_submodules_inherit_the_layout() -> None:
    torch.manual_seed(0)
    first_model = _Encoder(batch_first=True).double()
    second_model = _Encoder(batch_first=False).double()
    second_model.load_state_dict(first_model.state_dict())
    x = torch.randn(3, 5, 8, dtype=F64)
    y = torch.randint(0, 3, (3, 5))
    grads = []
    for model, data in ((first_model, x), (second_model, x.transpose(0, 1))):
        # The head sees the encoder's layout: sequence-first in the second.
        head = {'head': {'batch_first': model.batch_first}}
        precon = KFACPreconditioner(
            model, relative_clip=None, module_options=head
        )
        report = {e['name']: e for e in precon.describe()['preconditioned']}
        source = report['layer.linear1']['options']['batch_first']
        assert source['source'] == 'inherited from layer'
        attention = report['layer.self_attn.q_proj']['options']['batch_first']
        assert attention['source'] == 'inherited from layer.self_attn'
        out = model(data)
        F.cross_entropy(out.reshape(-1, 3), y.reshape(-1)).backward()
        precon.step()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    for name, grad in grads[0].items():
        torch.testing.assert_close(
            grads[1][name], grad, rtol=1e-10, atol=1e-15
        )


def test_a_bad_value_names_its_pattern() -> None:
    with pytest.raises(
        ValueError, match=r"^module_options\['0'\]: kfac_approx"
    ):
        KFACPreconditioner(
            nn.Sequential(nn.Linear(2, 2)),
            module_options={'0': {'kfac_approx': 'mean'}},
        )
    with pytest.raises(
        TypeError, match=r"^module_options\['0'\]: batch_first"
    ):
        KFACPreconditioner(
            nn.Sequential(nn.Linear(2, 2)),
            module_options={'0': {'batch_first': 1}},
        )
