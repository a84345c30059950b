"""Convolutions of any dimension as Linear layers over patches.

A convolution with `groups == 1` is a Linear map from the `C·Π k` values
of each input patch to the `out` channels, shared across the output
positions (`L'`, `H'·W'` or `D'·H'·W'`): `A` is formed from the unfolded
patches and `G` from the output gradient at every position (see the
conventions in [`kfac.math`][kfac.math]). One helper serves
`nn.Conv1d`, `nn.Conv2d` and `nn.Conv3d`.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from kfac.layers.helper import Grads
from kfac.layers.helper import ModuleHelper
from kfac.layers.helper import read_grad
from kfac.layers.helper import write_rows
from kfac.layers.sampling import select_positions

_CONVOLUTIONS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)

PATCH_BLOCK_ELEMENTS = 2**21
"""Elements of unfolded convolution patches computed at once (8 MiB of
float32)."""


class ConvModuleHelper(ModuleHelper):
    """Helper for `nn.Conv1d`, `nn.Conv2d` and `nn.Conv3d` with
    `groups == 1`.

    Inputs unfold into patches (respecting `stride`, `padding` including
    `'same'`/`'valid'`, `dilation` and `padding_mode`), so the layer is a
    Linear over `C·Π kernel_size` inputs shared across the output
    positions. An input without its batch dimension is one example.

    Args:
        module: the convolution.

    Raises:
        TypeError: `module` is not a 1-, 2- or 3-D convolution.
        ValueError: `module.groups` is not 1.
    """

    module: nn.Conv1d | nn.Conv2d | nn.Conv3d

    samples_positions = True

    def __init__(self, module: nn.Module) -> None:
        if not isinstance(module, _CONVOLUTIONS):
            raise TypeError(
                'ConvModuleHelper needs an nn.Conv1d, nn.Conv2d or '
                f'nn.Conv3d; got {type(module).__name__}',
            )
        if module.groups != 1:
            raise ValueError(
                f'{type(self).__name__} supports groups=1 only; got '
                f'groups={module.groups}',
            )
        super().__init__(module)
        self.spatial = len(module.kernel_size)
        """Number of spatial dimensions (1, 2 or 3)."""

    @property
    def call_settings(self) -> dict[str, object]:
        """The options, `stride`, `padding`, `dilation` and
        `padding_mode`.
        """
        m = self.module
        return {
            **super().call_settings,
            'stride': m.stride,
            'padding': m.padding,
            'dilation': m.dilation,
            'padding_mode': m.padding_mode,
        }

    def _pad_amounts(self) -> list[int]:
        """`F.pad` amounts, the last dimension first."""
        m = self.module
        pads: list[int] = []
        for dim in reversed(range(self.spatial)):
            if isinstance(m.padding, str):
                same = m.padding == 'same'
                total = m.dilation[dim] * (m.kernel_size[dim] - 1) * same
                before, after = total // 2, total - total // 2
            else:
                before = after = m.padding[dim]
            pads += [before, after]
        return pads

    def _batched(self, tensor: torch.Tensor) -> torch.Tensor:
        batched = tensor.dim() == self.spatial + 2
        return tensor if batched else tensor[None]

    def _patch_blocks(
        self,
        layer_input: torch.Tensor,
        dtype: torch.dtype,
    ) -> Iterator[torch.Tensor]:
        """The input patches, a few examples at a time, as `(in, n, T)`
        views of one reused buffer (use each before asking for the next).
        """
        m = self.module
        x = self._batched(layer_input)
        pads = self._pad_amounts()
        if any(pads):
            mode = 'constant' if m.padding_mode == 'zeros' else m.padding_mode
            x = F.pad(x, pads, mode=mode)
        n, channels = x.shape[:2]
        kernel, dilation, stride = m.kernel_size, m.dilation, m.stride
        out = [
            (size - d * (k - 1) - 1) // s + 1
            for size, k, d, s in zip(x.shape[2:], kernel, dilation, stride)
        ]
        positions = math.prod(out)
        rows = channels * math.prod(kernel)
        # Patches are Π k times larger than the input: build them a few
        # examples at a time in one reused buffer, laid out (C, *kernel,
        # examples, *out) so that each kernel offset is one strided copy
        # of a shifted slice and the block is the (in, r) matrix as it is.
        per_example = max(1, rows * positions)
        chunk = max(1, min(n, PATCH_BLOCK_ELEMENTS // per_example))
        buffer = x.new_empty(per_example * chunk, dtype=dtype)
        for start in range(0, n, chunk):
            block = x[start : start + chunk].transpose(0, 1)
            count = block.shape[1]
            patches = buffer[: per_example * count].view(
                channels, *kernel, count, *out
            )
            for offsets in itertools.product(*(range(k) for k in kernel)):
                window = [
                    slice(o * d, o * d + s * (size - 1) + 1, s)
                    for o, d, s, size in zip(offsets, dilation, stride, out)
                ]
                index: tuple[int | slice, ...] = (slice(None), *offsets)
                target = patches[index]
                target.copy_(block[(slice(None), slice(None), *window)])
            yield patches.view(rows, count, positions)

    def a_columns(  # noqa: D102
        self,
        layer_input: torch.Tensor,
        dtype: torch.dtype,
    ) -> Iterator[torch.Tensor]:
        batch, first = self.batch_size(layer_input), 0
        for columns in self._patch_blocks(layer_input, dtype):
            if self.kfac_approx == 'reduce':
                yield columns.mean(dim=2)
                continue
            drawn, _ = select_positions(
                self.sampler,
                columns,
                examples=1,
                dim=2,
                batch=batch,
                first=first,
            )
            first += columns.shape[1]
            yield drawn.reshape(columns.shape[0], -1)

    def a_example_rows(  # noqa: D102
        self,
        layer_input: torch.Tensor,
        dtype: torch.dtype,
    ) -> torch.Tensor:
        blocks = [
            block.permute(1, 2, 0).clone()
            for block in self._patch_blocks(layer_input.detach(), dtype)
        ]
        return self.with_bias_column(torch.cat(blocks))

    def g_example_rows(  # noqa: D102
        self,
        grad_output: torch.Tensor,
        dtype: torch.dtype,
        scale: float,
    ) -> torch.Tensor:
        g = self._batched(grad_output.detach())
        rows = g.reshape(g.shape[0], g.shape[1], -1).transpose(1, 2).to(dtype)
        return rows * scale if scale != 1.0 else rows

    def g_columns(  # noqa: D102
        self,
        grad_output: torch.Tensor,
        dtype: torch.dtype,
        scale: float,
    ) -> torch.Tensor:
        g = self._batched(grad_output)
        if self.sampler is not None and self.kfac_approx == 'expand':
            return self._sampled_g_columns(g, dtype, scale)
        cols = torch.empty(
            (g.shape[1], g.shape[0], *g.shape[2:]),
            dtype=dtype,
            device=g.device,
        )
        torch.mul(g.transpose(0, 1).to(dtype), scale, out=cols)
        if self.kfac_approx == 'reduce':
            return cols.reshape(g.shape[1], g.shape[0], -1).sum(dim=2)
        return cols.reshape(g.shape[1], -1)

    def _sampled_g_columns(
        self, g: torch.Tensor, dtype: torch.dtype, scale: float
    ) -> torch.Tensor:
        """`g_columns` of the drawn positions, scaled by `√(T/k)` too."""
        flat = g.reshape(g.shape[0], g.shape[1], -1)
        drawn, weight = select_positions(
            self.sampler, flat, examples=0, dim=2, batch=g.shape[0]
        )
        cols = drawn.transpose(0, 1).to(dtype) * (scale * math.sqrt(weight))
        return cols.reshape(g.shape[1], -1)

    def batch_size(self, tensor: torch.Tensor) -> int:  # noqa: D102
        return self._batched(tensor).shape[0]

    def positions(self, tensor: torch.Tensor) -> int:  # noqa: D102
        return math.prod(self._batched(tensor).shape[2:])


class ConvGroupHelper(ConvModuleHelper):
    """One group of a grouped (or depthwise) convolution, preconditioned as
    a convolution of its own.

    A convolution with `groups = g` is `g` independent convolutions, each
    from `C/g` input channels to `out/g` output channels; K-FAC gives each
    its own `A` and `G` (block-diagonal factors, one block per group).

    Args:
        module: the convolution.
        group: which group, in `[0, groups)`.

    Raises:
        TypeError: `module` is not a 1-, 2- or 3-D convolution.
        ValueError: `group` is not one of its groups.
    """

    def __init__(self, module: nn.Module, group: int) -> None:
        if not isinstance(module, _CONVOLUTIONS):
            raise TypeError(
                'ConvGroupHelper needs an nn.Conv1d, nn.Conv2d or '
                f'nn.Conv3d; got {type(module).__name__}',
            )
        if not 0 <= group < module.groups:
            raise ValueError(
                f'group must be in [0, {module.groups}); got {group}'
            )
        ModuleHelper.__init__(self, module)
        self.spatial = len(module.kernel_size)
        self.group = group
        """The group this helper preconditions."""
        self._in = module.in_channels // module.groups
        self._out = module.out_channels // module.groups

    @property
    def rows(self) -> slice:
        """The output channels (rows of the weight and bias) of the group."""
        return slice(self.group * self._out, (self.group + 1) * self._out)

    @property
    def g_factor_shape(self) -> tuple[int, int]:
        """`(out/g, out/g)`."""
        return (self._out, self._out)

    def _channels(self, tensor: torch.Tensor, width: int) -> torch.Tensor:
        start = self.group * width
        return self._batched(tensor)[:, start : start + width]

    def a_columns(  # noqa: D102
        self,
        layer_input: torch.Tensor,
        dtype: torch.dtype,
    ) -> Iterator[torch.Tensor]:
        yield from super().a_columns(
            self._channels(layer_input, self._in), dtype
        )

    def g_columns(  # noqa: D102
        self,
        grad_output: torch.Tensor,
        dtype: torch.dtype,
        scale: float,
    ) -> torch.Tensor:
        grad = self._channels(grad_output, self._out)
        return super().g_columns(grad, dtype, scale)

    def a_example_rows(  # noqa: D102
        self,
        layer_input: torch.Tensor,
        dtype: torch.dtype,
    ) -> torch.Tensor:
        return super().a_example_rows(
            self._channels(layer_input, self._in), dtype
        )

    def g_example_rows(  # noqa: D102
        self,
        grad_output: torch.Tensor,
        dtype: torch.dtype,
        scale: float,
    ) -> torch.Tensor:
        grad = self._channels(grad_output, self._out)
        return super().g_example_rows(grad, dtype, scale)

    def get_grad(  # noqa: D102
        self, grads: Grads | None = None
    ) -> torch.Tensor | None:
        wgrad = read_grad(self.weight, grads)
        if wgrad is None:
            return None
        v = wgrad[self.rows].reshape(self._out, -1)
        bias = self.bias
        if bias is not None:
            part = read_grad(bias, grads)
            column = (
                torch.zeros_like(v[:, 0]) if part is None else part[self.rows]
            )
            v = torch.cat([v, column[:, None]], dim=1)
        return v

    def set_grad(  # noqa: D102
        self,
        grad: torch.Tensor,
        scale: torch.Tensor | None = None,
        grads: Grads | None = None,
    ) -> None:
        rows = self.rows
        weight = self.weight
        weight_part = grad if self.bias is None else grad[:, :-1]
        write_rows(
            weight,
            rows,
            weight_part.reshape(weight[rows].shape),
            scale,
            grads,
        )
        bias = self.bias
        if bias is not None:
            write_rows(bias, rows, grad[:, -1], scale, grads)


Conv2dModuleHelper = ConvModuleHelper
"""The name of [`ConvModuleHelper`][kfac.layers.conv.ConvModuleHelper]
before it took 1-D and 3-D convolutions too."""
