"""The curvature interface: what a layer's method does with its factors.

A [`KFACBaseLayer`][kfac.layers.base.KFACBaseLayer] is composed of a module
helper (shapes, gradients, hook data), statistics (the running factors `A`
and `G`) and a *curvature*: the method that turns the factors into a
decomposition and the decomposition into a preconditioned gradient. The
curvatures of the library (EIGEN, INVERSE, EKFAC, EIGEN_ADAM, ONE_SIDED)
implement this interface,
and so can one defined outside it:

```python
@dataclasses.dataclass(frozen=True)
class MyConfig(kfac.CurvatureConfig):
    name: ClassVar[str] = 'mine'

    def make(self, layer):
        return MyCurvature(layer)

KFACPreconditioner(model, compute_method=MyConfig())
```

A [`CurvatureConfig`][kfac.layers.curvature.base.CurvatureConfig] is the
method with its options (validated, frozen, shared by all layers); its
`make` builds one [`Curvature`][kfac.layers.curvature.base.Curvature] per
layer, which holds that layer's method state. The engine calls a curvature
only through this interface and never asks which one it is:

* on each factor's *inverse worker*, `decompose` (one attempt, retried by
  the layer in float64 and with jitter when it raises or is not finite)
  and `finalize` (what is kept of a valid attempt);
* the decomposition's tensors travel to the layer's gradient workers as
  `layout` says (shapes, and which are symmetric and may travel packed);
* on the gradient workers, `precondition`;
* a curvature whose statistics every rank must estimate from its own
  examples (EKFAC's scaling) sets `bases_everywhere` and
  `reduces_statistics`, returns them from
  `batch_statistics` on factor-update steps (after that step's
  decompositions), and the engine averages them over the ranks and hands
  them to `update_statistics`; `restart` follows a basis refresh;
* a curvature whose factors are the gradient's own sets
  `gradient_factors`: the engine registers no hooks for its layer and
  allreduces none of its factors, but calls `update_gradient_factors` on
  every rank with the averaged gradient on factor-update steps;
* a curvature that keeps statistics where the gradient is preconditioned
  (EIGEN_ADAM's second moments) sets `grad_worker_statistics`:
  `state_dict()` gathers them from a gradient worker;
* state: `statistic_shapes`, `saved_statistics`, `load_statistics`;
  memory: `memory_usage`; placement cost: `cost`.

A curvature never calls `torch.distributed`: the engine moves its tensors.
"""

from __future__ import annotations

import abc
import dataclasses
import enum
from collections.abc import Mapping
from typing import TYPE_CHECKING
from typing import ClassVar
from typing import NamedTuple

import torch

from kfac.enums import AssignmentStrategy
from kfac.enums import parse_enum
from kfac.math import compute_dtype

if TYPE_CHECKING:  # the layer holds its curvature and the curvature its layer
    from kfac.layers.base import KFACBaseLayer

__all__ = ['Curvature', 'CurvatureConfig', 'Decomposed', 'Layout']

Layout = tuple[tuple[tuple[int, ...], bool], ...]
"""Shapes of a decomposition's tensors, each with whether it is symmetric
(and so may travel as a packed triangle)."""


class Decomposed(NamedTuple):
    """What one decomposition attempt returns."""

    tensors: tuple[torch.Tensor, ...]
    """The decomposition's tensors."""
    ok: torch.Tensor | None
    """A 0-d bool tensor when the routine reports success itself, else
    None (finiteness is checked by the layer)."""


@dataclasses.dataclass(frozen=True)
class CurvatureConfig(abc.ABC):
    """A curvature method with its options: builds each layer's
    [`Curvature`][kfac.layers.curvature.base.Curvature].

    Subclasses are frozen dataclasses whose fields are the method's
    options, validated in `__post_init__` (a subclass that adds checks of
    its own calls this class's first, which parses the options named in
    `enums`).
    """

    name: ClassVar[str]
    """The method's name (logged, and shown by `describe()`)."""

    enums: ClassVar[Mapping[str, type[enum.Enum]]] = {}
    """The options given as a member of an enum or its value, by name:
    `__post_init__` stores the member (a `TypeError` or `ValueError`
    naming the option for anything else)."""

    default_relative_clip: ClassVar[float | None] = 1.0
    """What `relative_clip='auto'` means for this method (model-wide)
    without a `kl_clip`: 1.0 (the preconditioned gradient at most as long
    as the raw one; every method of the library), or None for a method of
    your own whose step has a scale of its own."""

    def __post_init__(self) -> None:
        for option, kind in self.enums.items():
            value = parse_enum(kind, getattr(self, option), option)
            object.__setattr__(self, option, value)

    @abc.abstractmethod
    def make(self, layer: KFACBaseLayer) -> Curvature:
        """The curvature of `layer` (called once, when the layer is built).

        Raises:
            ValueError: the method cannot precondition this layer (the
                message says why).
        """


class Curvature(abc.ABC):
    """One layer's method: decomposition, preconditioning, and their state.

    Args:
        layer: the layer this curvature belongs to; read its factors
            (`layer.factor('A')`, with `.value`, `.decomposition`,
            `.diagonal`, `.dim`), its helper (`layer.helper.grad_shape`)
            and its dtypes (`layer.inv_dtype`) through it.
    """

    format: str
    """Name of the decomposition's layout, checked when a saved state is
    loaded (a decomposition of another format is recomputed)."""

    bases_everywhere: ClassVar[bool] = False
    """Whether every rank that holds examples needs this layer's
    decompositions, not only its gradient workers (EKFAC: each rank
    estimates the scaling from its own examples)."""

    reduces_statistics: ClassVar[bool] = False
    """Whether `batch_statistics` returns statistics for the engine to
    average over the ranks on factor-update steps (EKFAC's scaling)."""

    keeps_examples: ClassVar[bool] = False
    """Whether the layer must keep each call's input and output gradient
    until the step's decompositions are done (statistics of each example,
    as EKFAC's scaling)."""

    grad_worker_statistics: ClassVar[bool] = False
    """Whether the saved statistics live only where the layer's gradient
    is preconditioned (its gradient workers), as EIGEN_ADAM's second
    moments: `state_dict()` broadcasts them from a gradient worker to the
    ranks that receive its gradient (every rank then calls it), and a
    rank that is no gradient worker drops them on load."""

    gradient_factors: bool = False
    """Whether the layer's factors are the gradient's own (`G = E[V Vᵀ]`,
    `A = E[Vᵀ V]`): the engine then registers no hooks for the layer,
    allreduces none of its factors, and calls `update_gradient_factors`
    with the averaged gradient on every rank on factor-update steps."""

    def __init__(self, layer: KFACBaseLayer) -> None:
        self.layer = layer

    def __repr__(self) -> str:
        return f'{type(self).__name__}()'

    # Decomposition (on the inverse worker) --------------------------------

    @abc.abstractmethod
    def layout(self, name: str) -> Layout:
        """Shapes of factor `name`'s decomposition tensors, and whether each
        is symmetric.
        """

    @abc.abstractmethod
    def decompose(
        self,
        name: str,
        matrix: torch.Tensor,
        dtype: torch.dtype,
        damping: float,
    ) -> Decomposed:
        """One attempt at decomposing `matrix` (factor `name`, already in
        `dtype`, a vector for a diagonal factor).

        Raises:
            torch.linalg.LinAlgError: the attempt failed (the layer
                retries).
        """

    def finalize(
        self,
        name: str,
        tensors: tuple[torch.Tensor, ...],
        damping: float,
    ) -> tuple[torch.Tensor, ...] | None:
        """What is kept of a valid attempt (None: it cannot be completed,
        for it needs another factor's decomposition, which failed). The
        default keeps the tensors.
        """
        return tensors

    def cost(self, name: str, strategy: AssignmentStrategy) -> float:
        """KAISA's cost of decomposing factor `name` (balances the inverse
        workers): a dense `n x n` factor costs `n³` (`COMPUTE`) or `n²`
        (`MEMORY`), a diagonal one `n`.
        """
        factor = self.layer.factor(name)
        if factor.diagonal:
            return float(factor.dim)
        power = 3 if strategy is AssignmentStrategy.COMPUTE else 2
        return float(factor.dim**power)

    # Preconditioning (on the gradient workers) ----------------------------

    @abc.abstractmethod
    def precondition(self, grad: torch.Tensor, damping: float) -> torch.Tensor:
        """`V'` from `V` (`grad`, `(out, in[+1])` in `layer.inv_dtype`);
        called only when both factors' decompositions are held here.
        """

    # Statistics the engine reduces on factor-update steps -----------------

    def batch_statistics(self) -> dict[str, torch.Tensor]:
        """This rank's batch statistics of the last factor update, by name,
        to be averaged over all ranks (none by default). Called on every
        rank after the step's decompositions.
        """
        return {}

    def update_statistics(  # noqa: B027  # optional: nothing by default
        self,
        averaged: dict[str, torch.Tensor],
        decay: float,
        damping: float,
        *,
        preconditions: bool,
    ) -> None:
        """Fold the rank-averaged `batch_statistics` in (`decay`: the
        factors' `ξ`; `preconditions`: this rank preconditions the layer).
        """

    def update_gradient_factors(
        self, grad: torch.Tensor, decay: float
    ) -> None:
        """Fold the gradient's own factors `V Vᵀ` (as `G`) and `Vᵀ V` (as
        `A`) into the running factors: the first update sets them, later
        ones `F ← ξ F + (1 - ξ) F_batch`. A non-finite `V` leaves them as
        they were (zero before the first finite one), without a host
        synchronisation.

        Args:
            grad: `V`, `(out, in[+1])`, the same on every rank (after the
                data-parallel reduction).
            decay: `ξ` (`factor_decay`).
        """
        layer = self.layer
        v = grad.to(compute_dtype(grad.dtype, layer.factor_dtype))
        finite = torch.isfinite(v).all()
        v = torch.where(finite, v, torch.zeros_like(v))
        for name, batch in (('A', v.T @ v), ('G', v @ v.T)):
            old = layer.factor(name).value
            if old is None:
                layer.set_factor(name, batch)
                continue
            new = batch.mul_(1.0 - decay).add_(
                old.to(batch.dtype), alpha=decay
            )
            layer.set_factor(name, torch.where(finite, new, old))

    def restart(self) -> None:  # noqa: B027  # optional: nothing by default
        """The factors were just decomposed afresh (a basis refresh); called
        on every rank, after the step's decompositions arrived (a rank that
        receives them may receive them into the tensors it held).
        """

    # State -------------------------------------------------------------------

    def statistic_shapes(self) -> dict[str, tuple[int, ...]]:
        """The running statistics saved besides the factors, by name, with
        their shapes (none by default).
        """
        return {}

    def saved_statistics(self) -> dict[str, torch.Tensor]:
        """The running statistics that exist now."""
        return {}

    def load_statistics(  # noqa: B027  # optional: nothing by default
        self, saved: dict[str, torch.Tensor], restored: bool
    ) -> None:
        """Restore the saved statistics (`restored`: the decompositions
        were restored too, rather than to be recomputed).
        """

    def follow(self) -> None:  # noqa: B027  # optional: nothing by default
        """The layer moved to another device or dtype: move what is held."""

    def memory_usage(self) -> dict[str, int]:
        """Bytes held besides the factors and decompositions, by kind."""
        return {}
