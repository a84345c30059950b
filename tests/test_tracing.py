"""The original's timing decorator: `trace` and its table."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

import pytest

from kfac.tracing import clear_trace
from kfac.tracing import get_trace
from kfac.tracing import log_trace
from kfac.tracing import trace


@pytest.fixture(autouse=True)
def _empty_table() -> Iterator[None]:
    clear_trace()
    yield
    clear_trace()


class _Clock:
    """A fake `time.perf_counter` that advances as told."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> _Clock:
    fake = _Clock()
    monkeypatch.setattr(time, 'perf_counter', fake)
    return fake


def test_trace_records_each_call(clock: _Clock) -> None:
    durations = iter([3.0, 1.0, 2.0])

    @trace()
    def work(x: int) -> int:
        clock.now += next(durations)
        return x + 1

    assert get_trace() == {}
    assert [work(1), work(2), work(3)] == [2, 3, 4]
    assert work.__name__ == 'work'
    assert get_trace() == {'work': 2.0}
    assert get_trace(average=False) == {'work': 6.0}
    assert get_trace(max_history=2) == {'work': 1.5}
    assert get_trace(average=False, max_history=1) == {'work': 2.0}
    clear_trace()
    assert get_trace() == {}


def test_trace_sync_is_called_around_each_call(clock: _Clock) -> None:
    events: list[str] = []

    @trace(sync=lambda: events.append(f'sync at {clock.now}'))
    def work() -> None:
        clock.now += 1.0
        events.append('call')

    work()
    assert events == ['sync at 0.0', 'call', 'sync at 1.0']
    assert get_trace() == {'work': 1.0}


def test_trace_sync_true_warns_and_issues_no_barrier() -> None:
    with pytest.warns(DeprecationWarning, match=r'sync=True\) no longer'):
        decorator = trace(sync=True)

    @decorator
    def work() -> int:
        return 5

    # No process group exists: a barrier would raise.
    assert work() == 5
    assert list(get_trace()) == ['work']


@pytest.mark.parametrize('sync', [1, 'yes', None])
def test_trace_rejects_a_sync_that_is_not_bool_or_callable(
    sync: object,
) -> None:
    with pytest.raises(TypeError, match='^sync must be a bool or callable'):
        trace(sync=sync)  # type: ignore[arg-type]  # the wrong type tested


@pytest.mark.parametrize('max_history', [0, -1, 1.5, True])
def test_get_trace_rejects_a_bad_max_history(max_history: object) -> None:
    with pytest.raises(ValueError, match='^max_history must be a positive'):
        get_trace(max_history=max_history)  # type: ignore[arg-type]


def test_log_trace_logs_one_record_per_function(
    clock: _Clock, caplog: pytest.LogCaptureFixture
) -> None:
    @trace()
    def first() -> None:
        clock.now += 0.5

    @trace()
    def second() -> None:
        clock.now += 0.25

    first()
    second()
    with caplog.at_level(logging.DEBUG, logger='kfac.tracing'):
        log_trace(loglevel=logging.DEBUG)
    assert [r.getMessage() for r in caplog.records] == [
        'first: 0.500000 s',
        'second: 0.250000 s',
    ]
    assert {r.levelno for r in caplog.records} == {logging.DEBUG}
