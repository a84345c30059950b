"""Property-based tests of kfac.assignment (Hypothesis).

The placement's own properties are in test_placement_properties.py; here
every rank's KAISAAssignment must agree with the one plan.
"""

from __future__ import annotations

from hypothesis import given

from kfac.assignment import KAISAAssignment
from tests.test_placement_properties import SETTINGS
from tests.test_placement_properties import Case
from tests.test_placement_properties import cases


def _assignment(
    case: Case, rank: int, calls: list[list[int]]
) -> KAISAAssignment:
    return KAISAAssignment(
        case.work,
        local_rank=rank,
        world_size=case.world_size,
        grad_worker_fraction=case.grad_workers / case.world_size,
        group_func=lambda ranks: calls.append(ranks),
        colocate_factors=case.colocate,
    )


@SETTINGS
@given(cases())
def test_every_rank_sees_the_same_plan(case: Case) -> None:
    plan = case.plan()
    gw = case.grad_workers
    expected_calls: list[list[int]] = []
    if case.world_size > 1:
        groups = plan.grad_worker_groups + plan.grad_receiver_groups
        expected_calls = [list(group) for group in groups]
    for rank in range(case.world_size):
        calls: list[list[int]] = []
        assignment = _assignment(case, rank, calls)
        assert assignment.plan == plan
        assert calls == expected_calls
        receivers = plan.grad_receiver_groups[rank % gw]
        assert rank in receivers
        for layer in case.work:
            workers = plan.grad_worker_groups[plan.layer_groups[layer]]
            src = assignment.src_grad_worker(layer)
            assert src in workers
            assert src in receivers
            assert assignment.is_grad_worker(layer) == (rank in workers)
            assert (src == rank) == assignment.is_grad_worker(layer)
            for factor in case.work[layer]:
                inv = assignment.inv_worker(layer, factor)
                assert inv == plan.inv_workers[layer][factor]
