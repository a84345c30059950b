"""A training script exits cleanly without freeing the preconditioner.

A gloo rank used to abort at exit (SIGABRT, `terminate called without an
active exception`) in a few launches in a hundred: gloo's worker threads
ran and freed the Python callbacks chained to K-FAC's collectives, and
dropped the last references to their tensors, both of which take the
GIL, and CPython ends a thread that waits for the GIL when the interpreter
shuts down. The checks here:

* no Python callback is chained to the future of any collective the
  communicator starts, and the communicator keeps each future (with the
  tensors it holds) past its completion (the causes, checked on 2 ranks);
* the group cache keeps no process group alive after
  `destroy_process_group()`;
* `scripts/exit_stress.py` launches user-style DDP and FSDP2 scripts and
  none aborts (a few launches here; `python scripts/exit_stress.py
  --launches 100` is the full measurement, see the troubleshooting page);
* the stress script tells an abort from a failure, so that its zero counts
  mean something.
"""

from __future__ import annotations

import pathlib
import sys
import time
import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist

from kfac.assignment import KAISAAssignment
from kfac.distributed import TorchDistributedCommunicator
from scripts import exit_stress
from testing.distributed import run_distributed
from testing.torch_release import FSDP2_ON_CPU


def _chained_callbacks_during(
    run: Callable[[], None],
) -> list[Callable[..., Any]]:
    """Run `run`; return the callbacks chained with `Future.then` meanwhile.

    The callbacks are still chained (to the original method), so `run`
    works the same either way.
    """
    calls: list[Callable[..., Any]] = []
    original = torch._C.Future.then

    def then(future: Any, callback: Callable[..., Any]) -> Any:
        calls.append(callback)
        return original(future, callback)

    # A spy in place of the method (its generic signature is not kept).
    torch._C.Future.then = then  # type: ignore[method-assign,assignment]  # a spy in place of the method
    try:
        run()
    finally:
        torch._C.Future.then = original  # type: ignore[method-assign]  # the method put back
    return calls


def _collectives() -> None:
    rank = dist.get_rank()
    comm = TorchDistributedCommunicator(symmetry_aware=True)
    sym = torch.tensor([[1.0, 2.0], [2.0, 3.0]]) * (rank + 1)

    def run() -> None:
        handles = [
            comm.allreduce(torch.full((3,), float(rank))),
            comm.allreduce_bucketed(sym.clone(), symmetric=True),
            comm.allreduce_bucketed(torch.ones(2), average=False),
            comm.broadcast(torch.full((2,), float(rank)), src=1),
        ]
        comm.flush()
        results = [handle.wait() for handle in handles]
        assert torch.equal(results[0], torch.full((3,), 0.5))
        assert torch.equal(results[1], sym / (rank + 1) * 1.5)
        assert torch.equal(results[2], torch.full((2,), 2.0))
        assert torch.equal(results[3], torch.full((2,), 1.0))
        assert all(handle.done() for handle in handles)

    assert _chained_callbacks_during(run) == []


def _use_count_drops_to(
    tensor: torch.Tensor, count: int, seconds: float
) -> bool:
    """Whether `tensor`'s C++ reference count falls to `count` within
    `seconds` (a gloo worker drops its own references just after it
    completes a future).
    """
    deadline = time.monotonic() + seconds
    while _use_count(tensor) > count and time.monotonic() < deadline:
        time.sleep(0.001)
    return _use_count(tensor) == count


def _use_count(tensor: torch.Tensor) -> int:
    return int(tensor._use_count())  # type: ignore[attr-defined]  # private


def _futures_kept() -> None:
    comm = TorchDistributedCommunicator()
    tensor = torch.ones(3)
    comm.allreduce(tensor).wait()  # the handle is dropped at once
    # The communicator still holds the future, whose value is the tensor:
    # the worker's references were never the last ones.
    assert not _use_count_drops_to(tensor, 1, seconds=0.5)
    comm.allreduce(torch.ones(1)).wait()  # lets go of the first future
    assert _use_count_drops_to(tensor, 1, seconds=10)


def _released_within(ref: weakref.ref[torch.Tensor], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while ref() is not None and time.monotonic() < deadline:
        time.sleep(0.001)
    return ref() is None


def _inputs_kept() -> None:
    """The inputs of an all-gather and a scatter (not in their futures'
    values) are kept as long as the futures.
    """
    comm = TorchDistributedCommunicator()
    rank = dist.get_rank()
    world = dist.group.WORLD
    assert world is not None
    local = torch.full((2 - rank, 3), float(rank))  # 3 rows: 2 and 1
    whole = comm.all_gather_rows(local, rows=3, group=world)
    assert whole.wait().tolist() == [[0.0] * 3, [0.0] * 3, [1.0] * 3]
    padded = weakref.ref(comm._kept[-1][1][0])
    time.sleep(0.2)  # the worker has let go of its references
    assert padded() is not None  # kept with the completed future
    chunks = [torch.full((2,), 5.0), torch.full((2,), 6.0)] if rank else None
    out = comm.scatter(torch.empty(2), chunks, src=1).wait()
    assert out.tolist() == [5.0 + rank] * 2
    assert _released_within(padded, 10)  # let go at the next collective
    sent = [weakref.ref(c) for c in comm._kept[-1][1]]
    del chunks
    assert len(sent) == (2 if rank else 0)
    time.sleep(0.2)
    assert all(r() is not None for r in sent)
    comm.allreduce(torch.ones(1)).wait()
    assert all(_released_within(r, 10) for r in sent)


def test_inputs_are_kept_with_their_futures(tmp_path: pathlib.Path) -> None:
    run_distributed(_inputs_kept, 2, tmp_path=tmp_path)


def test_collectives_chain_no_python_callback(tmp_path: pathlib.Path) -> None:
    run_distributed(_collectives, 2, tmp_path=tmp_path)


def test_futures_are_kept_past_their_completion(
    tmp_path: pathlib.Path,
) -> None:
    run_distributed(_futures_kept, 2, tmp_path=tmp_path)


def _groups_freed() -> None:
    assignment = KAISAAssignment(
        {'a': {'A': 1.0, 'G': 1.0}, 'b': {'A': 1.0, 'G': 1.0}},
        local_rank=dist.get_rank(),
        world_size=2,
        grad_worker_fraction=0.5,
    )
    groups = {assignment.grad_worker_group(name) for name in 'ab'}
    groups.add(dist.group.WORLD)
    refs = [
        weakref.ref(group)
        for group in groups
        if isinstance(group, dist.ProcessGroup)
    ]
    assert len(refs) == 2  # this rank's own group of one, and the world
    del groups
    dist.destroy_process_group()
    assert all(ref() is not None for ref in refs)  # the assignment's
    del assignment
    assert [ref() for ref in refs] == [None, None]


def test_process_groups_are_freed_with_the_last_user(
    tmp_path: pathlib.Path,
) -> None:
    run_distributed(_groups_freed, 2, tmp_path=tmp_path)


@pytest.mark.parametrize(
    'model_kind',
    [
        pytest.param(kind, marks=FSDP2_ON_CPU) if kind == 'fsdp' else kind
        for kind in exit_stress.MODELS
    ],
)
def test_user_style_scripts_exit_without_aborting(model_kind: str) -> None:
    tallies = exit_stress.stress([model_kind], 1, verbose=False)
    tally = tallies[model_kind]
    assert (tally.launches, tally.aborts, tally.failures) == (1, 0, 0), (
        tally.summary(model_kind)
    )


def _python(code: str) -> list[str]:
    return [sys.executable, '-c', code]


@pytest.mark.parametrize(
    ('code', 'aborted', 'failed'),
    [
        ('pass', False, False),
        ('import os; os.abort()', True, False),
        ('raise SystemExit(3)', False, True),
    ],
)
def test_launch_tells_an_abort_from_a_failure(
    code: str, aborted: bool, failed: bool
) -> None:
    result = exit_stress.launch(_python(code), 2, timeout=60)
    assert len(result.codes) == 2
    assert (result.aborted, result.failed) == (aborted, failed)


def test_launch_gives_each_rank_the_torchrun_environment() -> None:
    code = (
        'import os, sys; '
        'keys = "RANK WORLD_SIZE LOCAL_RANK MASTER_ADDR".split(); '
        'sys.stderr.write(" ".join(os.environ[k] for k in keys))'
    )
    result = exit_stress.launch(_python(code), 2, timeout=60)
    assert result.codes == (0, 0)
    assert result.stderr == ('0 2 0 127.0.0.1', '1 2 1 127.0.0.1')


def test_launch_kills_ranks_past_the_timeout() -> None:
    result = exit_stress.launch(
        _python('import time; time.sleep(60)'), 1, timeout=0.5
    )
    assert result.codes == (None,)
    assert result.failed and not result.aborted


def test_summary_counts_what_the_launches_did() -> None:
    tally = exit_stress.Tally(
        launches=100, aborts=0, failures=1, seconds=512.3
    )
    assert tally.summary('fsdp') == (
        'fsdp: 0 aborted, 1 failed of 100 launches in 512 s'
    )
