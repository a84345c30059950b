"""Tests of kfac.distributed: the communicator, alone and on 2-4 ranks.

The collectives are checked exactly: every rank builds integer-valued
tensors from a seed and its rank, so each rank can compute every other rank's
contribution, and sums (and their quotient by the group size) are compared
bit for bit with the same arithmetic done locally.

Starting ranks costs seconds, so the checks of one world size share a
launch; each check is still its own test, and a failing check does not hide
the others (see `launch_checks`).
"""

from __future__ import annotations

import dataclasses
import fractions
import itertools
import math
import pathlib
import random
from collections.abc import Callable
from collections.abc import Iterator
from collections.abc import Sequence
from typing import cast

import numpy as np
import pytest
import torch
import torch.distributed as dist

from kfac import distributed as kd
from kfac.distributed import NonSquareTensorError
from kfac.distributed import TorchDistributedCommunicator
from kfac.distributed import get_rank
from kfac.distributed import get_world_size
from testing.distributed import DistributedTestError
from testing.distributed import run_distributed

DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


# --------------------------------------------------------------------------
# Values every rank can compute for every rank.


def make_value(
    seed: int,
    rank: int,
    shape: Sequence[int],
    dtype: torch.dtype,
    *,
    symmetric: bool = False,
) -> torch.Tensor:
    """Integer-valued tensor in [-16, 16], a function of (seed, rank)."""
    generator = torch.Generator().manual_seed(seed * 1009 + rank)
    values = torch.randint(-8, 9, tuple(shape), generator=generator)
    if symmetric:
        values = values + values.T
    return values.to(dtype)


def reduced(
    seed: int,
    ranks: Sequence[int],
    shape: Sequence[int],
    dtype: torch.dtype,
    *,
    symmetric: bool = False,
    average: bool = False,
) -> torch.Tensor:
    """The sum (or mean) over ``ranks`` of their :func:`make_value`."""
    total = make_value(seed, ranks[0], shape, dtype, symmetric=symmetric)
    for rank in ranks[1:]:
        total = total + make_value(
            seed, rank, shape, dtype, symmetric=symmetric
        )
    return total / len(ranks) if average else total


def upper_symmetrized(matrix: torch.Tensor) -> torch.Tensor:
    """The symmetric matrix whose upper triangle is ``matrix``'s."""
    return torch.triu(matrix) + torch.triu(matrix, 1).T


def assert_same(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype
    assert actual.shape == expected.shape
    assert torch.equal(actual, expected), (actual, expected)


# --------------------------------------------------------------------------
# Without a process group.


def test_rank_and_size_without_process_group() -> None:
    assert not dist.is_initialized()
    assert get_rank() == 0
    assert get_world_size() == 1


def test_rank_and_size_without_torch_distributed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(dist, 'is_available', lambda: False)
    assert get_rank() == 0
    assert get_world_size() == 1
    tensor = torch.ones(3)
    assert TorchDistributedCommunicator().allreduce(tensor).wait() is tensor


@pytest.mark.parametrize('symmetry_aware', [False, True])
@pytest.mark.parametrize('bucket_cap_mb', [0, 25])
def test_single_process_collectives_return_input(
    symmetry_aware: bool, bucket_cap_mb: float
) -> None:
    comm = TorchDistributedCommunicator(
        bucket_cap_mb, symmetry_aware=symmetry_aware
    )
    matrix = make_value(1, 0, (4, 4), torch.float32)
    original = matrix.clone()
    handles = [
        comm.allreduce(matrix),
        comm.allreduce(matrix, symmetric=True, average=False),
        comm.allreduce_bucketed(matrix),
        comm.allreduce_bucketed(matrix, symmetric=True),
        comm.broadcast(matrix, src=0),
        comm.broadcast(matrix, src=0, symmetric=True),
    ]
    comm.flush()
    for handle in handles:
        assert handle.done()
        assert handle.wait() is matrix
    assert_same(matrix, original)
    assert not comm.bytes_communicated
    assert not comm.collectives_started


def test_single_process_scatter_copies_the_only_chunk() -> None:
    comm = TorchDistributedCommunicator()
    out = torch.zeros(3)
    handle = comm.scatter(out, [torch.arange(3.0)], src=0)
    assert handle.done() and handle.wait() is out
    assert out.tolist() == [0.0, 1.0, 2.0]
    assert not comm.bytes_communicated  # a one-rank shortcut


def test_single_process_all_gather_stacks_the_input() -> None:
    comm = TorchDistributedCommunicator()
    tensor = torch.arange(6.0).reshape(2, 3)
    handle = comm.all_gather(tensor)
    assert handle.done()
    assert_same(handle.wait(), tensor[None])
    assert not comm.collectives_started  # a one-rank shortcut
    with pytest.raises(TypeError, match=r'tensor must be a torch\.Tensor'):
        comm.all_gather([1.0])  # type: ignore[arg-type]  # wrong on purpose


def test_single_process_argument_errors() -> None:
    comm = TorchDistributedCommunicator(symmetry_aware=True)
    with pytest.raises(ValueError, match=r'src=1 is not a member.*\[0\]'):
        comm.broadcast(torch.zeros(2), src=1)
    with pytest.raises(TypeError, match='src must be an int'):
        comm.broadcast(torch.zeros(2), src=True)
    with pytest.raises(TypeError, match='src must be an int'):
        comm.broadcast(torch.zeros(2), src='0')  # type: ignore[arg-type]  # wrong on purpose
    with pytest.raises(TypeError, match=r'tensor must be a torch\.Tensor'):
        comm.allreduce([1.0])  # type: ignore[arg-type]  # wrong on purpose
    with pytest.raises(NonSquareTensorError, match=r'shape \(2, 3\)'):
        comm.allreduce(torch.zeros(2, 3), symmetric=True)
    with pytest.raises(NonSquareTensorError, match=r'shape \(4,\)'):
        comm.allreduce_bucketed(torch.zeros(4), symmetric=True)
    with pytest.raises(NonSquareTensorError):
        comm.broadcast(torch.zeros(2, 2, 2), src=0, symmetric=True)
    with pytest.raises(TypeError, match=r'torch\.int64.*average=False'):
        comm.allreduce(torch.zeros(2, dtype=torch.int64))
    integers = torch.arange(3)
    assert comm.allreduce(integers, average=False).wait() is integers
    numpy_rank = cast('int', np.int64(0))  # an integer, typed int or not
    assert comm.broadcast(integers, src=numpy_rank).wait() is integers


def test_bucket_key_needs_a_process_group() -> None:
    with pytest.raises(RuntimeError, match='no default process group'):
        kd._groups.group_key(None)


# --------------------------------------------------------------------------
# Communicator arguments.


@pytest.mark.parametrize('value', [True, '25', None, 1 + 0j])
def test_bucket_cap_type_error(value: object) -> None:
    with pytest.raises(TypeError, match='allreduce_bucket_cap_mb'):
        TorchDistributedCommunicator(bucket_cap_mb=value)  # type: ignore[arg-type]  # wrong on purpose


@pytest.mark.parametrize('value', [-1, -1e-9, math.nan, math.inf, -math.inf])
def test_bucket_cap_value_error(value: float) -> None:
    with pytest.raises(ValueError, match='allreduce_bucket_cap_mb') as info:
        TorchDistributedCommunicator(bucket_cap_mb=value)
    assert repr(value) in str(info.value) or str(value) in str(info.value)


@pytest.mark.parametrize('value', [1, 'yes', None])
def test_symmetry_aware_type_error(value: object) -> None:
    with pytest.raises(TypeError, match='symmetry_aware'):
        TorchDistributedCommunicator(symmetry_aware=value)  # type: ignore[arg-type]  # wrong on purpose


@pytest.mark.parametrize(
    ('value', 'expected'),
    [
        (0, 0.0),
        (25, 25.0),
        (0.5, 0.5),
        (fractions.Fraction(1, 4), 0.25),
        (np.float32(2.0), 2.0),
    ],
)
def test_valid_communicator_arguments(value: float, expected: float) -> None:
    comm = TorchDistributedCommunicator(value, symmetry_aware=True)
    assert comm.bucket_cap_mb == expected
    assert isinstance(comm.bucket_cap_mb, float)
    assert comm.symmetry_aware is True
    assert repr(comm) == (
        f'TorchDistributedCommunicator(bucket_cap_mb={expected!r}, '
        'symmetry_aware=True)'
    )


# --------------------------------------------------------------------------
# Collectives on 2, 3 and 4 ranks: one launch per world size, one test per
# check.


@dataclasses.dataclass(frozen=True)
class Group:
    """A process group with its global ranks (``group`` None: default)."""

    name: str
    ranks: tuple[int, ...]
    group: dist.ProcessGroup | None
    key: str  # which communicator bucket key the group must map to

    @property
    def member(self) -> bool:
        return dist.get_rank() in self.ranks


def make_groups(world_size: int) -> list[Group]:
    """Groups of several sizes; every rank creates all in the same order."""
    everyone = tuple(range(world_size))
    groups = [
        Group('none', everyone, None, 'world'),
        Group('WORLD', everyone, dist.group.WORLD, 'world'),
    ]
    subsets = {
        'all-again': everyone,
        'evens': everyone[0::2],
        'odds': everyone[1::2],
        'first-half': everyone[: (world_size + 1) // 2],
        'second-half': everyone[(world_size + 1) // 2 :],
        'all-but-last': everyone[:-1],
    }
    for name, ranks in subsets.items():
        groups.append(Group(name, ranks, dist.new_group(list(ranks)), name))
    return groups


def check_rank_and_size(groups: Sequence[Group]) -> None:
    """`get_rank`/`get_world_size` agree with torch.distributed's."""
    assert get_world_size() == dist.get_world_size()
    assert get_rank() == dist.get_rank()
    for group in groups:
        if group.member:
            assert get_world_size(group.group) == len(group.ranks)
            assert get_rank(group.group) == group.ranks.index(get_rank())
        else:
            assert get_world_size(group.group) == -1
            assert get_rank(group.group) == -1


def member_groups(
    groups: Sequence[Group], base: int
) -> Iterator[tuple[Iterator[int], Group]]:
    """Yield this rank's groups, with seeds that agree across their ranks."""
    for index, group in enumerate(groups):
        if group.member:
            yield itertools.count(base + 1000 * index), group


def check_allreduce(groups: Sequence[Group]) -> None:
    comm = TorchDistributedCommunicator()
    shapes: list[tuple[int, ...]] = [(), (5,), (3, 4), (2, 3, 2)]
    for (seeds, group), dtype in itertools.product(
        member_groups(groups, 0), DTYPES
    ):
        for shape, average in itertools.product(shapes, (False, True)):
            seed = next(seeds)
            tensor = make_value(seed, get_rank(), shape, dtype)
            result = comm.allreduce(
                tensor, group=group.group, average=average
            ).wait()
            assert result is tensor  # documented: in place
            expected = reduced(
                seed, group.ranks, shape, dtype, average=average
            )
            assert_same(result, expected)
        # A non-contiguous tensor is reduced in a copy, itself unchanged.
        seed = next(seeds)
        tensor = make_value(seed, get_rank(), (4, 3), dtype).T
        original = tensor.clone()
        result = comm.allreduce(tensor, group=group.group).wait()
        expected = reduced(seed, group.ranks, (4, 3), dtype, average=True)
        assert_same(result, expected.T)
        assert_same(tensor, original)


def check_symmetric_allreduce(groups: Sequence[Group]) -> None:
    packing = TorchDistributedCommunicator(symmetry_aware=True)
    plain = TorchDistributedCommunicator(symmetry_aware=False)
    for (seeds, group), dtype, n in itertools.product(
        member_groups(groups, 10_000), DTYPES, (1, 2, 7)
    ):
        multi = len(group.ranks) > 1
        for comm, average in itertools.product((packing, plain), (0, 1)):
            seed = next(seeds)
            matrix = make_value(
                seed, get_rank(), (n, n), dtype, symmetric=True
            )
            original = matrix.clone()
            before = comm.bytes_communicated['allreduce']
            result = comm.allreduce(
                matrix,
                group=group.group,
                symmetric=True,
                average=bool(average),
            ).wait()
            expected = reduced(
                seed,
                group.ranks,
                (n, n),
                dtype,
                symmetric=True,
                average=bool(average),
            )
            assert_same(result, expected)
            numel = n * (n + 1) // 2 if comm is packing else n * n
            sent = comm.bytes_communicated['allreduce'] - before
            assert sent == multi * numel * matrix.element_size()
            if comm is packing:
                assert_same(matrix, original)  # packing copies
        # Only the upper triangle travels: the lower one is ignored.
        seed = next(seeds)
        matrix = make_value(seed, get_rank(), (n, n), dtype)
        result = packing.allreduce(
            matrix, group=group.group, symmetric=True, average=False
        ).wait()
        total = reduced(seed, group.ranks, (n, n), dtype)
        assert_same(result, upper_symmetrized(total) if multi else total)


def check_broadcast(groups: Sequence[Group]) -> None:
    packing = TorchDistributedCommunicator(symmetry_aware=True)
    plain = TorchDistributedCommunicator()
    rank = get_rank()
    for (seeds, group), dtype in itertools.product(
        member_groups(groups, 20_000), DTYPES
    ):
        multi = len(group.ranks) > 1
        for src in group.ranks:
            seed = next(seeds)
            tensor = make_value(seed, rank, (3, 5), dtype)
            result = plain.broadcast(tensor, src=src, group=group.group).wait()
            assert result is tensor  # documented: in place
            assert_same(result, make_value(seed, src, (3, 5), dtype))
            for symmetric in (True, False):
                seed = next(seeds)
                matrix = make_value(
                    seed, rank, (6, 6), dtype, symmetric=symmetric
                )
                original = matrix.clone()
                before = packing.bytes_communicated['broadcast']
                result = packing.broadcast(
                    matrix, src=src, group=group.group, symmetric=True
                ).wait()
                sent = packing.bytes_communicated['broadcast'] - before
                assert sent == multi * 21 * matrix.element_size()
                expected = make_value(
                    seed, src, (6, 6), dtype, symmetric=symmetric
                )
                if multi:
                    expected = upper_symmetrized(expected)
                assert_same(result, expected)
                assert_same(matrix, original)  # packing copies
        outsiders = sorted(
            set(range(dist.get_world_size())) - set(group.ranks)
        )
        for src in outsiders:
            with pytest.raises(ValueError, match=f'src={src} is not a member'):
                plain.broadcast(torch.zeros(2), src=src, group=group.group)


def check_all_gather(groups: Sequence[Group]) -> None:
    comm = TorchDistributedCommunicator()
    rank = get_rank()
    shapes: list[tuple[int, ...]] = [(), (4,), (2, 3)]

    def value(
        seed: int, rank: int, shape: tuple[int, ...], dtype: torch.dtype
    ) -> torch.Tensor:
        tensor = make_value(seed, rank, shape, dtype)
        return tensor.T if tensor.dim() == 2 else tensor  # not contiguous

    for (seeds, group), dtype in itertools.product(
        member_groups(groups, 30_000), (*DTYPES, torch.int64)
    ):
        for shape in shapes:
            seed = next(seeds)
            tensor = value(seed, rank, shape, dtype)
            original = tensor.clone()
            before = comm.collectives_started['gathered']
            result = comm.all_gather(
                tensor, group=group.group, kind='gathered'
            ).wait()
            started = comm.collectives_started['gathered'] - before
            assert started == (len(group.ranks) > 1)
            expected = torch.stack(
                [value(seed, r, shape, dtype) for r in group.ranks]
            )
            assert_same(result, expected)
            assert_same(tensor, original)  # read, never written
    assert 'allgather' not in comm.collectives_started  # counted by kind


def check_not_a_member(groups: Sequence[Group]) -> None:
    comm = TorchDistributedCommunicator()
    match = 'not a member of the process group'
    for group in groups:
        if group.member:
            continue
        with pytest.raises(ValueError, match=match):
            comm.allreduce(torch.zeros(2), group=group.group)
        with pytest.raises(ValueError, match=match):
            comm.allreduce_bucketed(torch.zeros(2), group=group.group)
        with pytest.raises(ValueError, match=match):
            comm.broadcast(
                torch.zeros(2), src=group.ranks[0], group=group.group
            )
        with pytest.raises(ValueError, match=match):
            comm.all_gather(torch.zeros(2), group=group.group)
    assert not comm.collectives_started


def check_bucket_cap_zero(groups: Sequence[Group]) -> None:
    """``bucket_cap_mb=0``: one in-place allreduce per tensor."""
    comm = TorchDistributedCommunicator(bucket_cap_mb=0, symmetry_aware=True)
    expected_count = 0
    for seeds, group in member_groups(groups, 30_000):
        seed = next(seeds)
        tensor = make_value(seed, get_rank(), (4, 4), torch.float64)
        handle = comm.allreduce_bucketed(tensor, group=group.group)
        assert handle.wait() is tensor
        assert_same(
            tensor,
            reduced(seed, group.ranks, (4, 4), torch.float64, average=True),
        )
        expected_count += len(group.ranks) > 1
        assert comm.collectives_started['allreduce'] == expected_count
    comm.flush()
    assert comm.collectives_started['allreduce'] == expected_count
    assert comm.bytes_communicated['allreduce'] == 128 * expected_count
    comm.reset_stats()
    assert not comm.collectives_started
    assert not comm.bytes_communicated


def check_unflushed_wait(groups: Sequence[Group]) -> None:
    """``wait()`` on a pending bucket starts that bucket only."""
    comm = TorchDistributedCommunicator(bucket_cap_mb=1)
    rank = get_rank()
    for index, group in enumerate(groups):
        if not group.member or len(group.ranks) == 1:
            continue
        seeds = [40_000 + 10 * index + i for i in range(4)]
        first = [
            comm.allreduce_bucketed(
                make_value(seed, rank, (3,), torch.float32), group=group.group
            )
            for seed in seeds[:3]
        ]
        assert not any(handle.done() for handle in first)
        started = comm.collectives_started['allreduce']
        result = first[1].wait()
        assert comm.collectives_started['allreduce'] == started + 1
        assert_same(
            result,
            reduced(seeds[1], group.ranks, (3,), torch.float32, average=True),
        )
        # The started bucket takes no more tensors: this one opens a new one.
        last = comm.allreduce_bucketed(
            make_value(seeds[3], rank, (3,), torch.float32), group=group.group
        )
        assert not last.done()
        comm.flush()
        comm.flush()  # nothing left to start
        assert comm.collectives_started['allreduce'] == started + 2
        for seed, handle in zip(seeds, [*first, last], strict=True):
            expected = reduced(
                seed, group.ranks, (3,), torch.float32, average=True
            )
            assert_same(handle.wait(), expected)
            assert handle.done()


@dataclasses.dataclass(frozen=True)
class Item:
    """One tensor handed to ``allreduce_bucketed`` in a random sequence."""

    group: Group
    seed: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    symmetric: bool
    average: bool
    wait_at_once: bool

    def value(self) -> torch.Tensor:
        return make_value(
            self.seed,
            get_rank(),
            self.shape,
            self.dtype,
            symmetric=self.symmetric,
        )

    def expected(self) -> torch.Tensor:
        return reduced(
            self.seed,
            self.group.ranks,
            self.shape,
            self.dtype,
            symmetric=self.symmetric,
            average=self.average,
        )

    def payload_bytes(self, symmetry_aware: bool) -> int:
        numel = math.prod(self.shape)
        if self.symmetric and symmetry_aware:
            numel = self.shape[0] * (self.shape[0] + 1) // 2
        return numel * self.dtype.itemsize


def random_sequence(
    groups: Sequence[Group], trial: int
) -> tuple[int, bool, list[Item]]:
    """A cap in bytes, symmetry awareness and items; same on every rank."""
    rng = random.Random(trial)
    cap_bytes = rng.choice([16, 200, 1000, 5000])
    items = []
    for index in range(rng.randint(1, 30)):
        symmetric = rng.random() < 0.3
        big = rng.random() < 0.1
        if symmetric:
            n = rng.randint(30, 40) if big else rng.randint(1, 12)
            shape: tuple[int, ...] = (n, n)
        elif big:
            shape = (rng.randint(300, 400), 3)
        else:
            shape = tuple(rng.randint(1, 9) for _ in range(rng.randint(0, 3)))
        items.append(
            Item(
                group=rng.choice(groups),
                seed=100_000 + 100 * trial + index,
                shape=shape,
                dtype=rng.choice(DTYPES),
                symmetric=symmetric,
                average=rng.random() < 0.5,
                wait_at_once=rng.random() < 0.1,
            )
        )
    return cap_bytes, rng.random() < 0.5, items


def simulate_buckets(
    items: Sequence[Item], cap_bytes: int, symmetry_aware: bool
) -> tuple[int, int, set[int]]:
    """Apply the documented bucketing rules to this rank's items.

    Returns the number of collectives, their payload bytes, and the
    positions (in ``items``) whose bucket is still pending before flush.
    """
    open_buckets: dict[tuple[str, torch.dtype], int] = {}
    sizes: list[int] = []  # bytes of each bucket, by bucket id
    bucket_of: dict[int, int] = {}
    started: set[int] = set()

    def start(key: tuple[str, torch.dtype]) -> None:
        started.add(open_buckets.pop(key))

    for position, item in enumerate(items):
        if not item.group.member or len(item.group.ranks) == 1:
            continue
        nbytes = item.payload_bytes(symmetry_aware)
        key = (item.group.key, item.dtype)
        if (
            key in open_buckets
            and sizes[open_buckets[key]] + nbytes > cap_bytes
        ):
            start(key)
        if key not in open_buckets:
            open_buckets[key] = len(sizes)
            sizes.append(0)
        bucket = bucket_of[position] = open_buckets[key]
        sizes[bucket] += nbytes
        if sizes[bucket] >= cap_bytes or item.wait_at_once:
            start(key)
    pending = {p for p, b in bucket_of.items() if b not in started}
    return len(sizes), sum(sizes), pending


def check_random_buckets(groups: Sequence[Group], trial: int) -> None:
    """Bucketed allreduce of a random sequence against its simulation."""
    cap_bytes, symmetry_aware, items = random_sequence(groups, trial)
    comm = TorchDistributedCommunicator(
        cap_bytes / 2**20, symmetry_aware=symmetry_aware
    )
    inputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    handles: dict[int, kd.Handle] = {}
    for position, item in enumerate(items):
        if not item.group.member:
            continue
        tensor = item.value()
        inputs[position] = (tensor, tensor.clone())
        handles[position] = comm.allreduce_bucketed(
            tensor,
            group=item.group.group,
            symmetric=item.symmetric,
            average=item.average,
        )
        if item.wait_at_once:
            assert_same(handles[position].wait(), item.expected())
    count, nbytes, pending = simulate_buckets(items, cap_bytes, symmetry_aware)
    for position, handle in handles.items():
        if position in pending:
            assert not handle.done()
    comm.flush()
    for position, handle in handles.items():
        result = handle.wait()
        assert_same(result, items[position].expected())
        tensor, original = inputs[position]
        assert_same(tensor, original)  # bucketing never writes the input
        if len(items[position].group.ranks) == 1:
            assert result is tensor
    assert comm.collectives_started['allreduce'] == count, trial
    assert comm.bytes_communicated['allreduce'] == nbytes, trial


def check_all_random_buckets(groups: Sequence[Group]) -> None:
    """Forty random sequences of bucketed allreduces."""
    for trial in range(40):
        check_random_buckets(groups, trial)


CHECKS: dict[str, Callable[[Sequence[Group]], None]] = {
    'rank_and_size': check_rank_and_size,
    'allreduce': check_allreduce,
    'symmetric_allreduce': check_symmetric_allreduce,
    'broadcast': check_broadcast,
    'all_gather': check_all_gather,
    'not_a_member': check_not_a_member,
    'bucket_cap_zero': check_bucket_cap_zero,
    'unflushed_wait': check_unflushed_wait,
    'random_buckets': check_all_random_buckets,
}


def _done(run_dir: pathlib.Path, name: str, rank: int) -> pathlib.Path:
    return run_dir / f'{name}.rank{rank}.done'


def run_checks(
    world_size: int, names: Sequence[str], run_dir: pathlib.Path
) -> None:
    """Body of every rank: the checks `names` in order, each marked done."""
    assert get_world_size() == world_size
    groups = make_groups(world_size)
    for name in names:
        CHECKS[name](groups)
        _done(run_dir, name, get_rank()).touch()


def launch_checks(
    world_size: int, tmp_path: pathlib.Path
) -> dict[str, str | None]:
    """Run every check on `world_size` ranks; return each one's failure.

    The checks share a launch. A check that fails stops its launch (the
    other ranks may be waiting for the failed one in a collective), so the
    launch is attributed to the first check some rank did not finish, and
    the checks after it run in a new launch: each check is reported
    whatever the others do. Passing checks map to None.
    """
    outcome: dict[str, str | None] = {}
    pending = list(CHECKS)
    while pending:
        run_dir = tmp_path / f'launch{len(outcome)}'
        run_dir.mkdir()
        try:
            run_distributed(
                run_checks,
                world_size,
                world_size,
                pending,
                run_dir,
                tmp_path=run_dir,
                timeout=150,
            )
            error = None
        except DistributedTestError as failure:
            error = str(failure)
        unfinished = [
            name
            for name in pending
            if not all(
                _done(run_dir, name, rank).exists()
                for rank in range(world_size)
            )
        ]
        if not unfinished:
            if error is not None:  # after every check had passed
                raise DistributedTestError(error)
            outcome.update(dict.fromkeys(pending))
            return outcome
        assert error is not None  # run_distributed checks every rank
        failed = pending.index(unfinished[0])
        outcome.update(dict.fromkeys(pending[:failed]))
        outcome[pending[failed]] = error
        pending = pending[failed + 1 :]
    return outcome


@pytest.fixture(scope='module', params=[2, 3, 4], ids='world{}'.format)
def collective_outcomes(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[str, str | None]:
    world_size: int = request.param
    tmp_path = tmp_path_factory.mktemp(f'collectives{world_size}')
    return launch_checks(world_size, tmp_path)


@pytest.mark.timeout(600)
@pytest.mark.parametrize('check', list(CHECKS))
def test_collective(
    check: str, collective_outcomes: dict[str, str | None]
) -> None:
    error = collective_outcomes[check]
    if error is not None:
        pytest.fail(f'check {check!r} failed:\n{error}', pytrace=False)
