"""kfac.layers.conv: 1-, 2- and 3-D convolutions, expand and reduce."""

from __future__ import annotations

import copy
from typing import Any
from typing import cast

import pytest
import torch
from torch import nn

from kfac.config import StatisticsConfig
from kfac.layers.conv import ConvGroupHelper
from kfac.layers.conv import ConvModuleHelper
from kfac.layers.modules import Conv2dModuleHelper
from kfac.preconditioner import KFACPreconditioner
from testing.asserts import assert_rel_close
from testing.reference import conv_patches_nd
from testing.reference import layer_factors

F64 = torch.float64


def _step(
    model: nn.Module, x: torch.Tensor, **kwargs: Any
) -> tuple[KFACPreconditioner, torch.Tensor]:
    """One step; returns the preconditioner and the first layer's output
    gradient (retained).
    """
    precon = KFACPreconditioner(model, relative_clip=None, **kwargs)
    first = next(iter(precon.layers.values())).module.module
    outputs: list[torch.Tensor] = []
    handle = first.register_forward_hook(
        lambda m, i, o: outputs.append(o) or o.retain_grad()  # type: ignore[func-returns-value]  # append and retain_grad return None
    )
    y = model(x)
    handle.remove()
    (y.square().sum() / len(x)).backward()  # a mean over the N examples
    precon.step()
    grad = outputs[0].grad
    assert grad is not None
    return precon, grad


CASES = [
    {'kernel_size': 3},
    {'kernel_size': 2, 'stride': 2, 'bias': False},
    {'kernel_size': 3, 'padding': 'same', 'dilation': 2},
    {'kernel_size': 3, 'padding': 1, 'padding_mode': 'reflect'},
    {'kernel_size': 2, 'padding': 1, 'padding_mode': 'circular'},
    {'kernel_size': 3, 'padding': 2, 'padding_mode': 'replicate'},
]


@pytest.mark.parametrize('case', CASES, ids=lambda c: str(c))
@pytest.mark.parametrize('approx', ['expand', 'reduce'])
@pytest.mark.parametrize('dims', [1, 3])
def test_conv_factors_equal_their_definition(
    case: dict[str, Any], approx: str, dims: int
) -> None:
    """A Linear on the unfolded patches, shared across the positions."""
    torch.manual_seed(0)
    conv_type = nn.Conv1d if dims == 1 else nn.Conv3d
    conv = conv_type(2, 3, **case).double()
    model = nn.Sequential(conv, nn.Tanh())
    shape = (9,) if dims == 1 else (5, 4, 5)
    x = torch.randn(3, 2, *shape, dtype=F64)
    precon, grad = _step(
        model, x, statistics=StatisticsConfig(kfac_approx=approx)
    )
    patches = conv_patches_nd(conv, x)  # (N, positions, C·Π k)
    g = grad.flatten(2).transpose(1, 2)  # (N, positions, out)
    a, g_ref = layer_factors(
        patches, g, bias=conv.bias is not None, approx=approx
    )
    layer = precon.layers['0']
    assert layer.a.value is not None and layer.g.value is not None
    label = f'conv{dims}d {approx} factors'
    assert_rel_close(layer.a.value, a, rtol=1e-12, label=label)
    assert_rel_close(layer.g.value, g_ref, rtol=1e-12, label=label)


@pytest.mark.parametrize('approx', ['expand', 'reduce'])
def test_conv1d_preconditions_like_a_conv2d_of_height_one(
    approx: str,
) -> None:
    torch.manual_seed(0)
    conv1 = nn.Conv1d(3, 4, 3, stride=2, padding=1, dilation=1).double()
    conv2 = nn.Conv2d(3, 4, (1, 3), stride=(1, 2), padding=(0, 1)).double()
    with torch.no_grad():
        conv2.weight.copy_(conv1.weight[:, :, None])
        assert conv1.bias is not None and conv2.bias is not None
        conv2.bias.copy_(conv1.bias)
    one = nn.Sequential(conv1, nn.Tanh(), nn.Flatten(), nn.Linear(16, 2))
    one = one.double()
    two = nn.Sequential(conv2, nn.Tanh(), nn.Flatten(), nn.Linear(16, 2))
    two[3] = copy.deepcopy(one[3])
    first = KFACPreconditioner(
        one,
        relative_clip=None,
        statistics=StatisticsConfig(kfac_approx=approx),
    )
    second = KFACPreconditioner(
        two.double(),
        relative_clip=None,
        statistics=StatisticsConfig(kfac_approx=approx),
    )
    for step in range(2):  # a running average and a second decomposition
        x = torch.randn(
            5, 3, 8, dtype=F64, generator=torch.Generator().manual_seed(step)
        )
        for model, data, precon in (
            (one, x, first),
            (two, x[:, :, None], second),
        ):
            model.zero_grad()
            model(data).square().mean().backward()
            precon.step()
        for name in ('0', '3'):
            for mine, theirs in zip(
                first.layers[name].factors, second.layers[name].factors
            ):
                assert mine.value is not None and theirs.value is not None
                assert_rel_close(
                    mine.value, theirs.value, rtol=1e-12, label='conv1d twin'
                )
        for p, q in zip(one.parameters(), two.parameters()):
            assert p.grad is not None and q.grad is not None
            assert_rel_close(
                p.grad,
                q.grad.reshape(p.grad.shape),
                rtol=1e-10,
                label='conv1d twin',
            )


def test_unbatched_input_is_one_example() -> None:
    conv = nn.Conv1d(2, 3, 3).double()
    helper = ConvModuleHelper(conv)
    x = torch.randn(2, 7, dtype=F64)
    out = conv(x)
    assert helper.batch_size(x) == helper.batch_size(out) == 1
    assert helper.positions(out) == 5
    a, count = helper.a_statistic(x, F64)
    a_batched, count_batched = helper.a_statistic(x[None], F64)
    assert count == count_batched == 5
    assert torch.equal(a, a_batched)


def test_helper_refuses_what_it_cannot_precondition() -> None:
    with pytest.raises(TypeError, match='needs an nn.Conv1d, nn.Conv2d'):
        ConvModuleHelper(nn.Linear(2, 2))
    with pytest.raises(ValueError, match='supports groups=1 only'):
        Conv2dModuleHelper(nn.Conv2d(4, 4, 3, groups=2))
    assert Conv2dModuleHelper is ConvModuleHelper


class _Split(nn.Module):
    """A grouped convolution written as one convolution per group."""

    def __init__(self, grouped: nn.Conv1d | nn.Conv2d) -> None:
        super().__init__()
        groups = grouped.groups
        out = grouped.out_channels // groups
        self.width = grouped.in_channels // groups
        kind = type(grouped)
        self.parts = nn.ModuleList(
            kind(
                self.width,
                out,
                grouped.kernel_size,  # type: ignore[arg-type]  # a Conv2d's own settings
                stride=grouped.stride,  # type: ignore[arg-type]  # a Conv2d's own settings
                padding=grouped.padding,  # type: ignore[arg-type]  # a Conv2d's own settings
                bias=grouped.bias is not None,
            ).double()
            for _ in range(groups)
        )
        with torch.no_grad():
            for j, part in enumerate(self.convs):
                part.weight.copy_(grouped.weight[j * out : (j + 1) * out])
                if part.bias is not None and grouped.bias is not None:
                    part.bias.copy_(grouped.bias[j * out : (j + 1) * out])

    @property
    def convs(self) -> list[nn.Conv1d | nn.Conv2d]:
        return [cast(nn.Conv1d | nn.Conv2d, part) for part in self.parts]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.width
        return torch.cat(
            [p(x[:, j * w : (j + 1) * w]) for j, p in enumerate(self.parts)],
            dim=1,
        )


@pytest.mark.parametrize(
    'grouped',
    [
        lambda: nn.Conv2d(4, 6, 3, groups=2, padding=1),
        lambda: nn.Conv1d(3, 3, 3, groups=3, bias=False),  # depthwise
    ],
    ids=['grouped-2d', 'depthwise-1d'],
)
def test_grouped_convolution_preconditions_like_one_per_group(
    grouped: Any,
) -> None:
    """Block-diagonal factors: each group is a convolution of its own."""
    torch.manual_seed(0)
    conv = grouped().double()
    split = _Split(conv)
    precon = KFACPreconditioner(conv, relative_clip=None)
    reference = KFACPreconditioner(split, relative_clip=None)
    # the root module's groups: '' + '.group<j>'
    assert list(precon.layers) == [f'.group{j}' for j in range(conv.groups)]
    shape = (
        (5, conv.in_channels, 6, 6) if conv.weight.dim() == 4 else (5, 3, 9)
    )
    for step in range(2):
        x = torch.randn(
            *shape, dtype=F64, generator=torch.Generator().manual_seed(step)
        )
        for model, kfac in ((conv, precon), (split, reference)):
            model.zero_grad()
            model(x).tanh().sum().backward()
            kfac.step()
    for j, layer in enumerate(precon.layers.values()):
        for mine, theirs in zip(
            layer.factors, reference.layers[f'parts.{j}'].factors
        ):
            assert mine.value is not None and theirs.value is not None
            assert_rel_close(
                mine.value, theirs.value, rtol=1e-12, label='groups'
            )
    out = conv.out_channels // conv.groups
    assert conv.weight.grad is not None
    for j, part in enumerate(split.convs):
        rows = slice(j * out, (j + 1) * out)
        assert part.weight.grad is not None
        assert_rel_close(
            conv.weight.grad[rows],
            part.weight.grad,
            rtol=1e-10,
            label='groups',
        )
        if conv.bias is not None and part.bias is not None:
            assert conv.bias.grad is not None and part.bias.grad is not None
            assert_rel_close(
                conv.bias.grad[rows],
                part.bias.grad,
                rtol=1e-10,
                label='groups',
            )


def test_group_helper_checks_and_a_missing_bias_gradient() -> None:
    with pytest.raises(TypeError, match='needs an nn.Conv1d, nn.Conv2d'):
        ConvGroupHelper(nn.Linear(2, 2), 0)
    conv = nn.Conv1d(4, 4, 3, groups=2).double()
    with pytest.raises(ValueError, match=r'group must be in \[0, 2\); got 2'):
        ConvGroupHelper(conv, 2)
    helper = ConvGroupHelper(conv, 1)
    assert helper.get_grad() is None  # no backward yet
    conv.weight.grad = torch.ones_like(conv.weight)
    v = helper.get_grad()
    assert v is not None and v.shape == (2, 2 * 3 + 1)
    assert torch.equal(v[:, -1], torch.zeros(2, dtype=F64))  # no bias grad
