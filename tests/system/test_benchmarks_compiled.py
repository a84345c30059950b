"""benchmarks.compiled: the eager and compiled halves pair up, and the
compiled-over-eager cycle is paired by round and weighted by step kind.
(Timing itself is `make bench`'s; no test asserts a time.)
"""

from __future__ import annotations

import dataclasses
import types
from typing import Any

import pytest

from benchmarks.compiled import MODES
from benchmarks.compiled import _paired_cycle
from benchmarks.compiled import compiled_configs
from benchmarks.harness import Config
from benchmarks.harness import Sample
from benchmarks.harness import step_kind


@pytest.mark.parametrize('mode', MODES)
def test_eager_and_compiled_halves_pair_up(mode: str) -> None:
    configs = compiled_configs(mode)
    half = len(configs) // 2
    eager, compiled = configs[:half], configs[half:]
    assert all(c.compile_mode is None for c in eager)
    assert all(c.compile_mode == mode for c in compiled)
    for a, b in zip(eager, compiled):
        same = dataclasses.replace(b, name=a.name, compile_mode=None)
        assert same == a
    assert eager[0].method is None and eager[1].factor_steps == 1


def _runner(config: Config, seconds: dict[int, float]) -> Any:
    samples = [
        Sample(step, step_kind(step, config), s, {})
        for step, s in seconds.items()
    ]
    return types.SimpleNamespace(config=config, samples=samples)


def test_compiled_over_eager_cycle_is_paired_and_weighted() -> None:
    """Timed steps 1-20 of a 10/100 run (step 0 is the warm-up): kinds f
    at 10 and 20, '-' elsewhere; its 'fi' steps come from the 1/1 runs.
    Paired by round, each kind's median ratio is weighted by its count in
    a cycle: 1 fi, 9 f, 90 '-'.
    """
    cycle = Config('c', 'eigen', 10, 100)
    every = Config('e', 'eigen', 1, 1)
    slow = {step: 3.0 if step % 10 == 0 else 1.0 for step in range(1, 21)}
    fast = {step: s / (3 if step % 10 == 0 else 2) for step, s in slow.items()}
    mine = [_runner(every, {0: 4.0, 1: 8.0}), _runner(cycle, slow)]
    theirs = [_runner(every, {0: 1.0, 1: 2.0}), _runner(cycle, fast)]
    ratio = _paired_cycle(mine, theirs, cycle)
    assert ratio == pytest.approx((1 * 4 + 9 * 3 + 90 * 2) / 100)
