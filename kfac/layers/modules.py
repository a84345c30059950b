"""Uniform access to the torch modules K-FAC preconditions.

A [`ModuleHelper`][kfac.layers.modules.ModuleHelper] hides what differs between
module types: the shapes of the Kronecker factors, the gradient as the
`(out, in[+1])` matrix `V`, and the rows from which `A` and `G` are formed
(see [`kfac.math`][kfac.math] for the conventions).
"""

from __future__ import annotations

import abc
import math
from collections.abc import Iterator
from typing import cast

import torch
from torch import nn

from kfac.sharding import current_grad

PATCH_BLOCK_ELEMENTS = 2**21
"""Elements of unfolded convolution patches computed at once (8 MiB of
float32)."""


class ModuleHelper(abc.ABC):
    """K-FAC's view of one module with a weight and an optional bias.

    Args:
        module: the module; it must have a `weight` tensor.

    Raises:
        TypeError: `module` is not a `torch.nn.Module` with a weight tensor.
    """

    module: nn.Module

    a_diagonal: bool = False
    """Whether `A` is diagonal and kept as the vector of its diagonal
    (`a_statistic` then returns the sum of diagonals, shape `(in,)`), as
    for an embedding."""

    batch_first: bool = True
    """Whether inputs put examples first (see
    [`ModuleOptions`][kfac.layers.options.ModuleOptions]); set at
    registration."""

    kfac_approx: str = 'expand'
    """How shared positions enter the factors: `'expand'` (each position
    a row) or `'reduce'` (one row per example: inputs averaged, output
    gradients summed over its positions); set at registration."""

    def __init__(self, module: nn.Module) -> None:
        if not isinstance(module, nn.Module) or not isinstance(
            getattr(module, 'weight', None),
            torch.Tensor,
        ):
            raise TypeError(
                f'module must be a torch.nn.Module with a weight tensor; got '
                f'{module!r}',
            )
        self.module = module

    def __repr__(self) -> str:
        return f'{type(self).__name__}({self.module!r})'

    @property
    def weight(self) -> torch.Tensor:
        """The module's weight parameter."""
        return cast(torch.Tensor, self.module.weight)

    @property
    def bias(self) -> torch.Tensor | None:
        """The bias if it exists and is trained, else None."""
        bias = getattr(self.module, 'bias', None)
        if isinstance(bias, torch.Tensor) and bias.requires_grad:
            return bias
        return None

    def parameters(self) -> tuple[torch.Tensor, ...]:
        """The trained tensors whose gradients form `V`: weight, bias."""
        bias = self.bias
        return (self.weight,) if bias is None else (self.weight, bias)

    @property
    def has_bias(self) -> bool:
        """Whether `A` includes the constant-1 input of a trained bias."""
        return self.bias is not None

    @property
    def a_factor_shape(self) -> tuple[int, int]:
        """Shape of `A`: `(in[+1], in[+1])`."""
        n = self.in_features + int(self.has_bias)
        return (n, n)

    @property
    def g_factor_shape(self) -> tuple[int, int]:
        """Shape of `G`: `(out, out)`."""
        out = self.weight.shape[0]
        return (out, out)

    @property
    def grad_shape(self) -> tuple[int, int]:
        """Shape of the gradient matrix `V`: `(out, in[+1])`."""
        return (self.g_factor_shape[0], self.a_factor_shape[0])

    @property
    def in_features(self) -> int:
        """Number of inputs each output sees (`in`)."""
        return math.prod(self.weight.shape[1:])

    def get_grad(self) -> torch.Tensor | None:
        """Return `V = [∇W, ∇b]` of shape `(out, in[+1])`.

        None when the weight has no gradient in this step.
        """
        wgrad = current_grad(self.weight)
        if wgrad is None:
            return None
        v = wgrad.reshape(wgrad.shape[0], -1)
        bias = self.bias
        if bias is not None:
            bgrad = current_grad(bias)
            if bgrad is None:
                bgrad = torch.zeros_like(bias)
            v = torch.cat([v, bgrad.reshape(-1, 1)], dim=1)
        return v

    def set_grad(
        self,
        grad: torch.Tensor,
        scale: torch.Tensor | None = None,
    ) -> None:
        """Write `V` (times `scale`) into the parameters' `.grad`.

        `V` has shape `(out, in[+1])`; with a bias, its last column is the
        bias gradient.

        An existing contiguous `.grad` is written in one pass (the scaled
        product goes straight into it); otherwise a new `.grad` is made.

        Args:
            grad: `V`.
            scale: optional 0-d multiplier (the KL clip).
        """
        bias = self.bias
        if bias is None:
            _write(self.weight, grad, scale)
        else:
            _write(self.weight, grad[:, :-1], scale)
            _write(bias, grad[:, -1], scale)

    def a_statistic(
        self,
        layer_input: torch.Tensor,
        dtype: torch.dtype,
    ) -> tuple[torch.Tensor, int]:
        """Return `(Σ ã ãᵀ, number of rows)` of one batch's inputs.

        The input vectors arrive as column blocks `(in, r)`; the bias
        entries of `Σ ã ãᵀ` (last row and column) are the column sums and
        the count, so the ones are never materialised.

        Args:
            layer_input: the module's input as seen by its forward hook.
            dtype: dtype of the sum (at least float32).
        """
        n = self.in_features
        dim = n + int(self.has_bias)
        out = torch.zeros((dim, dim), dtype=dtype, device=layer_input.device)
        gram_block = out[:n, :n]
        count = 0
        for cols in self.a_columns(layer_input.detach(), dtype):
            gram_block.addmm_(cols, cols.T)
            if self.has_bias:
                out[:n, n] += cols.sum(dim=1)
            count += cols.shape[1]
        if self.has_bias:
            out[n, :n] = out[:n, n]
            out[n, n] = count
        return out, count

    def g_statistic(
        self,
        grad_output: torch.Tensor,
        dtype: torch.dtype,
        scale: float,
        per_example: bool,
    ) -> tuple[torch.Tensor, int]:
        """Return `(Σ g gᵀ, number of examples)` of one batch.

        Args:
            grad_output: gradient of the loss with respect to the output.
            dtype: dtype of the sum (at least float32).
            scale: multiplier turning `grad_output` into `g`, before the
                batch-size factor.
            per_example: multiply by the number of examples `N` as well
                (`'mean'` loss reduction).
        """
        n = self.batch_size(grad_output)
        if per_example:
            scale = scale * n
        # Scaled before the product: a loss-scaled gradient squared could
        # overflow before the scale is divided out.
        cols = self.g_columns(grad_output.detach(), dtype, scale)
        return cols @ cols.T, n

    @abc.abstractmethod
    def a_columns(
        self,
        layer_input: torch.Tensor,
        dtype: torch.dtype,
    ) -> Iterator[torch.Tensor]:
        """Input vectors as column blocks `(in, r)` in `dtype`.

        One column per example and position, in blocks of bounded size. A
        block may be overwritten by the next one: use it before asking for
        the next.
        """

    @abc.abstractmethod
    def g_columns(
        self,
        grad_output: torch.Tensor,
        dtype: torch.dtype,
        scale: float,
    ) -> torch.Tensor:
        """Scaled output gradients as columns `(out, R)` in `dtype`."""

    @abc.abstractmethod
    def positions(self, tensor: torch.Tensor) -> int:
        """Weight-sharing positions `T` per example of an input or
        output-gradient tensor (1 without sharing).
        """

    @abc.abstractmethod
    def batch_size(self, tensor: torch.Tensor) -> int:
        """Number of examples `N` in an input or output-gradient tensor."""


def _write(
    param: torch.Tensor,
    value: torch.Tensor,
    scale: torch.Tensor | None,
) -> None:
    """`param.grad = scale · value` (reshaped), reusing `param.grad`."""
    target = current_grad(param)
    if target is not None and target.is_contiguous():
        view = target.view(value.shape)
        if scale is None:
            view.copy_(value)
        else:
            torch.mul(value, scale, out=view)
        return
    new = (value.clone() if scale is None else value * scale).reshape(
        param.shape
    )
    if target is None:
        param.grad = new.to(param.dtype)
    else:
        target.copy_(new)


def write_rows(
    param: torch.Tensor,
    rows: slice,
    value: torch.Tensor,
    scale: torch.Tensor | None,
) -> None:
    """`param.grad[rows] = scale · value` (a `.grad` of zeros if none)."""
    whole = current_grad(param)
    if whole is None:
        whole = param.grad = torch.zeros_like(param)
    target = whole[rows]
    if scale is None:
        target.copy_(value)
    else:
        torch.mul(value, scale, out=target)


class LinearModuleHelper(ModuleHelper):
    """Helper for `torch.nn.Linear` on inputs of any rank.

    An input of shape `(N, *positions, in)` has `N` examples and
    `prod(positions)` weight-sharing positions each; with `batch_first`
    False an input of three or more dimensions is `(T, N, *positions, in)`.
    A 2-D input is `(N, in)` and a 1-D input one example either way.
    """

    def _rows(self, tensor: torch.Tensor) -> torch.Tensor:
        """`(N, T, features)`: examples first, positions flattened."""
        if tensor.dim() > 2 and not self.batch_first:
            tensor = tensor.transpose(0, 1)
        if tensor.dim() == 1:
            tensor = tensor[None]
        return tensor.reshape(tensor.shape[0], -1, tensor.shape[-1])

    def a_columns(  # noqa: D102
        self,
        layer_input: torch.Tensor,
        dtype: torch.dtype,
    ) -> Iterator[torch.Tensor]:
        rows = self._rows(layer_input)
        if self.kfac_approx == 'reduce':
            yield rows.to(dtype).mean(dim=1).T
        else:
            yield rows.reshape(-1, rows.shape[-1]).to(dtype).T

    def g_columns(  # noqa: D102
        self,
        grad_output: torch.Tensor,
        dtype: torch.dtype,
        scale: float,
    ) -> torch.Tensor:
        rows = self._rows(grad_output).to(dtype)
        if scale != 1.0:
            rows = rows * scale
        if self.kfac_approx == 'reduce':
            return rows.sum(dim=1).T
        return rows.reshape(-1, rows.shape[-1]).T

    def batch_size(self, tensor: torch.Tensor) -> int:  # noqa: D102
        if tensor.dim() > 2 and not self.batch_first:
            return tensor.shape[1]
        return tensor.shape[0] if tensor.dim() > 1 else 1

    def positions(self, tensor: torch.Tensor) -> int:  # noqa: D102
        return tensor.numel() // (self.batch_size(tensor) * tensor.shape[-1])


# Convolutions have a module of their own; the name stays importable here.
from kfac.layers.conv import Conv2dModuleHelper  # noqa: E402
from kfac.layers.conv import ConvModuleHelper  # noqa: E402

__all__ = [
    'PATCH_BLOCK_ELEMENTS',
    'Conv2dModuleHelper',
    'ConvModuleHelper',
    'LinearModuleHelper',
    'ModuleHelper',
    'write_rows',
]
