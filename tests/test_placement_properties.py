"""Property-based tests of kfac.placement (Hypothesis)."""

from __future__ import annotations

import dataclasses
import itertools

from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st

from kfac.placement import KAISAPlan
from kfac.placement import grad_workers_from_fraction
from kfac.placement import plan_kaisa
from kfac.placement import valid_grad_worker_fractions

SETTINGS = settings(max_examples=200, deadline=None)


@dataclasses.dataclass(frozen=True)
class Case:
    work: dict[str, dict[str, float]]
    world_size: int
    grad_workers: int
    colocate: bool

    def plan(self) -> KAISAPlan:
        return plan_kaisa(
            self.work,
            world_size=self.world_size,
            grad_workers=self.grad_workers,
            colocate_factors=self.colocate,
        )


# A layer is 1 to 3 factor costs, named 'A', 'G', 'B' in that order.
LAYERS = st.lists(
    st.lists(st.floats(0.0, 1e6), min_size=1, max_size=3),
    min_size=1,
    max_size=12,
)


@st.composite
def cases(draw: st.DrawFn) -> Case:
    world_size = draw(st.integers(1, 16))
    divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
    layers = draw(LAYERS)
    return Case(
        work={
            f'layer{index}': dict(zip('AGB', costs, strict=False))
            for index, costs in enumerate(layers)
        },
        world_size=world_size,
        grad_workers=draw(st.sampled_from(divisors)),
        colocate=draw(st.booleans()),
    )


def _loads(case: Case, plan: KAISAPlan) -> list[float]:
    loads = [0.0] * case.world_size
    for layer, factors in plan.inv_workers.items():
        for factor, rank in factors.items():
            loads[rank] += case.work[layer][factor]
    return loads


@SETTINGS
@given(cases())
def test_plan_properties(case: Case) -> None:
    # One Hypothesis test drives several checks so they share the generated
    # examples (keeps the suite fast).
    plan = case.plan()
    _check_inverse_workers(case, plan)
    _check_partition(case, plan)
    _check_greedy_load_bound(case, plan)
    _check_deterministic(case, plan)


def _check_inverse_workers(case: Case, plan: KAISAPlan) -> None:
    """Every factor has one inverse worker, in its layer's worker group."""
    assert list(plan.inv_workers) == list(case.work)
    assert list(plan.layer_groups) == list(case.work)
    for layer, costs in case.work.items():
        assert list(plan.inv_workers[layer]) == list(costs)
        group = plan.grad_worker_groups[plan.layer_groups[layer]]
        for rank in plan.inv_workers[layer].values():
            assert 0 <= rank < case.world_size
            assert rank in group
        if case.colocate:
            assert len(set(plan.inv_workers[layer].values())) == 1


def _check_partition(case: Case, plan: KAISAPlan) -> None:
    """Worker groups and receiver groups each partition the ranks."""
    world, gw = case.world_size, case.grad_workers
    for groups, count, size in (
        (plan.grad_worker_groups, world // gw, gw),
        (plan.grad_receiver_groups, gw, world // gw),
    ):
        assert len(groups) == count
        assert all(len(group) == size for group in groups)
        assert sorted(itertools.chain(*groups)) == list(range(world))
    # Each receiver group holds exactly one rank of each worker group.
    for receivers in plan.grad_receiver_groups:
        for workers in plan.grad_worker_groups:
            assert len(set(receivers) & set(workers)) == 1
    # Worker groups are blocks of consecutive ranks.
    for workers in plan.grad_worker_groups:
        assert list(workers) == list(range(workers[0], workers[0] + gw))


def _check_greedy_load_bound(case: Case, plan: KAISAPlan) -> None:
    """Max rank load is bounded as list scheduling guarantees.

    Let ``T`` be the total cost, ``W`` the world size, ``gw`` the gradient
    workers per layer (``W / gw`` worker groups). A *job* is what goes to one
    rank at once: a whole layer with colocation, else one factor. Take the
    rank ``r`` with the largest final load and the last job ``J`` (cost
    ``c_J``) of layer ``L`` (total ``c_L``) placed on it. When ``L`` was
    placed, its group was the least loaded, so that group held at most
    ``(T - c_L) / (W / gw)``; when ``J`` was placed, ``r`` was the least
    loaded of the group's ``gw`` ranks, which then held at most that plus
    the ``c_L - c_J`` of ``L`` already placed. Loads only grow, so::

        load(r) <= (T - c_L) / W + (c_L - c_J) / gw + c_J

    maximised over jobs. With colocation ``c_J = c_L``, giving
    ``max load <= T / W + max layer total``; without it,
    ``max load <= T / W + max layer total / gw + max factor cost``.
    The argument holds for any layer order; the descending order itself is
    checked by the hand-worked examples in test_placement.py.
    """
    loads = _loads(case, plan)
    total = sum(sum(costs.values()) for costs in case.work.values())
    assert abs(sum(loads) - total) <= 1e-6 * (1.0 + total)
    world, gw = case.world_size, case.grad_workers
    bound = 0.0
    for costs in case.work.values():
        layer_total = sum(costs.values())
        jobs = [layer_total] if case.colocate else list(costs.values())
        for job in jobs:
            per_job = (
                (total - layer_total) / world + (layer_total - job) / gw + job
            )
            bound = max(bound, per_job)
    assert max(loads) <= bound + 1e-9 * (1.0 + total)
    biggest_layer = max(sum(c.values()) for c in case.work.values())
    biggest_factor = max(max(c.values()) for c in case.work.values())
    job = biggest_layer if case.colocate else biggest_factor
    extra = 0.0 if case.colocate else biggest_layer / gw
    assert max(loads) <= total / world + extra + job + 1e-9 * (1.0 + total)


def _check_deterministic(case: Case, first: KAISAPlan) -> None:
    """The same inputs (in a fresh mapping) give an equal plan."""
    copied = {k: dict(v) for k, v in case.work.items()}
    again = plan_kaisa(
        copied,
        world_size=case.world_size,
        grad_workers=case.grad_workers,
        colocate_factors=case.colocate,
    )
    assert first == again
    assert hash(first) == hash(again)
    assert first.inv_workers == again.inv_workers


@SETTINGS
@given(st.integers(1, 64))
def test_every_valid_fraction_gives_its_divisor(world_size: int) -> None:
    fractions = valid_grad_worker_fractions(world_size)
    divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
    assert len(fractions) == len(divisors)
    for fraction, divisor in zip(fractions, divisors, strict=True):
        assert grad_workers_from_fraction(fraction, world_size) == divisor
    assert fractions[0] == 1 / world_size
    assert fractions[-1] == 1.0
