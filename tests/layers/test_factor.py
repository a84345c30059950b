"""kfac.layers.statistics: KroneckerFactor's batch, running average and
undo.
"""

from __future__ import annotations

import math

import pytest
import torch

from kfac.layers.statistics import KroneckerFactor
from kfac.layers.statistics import fold_batch
from testing.asserts import assert_rel_close

F64 = torch.float64


def gram(x: torch.Tensor, multiplier: float) -> tuple[torch.Tensor, int]:
    """``(Σ (m x)(m x)ᵀ, rows)``: the statistic of a Linear without bias."""
    rows = x.reshape(-1, x.shape[-1]) * multiplier
    return rows.T @ rows, rows.shape[0]


def factor() -> KroneckerFactor:
    return KroneckerFactor('A', 3, gram, F64)


def batch(seed: int, n: int = 5) -> torch.Tensor:
    return torch.randn(n, 3, generator=torch.Generator().manual_seed(seed))


def mean_outer(*batches: torch.Tensor) -> torch.Tensor:
    rows = torch.cat(batches).double()
    return sum(torch.outer(r, r) for r in rows) / rows.shape[0]  # type: ignore[return-value]  # a sum of tensors


def test_first_update_is_the_batch_then_a_running_average() -> None:
    f = factor()
    x1, x2, x3 = batch(1), batch(2, n=3), batch(3)
    f.capture(x1.double(), 1.0, now=True)
    f.capture(x2.double(), 1.0, now=False)  # deferred to update()
    assert f.update(0.9)
    first = mean_outer(x1, x2)  # no identity bias, no decay
    assert f.value is not None
    assert_rel_close(f.value, first, label='factor running average')
    f.capture(x3.double(), 2.0, now=True)
    assert f.update(0.9)
    expected = 0.9 * first + 0.1 * 4.0 * mean_outer(x3)
    assert_rel_close(f.value, expected, label='factor running average')


def test_update_without_a_batch_changes_nothing() -> None:
    f = factor()
    assert f.update(0.9) is None
    assert f.value is None
    f.capture(batch(1).double(), 1.0, now=True)
    f.update(0.9)
    kept = f.value
    assert f.update(0.9) is None
    assert f.value is kept


def test_rollback_restores_the_value_before_the_update() -> None:
    f = factor()
    f.capture(batch(1).double(), 1.0, now=True)
    f.update(0.9)
    f.commit()
    kept = f.value
    assert kept is not None
    f.capture(batch(2).double(), 1.0, now=True)
    f.update(0.9)
    assert f.value is not None and not torch.equal(f.value, kept)
    f.rollback()
    assert f.value is kept
    # after a commit there is nothing to undo
    f.capture(batch(3).double(), 1.0, now=True)
    f.update(0.9)
    f.commit()
    committed = f.value
    f.rollback()
    assert f.value is committed


def test_non_finite_batch_is_flagged_and_never_reaches_the_value() -> None:
    f = factor()
    f.capture(batch(1).double(), 1.0, now=True)
    f.update(0.9)
    f.commit()
    kept = f.value
    assert kept is not None
    bad = batch(2).double()
    bad[0, 1] = math.nan
    bad[1, 2] = math.inf
    f.capture(bad, 1.0, now=True)
    finite = f.update(0.9)
    assert finite is not None and not bool(finite)
    assert f.value is not None and torch.isfinite(f.value).all()
    f.rollback()
    assert f.value is kept


def test_move_takes_every_tensor_along() -> None:
    """A model converted after construction: the running average, its
    provisional predecessor, the batch (computed and pending) and the
    decomposition all follow, in their dtypes.
    """
    f = factor()
    f.capture(batch(0), 1.0, now=True)
    f.update(0.5)
    f.commit()
    f.decomposition = (torch.eye(3, dtype=torch.float32),)
    f.capture(batch(1), 1.0, now=True)  # a computed batch
    f.update(0.5)  # provisional: a predecessor is kept
    f.capture(batch(2), 1.0, now=True)
    f.capture(batch(3), 1.0, now=False)  # a pending one
    cpu = torch.device('cpu')
    f.move(cpu, torch.float64, torch.float64)
    assert f.dtype == torch.float64
    assert f.value is not None and f.value.dtype == torch.float64
    assert f.decomposition is not None
    assert f.decomposition[0].dtype == torch.float64
    f.rollback()  # back to the committed value, now float64
    assert f.value is not None and f.value.dtype == torch.float64
    assert_rel_close(
        f.value, mean_outer(batch(0)).double(), rtol=1e-6, label='move'
    )
    total = f.batch_sum()  # the computed and the pending batch
    assert total is not None
    assert_rel_close(
        total.double(),
        (gram(batch(2), 1.0)[0] + gram(batch(3), 1.0)[0]).double(),
        rtol=1e-6,
        label='move',
    )


def test_move_of_an_empty_factor_changes_its_dtype_only() -> None:
    f = factor()
    f.move(torch.device('cpu'), torch.float32, torch.float32)
    assert f.value is None and f.decomposition is None
    assert f.dtype == torch.float32


@pytest.mark.parametrize('diagonal', [False, True])
def test_compiled_update_equals_the_eager_one(diagonal: bool) -> None:
    """`update(compiled=True)` (one kernel from `torch.compile`): the
    first update, running averages with a new batch size each time, a
    non-finite batch and `decay == 1`, as the eager update to rounding.
    """

    def statistic(x: torch.Tensor, m: float) -> tuple[torch.Tensor, int]:
        total, rows = gram(x, m)
        return (total.diagonal().clone() if diagonal else total), rows

    pair = [KroneckerFactor('A', 3, statistic, F64, diagonal=diagonal)]
    pair.append(KroneckerFactor('A', 3, statistic, F64, diagonal=diagonal))
    bad = batch(3).double()
    bad[0, 1] = math.nan
    for step, (data, decay) in enumerate(
        [(batch(1), 0.9), (batch(2, n=4), 0.9), (bad, 0.9), (batch(4), 1.0)]
    ):
        flags = []
        for compiled, f in enumerate(pair):
            f.capture(data.double(), 1.0 + step, now=True)
            flags.append(f.update(decay, compiled=bool(compiled)))
            if step == 2:
                f.rollback()
            else:
                f.commit()
        assert [bool(flag) for flag in flags] == [step != 2] * 2
        eager, fused = (f.value for f in pair)
        assert eager is not None and fused is not None
        assert fused.dtype == F64 and fused.shape == eager.shape
        torch.testing.assert_close(fused, eager, rtol=1e-14, atol=0)


def test_fold_batch_is_the_eager_update_out_of_place() -> None:
    """What `compiled_fold` compiles, run eagerly: the eager update's value
    and flag, for a finite and a non-finite batch.
    """
    f = factor()
    f.capture(batch(1).double(), 1.0, now=True)
    f.update(0.9)
    f.commit()
    for data in (batch(2).double(), batch(3).double().fill_(math.inf)):
        current = f.value
        assert current is not None
        total, rows = gram(data, 1.0)
        value, finite = fold_batch(current, total, 0.9, 1.0 / rows, F64)
        f.capture(data, 1.0, now=True)
        flag = f.update(0.9)
        assert flag is not None and bool(finite) == bool(flag)
        assert f.value is not None
        torch.testing.assert_close(value, f.value, rtol=1e-15, atol=0)
        f.rollback()
