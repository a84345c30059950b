"""Example tests of kfac.assignment: tables, hand-placed plans, errors."""

from __future__ import annotations

import dataclasses
import fractions
import math
import types
from collections.abc import Callable
from collections.abc import Mapping
from typing import Any

import pytest
import torch.distributed as dist

from kfac.assignment import KAISAAssignment
from kfac.assignment import KAISAPlan
from kfac.assignment import WorkAssignment
from kfac.assignment import default_group_func
from kfac.assignment import factor_cost
from kfac.assignment import plan_kaisa
from kfac.assignment import valid_grad_worker_fractions
from kfac.enums import AssignmentStrategy
from kfac.enums import DistributedStrategy

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


class RecordingGroups:
    """A fake ``group_func`` that records calls and returns sentinels."""

    def __init__(self) -> None:
        self.calls: list[list[int]] = []
        self.made: dict[tuple[int, ...], object] = {}

    def __call__(self, ranks: list[int]) -> Any:
        self.calls.append(list(ranks))
        sentinel = object()
        self.made[tuple(ranks)] = sentinel
        return sentinel


def _assignment(**kwargs: Any) -> KAISAAssignment:
    arguments: dict[str, Any] = {
        'local_rank': 0,
        'world_size': 4,
        'grad_worker_fraction': 0.5,
    }
    arguments.update(kwargs)
    work = arguments.pop('work', WORK)
    return KAISAAssignment(work, **arguments)


def test_grid_table_lists_every_valid_fraction() -> None:
    for world_size in range(1, 9):
        expected = sorted(gw / world_size for w, gw in GRID if w == world_size)
        assert valid_grad_worker_fractions(world_size) == expected
    assert valid_grad_worker_fractions(6) == [1 / 6, 1 / 3, 0.5, 1.0]


@pytest.mark.parametrize(('world_size', 'grad_workers'), sorted(GRID))
def test_grid(world_size: int, grad_workers: int) -> None:
    worker_groups, receiver_groups = GRID[world_size, grad_workers]
    recorder = RecordingGroups()
    for rank in range(world_size):
        assignment = _assignment(
            local_rank=rank,
            world_size=world_size,
            grad_worker_fraction=grad_workers / world_size,
            group_func=recorder,
        )
        assert assignment.plan.grad_worker_groups == worker_groups
        assert assignment.plan.grad_receiver_groups == receiver_groups
        assert assignment.grad_workers == grad_workers
        assert assignment.grad_worker_fraction == grad_workers / world_size
        assert assignment.broadcast_gradients() == (grad_workers < world_size)
        assert assignment.broadcast_inverses() == (grad_workers > 1)
    # Every rank makes every group, worker groups first, in rank order;
    # nothing at all on a single rank.
    expected_calls = [list(g) for g in worker_groups + receiver_groups]
    if world_size == 1:
        expected_calls = []
    assert recorder.calls == expected_calls * world_size


@pytest.mark.parametrize('world_size', [2, 4, 6, 8])
def test_named_strategies(world_size: int) -> None:
    expected = {
        DistributedStrategy.COMM_OPT: world_size,
        'mem-opt': 1,
        'HYBRID_OPT': world_size // 2,
    }
    for strategy, grad_workers in expected.items():
        assignment = _assignment(
            world_size=world_size,
            grad_worker_fraction=strategy,
        )
        assert assignment.grad_workers == grad_workers


def test_hybrid_opt_on_one_rank_means_that_rank() -> None:
    assignment = _assignment(world_size=1, grad_worker_fraction='hybrid_opt')
    assert assignment.grad_workers == 1
    assert assignment.grad_worker_fraction == 1.0


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
    assignment = _assignment(
        world_size=world_size,
        grad_worker_fraction=fraction,
    )
    assert assignment.grad_workers == grad_workers


def test_src_grad_worker_and_groups_seen_from_each_rank() -> None:
    # W=4, gw=2: 'big' (cost 10) goes to worker group (0, 1), 'small'
    # (cost 1) to the then emptier group (2, 3). Rank r receives from the
    # member of the layer's group at position r % 2, over receiver group
    # (0, 2) for even r and (1, 3) for odd r.
    work = {'big': {'A': 5.0, 'G': 5.0}, 'small': {'A': 0.5, 'G': 0.5}}
    expected_src = {'big': [0, 1, 0, 1], 'small': [2, 3, 2, 3]}
    expected_member = {'big': [True, True, False, False]}
    expected_member['small'] = [False, False, True, True]
    workers = {'big': (0, 1), 'small': (2, 3)}
    for rank in range(4):
        recorder = RecordingGroups()
        assignment = _assignment(
            work=work,
            local_rank=rank,
            group_func=recorder,
        )
        receivers = (0, 2) if rank % 2 == 0 else (1, 3)
        for layer in work:
            assert (
                assignment.src_grad_worker(layer) == expected_src[layer][rank]
            )
            assert (
                assignment.is_grad_worker(layer)
                == (expected_member[layer][rank])
            )
            worker_group = recorder.made[workers[layer]]
            assert assignment.grad_worker_group(layer) is worker_group
            assert assignment.factor_group(layer, 'A') is worker_group
            assert assignment.factor_group(layer, 'G') is worker_group
            receiver_group = recorder.made[receivers]
            assert assignment.grad_receiver_group(layer) is receiver_group


def test_single_rank_has_no_groups() -> None:
    recorder = RecordingGroups()
    assignment = _assignment(
        world_size=1,
        grad_worker_fraction=1.0,
        group_func=recorder,
    )
    assert recorder.calls == []
    for layer in WORK:
        assert assignment.grad_worker_group(layer) is None
        assert assignment.grad_receiver_group(layer) is None
        assert assignment.factor_group(layer, 'G') is None
        assert assignment.is_grad_worker(layer)
        assert assignment.src_grad_worker(layer) == 0
        assert assignment.inv_worker(layer, 'A') == 0


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


def test_accessors_and_repr() -> None:
    assignment = _assignment(
        work={'l': {'A': 1, 'G': 2}},
        local_rank=1,
        world_size=2,
        grad_worker_fraction='mem_opt',
    )
    assert isinstance(assignment, WorkAssignment)
    assert assignment.get_layers() == ('l',)
    assert assignment.get_factors('l') == ('A', 'G')
    assert repr(assignment) == (
        'KAISAAssignment(local_rank=1, world_size=2, grad_workers=1, '
        "grad_worker_groups=((0,), (1,)), inv_workers={'l': {'A': 0, 'G': 0}})"
    )


def test_unknown_names_raise_key_error() -> None:
    assignment = _assignment()
    calls: list[Callable[[], object]] = [
        lambda: assignment.get_factors('nope'),
        lambda: assignment.inv_worker('nope', 'A'),
        lambda: assignment.is_grad_worker('nope'),
        lambda: assignment.src_grad_worker('nope'),
        lambda: assignment.factor_group('nope', 'A'),
        lambda: assignment.grad_worker_group('nope'),
        lambda: assignment.grad_receiver_group('nope'),
    ]
    for call in calls:
        with pytest.raises(KeyError, match=r"unknown layer 'nope'.*'fc'"):
            call()
    for layer in WORK:
        with pytest.raises(KeyError, match=r"unknown factor 'B'.*'A', 'G'"):
            assignment.inv_worker(layer, 'B')
        with pytest.raises(KeyError, match=r"unknown factor 'B'"):
            assignment.factor_group(layer, 'B')


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
    ('strategy', 'expected'),
    [
        (AssignmentStrategy.COMPUTE, 1000.0),
        ('memory', 100.0),
        ('COMPUTE', 1000.0),
    ],
)
def test_factor_cost(
    strategy: AssignmentStrategy | str, expected: float
) -> None:
    assert factor_cost(10, strategy) == expected


def test_default_group_func_without_process_group() -> None:
    assert not dist.is_initialized()
    make = default_group_func(4)
    assert make([0, 1]) is None
    assignment = _assignment(world_size=4)
    assert assignment.grad_worker_group('fc') is None
    assert assignment.grad_receiver_group('fc') is None


def test_default_group_func_uses_new_group(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    recorder = RecordingGroups()
    world = object()
    monkeypatch.setattr(dist, 'is_initialized', lambda: True)
    monkeypatch.setattr(dist, 'new_group', recorder)
    monkeypatch.setattr(dist, 'get_world_size', lambda group=None: 2)
    monkeypatch.setattr(dist, 'group', types.SimpleNamespace(WORLD=world))
    assert default_group_func(1)([0]) is None
    assert recorder.calls == []
    assignment = _assignment(world_size=2, grad_worker_fraction=1.0)
    # The whole world is the default group; other groups are made once.
    assert recorder.calls == [[0], [1]]
    assert assignment.grad_worker_group('fc') is world
    assert assignment.grad_receiver_group('fc') is recorder.made[0,]
    _assignment(world_size=2, grad_worker_fraction=1.0)
    assert recorder.calls == [[0], [1]]
    # A new default group (re-initialised) makes new groups.
    monkeypatch.setattr(dist, 'group', types.SimpleNamespace(WORLD=object()))
    _assignment(world_size=2, grad_worker_fraction=1.0)
    assert recorder.calls == [[0], [1], [0], [1]]


def _error_cases() -> list[tuple[dict[str, Any], type[Exception], str]]:
    nan, inf = math.nan, math.inf
    work_cases: list[tuple[object, type[Exception], str]] = [
        ([('l', {'A': 1})], TypeError, r'^work must be a mapping'),
        ({}, ValueError, r'^work must name at least one layer'),
        ({1: {'A': 1.0}}, TypeError, r'^work layer name must be a str'),
        ({'l': [1.0]}, TypeError, r"^work\['l'\] must be a mapping"),
        ({'l': {}}, ValueError, r"^work\['l'\] must name at least one"),
        ({'l': {2: 1.0}}, TypeError, r"^work\['l'\] factor name must be"),
    ]
    for cost in (-1.0, nan, inf, -inf):
        message = r"^work\['l'\]\['A'\] must be a finite real number >= 0"
        work_cases.append(({'l': {'A': cost}}, ValueError, message))
    for bad in ('1', True, None):
        message = r"^work\['l'\]\['A'\] must be a real number; got"
        work_cases.append(({'l': {'A': bad}}, TypeError, message))
    cases = [({'work': w}, e, m) for w, e, m in work_cases]
    valid = r'valid fractions: \[0\.25, 0\.5, 1\.0\]$'
    fractions_: list[tuple[object, type[Exception], str]] = [
        (0, ValueError, '^grad_worker_fraction=0 .*' + valid),
        (-0.5, ValueError, r'^grad_worker_fraction=-0\.5 .*' + valid),
        (0.3, ValueError, r'^grad_worker_fraction=0\.3 .*' + valid),
        (1.5, ValueError, r'^grad_worker_fraction=1\.5 .*' + valid),
        (2, ValueError, r'^grad_worker_fraction=2 .*' + valid),
        (nan, ValueError, r'^grad_worker_fraction=nan .*' + valid),
        (inf, ValueError, r'^grad_worker_fraction=inf .*' + valid),
        ('fast', ValueError, "^grad_worker_fraction='fast' is not a Dist"),
        (None, TypeError, '^grad_worker_fraction must be a float in'),
        (True, TypeError, '^grad_worker_fraction must be a float in'),
        ([0.5], TypeError, '^grad_worker_fraction must be a float in'),
    ]
    cases += [({'grad_worker_fraction': f}, e, m) for f, e, m in fractions_]
    cases += [
        ({'world_size': 0}, ValueError, '^world_size must be >= 1; got 0'),
        ({'world_size': 4.0}, TypeError, '^world_size must be an int'),
        ({'world_size': True}, TypeError, '^world_size must be an int'),
        ({'local_rank': -1}, ValueError, r'^local_rank must be in \[0, '),
        ({'local_rank': 4}, ValueError, r'world_size=4\); got 4$'),
        ({'local_rank': 1.0}, TypeError, '^local_rank must be an int'),
        ({'local_rank': False}, TypeError, '^local_rank must be an int'),
        ({'group_func': 3}, TypeError, '^group_func must be callable'),
        ({'colocate_factors': 1}, TypeError, '^colocate_factors must be a'),
        ({'colocate_factors': 'no'}, TypeError, '^colocate_factors must'),
    ]
    return cases


@pytest.mark.parametrize(('kwargs', 'error', 'match'), _error_cases())
def test_invalid_arguments(
    kwargs: dict[str, Any],
    error: type[Exception],
    match: str,
) -> None:
    with pytest.raises(error, match=match):
        _assignment(**kwargs)


def test_hybrid_opt_on_odd_world_lists_valid_fractions() -> None:
    with pytest.raises(
        ValueError,
        match=r'^grad_worker_fraction=HYBRID_OPT \(0\.5\) gives 1\.5 .*'
        r'valid fractions: \[0\.3333333333333333, 1\.0\]$',
    ):
        _assignment(world_size=3, grad_worker_fraction='hybrid_opt')


@pytest.mark.parametrize(
    ('kwargs', 'error', 'match'),
    [
        ({'grad_workers': 3}, ValueError, r'^grad_workers=3 must divide'),
        ({'grad_workers': 0}, ValueError, '^grad_workers must be >= 1'),
        ({'grad_workers': 2.0}, TypeError, '^grad_workers must be an int'),
        ({'world_size': -2}, ValueError, '^world_size must be >= 1'),
        ({'colocate_factors': None}, TypeError, '^colocate_factors must'),
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
