"""Example tests of kfac.assignment: groups seen from each rank, errors.

The placement itself (kfac.placement) has its own tests; these check what
KAISAAssignment adds: process groups, answers from each rank's point of
view, and its own arguments.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import pytest
import torch.distributed as dist

from kfac.assignment import KAISAAssignment
from kfac.assignment import WorkAssignment
from kfac.distributed import default_group_func
from tests.test_placement import GRID
from tests.test_placement import WORK


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


def test_hybrid_opt_on_one_rank_means_that_rank() -> None:
    assignment = _assignment(world_size=1, grad_worker_fraction='hybrid_opt')
    assert assignment.grad_workers == 1
    assert assignment.grad_worker_fraction == 1.0


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
        'grad_worker_groups=((0,), (1,)),\n'
        "  'l': inv_workers={'A': 0, 'G': 0}, is_grad_worker=False, "
        'src_grad_worker=0,\n'
        ')'
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
    return [
        ({'work': {'l': {'A': -1}}}, ValueError, r"^work\['l'\]\['A'\]"),
        ({'grad_worker_fraction': 0.3}, ValueError, r'valid fractions: \['),
        ({'grad_worker_fraction': None}, TypeError, '^grad_worker_fraction'),
        ({'world_size': 0}, ValueError, '^world_size must be >= 1; got 0'),
        ({'world_size': 4.0}, TypeError, '^world_size must be an int'),
        ({'world_size': True}, TypeError, '^world_size must be an int'),
        ({'local_rank': -1}, ValueError, r'^local_rank must be in \[0, '),
        ({'local_rank': 4}, ValueError, r'world_size=4\); got 4$'),
        ({'local_rank': 1.0}, TypeError, '^local_rank must be an int'),
        ({'local_rank': False}, TypeError, '^local_rank must be an int'),
        ({'group_func': 3}, TypeError, '^group_func must be None or callable'),
        ({'colocate_factors': 1}, TypeError, '^colocate_factors must be a'),
        ({'colocate_factors': 'no'}, TypeError, '^colocate_factors must'),
    ]


@pytest.mark.parametrize(('kwargs', 'error', 'match'), _error_cases())
def test_invalid_arguments(
    kwargs: dict[str, Any],
    error: type[Exception],
    match: str,
) -> None:
    with pytest.raises(error, match=match):
        _assignment(**kwargs)


@pytest.mark.parametrize('fraction', [0.25, 0.5, 1.0])
def test_shared_bases_are_held_by_every_rank(fraction: float) -> None:
    """EKFAC's layers: every rank holds their decompositions, received over
    the default group (None), whatever the fraction; the other layers keep
    the gradient workers'.
    """
    recorder = RecordingGroups()
    for rank in range(4):
        assignment = _assignment(
            local_rank=rank,
            grad_worker_fraction=fraction,
            group_func=recorder,
            shared_bases=['fc'],
        )
        assert assignment.plan.shared_bases == frozenset({'fc'})
        assert assignment.holds_decomposition('fc')
        for factor in ('A', 'G'):
            assert assignment.factor_group('fc', factor) is None
            assert assignment.factor_group(
                'conv1', factor
            ) is assignment.grad_worker_group('conv1')
        assert assignment.holds_decomposition('conv1') == (
            assignment.is_grad_worker('conv1')
        )
        assert assignment.broadcast_inverses()  # fc's, at least
    single = _assignment(
        world_size=1, grad_worker_fraction=1.0, shared_bases=['fc']
    )
    assert not single.broadcast_inverses()  # nothing to send on one rank
    with pytest.raises(ValueError, match=r"not in work: \['head'\]"):
        _assignment(shared_bases=['fc', 'head'])


def test_holds_decomposition_defaults_to_the_gradient_workers() -> None:
    """The interface's default, for a `WorkAssignment` that shares none."""

    class Workers(KAISAAssignment):
        holds_decomposition = WorkAssignment.holds_decomposition

    for rank in range(4):
        assignment = Workers(
            WORK, local_rank=rank, world_size=4, grad_worker_fraction=0.25
        )
        for layer in WORK:
            assert assignment.holds_decomposition(layer) == (
                assignment.is_grad_worker(layer)
            )


@pytest.mark.parametrize(('world_size', 'grad_workers'), sorted(GRID))
def test_partition_functions_give_the_grid(
    world_size: int, grad_workers: int
) -> None:
    workers, receivers = GRID[world_size, grad_workers]
    assert KAISAAssignment.partition_grad_workers(
        world_size, grad_workers
    ) == {frozenset(group) for group in workers}
    assert KAISAAssignment.partition_grad_receivers(
        world_size, grad_workers
    ) == {frozenset(group) for group in receivers}


@pytest.mark.parametrize(
    ('world_size', 'grad_workers', 'match'),
    [(4, 3, '^grad_workers=3 must divide'), (0, 2, '^world_size must be')],
)
def test_partition_functions_reject_a_bad_grid(
    world_size: int, grad_workers: int, match: str
) -> None:
    for partition in (
        KAISAAssignment.partition_grad_workers,
        KAISAAssignment.partition_grad_receivers,
    ):
        with pytest.raises(ValueError, match=match):
            partition(world_size, grad_workers)


def test_an_assignment_of_no_layers() -> None:
    assignment = _assignment(work={}, group_func=RecordingGroups())
    assert assignment.get_layers() == ()
    assert assignment.plan.grad_worker_groups == GRID[4, 2][0]


def test_greedy_assignment_places_over_the_given_groups() -> None:
    work = {'big': {'A': 6.0, 'G': 3.0}, 'mid': {'A': 2.0, 'G': 2.0}}
    assert KAISAAssignment.greedy_assignment(
        work, [[3], [0, 1]], 4, False
    ) == {
        'big': {'A': 3, 'G': 3},
        'mid': {'A': 0, 'G': 1},
    }
    with pytest.raises(
        ValueError, match=r'^worker_groups ranks must be < world_size=2; got'
    ):
        KAISAAssignment.greedy_assignment(work, [[0, 2]], 2, True)
    with pytest.raises(TypeError, match='^world_size must be an int'):
        KAISAAssignment.greedy_assignment(work, [[0]], 1.0, True)  # type: ignore[arg-type]  # the wrong type tested
