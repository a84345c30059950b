"""One Kronecker factor (`A` or `G`) of a layer.

The logic shared by both factors lives here once: capturing hook data,
accumulating a batch as a sum and a count, folding the batch into the
running average, and holding the factor's decomposition.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kfac.math import running_average

Statistic = Callable[[torch.Tensor, float], tuple[torch.Tensor, int]]
"""Computes `(sum of outer products, count)` from captured hook data and a
multiplier."""


class KroneckerFactor:
    """Batch accumulator, running average and decomposition of one factor.

    Args:
        name: `'A'` or `'G'`.
        dim: the factor is `(dim, dim)`.
        statistic: turns one captured tensor into `(Σ x xᵀ, count)`.
        dtype: dtype of the running average.

    """

    def __init__(
        self,
        name: str,
        dim: int,
        statistic: Statistic,
        dtype: torch.dtype,
    ) -> None:
        self.name = name
        self.dim = dim
        self.dtype = dtype
        self._statistic = statistic
        self.value: torch.Tensor | None = None
        """Running average, `(dim, dim)`; None before the first update."""
        self.decomposition: tuple[torch.Tensor, ...] | None = None
        """Tensors a gradient worker needs to apply this factor's inverse."""
        self._sum: torch.Tensor | None = None
        self._count = 0
        self._pending: list[tuple[torch.Tensor, float]] = []
        self._previous: tuple[torch.Tensor | None] | None = None
        self.captures = 0
        """Number of captures since the last reset."""

    def capture(
        self,
        data: torch.Tensor,
        multiplier: float,
        *,
        now: bool,
    ) -> None:
        """Record one micro-batch of hook data.

        Args:
            data: the module input (`A`) or output gradient (`G`).
            multiplier: scale applied to the statistic's rows.
            now: compute the statistic immediately (frees `data`) rather
                than keep `data` until `update`.

        """
        self.captures += 1
        if now:
            self._accumulate(data, multiplier)
        else:
            self._pending.append((data.detach(), multiplier))

    def _accumulate(self, data: torch.Tensor, multiplier: float) -> None:
        total, count = self._statistic(data, multiplier)
        self._sum = total if self._sum is None else self._sum.add_(total)
        self._count += count

    def batch_sum(self) -> torch.Tensor | None:
        """Fold in pending data; the batch's `Σ x xᵀ` (None if empty)."""
        for data, multiplier in self._pending:
            self._accumulate(data, multiplier)
        self._pending.clear()
        return self._sum

    def batch(self) -> torch.Tensor | None:
        """The accumulated batch factor `Σ x xᵀ / count`, or None."""
        total = self.batch_sum()
        return None if total is None else total / self._count

    def update(self, decay: float) -> torch.Tensor | None:
        """Fold the batch into the running average and reset the batch.

        The update is provisional until `commit` or `rollback`.
        A batch with a non-finite entry is replaced by zeros before it is
        folded in, so no NaN or Inf reaches the running factor or any
        collective; the caller rolls the update back.

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
        finite = torch.isfinite(total.sum())
        # Zero the non-finite entries, then weight the batch by 0 if it had
        # any: two passes, no host synchronisation.
        total.nan_to_num_(0.0, 0.0, 0.0)
        keep = finite.to(total.dtype)
        self._previous = (self.value,)
        value = running_average(self.value, total, decay, 1.0 / count, keep)
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

    def memory_usage(self) -> dict[str, int]:
        """Bytes held: `factor`, `batch` and `decomposition`."""
        batch = sum(_nbytes(t) for t, _ in self._pending) + _nbytes(self._sum)
        decomposition = sum(_nbytes(t) for t in self.decomposition or ())
        return {
            'factor': _nbytes(self.value),
            'batch': batch,
            'decomposition': decomposition,
        }


def _nbytes(tensor: torch.Tensor | None) -> int:
    return 0 if tensor is None else tensor.numel() * tensor.element_size()
