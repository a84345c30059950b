"""EIGEN_ADAM: Adam's second moments in the factors' Kronecker eigenbases.

The factors are decomposed as EIGEN decomposes them (`eigh`, or the
warm-started QR of `basis_refresh='qr'`) on their inverse workers, every
`inv_update_steps`; their source is K-FAC's `A` and `G` or the gradient's
own (`source`, see
[`kfac.layers.curvature.source`][kfac.layers.curvature.source]).
On every step, each gradient worker of the layer rotates the gradient into
the bases, `R = Q_Gᵀ V Q_A`, updates `E ← β₂ E + (1 - β₂) R ⊙ R` and
returns `V' = Q_G (R ⊘ (√(E / c) + ε)) Q_Aᵀ` (the math is in
[`kfac.math.eigenbasis`][kfac.math.eigenbasis]; `c = 1 - β₂ᵗ` with
`bias_correction`, else 1).

Choices (measured and argued on the how-it-works page):

* `ε` is the method's own option (`eps`, Adam's 1e-8): `V'` has the scale of
  a unit step per coordinate, so `damping` (in the factors' units, for the
  other methods) plays no part;
* a basis refresh carries `E` into the new bases by default
  (`on_refresh='carry'`), or restarts it (`'restart'`): a restarted `E`
  makes the next step a sign step of length `1 / √(1 - β₂)` per
  coordinate without bias correction, and Adam's first step with it;
* there is no first moment: momentum is the base optimizer's (SGD with
  momentum at Adam-scale learning rates), applied after preconditioning;
* the relative clip keeps its default (`relative_clip='auto'`, 1): it
  scales each step back to the raw gradient's length, which grafts SGD's
  step length onto this method's direction (learning rates at SGD's
  scale); with `relative_clip=None` the step has Adam's scale (learning
  rates at Adam's scale). Measured on the study's GPT, the clipped form
  did better (see the how-it-works page).

`E` (with its update count `t`) lives where the layer's gradient is
preconditioned: on every rank under COMM-OPT, on one rank per layer under
MEM-OPT. A non-finite `R` leaves `E` and `t` as they were (and the engine
keeps the raw gradient), without a host synchronisation. `state_dict()`
gathers `E` and `t` from a gradient worker (`grad_worker_statistics`), so
any rank's state holds them; a resume at any world size gives them to the
new gradient workers. Like EKFAC's `S`, `E` belongs to the bases it was
kept in: without saved decompositions it is kept under
`basis_refresh='eigh'` (recomputed from the same factors) and restarted
under `'qr'`.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from typing import TYPE_CHECKING
from typing import ClassVar

import torch

from kfac.enums import BasisRefresh
from kfac.enums import FactorSource
from kfac.enums import MomentRefresh
from kfac.layers.curvature.base import CurvatureConfig
from kfac.layers.curvature.eigen import EigenConfig
from kfac.layers.curvature.eigen import EigenCurvature
from kfac.layers.curvature.source import check_source
from kfac.math.eigenbasis import carry_second_moment
from kfac.math.eigenbasis import normalized_step
from kfac.math.eigenbasis import rotate
from kfac.math.eigenbasis import unrotate
from kfac.validation import check_bool
from kfac.validation import validate_float

if TYPE_CHECKING:  # the layer holds its curvature and the curvature its layer
    from kfac.layers.base import KFACBaseLayer

__all__ = ['COUNT_KEY', 'MOMENT_KEY', 'EigenAdamConfig', 'EigenAdamCurvature']

MOMENT_KEY = 'E'
"""The name of the second moments among a layer's saved statistics."""

COUNT_KEY = 'E_steps'
"""The name of their update count `t` (a 0-d tensor)."""


@dataclasses.dataclass(frozen=True)
class EigenAdamConfig(CurvatureConfig):
    """EIGEN_ADAM and its options.

    Attributes:
        beta2: `β₂`, the decay of the second moments, in `[0, 1)`.
        eps: `ε` > 0, added to `√(E / c)` (`damping` is not used).
        bias_correction: divide `E` by `1 - β₂ᵗ` (Adam's); False gives
            RMSprop's step in the bases.
        on_refresh: `'carry'` (rotate `E` into refreshed bases) or
            `'restart'` (zero it, and `t`).
        source: `'kfac'` (K-FAC's `A` and `G`) or `'gradient'` (the
            gradient's own `Vᵀ V` and `V Vᵀ`).
        basis_refresh: as for
            [`EigenConfig`][kfac.layers.curvature.eigen.EigenConfig].

    Raises:
        TypeError, ValueError: an option of the wrong type or value.
    """

    name: ClassVar[str] = 'eigen_adam'
    enums: ClassVar[Mapping[str, type[enum.Enum]]] = {
        'on_refresh': MomentRefresh,
        'source': FactorSource,
        'basis_refresh': BasisRefresh,
    }

    beta2: float = 0.95
    eps: float = 1e-8
    bias_correction: bool = True
    on_refresh: MomentRefresh | str = MomentRefresh.CARRY
    source: FactorSource | str = FactorSource.KFAC
    basis_refresh: BasisRefresh | str = BasisRefresh.EIGH

    def __post_init__(self) -> None:
        super().__post_init__()
        validate_float('beta2', self.beta2, low=0.0, low_open=False)
        if self.beta2 >= 1.0:
            raise ValueError(
                f'beta2 must be a finite number >= 0.0 and < 1.0; got '
                f'{self.beta2!r}',
            )
        validate_float('eps', self.eps, low=0.0)
        check_bool('bias_correction', self.bias_correction)

    def make(self, layer: KFACBaseLayer) -> EigenAdamCurvature:
        """The EIGEN_ADAM curvature of `layer`.

        Raises:
            ValueError: `source='gradient'` for a layer it cannot serve.
        """
        return EigenAdamCurvature(layer, self)


class EigenAdamCurvature(EigenCurvature):
    """`Q_G (R ⊘ (√(E / c) + ε)) Q_Aᵀ` with `R = Q_Gᵀ V Q_A`.

    Args:
        layer: the layer.
        config: the method's options.
    """

    grad_worker_statistics: ClassVar[bool] = True

    def __init__(self, layer: KFACBaseLayer, config: EigenAdamConfig) -> None:
        bases = EigenConfig(
            prediv_eigenvalues=False, basis_refresh=config.basis_refresh
        )
        super().__init__(layer, bases)
        self.adam = config
        self.gradient_factors = check_source(
            layer, FactorSource(config.source), config.name
        )
        self.moment: torch.Tensor | None = None
        """`E`, `(out, in[+1])` in `inv_dtype`; None before the first step
        preconditioned here."""
        self.count: torch.Tensor | None = None
        """`t`, the finite updates of `E` (0-d, `inv_dtype`)."""
        self._held: tuple[torch.Tensor | None, torch.Tensor] | None = None
        """A copy of the bases `E` is kept in (`Q_A` None when `A` is
        diagonal), for carrying it into the next ones (a rank that
        receives the bases receives them into the tensors it holds); None:
        those held now."""

    def __repr__(self) -> str:
        return f'{type(self).__name__}({self.adam})'

    # Preconditioning -------------------------------------------------------

    def precondition(self, grad: torch.Tensor, damping: float) -> torch.Tensor:
        """Update `E` with this `V` and return `V'` (`damping` is unused)."""
        bases = self._bases()
        assert bases is not None  # the layer checks
        qa, qg = bases
        if self._held is None and self._carries:
            self._held = _copy(bases)
        rotated = rotate(grad, qa, qg)
        moment, count = self._update(rotated)
        correction: torch.Tensor | float = 1.0
        if self.adam.bias_correction:
            correction = 1.0 - self.adam.beta2**count
        step = normalized_step(rotated, moment, self.adam.eps, correction)
        return unrotate(step, qa, qg)

    @property
    def _carries(self) -> bool:
        return self.adam.on_refresh is MomentRefresh.CARRY

    def _bases(self) -> tuple[torch.Tensor | None, torch.Tensor] | None:
        """`(Q_A, Q_G)` held here (`Q_A` None for a diagonal `A`), or None."""
        a = self.layer.factor('A').decomposition
        g = self.layer.factor('G').decomposition
        if a is None or g is None:
            return None
        return (None if self.layer.factor('A').diagonal else a[0]), g[0]

    def restart(self) -> None:
        """The bases were refreshed: carry `E` into them from the copy of
        the old ones (`on_refresh='carry'`), or zero `E` and `t`.
        """
        bases = self._bases()
        held, self._held = self._held, None
        if bases is None or self.moment is None or self.count is None:
            return
        if not self._carries:
            self.moment = torch.zeros_like(self.moment)
            self.count = torch.zeros_like(self.count)
            return
        if held is not None:
            qa, qg = bases
            pa = None if qa is None or held[0] is None else qa.T @ held[0]
            self.moment = carry_second_moment(self.moment, pa, qg.T @ held[1])
        self._held = _copy(bases)

    def _update(
        self, rotated: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`E ← β₂ E + (1 - β₂) R ⊙ R`, `t ← t + 1` if `R` is finite."""
        if self.moment is None or self.count is None:
            self.moment = torch.zeros_like(rotated)
            self.count = torch.zeros(
                (), dtype=rotated.dtype, device=rotated.device
            )
        beta = self.adam.beta2
        finite = torch.isfinite(rotated).all()
        new = torch.addcmul(
            self.moment * beta, rotated, rotated, value=1.0 - beta
        )
        self.moment = torch.where(finite, new, self.moment)
        self.count = self.count + finite.to(self.count.dtype)
        return self.moment, self.count

    # State and memory --------------------------------------------------------

    def follow(self) -> None:
        """Move `E` and `t` to the layer's device and `inv_dtype`."""
        layer = self.layer
        if self.moment is not None and self.count is not None:
            self.moment = self.moment.to(layer.device, layer.inv_dtype)
            self.count = self.count.to(layer.device, layer.inv_dtype)
        self._held = None

    def statistic_shapes(self) -> dict[str, tuple[int, ...]]:
        """`E`, shaped like `V`, and `t`, 0-d."""
        return {MOMENT_KEY: self.layer.helper.grad_shape, COUNT_KEY: ()}

    def saved_statistics(self) -> dict[str, torch.Tensor]:
        """`E` and `t` if they exist here."""
        if self.moment is None or self.count is None:
            return {}
        return {MOMENT_KEY: self.moment, COUNT_KEY: self.count}

    def load_statistics(
        self, saved: dict[str, torch.Tensor], restored: bool
    ) -> None:
        """Restore `E` and `t` (none unless both were saved). Without the
        saved decompositions they are kept under `basis_refresh='eigh'`
        and dropped under `'qr'` (see the module's docstring).
        """
        moment, count = saved.get(MOMENT_KEY), saved.get(COUNT_KEY)
        keep = restored or self.adam.basis_refresh is BasisRefresh.EIGH
        self.moment = self.count = None
        self._held = None
        if moment is None or count is None or not keep:
            return
        layer = self.layer
        self.moment = moment.to(device=layer.device, dtype=layer.inv_dtype)
        self.count = count.to(device=layer.device, dtype=layer.inv_dtype)

    def memory_usage(self) -> dict[str, int]:
        """`moment`: `E`, `t` and the copy of the bases `E` is kept in."""
        held = () if self._held is None else self._held
        kept = (self.moment, self.count, *held)
        tensors = [t for t in kept if t is not None]
        return {'moment': sum(t.numel() * t.element_size() for t in tensors)}


def _copy(
    bases: tuple[torch.Tensor | None, torch.Tensor],
) -> tuple[torch.Tensor | None, torch.Tensor]:
    qa, qg = bases
    return (None if qa is None else qa.clone()), qg.clone()
