"""A short step: fewer backward passes than `accumulation_steps` (a
trainer's last batches of an epoch).

Oracles, in float64: the factors of the passes seen, formed by explicit
loops from the unscaled per-example output gradients
(`testing.reference.layer_factors` on the passes' examples together); and
the twin that preconditions the same examples in one pass with
`accumulation_steps=1` (its gradient is the passes' mean).
"""

from __future__ import annotations

import pathlib
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from kfac.config import FisherConfig
from kfac.config import StatisticsConfig
from kfac.enums import AccumulationDivisor
from kfac.optimizer import KFACOptimizer
from kfac.preconditioner import KFACPreconditioner
from testing.distributed import run_distributed
from testing.models import TinyMLP
from testing.models import classification_data
from testing.reference import layer_factors

F64 = torch.float64
EXPECTED = 3
"""`accumulation_steps` of the short steps."""
BATCH = 4


def _model() -> TinyMLP:
    torch.manual_seed(0)
    return TinyMLP().to(F64)


def _precon(model: TinyMLP, **options: Any) -> KFACPreconditioner:
    options.setdefault('damping', 0.01)
    return KFACPreconditioner(model, factor_decay=0.5, **options)


def _data(passes: int) -> tuple[torch.Tensor, torch.Tensor]:
    return classification_data(passes * BATCH, (6,), seed=3)


def _short_step(
    precon: KFACPreconditioner,
    model: TinyMLP,
    passes: int,
    divisor: float,
    *,
    loss: str = 'cross_entropy',
) -> None:
    """`passes` backward passes of `BATCH` examples, each loss divided by
    `divisor`, then `step()`.
    """
    x, y = _data(passes)
    for part in range(passes):
        rows = slice(part * BATCH, (part + 1) * BATCH)
        out = model(x[rows])
        if loss == 'mc':
            precon.sample_fisher(out)
        (F.cross_entropy(out, y[rows]) / divisor).backward()
    precon.step()


def _grads(model: TinyMLP) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


def _reference_factors(
    model: TinyMLP, passes: int
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """`(A, G)` per layer from the `passes · BATCH` examples' unscaled
    gradients, by explicit loops.
    """
    x, y = _data(passes)
    inputs: dict[str, torch.Tensor] = {}
    outputs: dict[str, torch.Tensor] = {}

    def keep(name: str) -> Any:
        def hook(module: Any, args: Any, out: torch.Tensor) -> None:
            inputs[name] = args[0].detach()
            out.retain_grad()
            outputs[name] = out

        return hook

    handles = [
        model.fc1.register_forward_hook(keep('fc1')),
        model.fc2.register_forward_hook(keep('fc2')),
    ]
    F.cross_entropy(model(x), y).backward()
    for handle in handles:
        handle.remove()
    model.zero_grad()
    return {
        name: layer_factors(
            inputs[name][:, None],
            outputs[name].grad[:, None],  # type: ignore[index]  # retained
            bias=True,
        )
        for name in ('fc1', 'fc2')
    }


@pytest.mark.parametrize('in_hook', [True, False])
@pytest.mark.parametrize('method', ['eigen', 'ekfac'])
@pytest.mark.parametrize('divisor', list(AccumulationDivisor))
def test_short_step_factors_are_those_of_the_passes_seen(
    divisor: AccumulationDivisor, method: str, in_hook: bool
) -> None:
    passes = 2
    model = _model()
    precon = _precon(
        model,
        accumulation_steps=EXPECTED,
        compute_method=method,
        update_factors_in_hook=in_hook,
        statistics=StatisticsConfig(accumulation_divisor=divisor),
    )
    by = EXPECTED if divisor == 'accumulation_steps' else passes
    _short_step(precon, model, passes, by)
    got = _grads(model)
    want = _reference_factors(_model(), passes)
    for name, layer in precon.layers.items():
        a, g = want[name]
        torch.testing.assert_close(layer.factor('A').value, a)
        torch.testing.assert_close(layer.factor('G').value, g)

    # The twin: the same examples in one pass; its preconditioned gradient
    # is the short step's, times the share of the passes its loss had.
    twin = _model()
    twin_precon = _precon(
        twin, compute_method=method, update_factors_in_hook=in_hook
    )
    x, y = _data(passes)
    F.cross_entropy(twin(x), y).backward()
    twin_precon.step()
    share = passes / by
    for mine, theirs in zip(got, _grads(twin), strict=True):
        torch.testing.assert_close(mine, theirs * share)

    # Counts start again: a full step after the short one takes no
    # correction.
    model.zero_grad()
    _short_step(precon, model, EXPECTED, EXPECTED)
    assert precon.steps == 2


def test_a_short_step_needs_the_divisor() -> None:
    model = _model()
    precon = _precon(model, accumulation_steps=EXPECTED)
    with pytest.raises(ValueError, match='after 2 backward passes, fewer'):
        _short_step(precon, model, 2, EXPECTED)
    assert precon.steps == 0
    # Not when nothing depends on it: a summed loss ...
    model = _model()
    summed = _precon(
        model,
        accumulation_steps=EXPECTED,
        statistics=StatisticsConfig(loss_average=None),
    )
    _short_step(summed, model, 2, 1.0)
    assert summed.steps == 1
    # ... or a full step.
    model = _model()
    full = _precon(model, accumulation_steps=EXPECTED)
    _short_step(full, model, EXPECTED, EXPECTED)
    assert full.steps == 1


def test_the_monte_carlo_fisher_needs_no_divisor() -> None:
    """Its sampled losses are scaled by K-FAC itself: the short step's `G`
    is the twin's (the same draws: the examples keep their indices).
    """
    passes = 2
    model = _model()
    precon = _precon(
        model,
        accumulation_steps=EXPECTED,
        fisher=FisherConfig(fisher_type='mc', mc_samples=2),
    )
    _short_step(precon, model, passes, EXPECTED, loss='mc')
    twin = _model()
    twin_precon = _precon(
        twin, fisher=FisherConfig(fisher_type='mc', mc_samples=2)
    )
    x, y = _data(passes)
    out = twin(x)
    twin_precon.sample_fisher(out)
    F.cross_entropy(out, y).backward()
    twin_precon.step()
    for name, layer in precon.layers.items():
        other = twin_precon.layers[name]
        for factor in ('A', 'G'):
            torch.testing.assert_close(
                layer.factor(factor).value, other.factor(factor).value
            )


def test_kfac_optimizer_takes_a_short_step_and_refuses_more_or_none() -> None:
    model = _model()
    precon = _precon(
        model,
        accumulation_steps=2,
        statistics=StatisticsConfig(accumulation_divisor='passes'),
    )
    optimizer = KFACOptimizer(torch.optim.SGD(model.parameters(), 0.1), precon)
    x, y = _data(3)
    F.cross_entropy(model(x), y).backward()
    optimizer.step()  # one pass of two
    assert precon.steps == 1
    with pytest.raises(ValueError, match='0 backward passes since the last'):
        optimizer.step()
    for _ in range(3):
        F.cross_entropy(model(x), y).backward()
    with pytest.raises(ValueError, match='3 backward passes since the last'):
        optimizer.step()


def _two_ranks() -> None:
    """Rank `r` runs passes `2r` and `2r + 1` of four under DDP, a short
    step of `accumulation_steps=3`, the losses divided by 2: the
    allreduced factors are those of the sixteen examples.
    """
    rank = dist.get_rank()
    model = _model()
    ddp = DistributedDataParallel(model)
    precon = _precon(
        model,
        accumulation_steps=EXPECTED,
        statistics=StatisticsConfig(accumulation_divisor='passes'),
    )
    x, y = _data(4)
    for part in (2 * rank, 2 * rank + 1):
        rows = slice(part * BATCH, (part + 1) * BATCH)
        (F.cross_entropy(ddp(x[rows]), y[rows]) / 2).backward()
    precon.step()
    want = _reference_factors(_model(), 4)
    for name, layer in precon.layers.items():
        a, g = want[name]
        torch.testing.assert_close(layer.factor('A').value, a)
        torch.testing.assert_close(layer.factor('G').value, g)


@pytest.mark.timeout(120)
def test_a_short_step_on_two_ranks(tmp_path: pathlib.Path) -> None:
    run_distributed(_two_ranks, 2, tmp_path=tmp_path)
