"""kfac.layers.curvature.eigen_adam: Adam's second moments in the factors'
eigenbases, against the formula on explicit Kronecker matrices and, with
identity bases, against `torch.optim.RMSprop` (training end to end, under
DDP and across checkpoints is in tests/system/test_eigen_adam.py).
"""

from __future__ import annotations

from typing import Any
from typing import ClassVar

import pytest
import torch
from torch import nn

import kfac
from kfac.layers.base import KFACBaseLayer
from kfac.layers.curvature.eigen_adam import COUNT_KEY
from kfac.layers.curvature.eigen_adam import MOMENT_KEY
from kfac.layers.curvature.eigen_adam import EigenAdamConfig
from kfac.layers.curvature.eigen_adam import EigenAdamCurvature
from kfac.layers.embedding import EmbeddingModuleHelper
from kfac.layers.modules import LinearModuleHelper
from testing.asserts import assert_rel_close

F64 = torch.float64
BETA2 = 0.7
EPS = 1e-3


def linear_layer(**options: Any) -> KFACBaseLayer:
    torch.manual_seed(0)
    config = EigenAdamConfig(beta2=BETA2, eps=EPS, **options)
    return KFACBaseLayer(
        LinearModuleHelper(nn.Linear(4, 3).double()), curvature=config
    )


def curvature(layer: KFACBaseLayer) -> EigenAdamCurvature:
    assert isinstance(layer.curvature, EigenAdamCurvature)
    return layer.curvature


def spd(n: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    m = torch.randn(n, n, generator=gen, dtype=F64)
    return m @ m.T + 0.1 * torch.eye(n, dtype=F64)


def refresh(layer: KFACBaseLayer, a: torch.Tensor, g: torch.Tensor) -> None:
    """New factors decomposed, and the refresh told, as a step does it."""
    layer.set_factor('A', a)
    layer.set_factor('G', g)
    for name in ('A', 'G'):
        assert layer.compute_decomposition(name, 0.0)
    layer.curvature.restart()


def grads(count: int, shape: tuple[int, int]) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(9)
    return [torch.randn(shape, generator=gen, dtype=F64) for _ in range(count)]


def vec(m: torch.Tensor) -> torch.Tensor:
    return m.T.reshape(-1)


def unvec(v: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    return v.reshape(shape[1], shape[0]).T


class Reference:
    """The formula on `vec V` in `Q = Q_A ⊗ Q_G` (column-major `vec`)."""

    def __init__(self, carry: bool, bias_correction: bool) -> None:
        self.carry = carry
        self.bias_correction = bias_correction
        self.basis: torch.Tensor | None = None
        self.moment: torch.Tensor | None = None
        self.count = 0

    def refresh(self, a: torch.Tensor, g: torch.Tensor) -> None:
        basis = torch.kron(torch.linalg.eigh(a)[1], torch.linalg.eigh(g)[1])
        old, self.basis = self.basis, basis
        if old is None or self.moment is None:
            return
        if not self.carry:
            self.moment, self.count = None, 0
            return
        seen = basis.T @ old @ torch.diag(self.moment) @ old.T @ basis
        self.moment = torch.diagonal(seen).clone()

    def step(self, v: torch.Tensor) -> torch.Tensor:
        assert self.basis is not None
        r = self.basis.T @ vec(v)
        moment = torch.zeros_like(r) if self.moment is None else self.moment
        self.moment = BETA2 * moment + (1 - BETA2) * r * r
        self.count += 1
        c = 1 - BETA2**self.count if self.bias_correction else 1.0
        return unvec(
            self.basis @ (r / ((self.moment / c).sqrt() + EPS)), v.shape
        )


@pytest.mark.parametrize(
    ('on_refresh', 'bias_correction'),
    [('carry', True), ('restart', True), ('carry', False)],
)
def test_preconditioning_is_the_formula_on_explicit_matrices(
    on_refresh: str, bias_correction: bool
) -> None:
    layer = linear_layer(
        on_refresh=on_refresh, bias_correction=bias_correction
    )
    method = curvature(layer)
    reference = Reference(on_refresh == 'carry', bias_correction)
    for seed in (1, 2, 3):
        a, g = spd(5, seed), spd(3, 10 + seed)
        refresh(layer, a, g)
        reference.refresh(a, g)
        for v in grads(3 if seed < 3 else 2, (3, 5)):
            got = method.precondition(v, damping=123.0)  # no damping
            want = reference.step(v)
            assert_rel_close(got, want, rtol=1e-11, label='eigen_adam formula')
    assert method.count is not None
    assert int(method.count) == (8 if on_refresh == 'carry' else 2)


def test_identity_bases_are_rmsprop() -> None:
    """Diagonal factors (distinct values): the eigenbases are permutations
    with signs, under which the elementwise step is the same; without bias
    correction the step is `torch.optim.RMSprop`'s without momentum.
    """
    layer = linear_layer(bias_correction=False)
    method = curvature(layer)
    a = torch.diag(torch.tensor([3.0, 1.0, 4.0, 1.5, 9.0], dtype=F64))
    g = torch.diag(torch.tensor([2.0, 7.0, 1.0], dtype=F64))
    refresh(layer, a, g)
    param = nn.Parameter(torch.zeros(3, 5, dtype=F64))
    rmsprop = torch.optim.RMSprop([param], lr=1.0, alpha=BETA2, eps=EPS)
    for v in grads(5, (3, 5)):
        before = param.detach().clone()
        param.grad = v.clone()
        rmsprop.step()
        got = method.precondition(v, damping=0.0)
        assert_rel_close(got, before - param.detach(), label='RMSprop')


def test_a_nonfinite_gradient_leaves_the_moments() -> None:
    layer = linear_layer()
    method = curvature(layer)
    refresh(layer, spd(5, 1), spd(3, 2))
    v = grads(1, (3, 5))[0]
    method.precondition(v, 0.0)
    moment, count = method.moment, method.count
    assert moment is not None and count is not None
    bad = v.clone()
    bad[0, 0] = float('nan')
    assert not torch.isfinite(method.precondition(bad, 0.0)).all()
    assert method.moment is not None and method.count is not None
    assert torch.equal(method.moment, moment)
    assert torch.equal(method.count, count)


def test_state_round_trip_and_memory() -> None:
    layer = linear_layer()
    method = curvature(layer)
    method.follow()  # nothing to move
    assert method.saved_statistics() == {}
    assert method.memory_usage() == {'moment': 0}
    assert method.statistic_shapes() == {MOMENT_KEY: (3, 5), COUNT_KEY: ()}
    refresh(layer, spd(5, 1), spd(3, 2))
    for v in grads(2, (3, 5)):
        method.precondition(v, 0.0)
    saved = method.saved_statistics()
    assert int(saved[COUNT_KEY]) == 2
    # E, t and the copy of the bases E is kept in (5x5 and 3x3)
    assert method.memory_usage() == {'moment': 8 * (15 + 1 + 25 + 9)}
    other = curvature(linear_layer())
    other.load_statistics(dict(saved), restored=False)  # 'eigh': kept
    assert other.moment is not None
    assert torch.equal(other.moment, saved[MOMENT_KEY])
    other.follow()
    assert other.moment.dtype == F64
    warm = curvature(linear_layer(basis_refresh='qr'))
    warm.load_statistics(dict(saved), restored=False)  # 'qr': dropped
    assert warm.moment is None
    warm.load_statistics(dict(saved), restored=True)
    assert warm.moment is not None
    warm.load_statistics({MOMENT_KEY: saved[MOMENT_KEY]}, restored=True)
    assert warm.moment is None  # E without its count is not restored


def test_loaded_moments_belong_to_the_bases_held_when_loaded() -> None:
    """A refresh before the first step after a load keeps `E` (the bases
    it was kept in are the ones held, no copy of older ones exists).
    """
    layer = linear_layer()
    method = curvature(layer)
    refresh(layer, spd(5, 1), spd(3, 2))
    method.precondition(grads(1, (3, 5))[0], 0.0)
    saved = method.saved_statistics()
    loaded = linear_layer()
    refresh(loaded, spd(5, 1), spd(3, 2))
    curvature(loaded).load_statistics(dict(saved), restored=True)
    refresh(loaded, spd(5, 3), spd(3, 4))
    moment = curvature(loaded).moment
    assert moment is not None
    assert torch.equal(moment, saved[MOMENT_KEY])


def test_restart_without_bases_or_moments_does_nothing() -> None:
    layer = linear_layer()
    method = curvature(layer)
    method.restart()  # no bases held here (not a gradient worker)
    assert method.moment is None
    refresh(layer, spd(5, 1), spd(3, 2))  # the first refresh: no moments
    assert method.moment is None


def test_an_embedding_keeps_its_diagonal_input_factor() -> None:
    """`Q_A = I` for an embedding's diagonal `A`: `R = Q_Gᵀ V`."""
    torch.manual_seed(0)
    layer = KFACBaseLayer(
        EmbeddingModuleHelper(nn.Embedding(5, 3).double()),
        curvature=EigenAdamConfig(beta2=BETA2, eps=EPS),
    )
    method = curvature(layer)
    reference = Reference(carry=True, bias_correction=True)
    for seed in (1, 2):
        a = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0], dtype=F64) * seed
        g = spd(3, seed)
        refresh(layer, a, g)
        reference.refresh(torch.diag(a), g)
        for v in grads(2, (3, 5)):
            got = method.precondition(v, 0.0)
            assert_rel_close(
                got, reference.step(v), label='eigen_adam formula'
            )


def test_the_gradient_source_refuses_an_embedding() -> None:
    with pytest.raises(ValueError, match="source='gradient' needs one dense"):
        KFACBaseLayer(
            EmbeddingModuleHelper(nn.Embedding(5, 3)),
            curvature=EigenAdamConfig(source='gradient'),
        )


def test_the_gradient_factors_average_and_skip_a_nonfinite_gradient() -> None:
    layer = linear_layer(source='gradient')
    assert layer.curvature.gradient_factors
    v, w = grads(2, (3, 5))
    bad = torch.full((3, 5), float('nan'), dtype=F64)
    layer.curvature.update_gradient_factors(bad, 0.5)  # zero, not NaN
    first = layer.factor('A').value
    assert first is not None
    assert torch.equal(first, torch.zeros(5, 5, dtype=F64))
    layer.set_factor('A', None)
    layer.set_factor('G', None)
    layer.curvature.update_gradient_factors(v, 0.5)
    layer.curvature.update_gradient_factors(w, 0.5)
    layer.curvature.update_gradient_factors(bad, 0.5)
    a, g = layer.factor('A').value, layer.factor('G').value
    assert a is not None and g is not None
    assert_rel_close(a, 0.5 * v.T @ v + 0.5 * w.T @ w, label='V^T V')
    assert_rel_close(g, 0.5 * v @ v.T + 0.5 * w @ w.T, label='V V^T')


@pytest.mark.parametrize(
    ('options', 'error', 'text'),
    [
        ({'beta2': 1.0}, ValueError, 'beta2 must be'),
        ({'beta2': -0.1}, ValueError, 'beta2 must be'),
        ({'eps': 0.0}, ValueError, 'eps must be'),
        ({'bias_correction': 1}, TypeError, 'bias_correction'),
        ({'on_refresh': 'keep'}, ValueError, 'on_refresh'),
        ({'source': 'hooks'}, ValueError, 'source'),
    ],
)
def test_options_are_validated(
    options: dict[str, Any], error: type[Exception], text: str
) -> None:
    with pytest.raises(error, match=text):
        EigenAdamConfig(**options)


class Unclipped(EigenAdamConfig):
    """A method of one's own whose steps keep their own scale."""

    default_relative_clip: ClassVar[float | None] = None


def test_auto_is_the_methods_default_clip() -> None:
    model = nn.Sequential(nn.Linear(3, 2))
    adam = kfac.KFACPreconditioner(model, compute_method='eigen_adam')
    assert adam.relative_clip == 1.0
    assert 'EigenAdamCurvature' in repr(adam.layers['0'].curvature)
    adam.remove()
    own = kfac.KFACPreconditioner(model, compute_method=Unclipped())
    assert own.relative_clip is None
    own.remove()
    kept = kfac.KFACPreconditioner(
        model, compute_method=Unclipped(), relative_clip=0.5
    )
    assert kept.relative_clip == 0.5


def test_the_gradient_source_has_no_monte_carlo_fisher() -> None:
    with pytest.raises(ValueError, match='use no output gradients'):
        kfac.KFACConfig(
            compute_method=EigenAdamConfig(source='gradient'),
            fisher=kfac.FisherConfig(fisher_type='mc'),
        )
