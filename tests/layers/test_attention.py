"""kfac.layers.attention: a drop-in MultiheadAttention K-FAC can see."""

from __future__ import annotations

import copy
from typing import Any
from typing import cast

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kfac.layers.attention import AttentionProjection
from kfac.layers.attention import AttentionProjectionHelper
from kfac.layers.attention import KFACMultiheadAttention
from kfac.layers.attention import convert_attention
from kfac.preconditioner import KFACPreconditioner
from testing.asserts import assert_rel_close

F64 = torch.float64
E, HEADS, L, S, N = 8, 2, 4, 5, 3

CONFIGS: list[dict[str, Any]] = [
    {'batch_first': True},
    {'batch_first': False},
    {'batch_first': True, 'kdim': 5, 'vdim': 3},
    {'batch_first': False, 'add_bias_kv': True, 'add_zero_attn': True},
    {'batch_first': True, 'bias': False},
]


def _inputs(
    config: dict[str, Any], self_attention: bool, batched: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)

    def make(length: int, dim: int) -> torch.Tensor:
        if not batched:
            return torch.randn(length, dim, dtype=F64, generator=generator)
        shape = (N, length, dim) if config['batch_first'] else (length, N, dim)
        return torch.randn(shape, dtype=F64, generator=generator)

    query = make(L, E)
    if self_attention:
        return query, query, query
    return (
        query,
        make(S, config.get('kdim', E)),
        make(S, config.get('vdim', E)),
    )


CASES = [
    (config, self_attention)
    for config in CONFIGS
    for self_attention in (True, False)
    if not (self_attention and 'kdim' in config)  # kdim: cross-attention
]


@pytest.mark.parametrize(('config', 'self_attention'), CASES, ids=str)
@pytest.mark.parametrize('need_weights', [True, False])
def test_conversion_keeps_outputs_parameters_and_state_keys(
    config: dict[str, Any], self_attention: bool, need_weights: bool
) -> None:
    torch.manual_seed(0)
    original = nn.MultiheadAttention(E, HEADS, **config).double()
    converted = copy.deepcopy(original)
    params = [id(p) for p in converted.parameters()]
    keys = list(converted.state_dict())
    assert convert_attention(nn.Sequential(converted)) == ['0']
    assert isinstance(converted, KFACMultiheadAttention)
    assert [id(p) for p in converted.parameters()] == params
    assert list(converted.state_dict()) == keys
    query, key, value = _inputs(config, self_attention)
    length = key.shape[1] if config['batch_first'] else key.shape[0]
    mask = torch.rand(L, length, generator=torch.Generator().manual_seed(1))
    padding = torch.zeros(N, length, dtype=torch.bool)
    padding[0, -1] = True
    options = {
        'need_weights': need_weights,
        'attn_mask': mask > 0.7,
        'key_padding_mask': padding,
    }
    expected = original(query, key, value, **options)
    got = converted(query, key, value, **options)
    assert_rel_close(got[0], expected[0], rtol=1e-12, label='attention out')
    if need_weights:
        assert got[1] is not None and expected[1] is not None
        assert_rel_close(got[1], expected[1], rtol=1e-12, label='weights')
    else:
        assert got[1] is None and expected[1] is None
    expected[0].square().sum().backward()
    got[0].square().sum().backward()
    for p, q in zip(original.parameters(), converted.parameters()):
        assert p.grad is not None and q.grad is not None
        assert_rel_close(q.grad, p.grad, rtol=1e-11, label='attention grad')


def test_unbatched_input_and_repeated_conversion() -> None:
    torch.manual_seed(0)
    original = nn.MultiheadAttention(E, HEADS).double()
    converted = copy.deepcopy(original)
    convert_attention(converted)
    assert convert_attention(converted) == []  # already converted
    query, key, value = _inputs({'batch_first': False}, False, batched=False)
    expected = original(query, key, value)[0]
    assert_rel_close(
        converted(query, key, value)[0],
        expected,
        rtol=1e-12,
        label='unbatched',
    )


class _Explicit(nn.Module):
    """The same attention with three ordinary Linear projections."""

    def __init__(self, attention: nn.MultiheadAttention) -> None:
        super().__init__()
        e = attention.embed_dim
        self.q = nn.Linear(e, e).double()
        self.k = nn.Linear(e, e).double()
        self.v = nn.Linear(e, e).double()
        self.out = copy.deepcopy(attention.out_proj)
        bias = attention.in_proj_bias
        assert bias is not None
        with torch.no_grad():
            for i, linear in enumerate((self.q, self.k, self.v)):
                linear.weight.copy_(
                    attention.in_proj_weight[i * e : (i + 1) * e]
                )
                linear.bias.copy_(bias[i * e : (i + 1) * e])
        self.heads = attention.num_heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, length, e = x.shape
        q, k, v = (
            p(x).reshape(n, length, self.heads, -1).transpose(1, 2)
            for p in (self.q, self.k, self.v)
        )
        attended = F.scaled_dot_product_attention(q, k, v)
        out: torch.Tensor = self.out(
            attended.transpose(1, 2).reshape(n, length, e)
        )
        return out


def test_projections_precondition_like_three_linear_layers() -> None:
    """Each projection gets the factors of an ordinary Linear, and its rows
    of `in_proj_weight` the Linear's preconditioned gradient.
    """
    torch.manual_seed(0)
    attention = nn.MultiheadAttention(E, HEADS, batch_first=True).double()
    twin = _Explicit(attention)

    class _Wrapped(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = attention

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out: torch.Tensor = self.attn(x, x, x, need_weights=False)[0]
            return out

    model = _Wrapped()
    precon = KFACPreconditioner(model, relative_clip=None)
    reference = KFACPreconditioner(twin, relative_clip=None)
    assert list(precon.layers) == [
        'attn.out_proj',
        'attn.q_proj',
        'attn.k_proj',
        'attn.v_proj',
    ]
    for step in range(2):
        x = torch.randn(
            N, L, E, dtype=F64, generator=torch.Generator().manual_seed(step)
        )
        for m, p in ((model, precon), (twin, reference)):
            m.zero_grad()
            m(x).tanh().sum().backward()
            p.step()
    pairs = {'q_proj': 'q', 'k_proj': 'k', 'v_proj': 'v', 'out_proj': 'out'}
    for mine, theirs in pairs.items():
        for a, b in zip(
            precon.layers[f'attn.{mine}'].factors,
            reference.layers[theirs].factors,
        ):
            assert a.value is not None and b.value is not None
            assert_rel_close(
                a.value, b.value, rtol=1e-10, label='attention factors'
            )
    weight = attention.in_proj_weight.grad
    bias = attention.in_proj_bias.grad
    assert weight is not None and bias is not None
    for i, linear in enumerate((twin.q, twin.k, twin.v)):
        assert linear.weight.grad is not None and linear.bias.grad is not None
        rows = slice(i * E, (i + 1) * E)
        assert_rel_close(
            weight[rows], linear.weight.grad, rtol=1e-9, label='attention grad'
        )
        assert_rel_close(
            bias[rows], linear.bias.grad, rtol=1e-9, label='attention grad'
        )


def test_helper_checks_its_module() -> None:
    with pytest.raises(TypeError, match='needs an AttentionProjection'):
        AttentionProjectionHelper(nn.Linear(2, 2))
    attention = nn.MultiheadAttention(E, HEADS)
    projection = AttentionProjection(attention, 1)
    del attention
    with pytest.raises(RuntimeError, match='no longer exists'):
        projection.attention  # noqa: B018


def test_separate_projection_weights_without_bias_are_preconditioned() -> None:
    """`kdim`/`vdim` differ from `E`: q, k and v have weights of their own;
    without a bias the factors have no bias row.
    """
    torch.manual_seed(0)
    attention = nn.MultiheadAttention(
        E, HEADS, kdim=5, vdim=3, bias=False, batch_first=True
    ).double()

    class _Cross(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = attention

        def forward(self, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
            out: torch.Tensor = self.attn(q, kv[..., :5], kv[..., 5:])[0]
            return out

    model = _Cross()
    precon = KFACPreconditioner(model, relative_clip=None)
    q = torch.randn(N, L, E, dtype=F64)
    kv = torch.randn(N, S, 8, dtype=F64)
    model(q, kv).tanh().sum().backward()
    raw = {
        n: p.grad.clone()  # type: ignore[union-attr]  # backward() above set it
        for n, p in attention.named_parameters()
    }
    precon.step()
    shapes = {n: (x.a.dim, x.g.dim) for n, x in precon.layers.items()}
    assert shapes['attn.k_proj'] == (5, E) and shapes['attn.v_proj'] == (3, E)
    for name in ('q_proj_weight', 'k_proj_weight', 'v_proj_weight'):
        grad = getattr(attention, name).grad
        assert not torch.equal(grad, raw[name])  # preconditioned


def test_missing_bias_gradient_reads_as_zeros_and_is_written() -> None:
    attention = nn.MultiheadAttention(E, HEADS).double()
    convert_attention(attention)
    helper = AttentionProjectionHelper(cast(nn.Module, attention.k_proj))
    assert helper.get_grad() is None  # no backward yet
    assert repr(attention.k_proj) == 'AttentionProjection(index=1)'
    attention.in_proj_weight.grad = torch.ones_like(attention.in_proj_weight)
    v = helper.get_grad()
    assert v is not None and v.shape == (E, E + 1)
    assert torch.equal(v[:, -1], torch.zeros(E, dtype=F64))
    helper.set_grad(2 * v)
    bias = attention.in_proj_bias
    assert bias is not None and bias.grad is not None
    assert torch.equal(bias.grad, torch.zeros(3 * E, dtype=F64))
    assert torch.equal(
        attention.in_proj_weight.grad[E : 2 * E], 2 * torch.ones(E, E)
    )
