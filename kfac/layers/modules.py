"""Uniform access to the torch modules K-FAC preconditions.

A module helper hides what differs between module types: the shapes of
the Kronecker factors, the gradient as the `(out, in[+1])` matrix `V`, and
the rows from which `A` and `G` are formed (see [`kfac.math`][kfac.math]
for the conventions). Their base,
[`ModuleHelper`][kfac.layers.helper.ModuleHelper], and the gradient view
[`Grads`][kfac.layers.helper.Grads] are defined in
[`kfac.layers.helper`][kfac.layers.helper];
[`LinearModuleHelper`][kfac.layers.modules.LinearModuleHelper] here, the
convolution helper in [`kfac.layers.conv`][kfac.layers.conv] and the
others beside their modules (embedding, attention, tied and tiled
weights). This module also exports the helpers the original KAISA code
exposed here (`ModuleHelper`, `LinearModuleHelper`, `Conv2dModuleHelper`).
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch

from kfac.layers.conv import Conv2dModuleHelper
from kfac.layers.conv import ConvModuleHelper
from kfac.layers.helper import Grads
from kfac.layers.helper import ModuleHelper
from kfac.layers.sampling import select_positions

__all__ = [
    'Conv2dModuleHelper',
    'ConvModuleHelper',
    'Grads',
    'LinearModuleHelper',
    'ModuleHelper',
]


class LinearModuleHelper(ModuleHelper):
    """Helper for `torch.nn.Linear` on inputs of any rank.

    An input of shape `(N, *positions, in)` has `N` examples and
    `prod(positions)` weight-sharing positions each; with `batch_first`
    False an input of three or more dimensions is `(T, N, *positions, in)`.
    A 2-D input is `(N, in)` and a 1-D input one example either way.
    """

    samples_positions = True

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
            rows, _ = self._sampled(rows)
            yield rows.reshape(-1, rows.shape[-1]).to(dtype).T

    def g_columns(  # noqa: D102
        self,
        grad_output: torch.Tensor,
        dtype: torch.dtype,
        scale: float,
    ) -> torch.Tensor:
        rows = self._rows(grad_output).to(dtype)
        if self.kfac_approx == 'expand':
            rows, weight = self._sampled(rows)
            scale *= math.sqrt(weight)  # T/k in G; 1.0 with every position
        if scale != 1.0:
            rows = rows * scale
        if self.kfac_approx == 'reduce':
            return rows.sum(dim=1).T
        return rows.reshape(-1, rows.shape[-1]).T

    def _sampled(self, rows: torch.Tensor) -> tuple[torch.Tensor, float]:
        """The drawn positions of `(N, T, features)` rows, and `T/k`."""
        return select_positions(
            self.sampler, rows, examples=0, dim=1, batch=rows.shape[0]
        )

    def a_example_rows(  # noqa: D102
        self,
        layer_input: torch.Tensor,
        dtype: torch.dtype,
    ) -> torch.Tensor:
        return self.with_bias_column(
            self._rows(layer_input.detach()).to(dtype)
        )

    def g_example_rows(  # noqa: D102
        self,
        grad_output: torch.Tensor,
        dtype: torch.dtype,
        scale: float,
    ) -> torch.Tensor:
        rows = self._rows(grad_output.detach()).to(dtype)
        return rows * scale if scale != 1.0 else rows

    def batch_size(self, tensor: torch.Tensor) -> int:  # noqa: D102
        if tensor.dim() > 2 and not self.batch_first:
            return tensor.shape[1]
        return tensor.shape[0] if tensor.dim() > 1 else 1

    def positions(self, tensor: torch.Tensor) -> int:  # noqa: D102
        return tensor.numel() // (self.batch_size(tensor) * tensor.shape[-1])
