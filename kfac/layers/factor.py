"""One Kronecker factor (`A` or `G`) of a layer.

The logic shared by both factors lives here once: capturing hook data,
accumulating a batch as a sum and a count, folding the batch into the
running average, and holding the factor's decomposition.

A factor is dense (`(dim, dim)`) or *diagonal*: kept as the vector of its
diagonal, shape `(dim,)`, and never formed as a matrix (the `A` of an
embedding, whose one-hot inputs make it diagonal; see
[`kfac.layers.embedding`][kfac.layers.embedding]). Every operation here is
elementwise, so both kinds share it; the statistic returns the sum in the
factor's shape.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import torch

from kfac.math import running_average

Statistic = Callable[[torch.Tensor, float], tuple[torch.Tensor, int]]
"""Computes `(sum of outer products, count)` from captured hook data and a
multiplier (for a diagonal factor, the sum of their diagonals)."""


class Captured(NamedTuple):
    """One capture, ready to be added to a factor's batch.

    Either its statistic was computed (`total`) or its data is kept for
    later (`data`).
    """

    total: torch.Tensor | None
    """`Σ x xᵀ` when computed now."""
    rows: int
    """Rows counted (0 for an uncounted capture, or until computed)."""
    data: torch.Tensor | None
    """The hook data when the statistic is computed later."""
    multiplier: float
    """The multiplier of the rows."""
    counted: bool
    """Whether the statistic's count adds to the batch's count."""
    use: int = 0
    """Which use of a weight tied in transposed roles the capture came
    from (see [`kfac.layers.tied`][kfac.layers.tied])."""
    kept: torch.Tensor | None = None
    """The input itself, kept for statistics of each example (see
    [`kfac.layers.examples`][kfac.layers.examples]) whether or not the
    statistic was computed now."""


class KroneckerFactor:
    """Batch accumulator, running average and decomposition of one factor.

    Args:
        name: `'A'` or `'G'`.
        dim: the factor is `(dim, dim)`.
        statistic: turns one captured tensor into `(Σ x xᵀ, count)`
            (`(diag Σ x xᵀ, count)` for a diagonal factor).
        dtype: dtype of the running average.
        diagonal: the factor is diagonal and kept as its diagonal, shape
            `(dim,)`.

    """

    def __init__(
        self,
        name: str,
        dim: int,
        statistic: Statistic,
        dtype: torch.dtype,
        *,
        diagonal: bool = False,
    ) -> None:
        self.name = name
        self.dim = dim
        self.diagonal = diagonal
        """Whether the factor is diagonal, held as the vector of its
        diagonal."""
        self.dtype = dtype
        self._statistic = statistic
        self.value: torch.Tensor | None = None
        """Running average, of shape
        [`shape`][kfac.layers.factor.KroneckerFactor.shape]; None before the
        first update."""
        self.decomposition: tuple[torch.Tensor, ...] | None = None
        """Tensors a gradient worker needs to apply this factor's inverse."""
        self._sum: torch.Tensor | None = None
        self._count = 0
        self._pending: list[Captured] = []
        self._previous: tuple[torch.Tensor | None] | None = None
        self.captures = 0
        """Number of captures since the last reset."""

    @property
    def shape(self) -> tuple[int, ...]:
        """Shape of the running average: `(dim, dim)`, or `(dim,)` when
        diagonal.
        """
        return (self.dim,) if self.diagonal else (self.dim, self.dim)

    def capture(
        self,
        data: torch.Tensor,
        multiplier: float,
        *,
        now: bool,
    ) -> None:
        """Record one micro-batch of hook data (counted).

        Args:
            data: the module input (`A`) or output gradient (`G`).
            multiplier: scale applied to the statistic's rows.
            now: compute the statistic immediately (frees `data`) rather
                than keep `data` until `update`.

        """
        self.add(self.prepare(data, multiplier, now=now))

    def prepare(
        self,
        data: torch.Tensor,
        multiplier: float,
        *,
        now: bool,
        counted: bool = True,
    ) -> Captured:
        """A capture of `data` that `add` folds into the batch later.

        Args:
            data: the module input (`A`) or output gradient (`G`).
            multiplier: scale applied to the statistic's rows.
            now: compute the statistic now (frees `data`).
            counted: the statistic's row count adds to the batch's count;
                otherwise the count comes from `add_examples`.
        """
        if now:
            total, count = self._statistic(data, multiplier)
            return Captured(total, count if counted else 0, None, 1.0, True)
        return Captured(None, 0, data.detach(), multiplier, counted)

    def add(self, captured: Captured) -> None:
        """Fold a prepared capture into the batch."""
        self.captures += 1
        if captured.data is not None:
            self._pending.append(captured)
            return
        assert captured.total is not None  # computed when prepared
        self._add_sum(captured.total, captured.rows)

    def add_examples(self, count: int) -> None:
        """Count `count` more examples (for uncounted captures)."""
        self._count += count

    def _add_sum(self, total: torch.Tensor, count: int) -> None:
        self._sum = total if self._sum is None else self._sum.add_(total)
        self._count += count

    def batch_sum(self) -> torch.Tensor | None:
        """Fold in pending data; the batch's `Σ x xᵀ` (None if empty)."""
        for captured in self._pending:
            assert captured.data is not None  # only deferred ones pend
            total, count = self._statistic(captured.data, captured.multiplier)
            self._add_sum(total, count if captured.counted else 0)
        self._pending.clear()
        return self._sum

    def batch(self) -> torch.Tensor | None:
        """The accumulated batch factor `Σ x xᵀ / count`, or None."""
        total = self.batch_sum()
        return None if total is None else total / self._count

    def update(
        self, decay: float, *, compiled: bool = False
    ) -> torch.Tensor | None:
        """Fold the batch into the running average and reset the batch.

        The update is provisional until `commit` or `rollback`.
        A batch with a non-finite entry is replaced by zeros before it is
        folded in, so no NaN or Inf reaches the running factor or any
        collective; the caller rolls the update back.

        Args:
            decay: `ξ`.
            compiled: do the arithmetic in one kernel compiled with
                `torch.compile` (`fold_batch`; the same up to rounding);
                else in place, with eager kernels.

        Returns:
            None if there was no batch, else a 0-d bool tensor (on the
            factor's device, no host synchronisation): whether the batch
            was finite.
        """
        self.batch_sum()
        total, count = self._sum, self._count
        self.reset_batch()
        if total is None:
            return None
        scale = 1.0 / count if count else 1.0
        self._previous = (self.value,)
        if compiled:
            current = self.value
            if current is None:  # the first update: `scale · total` alone
                current, decay = torch.zeros_like(total), 0.0
            self.value, finite = compiled_fold()(
                current, total, decay, scale, self.dtype
            )
            return finite
        finite = torch.isfinite(total.sum())
        # Zero the non-finite entries, then weight the batch by 0 if it had
        # any: two passes, no host synchronisation.
        total.nan_to_num_(0.0, 0.0, 0.0)
        keep = finite.to(total.dtype)
        value = running_average(self.value, total, decay, scale, keep)
        self.value = value.to(self.dtype)
        return finite

    def commit(self) -> None:
        """Keep the last `update`."""
        self._previous = None

    def rollback(self) -> None:
        """Undo the last `update` (a non-finite batch somewhere)."""
        if self._previous is not None:
            self.value = self._previous[0]
            self._previous = None

    def reset_batch(self) -> None:
        """Drop the batch accumulated so far."""
        self._sum = None
        self._count = 0
        self._pending.clear()
        self.captures = 0

    def move(
        self,
        device: torch.device,
        dtype: torch.dtype,
        decomposition_dtype: torch.dtype,
    ) -> None:
        """Move every tensor held to `device`; the running average (and its
        provisional predecessor) to `dtype`, the decomposition to
        `decomposition_dtype`.
        """
        if self.value is not None:
            self.value = self.value.to(device, dtype)
        if self._previous is not None and self._previous[0] is not None:
            self._previous = (self._previous[0].to(device, dtype),)
        if self._sum is not None:
            self._sum = self._sum.to(device)
        self._pending = [
            c._replace(data=c.data.to(device)) if c.data is not None else c
            for c in self._pending
        ]
        if self.decomposition is not None:
            self.decomposition = tuple(
                t.to(device, decomposition_dtype) for t in self.decomposition
            )
        self.dtype = dtype

    def memory_usage(self) -> dict[str, int]:
        """Bytes held: `factor`, `batch` and `decomposition`."""
        batch = sum(_nbytes(c.data) for c in self._pending)
        batch += _nbytes(self._sum)
        decomposition = sum(_nbytes(t) for t in self.decomposition or ())
        return {
            'factor': _nbytes(self.value),
            'batch': batch,
            'decomposition': decomposition,
        }


def fold_batch(
    current: torch.Tensor,
    total: torch.Tensor,
    decay: float,
    scale: float,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`KroneckerFactor.update`'s arithmetic, out of place: the running
    average `decay · current + (1 - decay) · scale · total` in `dtype`
    (the batch weighted by zero if `total` has a non-finite entry, whose
    entries are zeroed), and whether `total` was finite (0-d bool). What
    `compiled_fold` compiles into one kernel.
    """
    finite = torch.isfinite(total.sum())
    keep = finite.to(total.dtype)
    clean = torch.nan_to_num(total, 0.0, 0.0, 0.0)
    batch = clean * (keep * ((1.0 - decay) * scale))
    return (batch + current.to(total.dtype) * decay).to(dtype), finite


@functools.cache
def compiled_fold() -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """`fold_batch` compiled for every factor size (dynamic shapes: a
    graph per dtype and rank, and per size above and below the point
    where inductor splits the sum), made on first use.
    """
    return torch.compile(fold_batch, dynamic=True)


def _nbytes(tensor: torch.Tensor | None) -> int:
    return 0 if tensor is None else tensor.numel() * tensor.element_size()
