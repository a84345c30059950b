"""The base of the module helpers, and where layers read gradients.

A [`ModuleHelper`][kfac.layers.helper.ModuleHelper] hides what differs
between module types: the shapes of the Kronecker factors, the gradient as
the `(out, in[+1])` matrix `V`, and the rows from which `A` and `G` are
formed (see [`kfac.math`][kfac.math] for the conventions). Gradients are
read and written through a [`Grads`][kfac.layers.helper.Grads]. The
helpers of each module type are in
[`kfac.layers.modules`][kfac.layers.modules] and the modules it names.
"""

from __future__ import annotations

import abc
import math
from collections.abc import Iterator
from typing import cast

import torch
from torch import nn

from kfac.layers.sampling import PositionSampler
from kfac.math import compute_dtype


class Grads:
    """Where layers read and write their parameters' gradients in a step.

    A parameter's gradient is its `.grad`, unless a whole tensor stands in
    for it: a gradient distributor holds the whole (gathered) gradient of a
    parameter sharded by FSDP2 here while its layers precondition, and
    writes the rows back to the shard afterwards. `None` where a `Grads`
    is expected means `.grad` throughout.
    """

    def __init__(self) -> None:
        self._whole: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def __len__(self) -> int:
        return len(self._whole)

    def get(self, param: torch.Tensor) -> torch.Tensor | None:
        """`param`'s gradient: the tensor held for it, else `.grad`."""
        held = self._whole.get(id(param))
        return param.grad if held is None else held[1]

    def hold(self, param: torch.Tensor, whole: torch.Tensor) -> None:
        """Let `whole` stand in for `param`'s gradient."""
        self._whole[id(param)] = (param, whole)

    def items(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """`(parameter, held gradient)` pairs, in the order held."""
        return list(self._whole.values())

    def clear(self) -> None:
        """Hold nothing: every gradient is `.grad` again."""
        self._whole.clear()


def read_grad(param: torch.Tensor, grads: Grads | None) -> torch.Tensor | None:
    """`param`'s gradient as `grads` sees it (`.grad` for None)."""
    return param.grad if grads is None else grads.get(param)


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

    samples_positions: bool = False
    """Whether the helper can form its statistics on a sample of
    positions (`position_sample`; Linear layers and convolutions)."""

    sampler: PositionSampler | None = None
    """Draws the positions `A` and `G` are formed from (see
    [`kfac.layers.sampling`][kfac.layers.sampling]); None: every
    position. Set at registration."""

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
    def device(self) -> torch.device:
        """The device of the module's weight."""
        return self.weight.device

    def has_symmetric_factors(self) -> bool:
        """Always true: `A` and `G` are second moments, so symmetric (the
        original's question to a helper).
        """
        return True

    def get_weight_grad(self) -> torch.Tensor | None:
        """The weight's `.grad`, in the weight's shape (None if unset)."""
        return self.weight.grad

    def get_bias_grad(self) -> torch.Tensor | None:
        """The trained bias's `.grad` (None without one, or if unset)."""
        bias = self.bias
        return None if bias is None else bias.grad

    def get_a_factor(self, a: torch.Tensor) -> torch.Tensor:
        """`A` of one batch from the module's input `a` (as its forward
        hook sees it): `Σ ã ãᵀ` over the rows `a` gives (every position
        of a shared weight, unless `kfac_approx='reduce'`) over their
        number, in float32 at least ([`kfac.math`][kfac.math]; for an
        `a_diagonal` helper, its diagonal).

        The original's name. For a Linear layer it equals the original's
        result; for a convolution the original also divided the patches
        by the number of output positions, which the expand convention
        does not.
        """
        total, rows = self.a_statistic(a, compute_dtype(a.dtype))
        return total / rows

    def get_g_factor(self, g: torch.Tensor) -> torch.Tensor:
        """`G` of one batch from `g`, the gradient of a loss averaged over
        the `N` examples with respect to the module's output (as its
        gradient hook sees it): `(1/N) Σ_n Σ_t ĝ ĝᵀ` over the examples
        `n` and shared positions `t`, with `ĝ = N · g`, in float32 at
        least ([`kfac.math`][kfac.math]).

        The original's name. The original took the mean of `g gᵀ` over
        the rows of `g` as given (and divided a convolution's by the
        number of output positions), which differs from this by a factor
        of `N²` (and more for shared weights).
        """
        total, examples = self.g_statistic(
            g, compute_dtype(g.dtype), 1.0, per_example=True
        )
        return total / examples

    def has_bias(self) -> bool:
        """Whether `A` includes the constant-1 input of a trained bias (a
        method, as in the original).
        """
        return self.bias is not None

    @property
    def a_factor_shape(self) -> tuple[int, int]:
        """Shape of `A`: `(in[+1], in[+1])`."""
        n = self.in_features + int(self.has_bias())
        return (n, n)

    @property
    def g_factor_shape(self) -> tuple[int, int]:
        """Shape of `G`: `(out, out)`."""
        out = self.weight.shape[0]
        return (out, out)

    @property
    def call_settings(self) -> dict[str, object]:
        """What decides the statistics of a call besides the weight's
        shape: the per-module options (and a convolution's geometry).
        Modules sharing a weight are one layer only when these are equal
        (see [`register_model`][kfac.layers.register.register_model]).
        """
        return {
            'batch_first': self.batch_first,
            'kfac_approx': self.kfac_approx,
        }

    @property
    def grad_shape(self) -> tuple[int, int]:
        """Shape of the gradient matrix `V`: `(out, in[+1])`."""
        return (self.g_factor_shape[0], self.a_factor_shape[0])

    @property
    def in_features(self) -> int:
        """Number of inputs each output sees (`in`)."""
        return math.prod(self.weight.shape[1:])

    def get_grad(self, grads: Grads | None = None) -> torch.Tensor | None:
        """Return `V = [∇W, ∇b]` of shape `(out, in[+1])`, read through
        `grads` (default: the parameters' `.grad`).

        None when the weight has no gradient in this step.
        """
        wgrad = read_grad(self.weight, grads)
        if wgrad is None:
            return None
        v = wgrad.reshape(wgrad.shape[0], -1)
        bias = self.bias
        if bias is not None:
            bgrad = read_grad(bias, grads)
            if bgrad is None:
                bgrad = torch.zeros_like(bias)
            v = torch.cat([v, bgrad.reshape(-1, 1)], dim=1)
        return v

    def set_grad(
        self,
        grad: torch.Tensor,
        scale: torch.Tensor | None = None,
        grads: Grads | None = None,
    ) -> None:
        """Write `V` (times `scale`) into the parameters' gradients
        (through `grads`; default: `.grad`).

        `V` has shape `(out, in[+1])`; with a bias, its last column is the
        bias gradient.

        An existing contiguous `.grad` is written in one pass (the scaled
        product goes straight into it); otherwise a new `.grad` is made.

        Args:
            grad: `V`.
            scale: optional 0-d multiplier (the KL clip).
            grads: where the gradients are written.
        """
        bias = self.bias
        if bias is None:
            _write(self.weight, grad, scale, grads)
        else:
            _write(self.weight, grad[:, :-1], scale, grads)
            _write(bias, grad[:, -1], scale, grads)

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
        dim = n + int(self.has_bias())
        out = torch.zeros((dim, dim), dtype=dtype, device=layer_input.device)
        gram_block = out[:n, :n]
        count = 0
        for cols in self.a_columns(layer_input.detach(), dtype):
            gram_block.addmm_(cols, cols.T)
            if self.has_bias():
                out[:n, n] += cols.sum(dim=1)
            count += cols.shape[1]
        if self.has_bias():
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
    def a_example_rows(
        self,
        layer_input: torch.Tensor,
        dtype: torch.dtype,
    ) -> torch.Tensor:
        """The inputs `ã` of each example and position, `(N, T, in[+1])`
        in `dtype` (the bias column included), whatever `kfac_approx`; for
        one-hot inputs (a diagonal `A`), the tokens instead, `(N, T)`
        integers, `-1` for a token outside the columns of `V`.
        """

    @abc.abstractmethod
    def g_example_rows(
        self,
        grad_output: torch.Tensor,
        dtype: torch.dtype,
        scale: float,
    ) -> torch.Tensor:
        """The scaled output gradients `g` of each example and position,
        `(N, T, out)` in `dtype`, in the order of
        [`a_example_rows`][kfac.layers.helper.ModuleHelper.a_example_rows].
        """

    def with_bias_column(self, rows: torch.Tensor) -> torch.Tensor:
        """`rows` `(..., in)` with a last column of ones when `A` has the
        bias entry (`(..., in + 1)`), else `rows`.
        """
        if not self.has_bias():
            return rows
        ones = rows.new_ones((*rows.shape[:-1], 1))
        return torch.cat([rows, ones], dim=-1)

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
    grads: Grads | None,
) -> None:
    """`param.grad = scale · value` (reshaped), reusing `param.grad`."""
    target = read_grad(param, grads)
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
    grads: Grads | None,
) -> None:
    """`param.grad[rows] = scale · value` (a `.grad` of zeros if none)."""
    whole = read_grad(param, grads)
    if whole is None:
        whole = param.grad = torch.zeros_like(param)
    target = whole[rows]
    if scale is None:
        target.copy_(value)
    else:
        torch.mul(value, scale, out=target)


__all__ = [
    'Grads',
    'ModuleHelper',
    'read_grad',
    'write_rows',
]
