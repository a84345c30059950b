"""A weight shared by several modules is one module called as often.

The twin oracle (see `testing.twins`) over each kind of sharer (Linear,
Conv2d, grouped Conv2d, Embedding) and the ways a step can go: three
sharers, a step where one sharer runs alone (the layer's owner or
another), factors computed at the update instead of in the hooks, and two
micro-batches per step. At every step the twins' raw gradients agree,
then their factors and their preconditioned gradients (float64). DDP at
W = 2 is in `tests/system/test_tied_twins_ddp.py`.
"""

from __future__ import annotations

import pytest

from testing.twins import KINDS
from testing.twins import Case
from testing.twins import check_twins

CASES = {
    'pair': Case(),
    'three sharers': Case(sharers=3, runs=((0, 1, 2), (2, 0, 1), (0, 1, 2))),
    'one sharer runs': Case(sharers=3, runs=((1,), (0, 1, 2), (2,), (0,))),
    'not in the hooks': Case(options={'update_factors_in_hook': False}),
    'two micro-batches': Case(options={'accumulation_steps': 2}),
    'inverse, not in the hooks, two micro-batches': Case(
        sharers=3,
        runs=((0, 2), (1,), (0, 1, 2)),
        options={
            'compute_method': 'inverse',
            'accumulation_steps': 2,
            'update_factors_in_hook': False,
            'inv_update_steps': 2,
        },
    ),
}


@pytest.mark.parametrize('kind', KINDS)
@pytest.mark.parametrize('name', list(CASES))
def test_shared_weight_equals_one_module_called_as_often(
    kind: str, name: str
) -> None:
    case = CASES[name]
    case = Case(kind, case.sharers, case.runs, case.options)
    assert check_twins(case) == len(case.runs)
