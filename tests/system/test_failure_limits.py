"""Limits on failures in a row, and a rank that stops.

`StatisticsConfig(max_decomposition_failures=n)` tolerates `n` failed
decompositions of a factor in a row and `max_nonfinite_statistics=n` as
many discarded factor updates; one more raises `FailureLimitError`, on
every rank alike (the counts travel with the health count of the factor
allreduce). A rank that stops calling collectives makes the others raise
`KFACDistributedError` naming the phase and the layers of the stalled
bucket, once the process group's timeout expires.
"""

from __future__ import annotations

import datetime
import math
import pathlib
import re
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from kfac import math as kmath
from kfac.checkpoint import flatten_state
from kfac.checkpoint import unflatten_state
from kfac.config import StatisticsConfig
from kfac.distributed._exchange import KFACDistributedError
from kfac.layers.base import LinAlgError
from kfac.layers.curvature import eigen as eigen_module
from kfac.preconditioner import KFACPreconditioner
from kfac.state import STATE_VERSION
from kfac.tracing import FailureLimitError
from testing.distributed import run_distributed
from testing.models import TinyMLP
from testing.models import classification_data
from testing.options import EVERY_STEP

F64 = torch.float64
STALL_S = 2.0
"""The process-group timeout of the stalled-rank run, in seconds."""


class Breakable:
    """`symmetric_eigh` that raises while `broken` (on the given ranks)."""

    def __init__(self, ranks: tuple[int, ...] | None = None) -> None:
        self.broken = False
        self.ranks = ranks
        self.original = kmath.symmetric_eigh

    def __call__(
        self, matrix: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        mine = self.ranks is None or dist.get_rank() in self.ranks
        if self.broken and mine:
            raise LinAlgError('injected failure')
        return self.original(matrix, dtype)


def limited(model: nn.Module, **limits: Any) -> KFACPreconditioner:
    return KFACPreconditioner(
        model,
        compute_method='eigen',
        statistics=StatisticsConfig(**limits),
        **EVERY_STEP,
    )


def train_step(
    model: nn.Module,
    precon: KFACPreconditioner,
    seed: int,
    *,
    poison: bool = False,
    rows: int = 8,
    part: slice = slice(None),
) -> None:
    model.zero_grad()
    x, y = classification_data(rows, (6,), seed=seed, dtype=F64)
    x, y = x[part], y[part]
    if poison:
        x[0, 0] = math.nan
    F.cross_entropy(model(x), y).backward()
    precon.step()


def traces(precon: KFACPreconditioner) -> dict[str, dict[str, float]]:
    """Per layer, the trace of each factor as it is now."""
    return {
        name: {
            f: float(layer.factor(f).value.trace())  # type: ignore[union-attr]  # a step formed the factors
            for f in ('A', 'G')
        }
        for name, layer in precon.layers.items()
    }


def test_decompositions_failing_past_the_limit_raise(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    eigh = Breakable()
    monkeypatch.setattr(eigen_module, 'symmetric_eigh', eigh)
    model = TinyMLP().double()
    precon = limited(model, max_decomposition_failures=1)
    train_step(model, precon, 0)
    eigh.broken = True
    train_step(model, precon, 1)  # fails once: tolerated
    train_step(model, precon, 2)  # fails twice, learnt at the next update
    failed = traces(precon)  # the matrices of the second failure
    layers = precon.metrics()['layers']
    assert all(
        layers[name]['decomposition_failures_in_a_row'] == {'A': 2, 'G': 2}
        for name in precon.layers
    )
    with pytest.raises(FailureLimitError) as info:
        train_step(model, precon, 3)
    error = info.value
    assert error.layers == tuple(precon.layers) == ('fc1', 'fc2')
    assert error.count == 2
    message = str(error)
    assert 'max_decomposition_failures=1' in message
    for name, by_factor in failed.items():
        for f, trace in by_factor.items():
            assert (
                f'layer {name}, factor {f} (trace {trace:.6g}): 2' in message
            )


def test_a_good_decomposition_ends_the_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    eigh = Breakable()
    monkeypatch.setattr(eigen_module, 'symmetric_eigh', eigh)
    model = TinyMLP().double()
    precon = limited(model, max_decomposition_failures=1)
    for seed in range(6):
        eigh.broken = seed % 2 == 1  # fails on every other step
        train_step(model, precon, seed)
        layer = precon.metrics()['layers']['fc1']
        in_a_row = layer.get('decomposition_failures_in_a_row', {})
        assert in_a_row == ({'A': 1, 'G': 1} if eigh.broken else {})
    assert precon.layers['fc1'].counters['decomposition_failures'] == 6


def test_nonfinite_statistics_past_the_limit_raise() -> None:
    model = TinyMLP().double()
    precon = limited(model, max_nonfinite_statistics=1)
    train_step(model, precon, 0)
    train_step(model, precon, 1, poison=True)
    train_step(model, precon, 2)  # a good update ends the run
    assert 'nonfinite_statistics_in_a_row' not in precon.metrics()
    train_step(model, precon, 3, poison=True)
    assert precon.metrics()['nonfinite_statistics_in_a_row'] == 1
    with pytest.raises(FailureLimitError) as info:
        train_step(model, precon, 4, poison=True)
    assert info.value.count == 2
    assert info.value.layers == ('fc1', 'fc2')  # NaN reaches both
    assert 'max_nonfinite_statistics=1' in str(info.value)
    assert precon.metrics()['nonfinite_statistics_steps'] == 3


def test_the_counts_survive_a_checkpoint(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    eigh = Breakable()
    monkeypatch.setattr(eigen_module, 'symmetric_eigh', eigh)
    torch.manual_seed(0)
    model = TinyMLP().double()
    precon = limited(model, max_decomposition_failures=1)
    train_step(model, precon, 0, poison=True)
    train_step(model, precon, 1)
    eigh.broken = True
    train_step(model, precon, 2)
    train_step(model, precon, 3)
    failed = traces(precon)  # the matrices of the last failure
    state = precon.state_dict()
    assert state['version'] == STATE_VERSION == 6
    flat = flatten_state(state)
    count, trace = flat['faults.failures.fc1.A']
    assert count == 2
    assert trace == pytest.approx(failed['fc1']['A'], rel=1e-12)
    assert unflatten_state(flat)['faults'] == state['faults']
    resumed_model = TinyMLP().double()
    resumed_model.load_state_dict(model.state_dict())
    resumed = limited(resumed_model, max_decomposition_failures=1)
    resumed.load_state_dict(state)
    metrics, again = precon.metrics(), resumed.metrics()
    assert again['nonfinite_statistics_steps'] == 1
    assert (
        again['nonfinite_statistics_steps']
        == (metrics['nonfinite_statistics_steps'])
    )
    for name in precon.layers:
        counts = again['layers'][name]['decomposition_failures_in_a_row']
        assert counts == {'A': 2, 'G': 2}
        assert (
            counts
            == (metrics['layers'][name]['decomposition_failures_in_a_row'])
        )
    errors = []
    for run, net in ((precon, model), (resumed, resumed_model)):
        with pytest.raises(FailureLimitError) as info:
            train_step(net, run, 4)
        errors.append(str(info.value))
    assert errors[0] == errors[1]


def test_a_state_without_faults_loads_with_none_counted() -> None:
    model = TinyMLP().double()
    precon = limited(model)
    train_step(model, precon, 0, poison=True)
    train_step(model, precon, 1)
    state = precon.state_dict()
    assert state['faults']['counters'] == {'nonfinite_statistics_steps': 1}
    old = {k: v for k, v in state.items() if k != 'faults'}
    old['version'] = 5
    precon.load_state_dict(old)
    assert 'nonfinite_statistics_steps' not in precon.metrics()


@pytest.mark.parametrize(
    ('faults', 'named'),
    [
        ([], "'faults' must be a mapping"),
        ({'counters': {'x': -1}}, "'faults.counters'"),
        ({'failures': {'fc1': {'B': [1, 0.0]}}}, "'faults.failures'"),
        ({'failures': {'fc1': {'A': [1]}}}, "'faults.failures'"),
    ],
)
def test_a_malformed_faults_entry_is_refused(
    faults: object, named: str
) -> None:
    model = TinyMLP().double()
    precon = limited(model)
    train_step(model, precon, 0)
    state: dict[str, Any] = dict(precon.state_dict())
    state['faults'] = faults
    with pytest.raises(TypeError, match=named):
        precon.load_state_dict(state)


@pytest.mark.parametrize(
    'field', ['max_decomposition_failures', 'max_nonfinite_statistics']
)
@pytest.mark.parametrize(
    ('value', 'error'), [(-1, ValueError), (1.5, TypeError), (True, TypeError)]
)
def test_a_limit_is_validated(
    field: str, value: object, error: type[Exception]
) -> None:
    with pytest.raises(error, match=field):
        options: dict[str, Any] = {field: value}
        StatisticsConfig(**options)


# Distributed ------------------------------------------------------------


def _gathered(value: object) -> list[object]:
    out: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def _limits_on_every_rank() -> None:
    rank = dist.get_rank()
    part = slice(rank * 4, rank * 4 + 4)
    eigh = Breakable(ranks=(0,))
    setattr(eigen_module, 'symmetric_eigh', eigh)  # noqa: B010
    torch.manual_seed(0)
    model = TinyMLP().double()
    precon = KFACPreconditioner(
        model,
        compute_method='eigen',
        grad_worker_fraction='mem_opt',
        statistics=StatisticsConfig(max_decomposition_failures=0),
        **EVERY_STEP,
    )
    on_rank0 = tuple(
        n for n in precon.layers if precon.assignment.inv_worker(n, 'A') == 0
    )
    assert on_rank0 and len(on_rank0) < len(precon.layers)
    eigh.broken = True
    train_step(model, precon, 0, part=part)  # rank 0's decompositions fail
    with pytest.raises(FailureLimitError) as info:
        train_step(model, precon, 1, part=part)
    assert info.value.layers == on_rank0
    assert info.value.count == 1
    messages = _gathered(str(info.value))
    assert messages[0] == messages[1]
    for name in on_rank0:  # rank 1 learnt them from the health count
        layer = precon.layers[name]
        assert layer.failures_in_a_row == {'A': 1, 'G': 1}
    eigh.broken = False

    model = TinyMLP().double()
    precon = KFACPreconditioner(
        model,
        statistics=StatisticsConfig(max_nonfinite_statistics=1),
        **EVERY_STEP,
    )
    train_step(model, precon, 0, part=part, poison=rank == 1)
    with pytest.raises(FailureLimitError) as info:
        train_step(model, precon, 1, part=part, poison=rank == 1)
    assert info.value.count == 2
    assert _gathered(str(info.value))[0] == str(info.value)


def _stalled_rank(store: str) -> None:
    rank = dist.get_rank()
    dist.barrier()
    dist.destroy_process_group()
    dist.init_process_group(
        'gloo',
        init_method=f'file://{store}',
        rank=rank,
        world_size=2,
        timeout=datetime.timedelta(seconds=STALL_S),
    )
    torch.manual_seed(0)
    model = TinyMLP().double()
    precon = KFACPreconditioner(model, **EVERY_STEP)
    raised = pathlib.Path(store + '.raised')
    if rank == 1:  # stops calling collectives until rank 0 has raised
        deadline = time.monotonic() + 60.0
        while not raised.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert raised.exists(), 'rank 0 never raised'
        return
    x, y = classification_data(4, (6,), dtype=F64)
    F.cross_entropy(model(x), y).backward()
    with pytest.raises(KFACDistributedError) as info:
        precon.step()
    raised.touch()
    error = info.value
    assert error.phase == 'factor_allreduce'
    assert set(error.layers) == set(precon.layers)  # one bucket holds all
    assert 'in phase factor_allreduce (it carried layers' in str(error)
    # a timeout, not rank 1 leaving (gloo says 'timeout' in torch 2.13,
    # 'timed out' in earlier releases)
    assert re.search('time(d )?out', str(error).lower()), str(error)


def _body(store: str) -> None:
    _limits_on_every_rank()
    _stalled_rank(store)


@pytest.mark.timeout(120)
def test_limits_and_a_stalled_rank_on_every_rank(
    tmp_path: pathlib.Path,
) -> None:
    run_distributed(_body, 2, str(tmp_path / 'short'), tmp_path=tmp_path)
