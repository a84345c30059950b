"""kfac.layers.curvature.ekfac: the running scaling, its restart, its
state, and preconditioning with it (the scaling itself against per-example
gradients is in tests/system/test_ekfac.py).
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import nn

from kfac.layers.base import KFACBaseLayer
from kfac.layers.curvature.ekfac import EKFACConfig
from kfac.layers.curvature.ekfac import EKFACCurvature
from kfac.layers.eigen import KFACEigenLayer
from kfac.layers.modules import LinearModuleHelper
from kfac.state import SavedLayer
from testing.asserts import assert_rel_close
from testing.reference import ekfac_scale_reference
from testing.reference import with_ones

F64 = torch.float64


def capture(layer: KFACBaseLayer, x: torch.Tensor, gout: torch.Tensor) -> None:
    """One call and its backward pass, as the hooks feed them."""
    captured = layer.prepare_input(x, now=True)
    count = layer.add_call(
        captured, gout, loss_scale=1.0, accumulation_steps=1, now=True
    )
    layer.add_examples(count)


def batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(6, 4, generator=gen, dtype=F64)
    gout = torch.randn(6, 3, generator=gen, dtype=F64)
    return x, gout


def layer(**kwargs: Any) -> KFACBaseLayer:
    torch.manual_seed(0)
    return KFACBaseLayer(
        LinearModuleHelper(nn.Linear(4, 3).double()),
        curvature=EKFACConfig(**{'prediv_eigenvalues': False, **kwargs}),
    )


def curvature(layer: KFACBaseLayer) -> EKFACCurvature:
    """The layer's EKFAC curvature."""
    assert isinstance(layer.curvature, EKFACCurvature)
    return layer.curvature


def factor_update(ekfac: KFACBaseLayer, seed: int) -> None:
    """A factor update with a decomposition, as a step does it."""
    capture(ekfac, *batch(seed))
    assert ekfac.update_factors(0.5) is not None
    ekfac.commit_factors()
    for name in ('A', 'G'):
        assert ekfac.compute_decomposition(name, 0.1)


def expected_batch(ekfac: KFACBaseLayer, seed: int) -> torch.Tensor:
    x, gout = batch(seed)
    grads = torch.stack(
        [torch.outer(6 * g, a) for g, a in zip(gout, with_ones(x))]
    )
    a, g = ekfac.a.decomposition, ekfac.g.decomposition
    assert a is not None and g is not None
    return ekfac_scale_reference(grads, g[0], a[0], 6)


def test_first_update_sets_later_ones_average() -> None:
    ekfac = layer()
    factor_update(ekfac, 0)
    first = curvature(ekfac).scale_batch()
    assert first is not None
    assert_rel_close(first, expected_batch(ekfac, 0), label='EKFAC layer')
    assert (
        curvature(ekfac).scale_batch() is None
    )  # the calls were handed over once
    ekfac_s = curvature(ekfac)
    ekfac_s.update_scale(first, 0.5, 0.1, precompute=True)
    assert ekfac_s.scale is not None
    assert torch.equal(ekfac_s.scale, first)
    capture(ekfac, *batch(1))
    ekfac.update_factors(0.5)
    second = curvature(ekfac).scale_batch()  # same bases: no decomposition
    assert second is not None
    curvature(ekfac).update_scale(second, 0.25, 0.1, precompute=True)
    assert ekfac_s.scale is not None
    assert_rel_close(
        ekfac_s.scale,
        0.25 * first + 0.75 * second,
        label='EKFAC layer',
    )


def test_restart_falls_back_to_the_eigenvalues() -> None:
    """Without `S` (after a refresh, before its update) the layer
    preconditions as EIGEN does.
    """
    ekfac, eigen = (
        layer(),
        KFACEigenLayer(LinearModuleHelper(nn.Linear(4, 3).double())),
    )
    for one in (ekfac, eigen):
        factor_update(one, 0)
    v = torch.randn(3, 5, dtype=F64)
    assert curvature(ekfac).scale is None
    assert torch.equal(
        ekfac.curvature.precondition(v, 0.1),
        eigen.curvature.precondition(v, 0.1),
    )
    curvature(ekfac).update_scale(
        torch.ones(3, 5, dtype=F64), 0.5, 0.1, precompute=False
    )
    assert not torch.equal(
        ekfac.curvature.precondition(v, 0.1),
        eigen.curvature.precondition(v, 0.1),
    )
    curvature(ekfac).restart()
    assert curvature(ekfac).scale is None
    assert torch.equal(
        ekfac.curvature.precondition(v, 0.1),
        eigen.curvature.precondition(v, 0.1),
    )


def test_nonfinite_batch_keeps_the_scale() -> None:
    ekfac = layer()
    factor_update(ekfac, 0)
    bad = torch.ones(3, 5, dtype=F64)
    bad[1, 2] = math.nan
    curvature(ekfac).update_scale(
        bad, 0.5, 0.1, precompute=False
    )  # after a restart
    a, g = ekfac.a.decomposition, ekfac.g.decomposition
    assert a is not None and g is not None
    assert torch.equal(curvature(ekfac).scale, torch.outer(g[1], a[1]))  # type: ignore[arg-type]
    good = torch.full((3, 5), 2.0, dtype=F64)
    curvature(ekfac).update_scale(good, 0.5, 0.1, precompute=False)
    kept = curvature(ekfac).scale
    assert kept is not None
    curvature(ekfac).update_scale(bad, 0.5, 0.1, precompute=False)
    assert torch.equal(curvature(ekfac).scale, kept)  # type: ignore[arg-type]


def test_kept_reciprocal_equals_the_one_formed_each_step() -> None:
    """`prediv_eigenvalues` keeps `1 / (S + λ)` from the update (on a rank
    that preconditions) and forms it again when `λ` changes.
    """
    kept, formed = layer(prediv_eigenvalues=True), layer()
    s = torch.rand(3, 5, dtype=F64)
    v = torch.randn(3, 5, dtype=F64)
    for one in (kept, formed):
        factor_update(one, 0)
        curvature(one).update_scale(s, 0.5, 0.1, precompute=True)
    assert (
        curvature(kept).memory_usage()['scale']
        == 2 * curvature(formed).memory_usage()['scale']
    )
    for damping in (0.1, 0.1, 0.3):
        assert torch.equal(
            kept.curvature.precondition(v, damping),
            formed.curvature.precondition(v, damping),
        )
    elsewhere = layer(prediv_eigenvalues=True)  # no gradient worker
    factor_update(elsewhere, 0)
    curvature(elsewhere).update_scale(s, 0.5, 0.1, precompute=False)
    assert (
        curvature(elsewhere).memory_usage()['scale']
        == curvature(formed).memory_usage()['scale']
    )


def test_rows_are_kept_for_one_factor_update() -> None:
    """Calls after the seal belong to the next update; a reset drops them,
    a rollback drops the sealed ones.
    """
    ekfac = layer()
    factor_update(ekfac, 0)
    capture(ekfac, *batch(1))  # after the seal
    assert ekfac.memory_usage()['example_rows'] > 0
    ekfac.reset_batch()
    batch_s = curvature(ekfac).scale_batch()
    assert batch_s is not None
    assert_rel_close(batch_s, expected_batch(ekfac, 0), label='EKFAC layer')
    capture(ekfac, *batch(2))
    assert ekfac.update_factors(0.5) is not None
    ekfac.rollback_factors()
    assert curvature(ekfac).scale_batch() is None
    assert ekfac.memory_usage()['example_rows'] == 0


def test_a_pass_without_calls_is_not_kept() -> None:
    ekfac = layer()
    ekfac.add_examples(0)
    factor_update(ekfac, 0)
    assert ekfac.statistics.examples is not None
    assert len(ekfac.statistics.examples.take()) == 1


def test_no_scale_without_bases() -> None:
    ekfac = layer()
    capture(ekfac, *batch(0))
    ekfac.update_factors(0.5)
    assert curvature(ekfac).scale_batch() is None


def test_scale_is_saved_and_loaded() -> None:
    ekfac = layer()
    assert ekfac.state_spec().statistic_shapes == {'S': (3, 5)}
    factor_update(ekfac, 0)
    assert ekfac.saved_state(True).statistics == {}
    s = torch.rand(3, 5, dtype=F64)
    curvature(ekfac).update_scale(s, 0.5, 0.1, precompute=False)
    saved = ekfac.saved_state(True)
    assert torch.equal(saved.statistics['S'], s)
    other = layer()
    assert other.load_saved_state(saved, keep=True)
    assert torch.equal(curvature(other).scale, s)  # type: ignore[arg-type]
    other.load_saved_state(SavedLayer(saved.factors), keep=True)
    assert curvature(other).scale is None
    # without the bases S was estimated in: kept where recomputing them
    # gives the same bases (eigh), restarted where not (qr)
    bare = SavedLayer(saved.factors, None, saved.statistics)
    assert not other.load_saved_state(bare, keep=True)
    assert torch.equal(curvature(other).scale, s)  # type: ignore[arg-type]
    warm = layer(basis_refresh='qr')
    assert not warm.load_saved_state(bare, keep=True)
    assert curvature(warm).scale is None
    assert warm.load_saved_state(saved, keep=True)
    assert torch.equal(curvature(warm).scale, s)  # type: ignore[arg-type]


def test_scale_follows_the_module() -> None:
    ekfac = layer()
    factor_update(ekfac, 0)
    curvature(ekfac).update_scale(
        torch.rand(3, 5, dtype=F64), 0.5, 0.1, precompute=False
    )
    ekfac.module.module.float()
    assert ekfac.follow_module()
    moved_s = curvature(ekfac).scale
    assert moved_s is not None
    assert moved_s.dtype == torch.float32
    capture(ekfac, *(t.float() for t in batch(1)))
    ekfac.module.module.double()
    assert ekfac.follow_module()  # the kept calls move too
    ekfac.update_factors(0.5)
    moved = curvature(ekfac).scale_batch()
    assert moved is not None
    assert moved.dtype == F64


def test_config_validates_its_options() -> None:
    with pytest.raises(TypeError, match='prediv_eigenvalues'):
        EKFACConfig(prediv_eigenvalues='yes')  # type: ignore[arg-type]
    with pytest.raises(ValueError, match='basis_refresh'):
        EKFACConfig(basis_refresh='lanczos')
    assert layer().bases_everywhere
    helper = LinearModuleHelper(nn.Linear(2, 2))
    assert not KFACEigenLayer(helper).bases_everywhere
