"""The original KAISA code's tensor helpers, kept for scripts that use them.

K-FAC itself forms its factors through the module helpers
([`ModuleHelper`][kfac.layers.helper.ModuleHelper]) and the functions of
[`kfac.math`][kfac.math]; these three keep the original's signatures and
results:

* [`append_bias_ones`][kfac.layers.utils.append_bias_ones]: a trailing 1
  on the last dimension (any number of dimensions, unlike
  [`kfac.math.append_bias_ones`][kfac.math.append_bias_ones]'s
  `(R, in)` rows);
* [`get_cov`][kfac.layers.utils.get_cov]: `aᵀ b / scale`, symmetrised
  when `b` is None;
* [`reshape_data`][kfac.layers.utils.reshape_data]: concatenate the
  tensors of several calls along the batch dimension.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kfac.math import gram

__all__ = ['append_bias_ones', 'get_cov', 'reshape_data']


def append_bias_ones(tensor: torch.Tensor) -> torch.Tensor:
    """Append a 1 to the last dimension: `(..., n)` to `(..., n + 1)`.

    Examples:
        >>> append_bias_ones(torch.zeros(2, 1)).tolist()
        [[0.0, 1.0], [0.0, 1.0]]
    """
    ones = tensor.new_ones((*tensor.shape[:-1], 1))
    return torch.cat([tensor, ones], dim=-1)


def get_cov(
    a: torch.Tensor,
    b: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """Return `aᵀ b / scale`, or the symmetrised `aᵀ a / scale` if `b` is
    None.

    Args:
        a: `(R, n)` matrix, one vector per row.
        b: `(R, n)` matrix, or None for `a` itself.
        scale: the divisor; `R` (the mean of the outer products) if None.

    Returns:
        `(n, n)` matrix, exactly symmetric when `b` is None.

    Raises:
        ValueError: `a` is not 2-D, or `b` has another shape.

    Examples:
        >>> get_cov(torch.tensor([[1.0, 2.0], [3.0, 4.0]])).tolist()
        [[5.0, 7.0], [7.0, 10.0]]
    """
    if a.dim() != 2:
        raise ValueError(f'a must be 2-D; got shape {tuple(a.shape)}')
    if b is not None and a.shape != b.shape:
        raise ValueError(
            f'b must have the shape of a {tuple(a.shape)}; '
            f'got {tuple(b.shape)}'
        )
    divisor = a.shape[0] if scale is None else scale
    if b is None:
        cov = gram(a, a.dtype) / divisor
        return (cov + cov.T) / 2
    out: torch.Tensor = a.T @ (b / divisor)
    return out


def reshape_data(
    data_list: Sequence[torch.Tensor],
    batch_first: bool = True,
    collapse_dims: bool = False,
) -> torch.Tensor:
    """Concatenate tensors along their batch dimension.

    Args:
        data_list: tensors equal in every dimension but the batch one.
        batch_first: the batch dimension is the first (else the second).
        collapse_dims: flatten every dimension but the last, giving a
            `(rows, n)` matrix, when the result has more than two.

    Returns:
        The concatenated (and maybe flattened) tensor.

    Examples:
        >>> reshape_data([torch.ones(2, 3, 4), torch.ones(1, 3, 4)]).shape
        torch.Size([3, 3, 4])
        >>> reshape_data([torch.ones(2, 3, 4)], collapse_dims=True).shape
        torch.Size([6, 4])
    """
    data = torch.cat(list(data_list), dim=0 if batch_first else 1)
    if collapse_dims and data.dim() > 2:
        data = data.reshape(-1, data.shape[-1])
    return data
