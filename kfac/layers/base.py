"""Per-layer K-FAC state and mathematics, independent of placement.

A [`KFACBaseLayer`][kfac.layers.base.KFACBaseLayer] holds one module's two
Kronecker factors and does what it is told: capture hook data, update the
running averages, compute a factor's decomposition and precondition the
gradient. It exposes its tensors (factors, decompositions, gradients) and
their layout; it never communicates. The collectives that move those
tensors between ranks live in [`kfac.distributed`][kfac.distributed], and
which rank does what is decided by a
[`WorkAssignment`][kfac.assignment.WorkAssignment]. Gradients are read
and written through a [`Grads`][kfac.layers.modules.Grads] the engine's
gradient placement hands the layer (default: the parameters' `.grad`).
"""

from __future__ import annotations

import abc
from collections import Counter
from collections.abc import Callable
from typing import ClassVar

import torch

from kfac.enums import FACTOR_NAMES
from kfac.layers.decomposition import DecompositionAttempts
from kfac.layers.decomposition import Layout
from kfac.layers.helper import Grads
from kfac.layers.helper import ModuleHelper
from kfac.math.lowrank import DAMPING_MODES
from kfac.math.lowrank import relative_damping
from kfac.state import LayerSpec
from kfac.state import SavedDecomposition
from kfac.state import SavedLayer
from kfac.validation import check_choice

__all__ = ['KFACBaseLayer']


class KFACBaseLayer(DecompositionAttempts):
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
        loss_average: how the loss averages its terms: `'batch'` (the
            default: over the `N` examples, so output gradients are
            multiplied by `N`), `'batch+sequence'` (over examples and
            positions) or `None` (a summed loss); see
            [`kfac.math`][kfac.math].
        damping_mode: `'absolute'` (`λ` as given) or `'relative'` (`λ`
            times the mean eigenvalue of `A ⊗ G`; see
            [`kfac.math.lowrank`][kfac.math.lowrank]).

    """

    bases_everywhere: ClassVar[bool] = False
    """Whether every rank that holds examples needs this layer's
    decompositions, not only its gradient workers (EKFAC: each rank
    estimates the scaling from its own examples)."""

    def __init__(
        self,
        module: ModuleHelper,
        *,
        factor_dtype: torch.dtype | None = None,
        inv_dtype: torch.dtype | None = None,
        loss_average: str | None = 'batch',
        damping_mode: str = 'absolute',
    ) -> None:
        self.damping_mode = check_choice(
            'damping_mode', damping_mode, DAMPING_MODES
        )
        super().__init__(
            module,
            factor_dtype=factor_dtype,
            inv_dtype=inv_dtype,
            loss_average=loss_average,
        )
        self.factor_masks = {}
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

    def follow_module(self) -> bool:  # noqa: D102  # documented in the base
        moved = super().follow_module()
        if moved:
            self.grad = self.raw_grad = None
        return moved

    def effective_damping(
        self,
        damping: float,
        means: Callable[[], tuple[torch.Tensor, torch.Tensor]],
    ) -> float | torch.Tensor:
        """The damping applied: `λ`, or under `damping_mode='relative'`
        `λ m(A) m(G)` from the factors' mean eigenvalues `means()`
        ([`relative_damping`][kfac.math.lowrank.relative_damping]).
        """
        if self.damping_mode == 'absolute':
            return damping
        return relative_damping(damping, *means())

    # Decompositions --------------------------------------------------------

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

    # Gradients -------------------------------------------------------------

    @property
    def has_grad(self) -> bool:
        """Whether the module's weight has a gradient in this step."""
        return self.module.weight.grad is not None

    @abc.abstractmethod
    def _precondition(
        self, grad: torch.Tensor, damping: float
    ) -> torch.Tensor:
        """Return the preconditioned `V` (in `inv_dtype`)."""

    def precondition_grad(
        self, damping: float, grads: Grads | None = None
    ) -> torch.Tensor | None:
        """Compute [`grad`][kfac.layers.base.KFACBaseLayer.grad] from the
        module's current gradient.

        Only gradient workers call this. Without both decompositions (every
        attempt to compute one failed) the raw gradient stands in for the
        preconditioned one, and the event is counted.
        """
        grad = self.module.get_grad(grads)
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
            raw = self.module.get_grad(grads)
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
            self.module.set_grad(grad, scale, grads)

    def clear_grad(self) -> None:
        """Forget this step's preconditioned and raw gradients."""
        self.grad = self.raw_grad = None

    def discard_grad(self) -> None:
        """Drop a non-finite preconditioned gradient, leaving `.grad` as it
        is; counted as `nonfinite_gradients`.
        """
        self.grad = self.raw_grad = None
        self.counters['nonfinite_gradients'] += 1

    # State -----------------------------------------------------------------

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
            self.statistic_shapes(),
        )

    def statistic_shapes(self) -> dict[str, tuple[int, ...]]:
        """The running statistics saved besides the factors, by name, and
        their shapes (none here).
        """
        return {}

    def saved_statistics(self) -> dict[str, torch.Tensor]:
        """The running statistics besides the factors that exist now."""
        return {}

    def saved_state(self, include_decompositions: bool) -> SavedLayer:
        """The running factors, and the decompositions held here if
        `include_decompositions`.
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
        return SavedLayer(factors, decomposition, self.saved_statistics())

    def load_saved_state(self, saved: SavedLayer, keep: bool) -> bool:
        """Restore the running factors of `saved` (a missing one is
        unset) and, if `keep` (a gradient worker), its decompositions.

        Returns:
            Whether `saved` had decompositions; without them they must be
            recomputed.
        """
        for factor in self.factors:
            self.set_factor(factor.name, saved.factors.get(factor.name))
        self.clear_decompositions()
        restored = saved.decomposition
        if restored is None:
            return False
        if keep:
            for f in FACTOR_NAMES:
                self.set_decomposition(f, restored.tensors[f])
        return True

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
