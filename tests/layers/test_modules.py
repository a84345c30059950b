from __future__ import annotations

from typing import Literal

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kfac.layers import conv as conv_module
from kfac.layers.modules import Conv2dModuleHelper
from kfac.layers.modules import LinearModuleHelper
from kfac.layers.modules import ModuleHelper
from testing.asserts import assert_rel_close
from testing.reference import conv_factors
from testing.reference import conv_patches
from testing.reference import grad_matrix
from testing.reference import linear_factors

F64 = torch.float64


def factors(
    helper: ModuleHelper,
    x: torch.Tensor,
    gout: torch.Tensor,
    reduction: str = 'mean',
) -> tuple[torch.Tensor, torch.Tensor]:
    a_sum, a_count = helper.a_statistic(x, F64)
    g_sum, g_count = helper.g_statistic(
        gout,
        F64,
        1.0,
        per_example=reduction == 'mean',
    )
    return a_sum / a_count, g_sum / g_count


@pytest.mark.parametrize(
    'shape',
    [(5, 4), (3, 6, 4), (2, 3, 2, 4), (4,)],
    ids=['2d', '3d-sequence', '4d', 'unbatched'],
)
@pytest.mark.parametrize('bias', [True, False])
@pytest.mark.parametrize('reduction', ['mean', 'sum'])
def test_linear_factors_equal_definition(
    shape: tuple[int, ...],
    bias: bool,
    reduction: str,
) -> None:
    torch.manual_seed(0)
    layer = nn.Linear(4, 3, bias=bias).double()
    x = torch.randn(shape, dtype=F64)
    gout = torch.randn((*shape[:-1], 3), dtype=F64)
    helper = LinearModuleHelper(layer)
    a, g = factors(helper, x, gout, reduction)
    xb, gb = (x[None], gout[None]) if x.dim() == 1 else (x, gout)
    a_ref, g_ref = linear_factors(xb, gb, bias=bias, reduction=reduction)
    assert_rel_close(a, a_ref, label='factors: linear A')
    assert_rel_close(g, g_ref, label='factors: linear G')
    # the shapes the layer allocates from are those of the definitions
    assert helper.a_factor_shape == a_ref.shape
    assert helper.g_factor_shape == g_ref.shape
    layer(x).sum().backward()
    assert helper.grad_shape == grad_matrix(layer).shape


CONVS = {
    'plain': dict(kernel_size=3),
    'stride-pad': dict(kernel_size=3, stride=2, padding=1),
    'asym': dict(kernel_size=(3, 2), stride=(2, 1), padding=(2, 0)),
    'dilation': dict(kernel_size=3, dilation=2, padding=2),
    'same': dict(kernel_size=(4, 3), padding='same', dilation=(1, 2)),
    'valid': dict(kernel_size=2, padding='valid', bias=False),
    'reflect': dict(kernel_size=3, padding=1, padding_mode='reflect'),
    'circular': dict(kernel_size=3, padding=2, padding_mode='circular'),
    'replicate': dict(kernel_size=3, padding=(1, 2), padding_mode='replicate'),
}


@pytest.mark.parametrize('name', list(CONVS))
def test_conv_factors_equal_definition(name: str) -> None:
    torch.manual_seed(1)
    conv = nn.Conv2d(2, 3, **CONVS[name]).double()  # type: ignore[arg-type]  # keyword options of nn.Conv2d
    x = torch.randn(3, 2, 7, 6, dtype=F64)
    out = conv(x)
    gout = torch.randn_like(out)
    helper = Conv2dModuleHelper(conv)
    a, g = factors(helper, x, gout)
    a_ref, g_ref = conv_factors(conv, x, gout)
    assert_rel_close(a, a_ref, label='factors: conv2d A')
    assert_rel_close(g, g_ref, label='factors: conv2d G')


@pytest.mark.parametrize('name', list(CONVS))
def test_conv_equals_linear_on_patches(name: str) -> None:
    """A conv is a Linear over its input patches shared across positions."""
    torch.manual_seed(2)
    conv = nn.Conv2d(2, 3, **CONVS[name]).double()  # type: ignore[arg-type]  # keyword options of nn.Conv2d
    x = torch.randn(2, 2, 6, 7, dtype=F64)
    patches = conv_patches(conv, x)  # (N, L, C*kh*kw)
    linear = nn.Linear(
        patches.shape[-1],
        3,
        bias=conv.bias is not None,
    ).double()
    with torch.no_grad():
        linear.weight.copy_(conv.weight.reshape(3, -1))
        if conv.bias is not None:
            linear.bias.copy_(conv.bias)
    out = conv(x)
    lin_out = linear(patches)  # (N, L, out)
    assert_rel_close(
        lin_out.transpose(1, 2).reshape(out.shape),
        out,
        label='conv vs linear on patches',
    )
    gout = torch.randn_like(out)
    lin_gout = gout.flatten(2).transpose(1, 2)
    conv_a, conv_g = factors(Conv2dModuleHelper(conv), x, gout)
    lin_a, lin_g = factors(LinearModuleHelper(linear), patches, lin_gout)
    assert_rel_close(conv_a, lin_a, label='conv vs linear on patches')
    assert_rel_close(conv_g, lin_g, label='conv vs linear on patches')


def test_conv_unbatched_input() -> None:
    conv = nn.Conv2d(2, 3, 3, padding=1).double()
    x = torch.randn(2, 5, 5, dtype=F64)
    gout = torch.randn(3, 5, 5, dtype=F64)
    a, g = factors(Conv2dModuleHelper(conv), x, gout)
    a_ref, g_ref = conv_factors(conv, x[None], gout[None])
    assert_rel_close(a, a_ref, label='factors: conv2d A')
    assert_rel_close(g, g_ref, label='factors: conv2d G')


@pytest.mark.parametrize(
    'module',
    [
        nn.Linear(4, 3),
        nn.Linear(4, 3, bias=False),
        nn.Conv2d(2, 3, (3, 2)),
        nn.Conv2d(2, 3, 3, bias=False),
    ],
    ids=['linear', 'linear-nobias', 'conv', 'conv-nobias'],
)
def test_grad_get_and_set_round_trip(module: nn.Module) -> None:
    module = module.double()
    helper: ModuleHelper = (
        Conv2dModuleHelper(module)
        if isinstance(module, nn.Conv2d)
        else LinearModuleHelper(module)
    )
    assert helper.get_grad() is None
    x = torch.randn((2, 2, 5, 5) if isinstance(module, nn.Conv2d) else (2, 4))
    module(x.double()).square().sum().backward()
    v = helper.get_grad()
    assert v is not None
    assert v.shape == helper.grad_shape
    assert torch.equal(v, grad_matrix(module))
    new = torch.randn(helper.grad_shape, dtype=F64)
    helper.set_grad(new)
    assert torch.equal(grad_matrix(module), new)
    # Writing into parameters without a .grad creates it.
    module.zero_grad(set_to_none=True)
    helper.set_grad(new)
    assert torch.equal(grad_matrix(module), new)


@pytest.mark.parametrize('existing', ['none', 'contiguous', 'channels_last'])
@pytest.mark.parametrize('scale', [None, 0.5])
def test_set_grad_scales_into_any_existing_grad(
    existing: str,
    scale: float | None,
) -> None:
    torch.manual_seed(4)
    conv = nn.Conv2d(3, 4, 3).double()
    helper = Conv2dModuleHelper(conv)
    if existing != 'none':
        conv(torch.randn(2, 3, 5, 5, dtype=F64)).sum().backward()
    if existing == 'channels_last':
        conv.weight.grad = conv.weight.grad.contiguous(  # type: ignore[union-attr]  # backward() above set it
            memory_format=torch.channels_last
        )
    before = conv.weight.grad
    new = torch.randn(helper.grad_shape, dtype=F64)
    factor = None if scale is None else torch.tensor(scale, dtype=F64)
    helper.set_grad(new, factor)
    expected = new if scale is None else new * scale
    assert torch.equal(grad_matrix(conv), expected)
    if before is not None:  # written in place, layout kept
        assert conv.weight.grad is before
    assert conv.weight.grad is not None
    assert conv.weight.grad.shape == conv.weight.shape


def test_set_grad_casts_to_the_parameter_dtype() -> None:
    layer = nn.Linear(3, 2).to(torch.bfloat16)
    helper = LinearModuleHelper(layer)
    new = torch.randn(helper.grad_shape)
    helper.set_grad(new, torch.tensor(2.0))  # no .grad yet: a new one
    assert layer.weight.grad is not None
    assert layer.weight.grad.dtype == torch.bfloat16
    helper.set_grad(new, torch.tensor(2.0))  # into the bf16 .grad
    torch.testing.assert_close(
        grad_matrix(layer).float(), 2.0 * new, rtol=1e-2, atol=0
    )


def test_frozen_bias_is_not_part_of_the_factors() -> None:
    """A bias that is not trained is no column of A or V."""
    layer = nn.Linear(3, 2).double()
    layer.bias.requires_grad_(False)
    helper = LinearModuleHelper(layer)
    x = torch.randn(4, 3, dtype=F64)
    out = layer(x)
    gout = torch.randn_like(out)
    a, g = factors(helper, x, gout)
    a_ref, g_ref = linear_factors(x, gout, bias=False)
    assert_rel_close(a, a_ref, label='factors: linear A')
    assert_rel_close(g, g_ref, label='factors: linear G')
    out.backward(gout)
    v = helper.get_grad()
    assert v is not None
    assert layer.weight.grad is not None
    assert torch.equal(v, layer.weight.grad)
    new = torch.randn(2, 3, dtype=F64)
    helper.set_grad(new)
    assert torch.equal(layer.weight.grad, new)
    assert layer.bias.grad is None


def test_missing_bias_grad_reads_as_zero() -> None:
    layer = nn.Linear(3, 2).double()
    F.linear(torch.randn(4, 3, dtype=F64), layer.weight).sum().backward()
    v = LinearModuleHelper(layer).get_grad()
    assert v is not None
    assert torch.equal(v[:, -1], torch.zeros(2, dtype=F64))


def test_repr_identifies_the_module() -> None:
    """Two Linear modules of different shapes are told apart."""
    small, wide = nn.Linear(2, 2), nn.Linear(2, 7)
    assert repr(LinearModuleHelper(small)) != repr(LinearModuleHelper(wide))
    assert repr(wide) in repr(LinearModuleHelper(wide))


@pytest.mark.parametrize(
    ('block_elements', 'padding_mode'),
    [
        (1, 'zeros'),  # one example per block
        (2 * 2 * 9 * 4 * 3, 'zeros'),  # blocks of 2, the last one partial
        (2 * 2 * 9 * 4 * 3, 'reflect'),
        (2**21, 'circular'),  # one block
    ],
)
def test_conv_factors_in_small_blocks_equal_definition(
    monkeypatch: pytest.MonkeyPatch,
    block_elements: int,
    padding_mode: Literal['zeros', 'reflect', 'circular'],
) -> None:
    """Building patches a few examples at a time gives the same sums."""
    monkeypatch.setattr(conv_module, 'PATCH_BLOCK_ELEMENTS', block_elements)
    torch.manual_seed(3)
    conv = nn.Conv2d(
        2, 3, 3, stride=2, padding=1, padding_mode=padding_mode
    ).double()
    x = torch.randn(5, 2, 7, 6, dtype=F64)
    gout = torch.randn_like(conv(x))
    a, g = factors(Conv2dModuleHelper(conv), x, gout)
    a_ref, g_ref = conv_factors(conv, x, gout)
    assert_rel_close(a, a_ref, label='factors: conv2d A')
    assert_rel_close(g, g_ref, label='factors: conv2d G')


@pytest.mark.parametrize('bias', [True, False])
def test_original_factor_methods_equal_the_definitions(bias: bool) -> None:
    # get_a_factor / get_g_factor: one batch's A and G, mean loss.
    torch.manual_seed(2)
    conv = nn.Conv2d(2, 3, kernel_size=3, padding=1, bias=bias).double()
    x = torch.randn(4, 2, 5, 5, dtype=F64)
    gout = torch.randn_like(conv(x))
    helper = Conv2dModuleHelper(conv)
    a_ref, g_ref = conv_factors(conv, x, gout)
    assert_rel_close(helper.get_a_factor(x), a_ref, label='factors: conv A')
    assert_rel_close(helper.get_g_factor(gout), g_ref, label='factors: conv G')
    linear = nn.Linear(4, 3, bias=bias)
    rows, grows = torch.randn(6, 4), torch.randn(6, 3)
    a_lin, g_lin = linear_factors(rows.double(), grows.double(), bias=bias)
    helper_lin = LinearModuleHelper(linear)
    a, g = helper_lin.get_a_factor(rows), helper_lin.get_g_factor(grows)
    assert a.dtype == g.dtype == torch.float32
    torch.testing.assert_close(a, a_lin.float())
    torch.testing.assert_close(g, g_lin.float())


def test_original_helper_accessors() -> None:
    layer = nn.Linear(3, 2)
    helper = LinearModuleHelper(layer)
    assert helper.device == layer.weight.device == torch.device('cpu')
    assert helper.has_symmetric_factors()
    assert helper.has_bias()
    assert helper.get_weight_grad() is None
    assert helper.get_bias_grad() is None
    layer(torch.randn(5, 3)).sum().backward()
    assert helper.get_weight_grad() is layer.weight.grad
    assert helper.get_bias_grad() is layer.bias.grad
    layer.bias.requires_grad_(False)
    assert not helper.has_bias()
    assert helper.get_bias_grad() is None
