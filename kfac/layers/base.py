"""A layer: one module's helper, statistics and curvature, composed.

A [`KFACBaseLayer`][kfac.layers.base.KFACBaseLayer] holds

* its module's [`ModuleHelper`][kfac.layers.helper.ModuleHelper]
  (`helper`; `module` is the original's name for it): factor shapes, the
  gradient as the `(out, in[+1])` matrix `V`, the rows of `A` and `G`;
* its statistics ([`LayerStatistics`][kfac.layers.statistics.LayerStatistics],
  or [`TiedStatistics`][kfac.layers.tied.TiedStatistics] for a weight tied
  in two roles): the running factors and how hook data feeds them;
* its curvature (a [`Curvature`][kfac.layers.curvature.base.Curvature]
  built by the method's config): decompositions and preconditioning.

It does what it is told: capture hook data, update the running averages,
decompose a factor (with retries, below) and precondition
the gradient. It exposes its tensors (factors, decompositions, gradients)
and their layout; it never communicates. The collectives that move those
tensors between ranks live in [`kfac.distributed`][kfac.distributed], and
which rank does what is decided by a
[`WorkAssignment`][kfac.assignment.WorkAssignment]. Gradients are read and
written through a [`Grads`][kfac.layers.helper.Grads] the engine's gradient
placement hands the layer (default: the parameters' `.grad`).

The retry policy of decompositions lives here too: a factor is decomposed
first in the layer's decomposition dtype; when that raises
`torch.linalg.LinAlgError` or gives a non-finite result, it is retried in
float64, then in float64 with a small diagonal jitter (`JITTER`).
Whatever the curvature, its layer runs each attempt through these
functions (`attempt_plan`, `prepare`, `try_attempt`, `decompose_all`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from collections.abc import Sequence
from typing import NamedTuple

import torch

from kfac.enums import FACTOR_NAMES
from kfac.layers.curvature.base import Curvature
from kfac.layers.curvature.base import CurvatureConfig
from kfac.layers.curvature.base import Decomposed
from kfac.layers.curvature.base import Layout
from kfac.layers.curvature.inverse import InverseConfig
from kfac.layers.helper import Grads
from kfac.layers.helper import ModuleHelper
from kfac.layers.statistics import Captured
from kfac.layers.statistics import KroneckerFactor
from kfac.layers.statistics import LayerStatistics
from kfac.layers.tied import make_statistics
from kfac.state import LayerSpec
from kfac.state import SavedDecomposition
from kfac.state import SavedLayer
from kfac.validation import check_instance

__all__ = [
    'JITTER',
    'Attempt',
    'KFACBaseLayer',
    'LinAlgError',
    'all_finite',
    'attempt_plan',
    'decompose_all',
    'prepare',
    'try_attempt',
]

LinAlgError: type[Exception] = torch.linalg.LinAlgError  # type: ignore[attr-defined]  # public, but not re-exported in the stubs
"""`torch.linalg.LinAlgError`, raised by a failed decomposition."""

JITTER = 1e-6
"""Relative diagonal jitter of the last decomposition attempt."""


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


def try_attempt(
    routine: Callable[[torch.Tensor], Decomposed],
    value: torch.Tensor,
    dtype: torch.dtype,
    jitter: float,
) -> Attempt | None:
    """Run `routine` (one curvature's decomposition) on `value` prepared
    for this attempt (see [`prepare`][kfac.layers.base.prepare]).

    Returns:
        The attempt, or None when the routine raised `LinAlgError`.
    """
    matrix = prepare(value, dtype, jitter)
    try:
        tensors, ok = routine(matrix)
    except LinAlgError:
        return None
    valid = all_finite(tensors)
    return Attempt(tensors, valid if ok is None else valid & ok)


def decompose_all(
    jobs: Sequence[tuple[KFACBaseLayer, str]], damping: float
) -> list[int]:
    """Decompose factor `name` of each `(layer, name)` in `jobs`.

    All first attempts run, then one host synchronisation reads their
    validity flags; only the failed ones are retried (see
    [`compute_decomposition`][kfac.layers.base.KFACBaseLayer.compute_decomposition]).

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


class KFACBaseLayer:
    """K-FAC state of one module: helper, statistics and curvature.

    Args:
        module: helper of the module this layer preconditions.
        curvature: the method and its options (default
            [`InverseConfig()`][kfac.layers.curvature.inverse.InverseConfig]);
            its `make` builds this layer's curvature.
        factor_dtype: dtype of the running factors; default: the wider of
            the parameter dtype and float32. Batch statistics are always
            accumulated in at least float32.
        inv_dtype: dtype in which decompositions are stored and gradients
            preconditioned; default: the wider of the parameter dtype and
            float32. Decompositions are computed in the wider of this and
            float32.
        loss_average: how the loss averages its terms: `'batch'` (the
            default: over the `N` examples, so output gradients are
            multiplied by `N`), `'batch+sequence'` (over examples and
            positions) or `None` (a summed loss); see
            [`kfac.math`][kfac.math].

    Raises:
        TypeError: `module` is not a helper, or `curvature` not a
            [`CurvatureConfig`][kfac.layers.curvature.base.CurvatureConfig].
        ValueError: the method cannot precondition this module.
    """

    def __init__(
        self,
        module: ModuleHelper,
        *,
        curvature: CurvatureConfig | None = None,
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
        config = InverseConfig() if curvature is None else curvature
        check_instance(
            'curvature',
            config,
            CurvatureConfig,
            'a kfac.layers.curvature.CurvatureConfig',
        )
        self.helper = module
        """The module's helper."""
        self.method = config
        """The method and its options this layer was built with."""
        self.statistics: LayerStatistics = make_statistics(
            module,
            factor_dtype=factor_dtype,
            inv_dtype=inv_dtype,
            loss_average=loss_average,
        )
        """The running factors and how hook data feeds them."""
        self.factor_masks: dict[str, torch.Tensor] = {}
        """Per factor name, a boolean mask applied to the matrix before it
        is decomposed (FSDP2 local mode: keep the blocks of rows one rank
        owns)."""
        self.grad: torch.Tensor | None = None
        """The preconditioned gradient of the current step, if any."""
        self.raw_grad: torch.Tensor | None = None
        """The gradient matrix `V` read by
        [`precondition_grad`][kfac.layers.base.KFACBaseLayer.precondition_grad]."""
        self.counters: Counter[str] = Counter()
        """Fault counters: `decomposition_retries`,
        `decomposition_failures`, `unpreconditioned_steps`,
        `nonfinite_gradients` (absent until the first event)."""
        self.failures_in_a_row: Counter[str] = Counter()
        """Per factor name, its decompositions that failed in every
        attempt since its last good one (counted by its inverse worker;
        the engine shares the counts with the other ranks)."""
        self.failed_traces: dict[str, float] = {}
        """Per factor name, the trace of the matrix of its last failed
        decomposition (on its inverse worker)."""
        self.curvature: Curvature = config.make(self)
        """The method: decompositions and preconditioning."""
        if self.curvature.keeps_examples:
            self.statistics.keep_examples()

    def __repr__(self) -> str:
        name, module = type(self).__name__, self.helper.module
        return f'{name}({module!r}, {self.method.name})'

    @property
    def module(self) -> ModuleHelper:
        """The module's helper (the original's name for `helper`)."""
        return self.helper

    # Statistics --------------------------------------------------------------

    @property
    def device(self) -> torch.device:
        """Device of the module's weight."""
        return self.statistics.device

    @property
    def factor_dtype(self) -> torch.dtype:
        """Dtype of the running factors."""
        return self.statistics.factor_dtype

    @property
    def inv_dtype(self) -> torch.dtype:
        """Dtype of the decompositions and preconditioned gradients."""
        return self.statistics.inv_dtype

    @property
    def a(self) -> KroneckerFactor:
        """Factor `A` (holding its decomposition)."""
        return self.statistics.a

    @property
    def g(self) -> KroneckerFactor:
        """Factor `G` (holding its decomposition)."""
        return self.statistics.g

    @property
    def factors(self) -> tuple[KroneckerFactor, ...]:
        """The running factors this layer keeps, allreduces and saves (see
        [`LayerStatistics.factors`][kfac.layers.statistics.LayerStatistics.factors]).
        """
        return self.statistics.factors

    def factor(self, name: str) -> KroneckerFactor:
        """The factor called `name` (`'A'`, `'G'`, or a tied use's)."""
        return self.statistics.factor(name)

    def decomposition_input(self, name: str) -> torch.Tensor | None:
        """The matrix decomposed for factor `name` (a tied layer combines
        its uses'), None before the first update.
        """
        return self.statistics.decomposition_input(name)

    @property
    def has_factors(self) -> bool:
        """Whether the running factors exist."""
        return self.statistics.has_factors

    @property
    def captures(self) -> tuple[int, int]:
        """Captures of `A` and of `G` since the last factor update."""
        return self.statistics.captures

    def save_layer_input(
        self, layer_input: torch.Tensor, *, now: bool
    ) -> None:
        """Capture the module input of one micro-batch (forward hook)."""
        self.statistics.save_layer_input(layer_input, now=now)

    def save_layer_grad_output(
        self,
        grad_output: torch.Tensor,
        *,
        loss_scale: float = 1.0,
        accumulation_steps: int = 1,
        now: bool,
    ) -> None:
        """Capture the output gradient of one micro-batch (see
        [`LayerStatistics.save_layer_grad_output`][kfac.layers.statistics.LayerStatistics.save_layer_grad_output]).
        """
        self.statistics.save_layer_grad_output(
            grad_output,
            loss_scale=loss_scale,
            accumulation_steps=accumulation_steps,
            now=now,
        )

    def prepare_input(
        self, layer_input: torch.Tensor, *, now: bool
    ) -> Captured:
        """Capture the input of one call, added with its output gradient
        by `add_call`.
        """
        return self.statistics.prepare_input(layer_input, now=now)

    def add_call(
        self,
        layer_input: Captured,
        grad_output: torch.Tensor,
        *,
        loss_scale: float,
        accumulation_steps: int,
        now: bool,
    ) -> int:
        """Add one call's input and output gradient to the batch (see
        [`LayerStatistics.add_call`][kfac.layers.statistics.LayerStatistics.add_call]).
        """
        return self.statistics.add_call(
            layer_input,
            grad_output,
            loss_scale=loss_scale,
            accumulation_steps=accumulation_steps,
            now=now,
        )

    def add_examples(self, count: int) -> None:
        """Count the examples of one backward pass."""
        self.statistics.add_examples(count)

    def update_factors(
        self, decay: float, *, compiled: bool = False
    ) -> torch.Tensor | None:
        """Fold the captured batch into the running averages, provisionally
        (see
        [`LayerStatistics.update_factors`][kfac.layers.statistics.LayerStatistics.update_factors]).
        """
        return self.statistics.update_factors(decay, compiled=compiled)

    def commit_factors(self) -> None:
        """Keep the last `update_factors`."""
        self.statistics.commit_factors()

    def rollback_factors(self) -> None:
        """Undo the last `update_factors`."""
        self.statistics.rollback_factors()

    def reset_batch(self) -> None:
        """Drop the data captured since the last factor update."""
        self.statistics.reset_batch()

    def set_factor(self, name: str, value: torch.Tensor | None) -> None:
        """Replace the running factor `name` (a reduced or loaded value)."""
        self.statistics.set_factor(name, value)

    def follow_module(self) -> bool:
        """Follow the module to a new device or dtype (`model.to(...)`);
        see
        [`LayerStatistics.follow_module`][kfac.layers.statistics.LayerStatistics.follow_module].

        Returns:
            Whether the module had moved.
        """
        moved = self.statistics.follow_module()
        if moved:
            self.grad = self.raw_grad = None
            self.curvature.follow()
        return moved

    # Decompositions ----------------------------------------------------------

    @property
    def bases_everywhere(self) -> bool:
        """Whether every rank that holds examples needs this layer's
        decompositions (see
        [`Curvature.bases_everywhere`][kfac.layers.curvature.base.Curvature.bases_everywhere]).
        """
        return self.curvature.bases_everywhere

    @property
    def decomposition_format(self) -> str:
        """Name of the decomposition's layout, checked when loading."""
        return self.curvature.format

    def decomposition_layout(self, name: str) -> Layout:
        """Shapes of factor `name`'s decomposition tensors, and whether each
        is symmetric (so may be sent as a packed triangle).
        """
        return self.curvature.layout(name)

    def decomposition(self, name: str) -> tuple[torch.Tensor, ...] | None:
        """Factor `name`'s decomposition held on this rank, or None."""
        return self.factor(name).decomposition

    def set_decomposition(
        self,
        name: str,
        tensors: tuple[torch.Tensor, ...] | None,
    ) -> None:
        """Store a received or loaded decomposition (None: no valid one).

        The tensors are moved to the layer's device and `inv_dtype`.
        """
        if tensors is not None:
            tensors = tuple(
                t.to(device=self.device, dtype=self.inv_dtype) for t in tensors
            )
        self.factor(name).decomposition = tensors

    @property
    def has_decomposition(self) -> bool:
        """Whether both factors' decompositions are held on this rank."""
        return all(
            self.factor(name).decomposition is not None
            for name in FACTOR_NAMES
        )

    def clear_decompositions(self) -> None:
        """Drop both decompositions (a rank that is no gradient worker)."""
        for name in FACTOR_NAMES:
            self.factor(name).decomposition = None

    def mask_factor(self, name: str, mask: torch.Tensor) -> None:
        """Decompose factor `name` multiplied by the boolean `mask` from
        now on (FSDP2 local mode: the blocks of rows each shard owns).
        A diagonal factor is left alone: it is block-diagonal already.
        """
        if not self.factor(name).diagonal:
            self.factor_masks[name] = mask

    def compute_decomposition(self, name: str, damping: float) -> bool:
        """Decompose factor `name`; store it in the factor.

        Only the factor's inverse worker calls this. A decomposition that
        raises `torch.linalg.LinAlgError` or returns a non-finite value is
        retried in float64, then in float64 with a small jitter (see
        the retry policy above); if all
        fail, the last good decomposition is kept (none: the layer's
        gradient goes unpreconditioned) and the failure is counted.

        This is `try_decomposition` followed by `finish_decomposition`;
        the engine calls those two itself so that one host synchronisation
        checks all the factors it decomposes.

        Returns:
            Whether a new decomposition was stored.
        """
        first = self.try_decomposition(name, damping)
        valid = first is not None and bool(first.valid)
        return self.finish_decomposition(name, damping, first, valid)

    def try_decomposition(
        self, name: str, damping: float, attempt: int = 0
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
        return try_attempt(
            lambda matrix: self.curvature.decompose(
                name, matrix, dtype, damping
            ),
            value,
            dtype,
            jitter,
        )

    def _attempts(self) -> list[tuple[torch.dtype, float]]:
        return attempt_plan(self.statistics.decomposition_dtype)

    def finish_decomposition(
        self,
        name: str,
        damping: float,
        first: Attempt | None,
        valid: bool,
    ) -> bool:
        """Store the first attempt if `valid`, else retry (see
        `compute_decomposition`).

        Args:
            name: `'A'` or `'G'`.
            damping: the damping in force.
            first: what `try_decomposition` returned for attempt 0.
            valid: `first.valid`, read on the host.

        Returns:
            Whether a new decomposition was stored.
        """
        if valid and first is not None and self._store(name, first, damping):
            del self.failures_in_a_row[name]
            return True
        for attempt in range(1, len(self._attempts())):
            result = self.try_decomposition(name, damping, attempt)
            if (
                result is not None
                and bool(result.valid)
                and self._store(name, result, damping)
            ):
                self.counters['decomposition_retries'] += attempt
                del self.failures_in_a_row[name]
                return True
        self.counters['decomposition_failures'] += 1
        self.failures_in_a_row[name] += 1
        self.failed_traces[name] = self._trace(name)
        return False

    def _trace(self, name: str) -> float:
        """The trace of the matrix decomposed for factor `name` (a host
        read, on the failure path only).
        """
        value = self.decomposition_input(name)
        assert value is not None  # decomposed, so it exists
        diagonal = value if value.dim() == 1 else value.diagonal()
        return float(diagonal.sum())

    def _store(self, name: str, result: Attempt, damping: float) -> bool:
        """Keep a valid attempt; False if it cannot be completed."""
        final = self.curvature.finalize(name, result.tensors, damping)
        if final is None:
            return False
        self.factor(name).decomposition = tuple(
            t.to(self.inv_dtype) for t in final
        )
        return True

    # Gradients ---------------------------------------------------------------

    @property
    def has_grad(self) -> bool:
        """Whether the module's weight has a gradient in this step."""
        return self.helper.weight.grad is not None

    def precondition_grad(
        self, damping: float, grads: Grads | None = None
    ) -> torch.Tensor | None:
        """Compute [`grad`][kfac.layers.base.KFACBaseLayer.grad] from the
        module's current gradient.

        Only gradient workers call this. Without both decompositions (every
        attempt to compute one failed) the raw gradient stands in for the
        preconditioned one, and the event is counted.
        """
        grad = self.helper.get_grad(grads)
        if grad is None:
            self.grad = None
            return None
        grad = grad.to(self.inv_dtype)
        self.raw_grad = grad
        if self.has_decomposition:
            self.grad = self.curvature.precondition(grad, damping)
        else:
            self.counters['unpreconditioned_steps'] += 1
            self.grad = grad
        return self.grad

    def grad_buffer(self) -> torch.Tensor:
        """The preconditioned gradient, or an uninitialised buffer of its
        shape, dtype and device (a rank that receives it).
        """
        if self.grad is not None:
            return self.grad
        shape = self.helper.grad_shape
        return torch.empty(shape, dtype=self.inv_dtype, device=self.device)

    def set_preconditioned_grad(self, grad: torch.Tensor) -> None:
        """Store a preconditioned gradient received from a gradient worker."""
        self.grad = grad

    def grad_statistics(self, grads: Grads | None = None) -> torch.Tensor:
        """`[Σ V' ⊙ V, ‖V'‖², ‖V‖²]` (shape `(3,)`) of a layer whose
        preconditioned gradient is set: what the clip of the step needs.

        A rank that received `V'` reads its own `V` through `grads`.
        """
        grad = self.grad
        if grad is None:
            raise RuntimeError(f'{self} has no preconditioned gradient')
        raw = self.raw_grad
        if raw is None:
            raw = self.helper.get_grad(grads)
            assert raw is not None  # V' exists only for modules with V
        pre = grad.reshape(-1)
        raw = raw.to(grad.dtype).reshape(-1)
        return torch.stack(
            [torch.vdot(pre, raw), torch.vdot(pre, pre), torch.vdot(raw, raw)]
        )

    def write_grad(
        self, scale: torch.Tensor | None, grads: Grads | None = None
    ) -> None:
        """Write [`grad`][kfac.layers.base.KFACBaseLayer.grad] (times
        `scale`) into `.grad` and clear it.
        """
        grad = self.grad
        self.grad = self.raw_grad = None
        if grad is not None:
            self.helper.set_grad(grad, scale, grads)

    def clear_grad(self) -> None:
        """Forget this step's preconditioned and raw gradients."""
        self.grad = self.raw_grad = None

    def discard_grad(self) -> None:
        """Drop a non-finite preconditioned gradient, leaving `.grad` as it
        is; counted as `nonfinite_gradients`.
        """
        self.grad = self.raw_grad = None
        self.counters['nonfinite_gradients'] += 1

    # State -------------------------------------------------------------------

    def state_spec(self) -> LayerSpec:
        """What this layer's saved state must look like (checked when a
        state is loaded; see [`kfac.state`][kfac.state]).
        """
        return LayerSpec(
            {f.name: f.dim for f in self.factors},
            self.decomposition_format,
            {
                f: tuple(s for s, _ in self.decomposition_layout(f))
                for f in FACTOR_NAMES
            },
            frozenset(f.name for f in self.factors if f.diagonal),
            self.curvature.statistic_shapes(),
        )

    def saved_state(self, include_decompositions: bool) -> SavedLayer:
        """The running factors and the curvature's statistics, and the
        decompositions held here if `include_decompositions`.
        """
        decomposition = None
        if include_decompositions and self.has_decomposition:
            decomposition = SavedDecomposition(
                self.decomposition_format,
                {f: self.decomposition(f) or () for f in FACTOR_NAMES},
            )
        factors = {
            f.name: f.value for f in self.factors if f.value is not None
        }
        statistics = self.curvature.saved_statistics()
        return SavedLayer(factors, decomposition, statistics)

    def load_saved_state(self, saved: SavedLayer, keep: bool) -> bool:
        """Restore the running factors of `saved` (a missing one is
        unset), the curvature's statistics (those kept on gradient workers
        only if `keep`) and, if `keep` (a gradient worker), its
        decompositions.

        Returns:
            Whether `saved` had decompositions; without them they must be
            recomputed.
        """
        for factor in self.factors:
            self.set_factor(factor.name, saved.factors.get(factor.name))
        self.clear_decompositions()
        restored = saved.decomposition
        if restored is not None and keep:
            for f in FACTOR_NAMES:
                self.set_decomposition(f, restored.tensors[f])
        statistics = dict(saved.statistics)
        if self.curvature.grad_worker_statistics and not keep:
            statistics = {}  # kept where the gradient is preconditioned
        self.curvature.load_statistics(statistics, restored is not None)
        return restored is not None

    # Introspection -----------------------------------------------------------

    def memory_usage(self) -> dict[str, int]:
        """Bytes held by this layer on this rank.

        Keys: `a_factors`, `g_factors`, `a_batch`, `g_batch`,
        `a_inverses`, `g_inverses` and `grad`, and the curvature's own
        (EKFAC: `scale`, `example_rows`; EIGEN_ADAM: `moment`).
        """
        grad = self.grad
        size = 0 if grad is None else grad.numel() * grad.element_size()
        return {
            **self.statistics.memory_usage(),
            'grad': size,
            **self.curvature.memory_usage(),
        }
