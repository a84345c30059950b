r"""Factors too large to keep whole: block-diagonal factors, one layer per
block.

A dense factor whose side `n` exceeds the module's `max_factor_dim` `L`
(see [`ModuleOptions`][kfac.layers.options.ModuleOptions]) is approximated
by a block-diagonal matrix: its side is split into the fewest near-equal
contiguous ranges of at most `L` indices,
`k = ⌈n / L⌉` ranges of `⌊n / k⌋` or `⌈n / k⌉` indices (the longer ones
first), and only the diagonal blocks are kept. This is how Distributed
Shampoo blocks large parameters, with blocks of equal work.

With `A ≈ blockdiag(A_1, ..., A_q)` (column ranges `c_j` of the gradient
matrix `V`, the bias column included in the last) and
`G ≈ blockdiag(G_1, ..., G_p)` (row ranges `r_i`), the Kronecker product
is block-diagonal too, one block per *tile* `V_{ij} = V[r_i, c_j]`:

`(A ⊗ G + λ I)⁻¹ vec(V)` restricted to tile `(i, j)` is
`(A_j ⊗ G_i + λ I)⁻¹ vec(V_{ij})`,

so each tile is preconditioned as a layer of its own, with the factors
`A_j = A[c_j, c_j]` and `G_i = G[r_i, r_i]` formed from the same hook data
as the whole factors (the rows of those ranges only). EIGEN applies
exactly this. INVERSE, whose factored damping depends on the factors'
traces, uses each tile's own `π = sqrt((tr A_j / |c_j|) / (tr G_i / |r_i|))`
(every tile is a K-FAC block of its own).

Each tile is a separate layer, named `<module>.block<k>` (`k` counting the
tiles row by row, `G` ranges outer), so the KAISA assignment places, and
the engine allreduces, decomposes, broadcasts and saves, every tile like
any other layer: a huge layer gives work to several ranks. The cost: a
tile's `A_j` is formed by each of the `p` tiles of its column (and `G_i`
by the `q` tiles of its row). For a `V = 50257`-row output layer of width
768 (`L = 8192`) that is 7 tiles with `G` blocks of 7180 or 7179 and the
768-wide `A` formed 7 times: 1.3 GiB of float32 factors instead of 9.4 GiB.
When both sides are split the factors of all tiles together take about
`2 · out · in` numbers, the size of two copies of the weight.

A diagonal factor (an embedding's `A`) costs `O(n)` and is never split.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import torch
from torch import nn

from kfac.layers.helper import Grads
from kfac.layers.helper import ModuleHelper
from kfac.layers.tied import TiedHelper
from kfac.validation import validate_int

__all__ = ['BlockHelper', 'block_helpers', 'split']


def split(dim: int, limit: int | None) -> list[slice]:
    """The fewest near-equal contiguous ranges of `range(dim)` of at most
    `limit` indices each (one range when `limit` is None).

    Examples:
        >>> split(10, 4)
        [slice(0, 4, None), slice(4, 7, None), slice(7, 10, None)]
        >>> split(4608, 8192)
        [slice(0, 4608, None)]
    """
    validate_int('dim', dim)
    if limit is None or dim <= limit:
        return [slice(0, dim)]
    count = -(-dim // validate_int('limit', limit))
    size, longer = divmod(dim, count)
    bounds = [0]
    for index in range(count):
        bounds.append(bounds[-1] + size + int(index < longer))
    return [slice(a, b) for a, b in itertools.pairwise(bounds)]


class BlockHelper(ModuleHelper):
    """One tile `V[rows, cols]` of another helper's gradient matrix,
    preconditioned with the diagonal blocks `A[cols, cols]` and
    `G[rows, rows]` of its factors.

    Reads the module, its options and its gradient through `base`; writes
    its tile into the gradient and leaves the rest of it as it is.

    Args:
        base: the helper of the whole module.
        rows: range of `G`'s side (rows of `V`).
        cols: range of `A`'s side (columns of `V`; for a module with a bias
            its last index is the bias column). A diagonal `A` is sliced
            only in a tied weight's tiles (see
            [`kfac.layers.tied`][kfac.layers.tied]).
        index: the tile's position among the module's tiles.
        count: the module's number of tiles.

    Raises:
        ValueError: a range that is empty or leaves the factor.
    """

    def __init__(
        self,
        base: ModuleHelper,
        rows: slice,
        cols: slice,
        *,
        index: int = 0,
        count: int = 1,
    ) -> None:
        for name, span, dim in (
            ('rows', rows, base.g_factor_shape[0]),
            ('cols', cols, base.a_factor_shape[0]),
        ):
            if not 0 <= span.start < span.stop <= dim or span.step:
                raise ValueError(
                    f'{name} must be a non-empty slice of range({dim}); got '
                    f'{span}'
                )
        self.module: nn.Module = base.module
        self.base = base
        """The helper of the whole module."""
        self.rows = rows
        """The tile's rows of `V` (range of `G`)."""
        self.cols = cols
        """The tile's columns of `V` (range of `A`)."""
        self.index = index
        """The tile's position among its module's tiles."""
        self.count = count
        """Number of tiles of the module."""
        self.a_diagonal = base.a_diagonal

    def __repr__(self) -> str:
        return (
            f'BlockHelper({self.base!r}, rows={self.rows}, cols={self.cols})'
        )

    # Options and parameters: the whole module's --------------------------

    @property
    def batch_first(self) -> bool:
        """The module's `batch_first` (set on the whole module's helper)."""
        return self.base.batch_first

    @batch_first.setter
    def batch_first(self, value: bool) -> None:
        self.base.batch_first = value

    @property
    def kfac_approx(self) -> str:
        """The module's `kfac_approx` (set on the whole module's helper)."""
        return self.base.kfac_approx

    @kfac_approx.setter
    def kfac_approx(self, value: str) -> None:
        self.base.kfac_approx = value

    @property
    def weight(self) -> torch.Tensor:  # noqa: D102
        return self.base.weight

    @property
    def bias(self) -> torch.Tensor | None:  # noqa: D102
        return self.base.bias

    # Shapes ------------------------------------------------------------------

    @property
    def _weight_cols(self) -> slice:
        """The tile's columns that are inputs (not the bias column)."""
        stop = min(self.cols.stop, self.base.in_features)
        return slice(self.cols.start, max(stop, self.cols.start))

    def has_bias(self) -> bool:
        """Whether the tile holds the bias column."""
        return self.base.has_bias() and self.cols.stop > self.base.in_features

    @property
    def in_features(self) -> int:
        """The tile's input columns (the bias column not counted)."""
        cols = self._weight_cols
        return int(cols.stop - cols.start)

    @property
    def a_factor_shape(self) -> tuple[int, int]:
        """`(|cols|, |cols|)`."""
        n = self.cols.stop - self.cols.start
        return (n, n)

    @property
    def g_factor_shape(self) -> tuple[int, int]:
        """`(|rows|, |rows|)`."""
        n = self.rows.stop - self.rows.start
        return (n, n)

    # Statistics --------------------------------------------------------------

    def a_statistic(
        self,
        layer_input: torch.Tensor,
        dtype: torch.dtype,
    ) -> tuple[torch.Tensor, int]:
        """`(Σ ã ãᵀ, rows)` restricted to the tile's columns (the
        diagonal's range of a diagonal `A`).
        """
        if self.a_diagonal:
            total, count = self.base.a_statistic(layer_input, dtype)
            return total[self.cols], count
        return super().a_statistic(layer_input, dtype)

    def a_columns(
        self,
        layer_input: torch.Tensor,
        dtype: torch.dtype,
    ) -> Iterator[torch.Tensor]:
        """The base's input columns, rows of the tile's range only."""
        cols = self._weight_cols
        for block in self.base.a_columns(layer_input, dtype):
            yield block[cols]

    def g_columns(
        self,
        grad_output: torch.Tensor,
        dtype: torch.dtype,
        scale: float,
    ) -> torch.Tensor:
        """The base's output-gradient columns, rows of the tile's range."""
        return self.base.g_columns(grad_output, dtype, scale)[self.rows]

    def a_example_rows(
        self,
        layer_input: torch.Tensor,
        dtype: torch.dtype,
    ) -> torch.Tensor:
        """The base's rows, the tile's columns only (tokens outside its
        range of a one-hot input become `-1`, the others count from its
        first column).
        """
        rows = self.base.a_example_rows(layer_input, dtype)
        if not self.a_diagonal:
            return rows[..., self.cols]
        inside = (rows >= self.cols.start) & (rows < self.cols.stop)
        return torch.where(inside, rows - self.cols.start, -1)

    def g_example_rows(
        self,
        grad_output: torch.Tensor,
        dtype: torch.dtype,
        scale: float,
    ) -> torch.Tensor:
        """The base's output-gradient rows, the tile's range only."""
        return self.base.g_example_rows(grad_output, dtype, scale)[
            ..., self.rows
        ]

    def batch_size(self, tensor: torch.Tensor) -> int:  # noqa: D102
        return self.base.batch_size(tensor)

    def positions(self, tensor: torch.Tensor) -> int:  # noqa: D102
        return self.base.positions(tensor)

    # Gradients ---------------------------------------------------------------

    def get_grad(self, grads: Grads | None = None) -> torch.Tensor | None:
        """The tile `V[rows, cols]` (None without a gradient)."""
        grad = self.base.get_grad(grads)
        return None if grad is None else grad[self.rows, self.cols]

    def set_grad(
        self,
        grad: torch.Tensor,
        scale: torch.Tensor | None = None,
        grads: Grads | None = None,
    ) -> None:
        """Write the tile (times `scale`) into the module's gradient; the
        rest of the gradient is read and written back unchanged.
        """
        whole = self.base.get_grad(grads)
        if whole is None:
            whole = grad.new_zeros(self.base.grad_shape)
        else:
            whole = whole.to(grad.dtype, copy=True)
        tile = whole[self.rows, self.cols]
        if scale is None:
            tile.copy_(grad)
        else:
            torch.mul(grad, scale, out=tile)
        self.base.set_grad(whole, grads=grads)


def block_helpers(
    name: str, helper: ModuleHelper, limit: int | None
) -> list[tuple[str, ModuleHelper]]:
    """The layers of `helper` under `max_factor_dim=limit`: itself when no
    dense factor exceeds `limit`, else one
    [`BlockHelper`][kfac.layers.blocks.BlockHelper] per tile, named
    `<name>.block<k>` (`block<k>` for the model itself, `name == ''`).
    """
    rows = split(helper.g_factor_shape[0], limit)
    a_dim = helper.a_factor_shape[0]
    cols = [slice(0, a_dim)] if helper.a_diagonal else split(a_dim, limit)
    count = len(rows) * len(cols)
    if count == 1:
        return [(name, helper)]
    tiles = [(r, c) for r in rows for c in cols]
    prefix = f'{name}.' if name else ''  # the model itself: no leading dot
    return [
        (f'{prefix}block{k}', _tile(helper, r, c, k, count))
        for k, (r, c) in enumerate(tiles)
    ]


def _tile(
    helper: ModuleHelper, rows: slice, cols: slice, index: int, count: int
) -> ModuleHelper:
    """Tile `(rows, cols)` of `helper`; of a tied weight, the tied pair of
    the embedding's tile and the head's transposed one.
    """
    if isinstance(helper, TiedHelper):
        return TiedHelper(
            BlockHelper(
                helper.embedding, rows, cols, index=index, count=count
            ),
            BlockHelper(helper.head, cols, rows, index=index, count=count),
            helper.names,
        )
    return BlockHelper(helper, rows, cols, index=index, count=count)
