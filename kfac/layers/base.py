"""Per-layer K-FAC state and mathematics, independent of placement.

A [`KFACBaseLayer`][kfac.layers.base.KFACBaseLayer] holds one module's two
Kronecker factors and does what it is told: capture hook data, update the
running averages, compute a factor's decomposition and precondition the
gradient. It exposes its tensors (factors, decompositions, gradients) and
their layout; it never communicates. The collectives that move those
tensors between ranks live in [`kfac.exchange`][kfac.exchange], and which
rank does what is decided by a
[`WorkAssignment`][kfac.assignment.WorkAssignment].
"""

from __future__ import annotations

import abc
from collections import Counter

import torch

from kfac.layers.compat import DeprecatedCollectives
from kfac.layers.decomposition import JITTER
from kfac.layers.decomposition import Attempt
from kfac.layers.decomposition import Decomposed
from kfac.layers.decomposition import DecompositionAttempts
from kfac.layers.decomposition import Layout
from kfac.layers.decomposition import LinAlgError
from kfac.layers.factor import KroneckerFactor
from kfac.layers.modules import ModuleHelper
from kfac.math import compute_dtype
from kfac.validation import check_choice
from kfac.validation import check_dtype
from kfac.validation import check_instance

__all__ = [
    'FACTOR_NAMES',
    'JITTER',
    'LOSS_REDUCTIONS',
    'Attempt',
    'Decomposed',
    'KFACBaseLayer',
    'Layout',
    'LinAlgError',
]

FACTOR_NAMES = ('A', 'G')
"""The names of a layer's two factors, in the order they are handled."""

LOSS_REDUCTIONS = ('mean', 'sum')
"""Allowed values of `loss_reduction`."""


class KFACBaseLayer(DecompositionAttempts, DeprecatedCollectives, abc.ABC):
    """K-FAC state of one module.

    Args:
        module: helper of the module this layer preconditions.
        factor_dtype: dtype of the running factors; default: the wider of
            the parameter dtype and float32. Batch statistics are always
            accumulated in at least float32.
        inv_dtype: dtype in which decompositions are stored and gradients
            preconditioned; default: the wider of the parameter dtype and
            float32. Decompositions are computed in the wider of this and
            float32.
        loss_reduction: `'mean'` (the loss averages its `N` examples, so
            output gradients are multiplied by `N`) or `'sum'`.

    """

    def __init__(
        self,
        module: ModuleHelper,
        *,
        factor_dtype: torch.dtype | None = None,
        inv_dtype: torch.dtype | None = None,
        loss_reduction: str = 'mean',
    ) -> None:
        check_instance(
            'module',
            module,
            ModuleHelper,
            'a kfac.layers.modules.ModuleHelper',
        )
        check_dtype('factor_dtype', factor_dtype)
        check_dtype('inv_dtype', inv_dtype)
        check_choice('loss_reduction', loss_reduction, LOSS_REDUCTIONS)
        self.module = module
        self.loss_reduction = loss_reduction
        param_dtype = module.weight.dtype
        stat_dtype = compute_dtype(param_dtype, factor_dtype or param_dtype)
        self.factor_dtype = factor_dtype or compute_dtype(param_dtype)
        self.inv_dtype = inv_dtype or compute_dtype(param_dtype)
        self.decomposition_dtype = compute_dtype(self.inv_dtype)
        self.a = KroneckerFactor(
            'A',
            module.a_factor_shape[0],
            lambda x, _: module.a_statistic(x, stat_dtype),
            self.factor_dtype,
        )
        self.g = KroneckerFactor(
            'G',
            module.g_factor_shape[0],
            lambda x, m: module.g_statistic(
                x,
                stat_dtype,
                m,
                per_example=loss_reduction == 'mean',
            ),
            self.factor_dtype,
        )
        self.grad: torch.Tensor | None = None
        """The preconditioned gradient of the current step, if any."""
        self.raw_grad: torch.Tensor | None = None
        """The gradient matrix `V` read by
        [`precondition_grad`][kfac.layers.base.KFACBaseLayer.precondition_grad]."""
        self.counters: Counter[str] = Counter()
        """Fault counters: `decomposition_retries`,
        `decomposition_failures`, `unpreconditioned_steps`,
        `nonfinite_gradients` (absent until the first event)."""

    def __repr__(self) -> str:
        return f'{type(self).__name__}({self.module.module!r})'

    # Factors ---------------------------------------------------------------

    @property
    def factors(self) -> tuple[KroneckerFactor, KroneckerFactor]:
        """`(A, G)`."""
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
            accumulation_steps: micro-batches in the step; with `'mean'`
                reduction each micro-batch loss is assumed divided by it, so
                the output gradient is multiplied back.
            now: compute the statistic now instead of keeping the tensor.

        """
        accumulation = (
            accumulation_steps if self.loss_reduction == 'mean' else 1
        )
        self.g.capture(grad_output, accumulation / loss_scale, now=now)

    @property
    def captures(self) -> tuple[int, int]:
        """Captures of `A` and of `G` since the last factor update."""
        return (self.a.captures, self.g.captures)

    def update_factors(self, decay: float) -> torch.Tensor | None:
        """Fold the captured batch into both running averages, provisionally.

        Returns:
            None if the module did not run (nothing changes), else a 0-d
                bool tensor: whether both batch statistics were finite. The
                caller then calls
                [`commit_factors`][kfac.layers.base.KFACBaseLayer.commit_factors]
                or
                [`rollback_factors`][kfac.layers.base.KFACBaseLayer.rollback_factors].
        """
        if not (self.a.captures and self.g.captures):
            self.reset_batch()
            return None
        finite_a = self.a.update(decay)
        finite_g = self.g.update(decay)
        assert finite_a is not None and finite_g is not None  # both captured
        return torch.logical_and(finite_a, finite_g)

    def commit_factors(self) -> None:
        """Keep the last `update_factors`."""
        for factor in self.factors:
            factor.commit()

    def rollback_factors(self) -> None:
        """Undo the last `update_factors`."""
        for factor in self.factors:
            factor.rollback()

    def reset_batch(self) -> None:
        """Drop captured data of both factors."""
        for factor in self.factors:
            factor.reset_batch()

    @property
    def has_factors(self) -> bool:
        """Whether both running factors exist."""
        return self.a.value is not None and self.g.value is not None

    def set_factor(self, name: str, value: torch.Tensor | None) -> None:
        """Replace the running factor `name` (a reduced or loaded value).

        The value is moved to the layer's device and factor dtype.
        """
        factor = self.factor(name)
        if value is not None:
            value = value.to(device=self.device, dtype=factor.dtype)
        factor.value = value

    # Decompositions --------------------------------------------------------

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

    @property
    @abc.abstractmethod
    def decomposition_format(self) -> str:
        """Name of the decomposition's layout, checked when loading."""

    @abc.abstractmethod
    def decomposition_layout(self, name: str) -> Layout:
        """Shapes of factor `name`'s decomposition tensors, and whether each
        is symmetric (so may be sent as a packed triangle).
        """

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
        return all(f.decomposition is not None for f in self.factors)

    def clear_decompositions(self) -> None:
        """Drop both decompositions (a rank that is no gradient worker)."""
        for factor in self.factors:
            factor.decomposition = None

    # Gradients -------------------------------------------------------------

    @property
    def device(self) -> torch.device:
        """Device of the module's weight."""
        return self.module.weight.device

    @property
    def has_grad(self) -> bool:
        """Whether the module's weight has a gradient in this step."""
        return self.module.weight.grad is not None

    @abc.abstractmethod
    def _precondition(
        self, grad: torch.Tensor, damping: float
    ) -> torch.Tensor:
        """Return the preconditioned `V` (in `inv_dtype`)."""

    def precondition_grad(self, damping: float) -> torch.Tensor | None:
        """Compute [`grad`][kfac.layers.base.KFACBaseLayer.grad] from the
        module's current gradient.

        Only gradient workers call this. Without both decompositions (every
        attempt to compute one failed) the raw gradient stands in for the
        preconditioned one, and the event is counted.
        """
        grad = self.module.get_grad()
        if grad is None:
            self.grad = None
            return None
        grad = grad.to(self.inv_dtype)
        self.raw_grad = grad
        if self.has_decomposition:
            self.grad = self._precondition(grad, damping)
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
        shape = self.module.grad_shape
        return torch.empty(shape, dtype=self.inv_dtype, device=self.device)

    def set_preconditioned_grad(self, grad: torch.Tensor) -> None:
        """Store a preconditioned gradient received from a gradient worker."""
        self.grad = grad

    def grad_inner_product(self) -> torch.Tensor:
        """`Σ V' ⊙ V` (0-d) of a layer whose preconditioned gradient is set.

        A rank that received `V'` reads its own `V` from the module.
        """
        grad = self.grad
        if grad is None:
            raise RuntimeError(f'{self} has no preconditioned gradient')
        raw = self.raw_grad
        if raw is None:
            raw = self.module.get_grad()
            assert raw is not None  # V' exists only for modules with V
        return torch.vdot(grad.reshape(-1), raw.to(grad.dtype).reshape(-1))

    def write_grad(self, scale: torch.Tensor | None) -> None:
        """Write [`grad`][kfac.layers.base.KFACBaseLayer.grad] (times
        `scale`) into `.grad` and clear it.
        """
        grad = self.grad
        self.grad = self.raw_grad = None
        if grad is not None:
            self.module.set_grad(grad, scale)

    def discard_grad(self) -> None:
        """Drop a non-finite preconditioned gradient, leaving `.grad` as it
        is; counted as `nonfinite_gradients`.
        """
        self.grad = self.raw_grad = None
        self.counters['nonfinite_gradients'] += 1

    # Introspection ---------------------------------------------------------

    def memory_usage(self) -> dict[str, int]:
        """Bytes held by this layer on this rank.

        Keys: `a_factors`, `g_factors`, `a_batch`, `g_batch`,
        `a_inverses`, `g_inverses` and `grad`.
        """
        usage: dict[str, int] = {}
        for factor in self.factors:
            key = factor.name.lower()
            parts = factor.memory_usage()
            usage[f'{key}_factors'] = parts['factor']
            usage[f'{key}_batch'] = parts['batch']
            usage[f'{key}_inverses'] = parts['decomposition']
        grad = self.grad
        usage['grad'] = (
            0 if grad is None else grad.numel() * grad.element_size()
        )
        return usage
