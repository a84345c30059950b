"""The statistics side of a layer: its two Kronecker factors.

[`LayerStatistics`][kfac.layers.statistics.LayerStatistics] (held by a
[`KFACBaseLayer`][kfac.layers.base.KFACBaseLayer] beside its helper and
its curvature) captures hook data into the factors `A` and `G`, folds
batches into their running averages, and follows the module when it moves
to another device or dtype. A weight tied in two roles has statistics of
its own kind ([`TiedStatistics`][kfac.layers.tied.TiedStatistics]).

Calls and examples: `A` counts its rows (examples times weight-sharing
positions, over every call of the module); `G` counts examples once per
backward pass (`add_examples`), because the calls of a module in one
pass are further positions of the same examples (see the conventions in
[`kfac.math`][kfac.math]).

Each factor is a [`KroneckerFactor`][kfac.layers.statistics.KroneckerFactor]:
the logic shared by `A` and `G` lives there once (capturing hook data,
accumulating a batch as a sum and a count, folding the batch into the
running average, holding the factor's decomposition). A factor is dense
(`(dim, dim)`) or *diagonal*: kept as the vector of its diagonal, shape
`(dim,)`, and never formed as a matrix (the `A` of an embedding, whose
one-hot inputs make it diagonal; see
[`kfac.layers.embedding`][kfac.layers.embedding]). Every operation on a
factor is elementwise, so both kinds share it; the statistic returns the
sum in the factor's shape.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import torch

from kfac.enums import LossAverage
from kfac.layers.examples import Call
from kfac.layers.examples import ExampleRows
from kfac.layers.helper import ModuleHelper
from kfac.math import compute_dtype
from kfac.math import running_average
from kfac.validation import check_dtype
from kfac.validation import check_instance

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
        [`shape`][kfac.layers.statistics.KroneckerFactor.shape]; None before
        the first update."""
        self.decomposition: tuple[torch.Tensor, ...] | None = None
        """Tensors a gradient worker needs to apply this factor's inverse."""
        self._sum: torch.Tensor | None = None
        self._count = 0
        self._weight = 1.0
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

    def weigh(self, weight: float) -> None:
        """Multiply the batch accumulated so far by `weight` (rows captured
        with a multiplier `√weight` too large or small).
        """
        self._weight *= weight

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
        return None if total is None else total * (self._weight / self._count)

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
        total, count, weight = self._sum, self._count, self._weight
        self.reset_batch()
        if total is None:
            return None
        scale = weight / count if count else weight
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
        self._weight = 1.0
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


def check_loss_average(loss_average: object) -> LossAverage | None:
    """`loss_average` as a [`LossAverage`][kfac.enums.LossAverage], or
    None (a summed loss).

    Raises:
        TypeError: neither a string, a `LossAverage` nor None.
        ValueError: a string naming no `LossAverage`.
    """
    if loss_average is None:
        return None
    allowed = ', '.join(repr(m.value) for m in LossAverage)
    if not isinstance(loss_average, str):
        raise TypeError(
            f'loss_average must be None (a summed loss) or one of {allowed}; '
            f'got {loss_average!r} of type {type(loss_average).__name__}',
        )
    try:
        return LossAverage(loss_average)
    except ValueError:
        raise ValueError(
            f'loss_average must be None (a summed loss) or one of {allowed} '
            f'(case-insensitive); got {loss_average!r}',
        ) from None


class LayerStatistics:
    """The factors `A` and `G` of one module and how they are fed.

    Args:
        module: helper of the module.
        factor_dtype: dtype of the running factors; default: the wider of
            the parameter dtype and float32. Batch statistics are always
            accumulated in at least float32.
        inv_dtype: dtype in which decompositions are stored and gradients
            preconditioned; default: the wider of the parameter dtype and
            float32. Decompositions are computed in the wider of this and
            float32.
        loss_average: how the loss averages its terms: `None` (summed),
            `'batch'` (over the `N` examples) or `'batch+sequence'` (over
            the `N T` examples and positions); see [`kfac.math`][kfac.math].
    """

    def __init__(
        self,
        module: ModuleHelper,
        *,
        factor_dtype: torch.dtype | None = None,
        inv_dtype: torch.dtype | None = None,
        loss_average: str | None = 'batch',
    ) -> None:
        check_instance(
            'module',
            module,
            ModuleHelper,
            'a kfac.layers.modules.ModuleHelper',
        )
        check_dtype('factor_dtype', factor_dtype)
        check_dtype('inv_dtype', inv_dtype)
        self.loss_average = check_loss_average(loss_average)
        self.module = module
        self._dtype_options = (factor_dtype, inv_dtype)
        self._set_dtypes(module.weight.dtype)
        self._placed = (module.weight.device, module.weight.dtype)
        self.a = KroneckerFactor(
            'A',
            module.a_factor_shape[0],
            lambda x, _: module.a_statistic(x, self.stat_dtype),
            self.factor_dtype,
            diagonal=module.a_diagonal,
        )
        self.g = KroneckerFactor(
            'G',
            module.g_factor_shape[0],
            lambda x, m: module.g_statistic(
                x, self.stat_dtype, m, per_example=False
            ),
            self.factor_dtype,
        )
        self.examples: ExampleRows | None = None
        """The calls of the current factor update, kept whole when a
        statistic needs each example (EKFAC's scaling; see
        [`keep_examples`][kfac.layers.statistics.LayerStatistics.keep_examples]);
        None otherwise."""

    def keep_examples(self) -> None:
        """Keep each call's input and output gradient from now on (a
        curvature that needs statistics of each example).
        """
        self.examples = ExampleRows()

    def example_rows(
        self, call: Call, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The output-gradient and input rows of one kept call, oriented as
        `V` (see [`ModuleHelper`][kfac.layers.helper.ModuleHelper]):
        `(g rows (N, T, out), a rows (N, T, in) or tokens (N, T))`.
        """
        return (
            self.module.g_example_rows(call.grad_output, dtype, call.scale),
            self.module.a_example_rows(call.layer_input, dtype),
        )

    @property
    def device(self) -> torch.device:
        """Device of the module's weight."""
        return self.module.weight.device

    def _set_dtypes(self, param_dtype: torch.dtype) -> None:
        factor_dtype, inv_dtype = self._dtype_options
        self.stat_dtype = compute_dtype(
            param_dtype, factor_dtype or param_dtype
        )
        self.factor_dtype = factor_dtype or compute_dtype(param_dtype)
        self.inv_dtype = inv_dtype or compute_dtype(param_dtype)
        self.decomposition_dtype = compute_dtype(self.inv_dtype)

    def follow_module(self) -> bool:
        """Follow the module to a new device or dtype (`model.to(...)`).

        Factors, statistics and decompositions move to the weight's device;
        dtypes left to their defaults (`factor_dtype=None`,
        `inv_dtype=None`) follow the weight's dtype. Cheap when nothing
        changed.

        Returns:
            Whether the module had moved.
        """
        weight = self.module.weight
        if (weight.device, weight.dtype) == self._placed:
            return False
        self._placed = (weight.device, weight.dtype)
        self._set_dtypes(weight.dtype)
        for factor in self.factors:
            factor.move(weight.device, self.factor_dtype, self.inv_dtype)
        if self.examples is not None:
            self.examples.move(weight.device)
        return True

    # Factors ---------------------------------------------------------------

    @property
    def factors(self) -> tuple[KroneckerFactor, ...]:
        """The running factors this layer keeps, allreduces and saves:
        `(A, G)`, except for a weight tied in two roles, which keeps one
        pair per use (see [`kfac.layers.tied`][kfac.layers.tied]). The
        decompositions always belong to `factor('A')` and `factor('G')`.
        """
        return (self.a, self.g)

    def factor(self, name: str) -> KroneckerFactor:
        """The factor called `name` (`'A'` or `'G'`)."""
        if name == 'A':
            return self.a
        if name == 'G':
            return self.g
        raise ValueError(f'factor name must be "A" or "G"; got {name!r}')

    def save_layer_input(
        self, layer_input: torch.Tensor, *, now: bool
    ) -> None:
        """Capture the module input of one micro-batch (forward hook)."""
        self.a.capture(layer_input, 1.0, now=now)

    def save_layer_grad_output(
        self,
        grad_output: torch.Tensor,
        *,
        loss_scale: float = 1.0,
        accumulation_steps: int = 1,
        now: bool,
    ) -> None:
        """Capture the output gradient of one micro-batch (backward hook).

        Args:
            grad_output: gradient of the (scaled) loss w.r.t. the output.
            loss_scale: the mixed-precision loss scale to divide out.
            accumulation_steps: micro-batches in the step; an averaged
                loss is assumed divided by it in each micro-batch, so the
                output gradient is multiplied back.
            now: compute the statistic now instead of keeping the tensor.

        """
        multiplier, count = self.g_scaling(grad_output, accumulation_steps)
        self.g.add(
            self.g.prepare(
                grad_output, multiplier / loss_scale, now=now, counted=False
            )
        )
        self.g.add_examples(count)

    def g_scaling(
        self, grad_output: torch.Tensor, accumulation_steps: int
    ) -> tuple[float, int]:
        """The multiplier turning an output gradient into `g`, and the
        number of terms `G` averages over.

        With `loss_average='batch'` the loss is a mean over `N` examples,
        so `g = N ∂L/∂s` and `G` averages over `N`; with
        `'batch+sequence'` over `N T` terms (`T` the layer's positions);
        summed (`None`), `g = ∂L/∂s` and `G` is a sum. A loss averaged
        over the micro-batches of a step is multiplied back by their number.
        """
        if self.loss_average is None:
            return 1.0, 0
        terms = self.module.batch_size(grad_output)
        if self.loss_average == 'batch+sequence':
            terms *= self.module.positions(grad_output)
        return float(terms * accumulation_steps), terms

    def prepare_input(
        self, layer_input: torch.Tensor, *, now: bool
    ) -> Captured:
        """Capture the input of one call, to be added with its output
        gradient by
        [`add_call`][kfac.layers.statistics.LayerStatistics.add_call].
        """
        return self.keep_input(
            self.a.prepare(layer_input, 1.0, now=now), layer_input
        )

    def keep_input(
        self, captured: Captured, layer_input: torch.Tensor
    ) -> Captured:
        """`captured`, holding `layer_input` too when the layer keeps
        [`examples`][kfac.layers.statistics.LayerStatistics.examples].
        """
        if self.examples is None:
            return captured
        return captured._replace(kept=layer_input.detach())

    def keep_call(
        self, captured: Captured, grad_output: torch.Tensor, scale: float
    ) -> None:
        """Keep one call for the
        [`examples`][kfac.layers.statistics.LayerStatistics.examples] (if
        kept), `scale` turning `grad_output` into `g`.
        """
        if self.examples is not None and captured.kept is not None:
            self.examples.add(
                Call(captured.use, captured.kept, grad_output.detach(), scale)
            )

    def add_call(
        self,
        layer_input: Captured,
        grad_output: torch.Tensor,
        *,
        loss_scale: float,
        accumulation_steps: int,
        now: bool,
    ) -> int:
        """Add one call's input and output gradient to the batch.

        The `A` rows are counted; `G`'s examples are counted once per
        backward pass by
        [`add_examples`][kfac.layers.statistics.LayerStatistics.add_examples],
        since several calls in one pass are positions of the same examples.

        Returns:
            The number of terms `G` averages over for this call (`N`,
                `N T` with `'batch+sequence'`, 0 for a summed loss).
        """
        self.a.add(layer_input)
        multiplier, count = self.g_scaling(grad_output, accumulation_steps)
        self.g.add(
            self.g.prepare(
                grad_output, multiplier / loss_scale, now=now, counted=False
            )
        )
        self.keep_call(layer_input, grad_output, multiplier / loss_scale)
        return count

    def scale_output_gradients(self, ratio: float) -> None:
        """Take the output gradients captured since the last factor update
        as `ratio` times what they were (`G`'s batch by `ratio²`, the kept
        examples' `g` by `ratio`): a short step whose losses were divided
        by another number than `accumulation_steps`.
        """
        for factor in self.factors:
            if factor.name == 'G':
                factor.weigh(ratio * ratio)
        if self.examples is not None:
            self.examples.scale(ratio)

    def add_examples(self, count: int) -> None:
        """Count the `count` examples of one backward pass (see `add_call`)."""
        self.g.add_examples(count)
        if self.examples is not None:
            self.examples.end_pass(count)

    @property
    def captures(self) -> tuple[int, int]:
        """Captures of `A` and of `G` since the last factor update."""
        return (self.a.captures, self.g.captures)

    def update_factors(
        self, decay: float, *, compiled: bool = False
    ) -> torch.Tensor | None:
        """Fold the captured batch into both running averages, provisionally
        (`compiled`: with compiled arithmetic; see
        [`KroneckerFactor.update`][kfac.layers.statistics.KroneckerFactor.update]).

        Returns:
            None if the module did not run (nothing changes), else a 0-d
                bool tensor: whether both batch statistics were finite. The
                caller then calls
                [`commit_factors`][kfac.layers.statistics.LayerStatistics.commit_factors]
                or
                [`rollback_factors`][kfac.layers.statistics.LayerStatistics.rollback_factors].
        """
        if self.examples is not None:
            self.examples.seal()
        if not (self.a.captures and self.g.captures):
            self.reset_batch()
            return None
        finite_a = self.a.update(decay, compiled=compiled)
        finite_g = self.g.update(decay, compiled=compiled)
        assert finite_a is not None and finite_g is not None  # both captured
        return torch.logical_and(finite_a, finite_g)

    def commit_factors(self) -> None:
        """Keep the last `update_factors`."""
        for factor in self.factors:
            factor.commit()

    def rollback_factors(self) -> None:
        """Undo the last `update_factors` (and drop the calls it sealed)."""
        for factor in self.factors:
            factor.rollback()
        if self.examples is not None:
            self.examples.drop_sealed()

    def reset_batch(self) -> None:
        """Drop captured data of both factors (and the calls kept since
        the last factor update).
        """
        for factor in self.factors:
            factor.reset_batch()
        if self.examples is not None:
            self.examples.discard()

    @property
    def has_factors(self) -> bool:
        """Whether both running factors exist."""
        return self.a.value is not None and self.g.value is not None

    def decomposition_input(self, name: str) -> torch.Tensor | None:
        """The matrix decomposed for factor `name`: its running average,
        None before the first update.
        """
        return self.factor(name).value

    def memory_usage(self) -> dict[str, int]:
        """Bytes held by the factors: `a_factors`, `g_factors`, `a_batch`,
        `g_batch`, `a_inverses` and `g_inverses`.
        """
        usage: dict[str, int] = {}
        for factor in self.factors:
            key = factor.name.lower()
            parts = factor.memory_usage()
            usage[f'{key}_factors'] = parts['factor']
            usage[f'{key}_batch'] = parts['batch']
            usage[f'{key}_inverses'] = parts['decomposition']
        return usage

    def set_factor(self, name: str, value: torch.Tensor | None) -> None:
        """Replace the running factor `name` (a reduced or loaded value).

        The value is moved to the layer's device and factor dtype.
        """
        factor = self.factor(name)
        if value is not None:
            value = value.to(device=self.device, dtype=factor.dtype)
        factor.value = value
