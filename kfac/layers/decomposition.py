"""Decomposition attempts: their results and the retry policy.

A factor is decomposed first in the layer's decomposition dtype; when that
raises `torch.linalg.LinAlgError` or gives a non-finite result, it is
retried in float64, then in float64 with a small diagonal jitter.
"""

from __future__ import annotations

import abc
from collections import Counter
from collections.abc import Sequence
from typing import NamedTuple

import torch

from kfac.layers.statistics import LayerStatistics

LinAlgError: type[Exception] = torch.linalg.LinAlgError  # type: ignore[attr-defined]  # public, but not re-exported in the stubs
"""`torch.linalg.LinAlgError`, raised by a failed decomposition."""

JITTER = 1e-6
"""Relative diagonal jitter of the last decomposition attempt."""

Layout = tuple[tuple[tuple[int, ...], bool], ...]
"""Shapes of a decomposition's tensors, each with whether it is symmetric
(and so may travel as a packed triangle)."""


class Decomposed(NamedTuple):
    """What a decomposition routine returns."""

    tensors: tuple[torch.Tensor, ...]
    """The decomposition's tensors."""
    ok: torch.Tensor | None
    """A 0-d bool tensor when the routine reports success itself, else
    None (finiteness is checked by the caller)."""


class Attempt(NamedTuple):
    """One decomposition attempt that did not raise."""

    tensors: tuple[torch.Tensor, ...]
    """The decomposition's tensors."""
    valid: torch.Tensor
    """0-d bool tensor on the device (no host synchronisation): whether
    the tensors are finite and the routine reported success."""


def all_finite(tensors: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """0-d bool tensor: whether every entry of every tensor is finite."""
    flags = [torch.isfinite(t).all() for t in tensors]
    return torch.stack(flags).all()


def attempt_plan(dtype: torch.dtype) -> list[tuple[torch.dtype, float]]:
    """`(dtype, relative jitter)` of each attempt, in order.

    Examples:
        >>> attempt_plan(torch.float32)
        [(torch.float32, 0.0), (torch.float64, 0.0), (torch.float64, 1e-06)]
        >>> attempt_plan(torch.float64)
        [(torch.float64, 0.0), (torch.float64, 1e-06)]
    """
    attempts = [(dtype, 0.0)]
    if dtype != torch.float64:
        attempts.append((torch.float64, 0.0))
    attempts.append((torch.float64, JITTER))
    return attempts


def prepare(
    value: torch.Tensor, dtype: torch.dtype, jitter: float
) -> torch.Tensor:
    """`value` in `dtype`, plus `jitter · (|tr F| / n + 1e-30) · I`.

    A diagonal factor (`value` of shape `(n,)`, its diagonal) gets the
    same jitter added to every entry.
    """
    matrix = value.to(dtype)
    if not jitter:
        return matrix
    diagonal = matrix if matrix.dim() == 1 else torch.diagonal(matrix)
    scale = float(diagonal.mean().abs()) + 1e-30
    if matrix.dim() == 1:
        return matrix + jitter * scale
    eye = torch.eye(matrix.shape[0], dtype=dtype, device=matrix.device)
    return matrix + jitter * scale * eye


class DecompositionAttempts(LayerStatistics, abc.ABC):
    """Decomposing a layer's factors with retries (the base of
    [`KFACBaseLayer`][kfac.layers.base.KFACBaseLayer], above its
    statistics).

    A subclass supplies `_decompose` (one attempt's routine) and may
    override `_finalize` (what is stored from a valid attempt).
    """

    counters: Counter[str]
    factor_masks: dict[str, torch.Tensor]
    """Per factor name, a boolean mask applied to the matrix before it
    is decomposed (FSDP2 local mode: keep the blocks of rows one rank
    owns)."""

    @abc.abstractmethod
    def _decompose(
        self,
        name: str,
        matrix: torch.Tensor,
        dtype: torch.dtype,
        damping: float,
    ) -> Decomposed:
        """Decompose `matrix` (factor `name`) computing in `dtype`.

        Raises:
            torch.linalg.LinAlgError: the decomposition failed.
        """

    def compute_decomposition(self, name: str, damping: float) -> bool:
        """Decompose factor `name`; store it in the factor.

        Only the factor's inverse worker calls this. A decomposition that
        raises `torch.linalg.LinAlgError` or returns a non-finite value is
        retried in float64, then in float64 with a small jitter
        (see [`prepare`][kfac.layers.decomposition.prepare]); if all fail,
        the last good decomposition is kept (none: the layer's gradient
        goes unpreconditioned) and the failure is counted.

        This is
        [`try_decomposition`][kfac.layers.decomposition.DecompositionAttempts.try_decomposition]
        followed by
        [`finish_decomposition`][kfac.layers.decomposition.DecompositionAttempts.finish_decomposition];
        the preconditioner calls those two itself so that one host
        synchronisation checks all the factors it decomposes.

        Returns:
            Whether a new decomposition was stored.
        """
        first = self.try_decomposition(name, damping)
        valid = first is not None and bool(first.valid)
        return self.finish_decomposition(name, damping, first, valid)

    def decomposition_input(self, name: str) -> torch.Tensor | None:
        """The matrix decomposed for factor `name`: its running average
        (a tied layer combines those of its uses), None before the first
        update.
        """
        return self.factor(name).value

    def _attempts(self) -> list[tuple[torch.dtype, float]]:
        """`(dtype, relative jitter)` of each attempt, in order."""
        return attempt_plan(self.decomposition_dtype)

    def try_decomposition(
        self,
        name: str,
        damping: float,
        attempt: int = 0,
    ) -> Attempt | None:
        """Run one attempt of decomposing factor `name`; store nothing.

        The first attempt (`attempt=0`) needs no host synchronisation
        beyond what the decomposition routine itself does.

        Returns:
            The attempt, or None when the routine raised `LinAlgError`.
        """
        value = self.decomposition_input(name)
        if value is None:
            raise RuntimeError(f'factor {name} of {self} has no value yet')
        mask = self.factor_masks.get(name)
        if mask is not None:
            value = value * mask.to(value.device)
        dtype, jitter = self._attempts()[attempt]
        matrix = prepare(value, dtype, jitter)
        try:
            tensors, ok = self._decompose(name, matrix, dtype, damping)
        except LinAlgError:
            return None
        valid = all_finite(tensors)
        return Attempt(tensors, valid if ok is None else valid & ok)

    def finish_decomposition(
        self,
        name: str,
        damping: float,
        first: Attempt | None,
        valid: bool,
    ) -> bool:
        """Store the first attempt if `valid`, else retry (see
        [`compute_decomposition`][kfac.layers.decomposition.DecompositionAttempts.compute_decomposition]).

        Args:
            name: `'A'` or `'G'`.
            damping: the damping in force.
            first: what `try_decomposition` returned for attempt 0.
            valid: `first.valid`, read on the host.

        Returns:
            Whether a new decomposition was stored.
        """
        if valid and first is not None and self._store(name, first, damping):
            return True
        for attempt in range(1, len(self._attempts())):
            result = self.try_decomposition(name, damping, attempt)
            if (
                result is not None
                and bool(result.valid)
                and self._store(name, result, damping)
            ):
                self.counters['decomposition_retries'] += attempt
                return True
        self.counters['decomposition_failures'] += 1
        return False

    def _store(self, name: str, result: Attempt, damping: float) -> bool:
        """Keep a valid attempt; False if it cannot be completed."""
        final = self._finalize(name, result.tensors, damping)
        if final is None:
            return False
        self.factor(name).decomposition = tuple(
            t.to(self.inv_dtype) for t in final
        )
        return True

    def _finalize(
        self,
        name: str,
        tensors: tuple[torch.Tensor, ...],
        damping: float,
    ) -> tuple[torch.Tensor, ...] | None:
        """Turn a valid attempt into the stored decomposition (None: it
        depends on another factor's decomposition, which failed).
        """
        return tensors


def decompose_all(
    jobs: Sequence[tuple[DecompositionAttempts, str]], damping: float
) -> list[int]:
    """Decompose factor `name` of each `(layer, name)` in `jobs`.

    All first attempts run, then one host synchronisation reads their
    validity flags; only the failed ones are retried (see
    [`compute_decomposition`][kfac.layers.decomposition.DecompositionAttempts.compute_decomposition]).

    Returns:
        The indices of the jobs whose every attempt failed.
    """
    first = [layer.try_decomposition(name, damping) for layer, name in jobs]
    flags = [result.valid for result in first if result is not None]
    valid = iter(torch.stack(flags).tolist() if flags else [])
    failed = []
    for index, ((layer, name), result) in enumerate(zip(jobs, first)):
        ok = result is not None and next(valid)
        if not layer.finish_decomposition(name, damping, result, ok):
            failed.append(index)
    return failed
