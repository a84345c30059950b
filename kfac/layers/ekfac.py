"""EKFAC: EIGEN's eigenbases with the scaling re-estimated per example.

A [`KFACEKFACLayer`][kfac.layers.ekfac.KFACEKFACLayer] decomposes its
factors as [`KFACEigenLayer`][kfac.layers.eigen.KFACEigenLayer] does
(eigenvectors and eigenvalues, `eigh` or a warm start) and preconditions
with `V' = Q_G [(Q_Gᵀ V Q_A) / (S + λ)] Q_Aᵀ`, where the scaling `S` is the
second moment of each example's gradient in those bases (the math, and the
cheapest form for each kind of layer, are in
[`kfac.math.ekfac`][kfac.math.ekfac]).

`S` follows the factors' schedule. On a factor-update step the layer keeps
each call's input and output gradient
([`ExampleRows`][kfac.layers.examples.ExampleRows]) until the step's
decomposition is done; then `scale_batch` forms this rank's batch `S` in
the bases in force, the engine averages it over the ranks, and
`update_scale` folds it into the running `S` with `factor_decay`. A basis
refresh restarts `S` (`restart_scale`): its next update sets it, and until
then (a decomposition on a step without a factor update) the eigenvalues
stand in for it, `S = d_G d_Aᵀ`, as under EIGEN. Every rank that holds
examples needs the bases, and holds `S`, so that any rank's
`state_dict()` saves it.

The calls of one backward pass are positions of the same examples, so
they must hold the same number of examples (a `ValueError` names the
module otherwise).
"""

from __future__ import annotations

from typing import Any
from typing import ClassVar

import torch

from kfac.layers.eigen import KFACEigenLayer
from kfac.layers.embedding import diagonal_eigen_precondition
from kfac.layers.examples import Call
from kfac.layers.examples import ExampleRows
from kfac.layers.examples import Pass
from kfac.layers.helper import ModuleHelper
from kfac.math import compute_dtype
from kfac.math import damped_reciprocal
from kfac.math import eigen_precondition
from kfac.math import eigenbasis_scale
from kfac.math import eigenvalue_outer_product
from kfac.math import onehot_scale
from kfac.math import rotate_onehot
from kfac.state import SavedLayer
from kfac.validation import check_bool

__all__ = ['SCALE_KEY', 'KFACEKFACLayer']

SCALE_KEY = 'S'
"""The name of the scaling among a layer's saved statistics."""

Rows = tuple[torch.Tensor, torch.Tensor]
"""`(g rows (N, T, out), a rows (N, T, in) or tokens (N, T))` of a call."""


class KFACEKFACLayer(KFACEigenLayer):
    """Precondition with `Q_G [(Q_Gᵀ V Q_A) / (S + λ)] Q_Aᵀ`.

    Args:
        module: helper of the module.
        prediv_eigenvalues: keep `1 / (S + λ)`, computed when `S` is
            updated on the ranks that precondition the layer
            (`compute_eigenvalue_outer_product`), instead of forming it at
            every step; recomputed if `λ` changes, so the result is the
            same either way. No `colocate_factors` needed: both bases are
            on every rank.
        basis_refresh: as for
            [`KFACEigenLayer`][kfac.layers.eigen.KFACEigenLayer].
        **kwargs: see [`KFACBaseLayer`][kfac.layers.base.KFACBaseLayer].
    """

    bases_everywhere: ClassVar[bool] = True

    def __init__(
        self,
        module: ModuleHelper,
        *,
        prediv_eigenvalues: bool = False,
        basis_refresh: str = 'eigh',
        **kwargs: Any,
    ) -> None:
        super().__init__(module, basis_refresh=basis_refresh, **kwargs)
        self.prediv_scale = check_bool(
            'prediv_eigenvalues', prediv_eigenvalues
        )
        self.examples = ExampleRows()
        self.scale: torch.Tensor | None = None
        """The running `S`, `(out, in[+1])` in `inv_dtype`; None after a
        basis refresh until its first update."""
        self._inverse: tuple[float, torch.Tensor] | None = None

    # The scaling -----------------------------------------------------------

    def restart_scale(self) -> None:
        """Forget `S` (the bases were refreshed): its next update sets it."""
        self.scale = None
        self._inverse = None

    def scale_batch(self) -> torch.Tensor | None:
        """This rank's batch `S` from the calls of the last factor update,
        in the bases held now; the calls are dropped.

        Returns:
            `(1/Z) Σ_n (Q_Gᵀ ∇W_n Q_A)²` in `inv_dtype`, or None without
                calls or bases.

        Raises:
            ValueError: the calls of one backward pass hold different
                numbers of examples.
        """
        assert self.examples is not None  # set at construction
        passes = self.examples.take()
        a, g = self.a.decomposition, self.g.decomposition
        if not passes or a is None or g is None:
            return None
        dtype = compute_dtype(self.stat_dtype, self.inv_dtype)
        qg = g[0].to(dtype)
        qa = None if self.a.diagonal else a[0].to(dtype)
        total = sum(self._pass_scale(p, qg, qa, dtype) for p in passes)
        assert isinstance(total, torch.Tensor)  # at least one pass
        count = sum(p.terms for p in passes)
        return (total / count if count else total).to(self.inv_dtype)

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
        terms = [self.example_rows(call, dtype) for call in step.calls]
        sizes = sorted({g.shape[0] for g, _ in terms})
        if len(sizes) > 1:
            raise ValueError(
                f'EKFAC: the calls of {self.module.module} in one backward '
                f'pass hold different numbers of examples {sizes}; its '
                "scaling needs each example's gradient over all its calls "
                '(use the same batch in every call, or another '
                'compute_method for this module)'
            )
        g_rows = torch.cat([g for g, _ in terms], dim=1)
        onehot = [not a.is_floating_point() for _, a in terms]
        if all(onehot) and qa is None:
            tokens = torch.cat([a for _, a in terms], dim=1)
            return onehot_scale(g_rows, tokens, qg, self.a.dim)
        if any(onehot):  # one-hot rows in a dense basis: rotate them first
            assert qa is not None  # one-hot rows with Q_A = I returned above
            rotated = [
                rotate_onehot(a, qa) if hot else a @ qa
                for (_, a), hot in zip(terms, onehot)
            ]
            return eigenbasis_scale(g_rows, torch.cat(rotated, 1), qg, None)
        a_rows = torch.cat([a for _, a in terms], dim=1)
        return eigenbasis_scale(g_rows, a_rows, qg, qa)

    def example_rows(self, call: Call, dtype: torch.dtype) -> Rows:
        """The output-gradient and input rows of one call, oriented as
        `V` (see [`ModuleHelper`][kfac.layers.helper.ModuleHelper]).
        """
        return (
            self.module.g_example_rows(call.grad_output, dtype, call.scale),
            self.module.a_example_rows(call.layer_input, dtype),
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
        batch = batch.to(device=self.device, dtype=self.inv_dtype)
        finite = torch.isfinite(batch).all()
        old = self.scale if self.scale is not None else self._eigenvalues()
        new = batch.clone()
        if self.scale is not None:
            new.mul_(1.0 - decay).add_(self.scale, alpha=decay)
        self.scale = torch.where(finite, new, old)
        self._inverse = None
        if precompute and self.prediv_scale:
            self._inverse = (damping, damped_reciprocal(self.scale, damping))

    def _eigenvalues(self) -> torch.Tensor:
        """`d_G d_Aᵀ`: EIGEN's scaling, which stands in for `S`."""
        a, g = self.a.decomposition, self.g.decomposition
        assert a is not None and g is not None  # callers check
        return torch.outer(g[-1], a[-1])

    # Preconditioning -------------------------------------------------------

    def _scale_inverse(self, damping: float) -> torch.Tensor:
        """`1 / (S + λ)`, or EIGEN's `1 / (d_G d_Aᵀ + λ)` without `S`."""
        scale = self.scale
        if scale is None:
            a, g = self.a.decomposition, self.g.decomposition
            assert a is not None and g is not None  # the caller checks
            return eigenvalue_outer_product(g[-1], a[-1], damping)
        if not self.prediv_scale:
            return damped_reciprocal(scale, damping)
        kept = self._inverse
        if kept is None or kept[0] != damping:
            kept = self._inverse = (damping, damped_reciprocal(scale, damping))
        return kept[1]

    def _precondition(
        self, grad: torch.Tensor, damping: float
    ) -> torch.Tensor:
        a, g = self.a.decomposition, self.g.decomposition
        assert (
            a is not None and g is not None
        )  # the caller checks has_decomposition
        scale = self._scale_inverse(damping)
        if self.a.diagonal:
            return diagonal_eigen_precondition(grad, g[0], scale)
        return eigen_precondition(grad, a[0], g[0], scale)

    # State and memory --------------------------------------------------------

    def follow_module(self) -> bool:  # noqa: D102  # documented in the base
        moved = super().follow_module()
        if moved and self.scale is not None:
            self.scale = self.scale.to(self.device, self.inv_dtype)
            self._inverse = None
        return moved

    def statistic_shapes(self) -> dict[str, tuple[int, ...]]:
        """`S`, shaped like `V`."""
        return {SCALE_KEY: self.module.grad_shape}

    def saved_statistics(self) -> dict[str, torch.Tensor]:
        """`S` if it exists."""
        return {} if self.scale is None else {SCALE_KEY: self.scale}

    def load_saved_state(self, saved: SavedLayer, keep: bool) -> bool:
        """As for any layer, and `S` (None when not saved). `S` belongs to
        the bases it was estimated in: without saved decompositions it is
        kept under `basis_refresh='eigh'` (recomputed from the same
        factors, they are the same bases) and restarted under `'qr'`
        (whose bases depended on the ones before).
        """
        restored = super().load_saved_state(saved, keep)
        scale = saved.statistics.get(SCALE_KEY)
        if not restored and self.basis_refresh != 'eigh':
            scale = None
        self.scale = (
            None
            if scale is None
            else scale.to(device=self.device, dtype=self.inv_dtype)
        )
        self._inverse = None
        return restored

    def memory_usage(self) -> dict[str, int]:
        """As for any layer, plus `scale` (`S` and a kept `1 / (S + λ)`)
        and `example_rows` (the calls kept for `S`; with
        `update_factors_in_hook=False` the same tensors as `a_batch` and
        `g_batch`).
        """
        return {**super().memory_usage(), **self.scale_memory()}

    def scale_memory(self) -> dict[str, int]:
        """Bytes of `scale` and `example_rows` (see `memory_usage`)."""
        inverse = None if self._inverse is None else self._inverse[1]
        tensors = [t for t in (self.scale, inverse) if t is not None]
        assert self.examples is not None  # set at construction
        return {
            'scale': sum(t.numel() * t.element_size() for t in tensors),
            'example_rows': sum(self.examples.nbytes()),
        }
