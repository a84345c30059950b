"""EKFAC: EIGEN's eigenbases with the scaling re-estimated per example.

The factors are decomposed as EIGEN decomposes them (eigenvectors and
eigenvalues, `eigh` or a warm start), and the gradient is preconditioned
with `V' = Q_G [(Q_Gᵀ V Q_A) / (S + λ)] Q_Aᵀ`, where the scaling `S` is the
second moment of each example's gradient in those bases (the math, and the
cheapest form for each kind of layer, are in
[`kfac.math.ekfac`][kfac.math.ekfac]).

`S` follows the factors' schedule. On a factor-update step the layer keeps
each call's input and output gradient
([`ExampleRows`][kfac.layers.examples.ExampleRows]) until the step's
decomposition is done; then `batch_statistics` forms this rank's batch `S`
in the bases in force, the engine averages it over the ranks, and
`update_statistics` folds it into the running `S` with `factor_decay`. A
basis refresh restarts `S` (`restart`): its next update sets it, and until
then (a decomposition on a step without a factor update) the eigenvalues
stand in for it, `S = d_G d_Aᵀ`, as under EIGEN. Every rank that holds
examples needs the bases, and holds `S`, so that any rank's `state_dict()`
saves it.

The calls of one backward pass are positions of the same examples, so they
must hold the same number of examples (a `ValueError` names the module
otherwise).
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from typing import TYPE_CHECKING
from typing import ClassVar

import torch

from kfac.enums import BasisRefresh
from kfac.layers.curvature.base import CurvatureConfig
from kfac.layers.curvature.eigen import EigenConfig
from kfac.layers.curvature.eigen import EigenCurvature
from kfac.layers.embedding import diagonal_eigen_precondition
from kfac.layers.examples import Pass
from kfac.math import compute_dtype
from kfac.math import damped_reciprocal
from kfac.math import eigen_precondition
from kfac.math import eigenbasis_scale
from kfac.math import eigenvalue_outer_product
from kfac.math import onehot_scale
from kfac.math import rotate_onehot
from kfac.validation import check_bool

if TYPE_CHECKING:  # the layer holds its curvature and the curvature its layer
    from kfac.layers.base import KFACBaseLayer

__all__ = ['SCALE_KEY', 'EKFACConfig', 'EKFACCurvature']

SCALE_KEY = 'S'
"""The name of the scaling among a layer's saved statistics."""


@dataclasses.dataclass(frozen=True)
class EKFACConfig(CurvatureConfig):
    """EKFAC and its options.

    Attributes:
        prediv_eigenvalues: keep `1 / (S + λ)`, computed when `S` is
            updated on the ranks that precondition the layer (the
            original's `compute_eigenvalue_outer_product`), instead of
            forming it at every step; recomputed if `λ` changes, so the
            result is the same either way.
        basis_refresh: as for
            [`EigenConfig`][kfac.layers.curvature.eigen.EigenConfig].

    `λ` is added to `S` as given (no `damping_mode`), and the bases are
    full (no `factor_rank`): `S` is re-estimated in the whole eigenbasis.

    Raises:
        TypeError, ValueError: an option of the wrong type or value.
    """

    name: ClassVar[str] = 'ekfac'
    enums: ClassVar[Mapping[str, type[enum.Enum]]] = {
        'basis_refresh': BasisRefresh
    }

    prediv_eigenvalues: bool = True
    basis_refresh: BasisRefresh | str = BasisRefresh.EIGH

    def __post_init__(self) -> None:
        super().__post_init__()
        check_bool('prediv_eigenvalues', self.prediv_eigenvalues)

    def make(self, layer: KFACBaseLayer) -> EKFACCurvature:
        """The EKFAC curvature of `layer`."""
        return EKFACCurvature(layer, self)


class EKFACCurvature(EigenCurvature):
    """`Q_G [(Q_Gᵀ V Q_A) / (S + λ)] Q_Aᵀ`.

    Args:
        layer: the layer.
        config: the method's options.
    """

    bases_everywhere: ClassVar[bool] = True
    reduces_statistics: ClassVar[bool] = True
    keeps_examples: ClassVar[bool] = True

    def __init__(self, layer: KFACBaseLayer, config: EKFACConfig) -> None:
        bases = EigenConfig(
            prediv_eigenvalues=False, basis_refresh=config.basis_refresh
        )
        super().__init__(layer, bases)
        self.ekfac = config
        self.scale: torch.Tensor | None = None
        """The running `S`, `(out, in[+1])` in `inv_dtype`; None after a
        basis refresh until its first update."""
        self._inverse: tuple[float, torch.Tensor] | None = None

    def __repr__(self) -> str:
        return f'{type(self).__name__}({self.ekfac})'

    # The scaling -----------------------------------------------------------

    def restart(self) -> None:
        """Forget `S` (the bases were refreshed): its next update sets it."""
        self.scale = None
        self._inverse = None

    def batch_statistics(self) -> dict[str, torch.Tensor]:
        """`{'S': batch}`: this rank's batch `S` from the calls of the last
        factor update, in the bases held now (empty without calls or
        bases); the calls are dropped.
        """
        batch = self.scale_batch()
        return {} if batch is None else {SCALE_KEY: batch}

    def scale_batch(self) -> torch.Tensor | None:
        """This rank's batch `S`, `(1/Z) Σ_n (Q_Gᵀ ∇W_n Q_A)²` in
        `inv_dtype`, or None without calls or bases.

        Raises:
            ValueError: the calls of one backward pass hold different
                numbers of examples.
        """
        layer = self.layer
        examples = layer.statistics.examples
        assert examples is not None  # kept for this curvature
        passes = examples.take()
        a = layer.factor('A').decomposition
        g = layer.factor('G').decomposition
        if not passes or a is None or g is None:
            return None
        dtype = compute_dtype(layer.statistics.stat_dtype, layer.inv_dtype)
        qg = g[0].to(dtype)
        qa = None if layer.factor('A').diagonal else a[0].to(dtype)
        total = sum(self._pass_scale(p, qg, qa, dtype) for p in passes)
        assert isinstance(total, torch.Tensor)  # at least one pass
        count = sum(p.terms for p in passes)
        return (total / count if count else total).to(layer.inv_dtype)

    def _pass_scale(
        self,
        step: Pass,
        qg: torch.Tensor,
        qa: torch.Tensor | None,
        dtype: torch.dtype,
    ) -> torch.Tensor:
        """`Σ_n (Q_Gᵀ ∇W_n Q_A)²` over the examples of one backward pass,
        every call's positions summed into `∇W_n`.
        """
        rows = self.layer.statistics.example_rows
        terms = [rows(call, dtype) for call in step.calls]
        sizes = sorted({g.shape[0] for g, _ in terms})
        if len(sizes) > 1:
            raise ValueError(
                f'EKFAC: the calls of {self.layer.helper.module} in one '
                f'backward pass hold different numbers of examples {sizes}; '
                "its scaling needs each example's gradient over all its "
                'calls (use the same batch in every call, or another '
                'compute_method for this module)'
            )
        g_rows = torch.cat([g for g, _ in terms], dim=1)
        onehot = [not a.is_floating_point() for _, a in terms]
        if all(onehot) and qa is None:
            tokens = torch.cat([a for _, a in terms], dim=1)
            return onehot_scale(g_rows, tokens, qg, self.layer.factor('A').dim)
        if any(onehot):  # one-hot rows in a dense basis: rotate them first
            assert qa is not None  # one-hot rows with Q_A = I returned above
            rotated = [
                rotate_onehot(a, qa) if hot else a @ qa
                for (_, a), hot in zip(terms, onehot)
            ]
            return eigenbasis_scale(g_rows, torch.cat(rotated, 1), qg, None)
        a_rows = torch.cat([a for _, a in terms], dim=1)
        return eigenbasis_scale(g_rows, a_rows, qg, qa)

    def update_statistics(
        self,
        averaged: dict[str, torch.Tensor],
        decay: float,
        damping: float,
        *,
        preconditions: bool,
    ) -> None:
        """Fold the rank-averaged batch `S` in (see `update_scale`)."""
        self.update_scale(
            averaged[SCALE_KEY], decay, damping, precompute=preconditions
        )

    def update_scale(
        self,
        batch: torch.Tensor,
        decay: float,
        damping: float,
        *,
        precompute: bool,
    ) -> None:
        """Fold the (rank-averaged) batch `S` into the running `S`: it sets
        `S` after a restart, else `S ← ξ S + (1 - ξ) S_batch`. A batch with a
        non-finite entry leaves `S` as it was (after a restart: the
        eigenvalues `d_G d_Aᵀ`), without a host synchronisation.

        Args:
            batch: the batch `S`, `(out, in[+1])`.
            decay: `ξ` (`factor_decay`).
            damping: `λ` in force, for `1 / (S + λ)`.
            precompute: this rank preconditions the layer: keep
                `1 / (S + λ)` if `prediv_eigenvalues`.
        """
        layer = self.layer
        batch = batch.to(device=layer.device, dtype=layer.inv_dtype)
        finite = torch.isfinite(batch).all()
        old = self.scale if self.scale is not None else self._eigenvalues()
        new = batch.clone()
        if self.scale is not None:
            new.mul_(1.0 - decay).add_(self.scale, alpha=decay)
        self.scale = torch.where(finite, new, old)
        self._inverse = None
        if precompute and self.ekfac.prediv_eigenvalues:
            self._inverse = (damping, damped_reciprocal(self.scale, damping))

    def _eigenvalues(self) -> torch.Tensor:
        """`d_G d_Aᵀ`: EIGEN's scaling, which stands in for `S`."""
        a = self.layer.factor('A').decomposition
        g = self.layer.factor('G').decomposition
        assert a is not None and g is not None  # callers check
        return torch.outer(g[-1], a[-1])

    # Preconditioning -------------------------------------------------------

    def _scale_inverse(self, damping: float) -> torch.Tensor:
        """`1 / (S + λ)`, or EIGEN's `1 / (d_G d_Aᵀ + λ)` without `S`."""
        scale = self.scale
        if scale is None:
            a = self.layer.factor('A').decomposition
            g = self.layer.factor('G').decomposition
            assert a is not None and g is not None  # the caller checks
            return eigenvalue_outer_product(g[-1], a[-1], damping)
        if not self.ekfac.prediv_eigenvalues:
            return damped_reciprocal(scale, damping)
        kept = self._inverse
        if kept is None or kept[0] != damping:
            kept = self._inverse = (damping, damped_reciprocal(scale, damping))
        return kept[1]

    def precondition(self, grad: torch.Tensor, damping: float) -> torch.Tensor:
        """`Q_G [(Q_Gᵀ V Q_A) / (S + λ)] Q_Aᵀ`."""
        a = self.layer.factor('A').decomposition
        g = self.layer.factor('G').decomposition
        assert a is not None and g is not None  # the layer checks
        scale = self._scale_inverse(damping)
        if self.layer.factor('A').diagonal:
            return diagonal_eigen_precondition(grad, g[0], scale)
        return eigen_precondition(grad, a[0], g[0], scale)

    # State and memory --------------------------------------------------------

    def follow(self) -> None:
        """Move `S` to the layer's device and `inv_dtype`."""
        if self.scale is not None:
            self.scale = self.scale.to(self.layer.device, self.layer.inv_dtype)
            self._inverse = None

    def statistic_shapes(self) -> dict[str, tuple[int, ...]]:
        """`S`, shaped like `V`."""
        return {SCALE_KEY: self.layer.helper.grad_shape}

    def saved_statistics(self) -> dict[str, torch.Tensor]:
        """`S` if it exists."""
        return {} if self.scale is None else {SCALE_KEY: self.scale}

    def load_statistics(
        self, saved: dict[str, torch.Tensor], restored: bool
    ) -> None:
        """Restore `S` (None when not saved). `S` belongs to the bases it
        was estimated in: without saved decompositions it is kept under
        `basis_refresh='eigh'` (recomputed from the same factors, they are
        the same bases) and restarted under `'qr'` (whose bases depended
        on the ones before).
        """
        scale = saved.get(SCALE_KEY)
        if not restored and self.ekfac.basis_refresh != 'eigh':
            scale = None
        layer = self.layer
        self.scale = (
            None
            if scale is None
            else scale.to(device=layer.device, dtype=layer.inv_dtype)
        )
        self._inverse = None

    def memory_usage(self) -> dict[str, int]:
        """`scale` (`S` and a kept `1 / (S + λ)`) and `example_rows` (the
        calls kept for `S`; with `update_factors_in_hook=False` the same
        tensors as `a_batch` and `g_batch`).
        """
        inverse = None if self._inverse is None else self._inverse[1]
        tensors = [t for t in (self.scale, inverse) if t is not None]
        examples = self.layer.statistics.examples
        assert examples is not None  # kept for this curvature
        return {
            'scale': sum(t.numel() * t.element_size() for t in tensors),
            'example_rows': sum(examples.nbytes()),
        }
