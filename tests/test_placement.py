"""Example tests of kfac.placement: the grid, hand-placed plans, errors."""

from __future__ import annotations

import dataclasses
import fractions
import math
from collections.abc import Mapping
from typing import Any

import pytest

from kfac.enums import AssignmentStrategy
from kfac.enums import DistributedStrategy
from kfac.placement import KAISAPlan
from kfac.placement import factor_cost
from kfac.placement import grad_workers_from_fraction
from kfac.placement import greedy_placement
from kfac.placement import parse_grad_worker_fraction
from kfac.placement import plan_kaisa
from kfac.placement import valid_grad_worker_fractions

Groups = tuple[tuple[int, ...], ...]


def _singles(n: int) -> Groups:
    return tuple((rank,) for rank in range(n))


def _whole(n: int) -> Groups:
    return (tuple(range(n)),)


# (world_size, grad_workers) -> (gradient-worker groups, receiver groups),
# written out by hand from the KAISA grid: worker groups are consecutive
# blocks of grad_workers ranks, receiver group j holds ranks r % gw == j.
GRID: dict[tuple[int, int], tuple[Groups, Groups]] = {
    (1, 1): (((0,),), ((0,),)),
    (2, 1): (((0,), (1,)), ((0, 1),)),
    (2, 2): (((0, 1),), ((0,), (1,))),
    (3, 1): (((0,), (1,), (2,)), ((0, 1, 2),)),
    (3, 3): (((0, 1, 2),), ((0,), (1,), (2,))),
    (4, 1): (_singles(4), _whole(4)),
    (4, 2): (((0, 1), (2, 3)), ((0, 2), (1, 3))),
    (4, 4): (_whole(4), _singles(4)),
    (5, 1): (_singles(5), _whole(5)),
    (5, 5): (_whole(5), _singles(5)),
    (6, 1): (_singles(6), _whole(6)),
    (6, 2): (((0, 1), (2, 3), (4, 5)), ((0, 2, 4), (1, 3, 5))),
    (6, 3): (((0, 1, 2), (3, 4, 5)), ((0, 3), (1, 4), (2, 5))),
    (6, 6): (_whole(6), _singles(6)),
    (7, 1): (_singles(7), _whole(7)),
    (7, 7): (_whole(7), _singles(7)),
    (8, 1): (_singles(8), _whole(8)),
    (8, 2): (
        ((0, 1), (2, 3), (4, 5), (6, 7)),
        ((0, 2, 4, 6), (1, 3, 5, 7)),
    ),
    (8, 4): (((0, 1, 2, 3), (4, 5, 6, 7)), ((0, 4), (1, 5), (2, 6), (3, 7))),
    (8, 8): (_whole(8), _singles(8)),
}

WORK: dict[str, dict[str, float]] = {
    'conv1': {'A': 27.0, 'G': 64.0},
    'fc': {'A': 1000.0, 'G': 8.0},
    'conv2': {'A': 125.0, 'G': 125.0},
}


def test_grid_table_lists_every_valid_fraction() -> None:
    for world_size in range(1, 9):
        expected = sorted(gw / world_size for w, gw in GRID if w == world_size)
        assert valid_grad_worker_fractions(world_size) == expected
    assert valid_grad_worker_fractions(6) == [1 / 6, 1 / 3, 0.5, 1.0]


@pytest.mark.parametrize(('world_size', 'grad_workers'), sorted(GRID))
def test_plan_grid(world_size: int, grad_workers: int) -> None:
    plan = plan_kaisa(
        WORK,
        world_size=world_size,
        grad_workers=grad_workers,
        colocate_factors=True,
    )
    assert (plan.grad_worker_groups, plan.grad_receiver_groups) == GRID[
        world_size, grad_workers
    ]
    assert (plan.world_size, plan.grad_workers) == (world_size, grad_workers)


@pytest.mark.parametrize('world_size', [1, 2, 4, 6, 8])
def test_named_strategies(world_size: int) -> None:
    expected = {
        DistributedStrategy.COMM_OPT: world_size,
        'mem-opt': 1,
        'HYBRID_OPT': max(1, world_size // 2),
    }
    for strategy, grad_workers in expected.items():
        assert grad_workers_from_fraction(strategy, world_size) == (
            grad_workers
        )


@pytest.mark.parametrize(
    ('fraction', 'world_size', 'grad_workers'),
    [
        (1, 4, 4),
        (fractions.Fraction(1, 3), 3, 1),
        (1 / 3, 6, 2),
        (0.1, 10, 1),
        (0.2, 10, 2),
        (0.5, 10, 5),
        (5 / 15, 15, 5),
    ],
)
def test_numeric_fractions(
    fraction: float,
    world_size: int,
    grad_workers: int,
) -> None:
    assert grad_workers_from_fraction(fraction, world_size) == grad_workers


@pytest.mark.parametrize(
    ('value', 'expected'),
    [
        ('comm_opt', DistributedStrategy.COMM_OPT),
        ('COMM-OPT', DistributedStrategy.COMM_OPT),
        ('Mem_Opt', DistributedStrategy.MEM_OPT),
        (DistributedStrategy.HYBRID_OPT, DistributedStrategy.HYBRID_OPT),
        (1, 1.0),
        (fractions.Fraction(1, 4), 0.25),
    ],
)
def test_parse_grad_worker_fraction(
    value: object, expected: float | DistributedStrategy
) -> None:
    parsed = parse_grad_worker_fraction(value)
    assert parsed == expected
    assert type(parsed) is type(expected)


def test_hand_placed_plan_without_colocation() -> None:
    # W=4, gw=2: worker groups g0 = (0, 1), g1 = (2, 3).
    # Totals: l1 = 10, l2 = 6, l3 = 5, l0 = 2, placed in that order:
    #   l1 -> g0 (tie 0/0, lowest index); g0 = 10
    #   l2 -> g1 (0 < 10);  g1 = 6
    #   l3 -> g1 (6 < 10);  g1 = 11
    #   l0 -> g0 (10 < 11); g0 = 12
    # Inside g0: l1.A=8 -> rank 0 (tie, lowest); l1.G=2 -> rank 1 (0 < 8);
    #   l0.A=1 -> rank 1 (2 < 8), then l0.G=1 -> rank 1 (3 < 8).
    # Inside g1: l2.A=3 -> rank 2 (tie); l2.G=3 -> rank 3 (0 < 3);
    #   l3.A=4 -> rank 2 (3 vs 3, tie, lowest); l3.G=1 -> rank 3 (3 < 7).
    work = {
        'l0': {'A': 1.0, 'G': 1.0},
        'l1': {'A': 8.0, 'G': 2.0},
        'l2': {'A': 3.0, 'G': 3.0},
        'l3': {'A': 4.0, 'G': 1.0},
    }
    plan = plan_kaisa(
        work,
        world_size=4,
        grad_workers=2,
        colocate_factors=False,
    )
    assert plan.layer_groups == {'l0': 0, 'l1': 0, 'l2': 1, 'l3': 1}
    assert plan.inv_workers == {
        'l0': {'A': 1, 'G': 1},
        'l1': {'A': 0, 'G': 1},
        'l2': {'A': 2, 'G': 3},
        'l3': {'A': 2, 'G': 3},
    }
    assert list(plan.inv_workers) == ['l0', 'l1', 'l2', 'l3']


def test_hand_placed_plan_with_colocation() -> None:
    # Same groups as above (l0, l1 in g0; l2, l3 in g1). Whole layers:
    #   g0: l1 (10) -> rank 0; l0 (2) -> rank 1 (0 < 10).
    #   g1: l2 (6) -> rank 2; l3 (5) -> rank 3 (0 < 6).
    work = {
        'l0': {'A': 1.0, 'G': 1.0},
        'l1': {'A': 8.0, 'G': 2.0},
        'l2': {'A': 3.0, 'G': 3.0},
        'l3': {'A': 4.0, 'G': 1.0},
    }
    plan = plan_kaisa(
        work, world_size=4, grad_workers=2, colocate_factors=True
    )
    assert plan.inv_workers == {
        'l0': {'A': 1, 'G': 1},
        'l1': {'A': 0, 'G': 0},
        'l2': {'A': 2, 'G': 2},
        'l3': {'A': 3, 'G': 3},
    }


def test_ties_follow_the_given_order() -> None:
    # MEM-OPT on 2 ranks: groups (0,) and (1,). Equal totals keep the given
    # order: c -> rank 0, a -> rank 1, b -> rank 0 (1 vs 1, lowest).
    work = {'c': {'A': 1.0}, 'a': {'A': 1.0}, 'b': {'A': 1.0}}
    plan = plan_kaisa(
        work, world_size=2, grad_workers=1, colocate_factors=True
    )
    assert plan.inv_workers == {'c': {'A': 0}, 'a': {'A': 1}, 'b': {'A': 0}}


def test_largest_factor_first_within_a_layer() -> None:
    # One group (0, 1), totals x = y = 6 so x goes first. x.G=5 before x.A=1:
    # G -> rank 0, A -> rank 1. y.A=3 (tie with y.G, given order first) ->
    # rank 1 (1 < 5), y.G=3 -> rank 1 (4 < 5).
    work = {'x': {'A': 1.0, 'G': 5.0}, 'y': {'A': 3.0, 'G': 3.0}}
    plan = plan_kaisa(
        work,
        world_size=2,
        grad_workers=2,
        colocate_factors=False,
    )
    assert plan.inv_workers == {'x': {'A': 1, 'G': 0}, 'y': {'A': 1, 'G': 1}}
    assert list(plan.inv_workers['x']) == ['A', 'G']


def test_plan_is_immutable_and_hashable() -> None:
    work = {'l': {'A': 1.0, 'G': 1.0}}
    plan = plan_kaisa(
        work, world_size=2, grad_workers=1, colocate_factors=True
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.world_size = 3  # type: ignore[misc]  # checking it is refused
    with pytest.raises(TypeError):
        plan.inv_workers['l'] = {}  # type: ignore[index]  # refused
    with pytest.raises(TypeError):
        plan.inv_workers['l']['A'] = 1  # type: ignore[index]  # refused
    layer_groups: dict[str, int] = {'l': 0}
    inv_workers: dict[str, Mapping[str, int]] = {'l': {'A': 0, 'G': 0}}
    built = KAISAPlan(
        world_size=2,
        grad_workers=1,
        grad_worker_groups=((0,), (1,)),
        grad_receiver_groups=((0, 1),),
        inv_workers=inv_workers,
        layer_groups=layer_groups,
    )
    layer_groups['l'] = 1
    inv_workers['l'] = {'A': 1}
    assert built == plan
    assert hash(built) == hash(plan)
    other = plan_kaisa(
        work, world_size=2, grad_workers=2, colocate_factors=True
    )
    assert other != plan


@pytest.mark.parametrize(
    ('dim', 'strategy', 'expected'),
    [
        (10, AssignmentStrategy.COMPUTE, 1000.0),
        (10, 'memory', 100.0),
        (7, 'COMPUTE', 343.0),
        (1, AssignmentStrategy.MEMORY, 1.0),
    ],
)
def test_factor_cost(
    dim: int, strategy: AssignmentStrategy | str, expected: float
) -> None:
    assert factor_cost(dim, strategy) == expected


def _work_errors() -> list[tuple[object, type[Exception], str]]:
    nan, inf = math.nan, math.inf
    cases: list[tuple[object, type[Exception], str]] = [
        ([('l', {'A': 1})], TypeError, r'^work must be a mapping'),
        ({1: {'A': 1.0}}, TypeError, r'^work layer name must be a str'),
        ({'l': [1.0]}, TypeError, r"^work\['l'\] must be a mapping"),
        ({'l': {}}, ValueError, r"^work\['l'\] must name at least one"),
        ({'l': {2: 1.0}}, TypeError, r"^work\['l'\] factor name must be"),
    ]
    for cost in (-1.0, nan, inf, -inf):
        message = r"^work\['l'\]\['A'\] must be a finite number >= 0\.0"
        cases.append(({'l': {'A': cost}}, ValueError, message))
    for bad in ('1', True, None):
        message = r"^work\['l'\]\['A'\] must be a real number; got"
        cases.append(({'l': {'A': bad}}, TypeError, message))
    return cases


@pytest.mark.parametrize(('work', 'error', 'match'), _work_errors())
def test_invalid_work(work: Any, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        plan_kaisa(work, world_size=4, grad_workers=2, colocate_factors=True)


@pytest.mark.parametrize(('world_size', 'grad_workers'), sorted(GRID))
def test_a_plan_of_no_layers_has_the_grid(
    world_size: int, grad_workers: int
) -> None:
    plan = plan_kaisa(
        {},
        world_size=world_size,
        grad_workers=grad_workers,
        colocate_factors=False,
    )
    workers, receivers = GRID[world_size, grad_workers]
    assert plan.grad_worker_groups == workers
    assert plan.grad_receiver_groups == receivers
    assert dict(plan.inv_workers) == {}
    assert dict(plan.layer_groups) == {}


def test_greedy_placement_over_uneven_groups() -> None:
    work = {
        'big': {'A': 6.0, 'G': 3.0},
        'mid': {'A': 2.0, 'G': 2.0},
        'small': {'A': 1.0},
    }
    # big (9) -> group (5,) alone; mid (4) -> group (1, 3): A to 1, G
    # to 3; small (1) -> group (1, 3), its least-loaded rank, 1 (tie).
    assert greedy_placement(work, [[5], [1, 3]], colocate_factors=False) == {
        'big': {'A': 5, 'G': 5},
        'mid': {'A': 1, 'G': 3},
        'small': {'A': 1},
    }
    assert greedy_placement(work, [[5], [1, 3]], colocate_factors=True) == {
        'big': {'A': 5, 'G': 5},
        'mid': {'A': 1, 'G': 1},
        'small': {'A': 3},
    }
    assert greedy_placement({}, [[0]], colocate_factors=True) == {}


@pytest.mark.parametrize(
    ('groups', 'error', 'match'),
    [
        (3, TypeError, '^worker_groups must be a list of lists of ranks'),
        ('01', TypeError, '^worker_groups must be a list of lists of ranks'),
        ([3], TypeError, '^worker_groups must be a list of lists of ranks'),
        ([['0']], TypeError, '^worker_groups rank must be an int'),
        ([[-1]], ValueError, '^worker_groups rank must be >= 0'),
        ([], ValueError, '^worker_groups must be non-empty groups'),
        ([[0], []], ValueError, '^worker_groups must be non-empty groups'),
        ([[0, 1], [1]], ValueError, r'of distinct ranks, at least one; got'),
    ],
)
def test_greedy_placement_rejects_bad_groups(
    groups: Any, error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        greedy_placement(WORK, groups, colocate_factors=True)


def test_greedy_placement_checks_work_and_colocate_factors() -> None:
    with pytest.raises(ValueError, match=r"^work\['l'\]\['A'\] must be"):
        greedy_placement({'l': {'A': -1.0}}, [[0]], colocate_factors=True)
    with pytest.raises(TypeError, match='^colocate_factors must be a'):
        greedy_placement(WORK, [[0]], colocate_factors=1)  # type: ignore[arg-type]  # the wrong type tested


@pytest.mark.parametrize(
    ('kwargs', 'error', 'match'),
    [
        ({'grad_workers': 3}, ValueError, r'^grad_workers=3 must divide'),
        ({'grad_workers': 0}, ValueError, '^grad_workers must be >= 1'),
        ({'grad_workers': 2.0}, TypeError, '^grad_workers must be an int'),
        ({'world_size': -2}, ValueError, '^world_size must be >= 1'),
        ({'colocate_factors': None}, TypeError, '^colocate_factors must'),
        ({'colocate_factors': 1}, TypeError, '^colocate_factors must be a'),
    ],
)
def test_invalid_plan_arguments(
    kwargs: dict[str, Any],
    error: type[Exception],
    match: str,
) -> None:
    arguments: dict[str, Any] = {
        'world_size': 4,
        'grad_workers': 2,
        'colocate_factors': True,
    }
    arguments.update(kwargs)
    with pytest.raises(error, match=match):
        plan_kaisa(WORK, **arguments)


IN_RANGE = r'must be a finite number > 0\.0 and <= 1\.0; got '


@pytest.mark.parametrize(
    ('fraction', 'workers'), [(0.3, r'1\.2'), (0.1, r'0\.4'), (0.75, '3')]
)
def test_fraction_must_give_a_divisor(fraction: float, workers: str) -> None:
    with pytest.raises(
        ValueError,
        match=rf'^grad_worker_fraction={fraction} gives {workers} gradient '
        r'workers at world_size=4; .* valid fractions: \[0\.25, 0\.5, 1\.0\]$',
    ):
        grad_workers_from_fraction(fraction, 4)


@pytest.mark.parametrize(
    ('fraction', 'error', 'match'),
    [
        (-0.5, ValueError, '^grad_worker_fraction ' + IN_RANGE + '-0.5$'),
        (1.5, ValueError, '^grad_worker_fraction ' + IN_RANGE + '1.5$'),
        (2, ValueError, '^grad_worker_fraction ' + IN_RANGE + '2$'),
        (math.nan, ValueError, '^grad_worker_fraction ' + IN_RANGE + 'nan$'),
        (math.inf, ValueError, '^grad_worker_fraction ' + IN_RANGE + 'inf$'),
        ('fast', ValueError, "^grad_worker_fraction='fast' is not a Dist"),
        (None, TypeError, '^grad_worker_fraction must be a float in'),
        (True, TypeError, '^grad_worker_fraction must be a float in'),
        ([0.5], TypeError, '^grad_worker_fraction must be a float in'),
    ],
)
def test_invalid_fractions(
    fraction: object, error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        grad_workers_from_fraction(fraction, 4)
    with pytest.raises(error, match=match):
        parse_grad_worker_fraction(fraction)


@pytest.mark.parametrize('world_size', [1, 2, 3, 4, 8])
def test_zero_is_the_original_spelling_of_mem_opt(world_size: int) -> None:
    # The original KAISA code read grad_worker_fraction=0 as 1 / world_size.
    smallest = valid_grad_worker_fractions(world_size)[0]
    assert parse_grad_worker_fraction(0) is DistributedStrategy.MEM_OPT
    assert parse_grad_worker_fraction(0.0) is DistributedStrategy.MEM_OPT
    assert grad_workers_from_fraction(0, world_size) == (
        grad_workers_from_fraction(smallest, world_size)
    )
    assert grad_workers_from_fraction(0, world_size) == (
        grad_workers_from_fraction('mem_opt', world_size)
    )


@pytest.mark.parametrize('fraction', [0.3, 0.5, 0.75, 'hybrid_opt', 1])
def test_one_rank_is_every_fraction_one_worker(fraction: object) -> None:
    # A script written for many ranks runs on one, as in the original.
    assert grad_workers_from_fraction(fraction, 1) == 1


def test_hybrid_opt_on_odd_world_lists_valid_fractions() -> None:
    with pytest.raises(
        ValueError,
        match=r'^grad_worker_fraction=HYBRID_OPT \(0\.5\) gives 1\.5 .*'
        r'valid fractions: \[0\.3333333333333333, 1\.0\]$',
    ):
        grad_workers_from_fraction('hybrid_opt', 3)


def test_invalid_factor_cost_and_world_size() -> None:
    with pytest.raises(ValueError, match=r'^dim must be >= 1; got 0'):
        factor_cost(0, 'compute')
    with pytest.raises(TypeError, match=r'^dim must be an int'):
        factor_cost(2.5, 'compute')  # type: ignore[arg-type]  # refused
    with pytest.raises(ValueError, match=r"^strategy='speed' is not"):
        factor_cost(3, 'speed')
    with pytest.raises(TypeError, match=r'^strategy must be'):
        factor_cost(3, 3)  # type: ignore[arg-type]  # refused
    with pytest.raises(ValueError, match=r'^world_size must be >= 1'):
        valid_grad_worker_fractions(0)
    with pytest.raises(TypeError, match=r'^world_size must be an int'):
        grad_workers_from_fraction(0.5, 4.0)  # type: ignore[arg-type]  # refused
