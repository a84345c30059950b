"""Run a function in several processes joined by a ``torch.distributed`` group.

:func:`run_distributed` is the launcher of the distributed tests: it starts
``world_size`` processes with the ``spawn`` start method, joins them in a
process group (gloo unless told; with NCCL, rank ``r`` uses ``cuda:r``)
whose rendezvous is a ``file://`` store inside the test's ``tmp_path`` (so
two tests never meet), runs ``fn(*args)`` on every rank and
checks every rank's exit code. A rank that raises writes its traceback to a
file in ``tmp_path``; the parent puts it into the :class:`DistributedTestError`
it raises, naming the rank and its exit code. A run that outlives its
``timeout`` is terminated and reported rank by rank, and once one rank has
failed the others get :data:`PEER_FAILURE_GRACE_S` seconds to finish before
they are terminated too (a rank waiting in a collective for a dead peer
would otherwise only stop at the timeout).

Starting a process that imports torch costs seconds, so a test should launch
once per world size and loop over its configurations inside ``fn``.
``fn`` and ``args`` are pickled: ``fn`` must be a module-level function of an
importable module (``tests.*`` and ``testing.*`` are: the children receive
the parent's ``sys.path``).

Coverage inside the workers: nothing here starts coverage. The project
runs ``coverage run -m pytest`` with ``concurrency = ['multiprocessing',
...]`` and ``parallel = true`` in ``[tool.coverage.run]``; coverage then
patches ``multiprocessing`` in the parent and, for the ``spawn`` start
method, pickles a "stowaway" object into the data every child unpickles at
start-up, which patches the child's ``multiprocessing`` as well. Every
worker is a ``multiprocessing.Process``, so its run is wrapped in a
``Coverage`` object that saves a ``.coverage.<host>.<pid>.<random>`` file
when the process ends, including on ``SIGTERM`` (``sigterm = true``), and
``coverage combine`` merges them. The workers therefore end through
multiprocessing's normal exit path (a failure is ``SystemExit(1)``, never
``os._exit``), so their data is saved; a worker killed with ``SIGKILL``
after ignoring ``SIGTERM`` loses its data, which only happens to a run
that already fails.
"""

from __future__ import annotations

import datetime
import faulthandler
import multiprocessing
import multiprocessing.connection
import os
import pathlib
import signal
import sys
import time
import traceback
import uuid
from collections.abc import Callable
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = [
    'PEER_FAILURE_GRACE_S',
    'DistributedTestError',
    'run_distributed',
]

#: Seconds the other ranks get to finish once one rank has failed.
PEER_FAILURE_GRACE_S = 10.0
#: Seconds a terminated (``SIGTERM``) rank gets before it is killed.
_TERMINATE_GRACE_S = 5.0
#: Seconds a straggler gets to write its stacks (``SIGUSR1``).
_DUMP_GRACE_S = 1.0
#: Seconds a rank pauses after ``fn``, the GIL released, before it exits.
_DRAIN_S = 0.1
_LOOPBACK = 'lo0' if sys.platform == 'darwin' else 'lo'


class DistributedTestError(AssertionError):
    """One or more ranks of a :func:`run_distributed` run failed."""


@dataclass(frozen=True)
class _Spec:
    """What a worker needs to join the group and report a failure."""

    world_size: int
    backend: str
    init_file: pathlib.Path
    traceback_dir: pathlib.Path
    timeout_s: float

    def traceback_file(self, rank: int) -> pathlib.Path:
        return self.traceback_dir / f'rank{rank}.traceback'

    def stack_file(self, rank: int) -> pathlib.Path:
        return self.traceback_dir / f'rank{rank}.stacks'


def run_distributed(
    fn: Callable[..., object],
    world_size: int,
    *args: object,
    tmp_path: pathlib.Path,
    timeout: float = 120.0,
    backend: str = 'gloo',
) -> None:
    """Run ``fn(*args)`` on ``world_size`` ranks of a new process group.

    Each rank is a fresh ``spawn`` process that sets
    ``torch.set_num_threads(1)``, calls ``init_process_group`` (file store in
    ``tmp_path``, process-group timeout ``timeout``), runs ``fn(*args)``,
    pauses :data:`_DRAIN_S` seconds with the GIL released (see
    ``_run_rank``) and destroys the group. ``fn`` reads its rank from
    ``torch.distributed``.
    Gloo is bound to the loopback interface (``GLOO_SOCKET_IFNAME``, unless
    the environment sets it). With ``'nccl'`` each rank first makes
    ``cuda:<rank>`` its current device, so ``world_size`` must not exceed
    the number of visible GPUs (NCCL refuses two ranks on one GPU).

    Args:
        fn: a picklable (module-level) function; its return value is ignored.
        world_size: number of ranks, at least 1.
        *args: picklable arguments passed to ``fn`` on every rank.
        tmp_path: a directory private to the calling test; the rendezvous
            file and the tracebacks of failing ranks are written there.
        timeout: seconds the whole run may take, process start-up included;
            ranks still running then are terminated.
        backend: the ``torch.distributed`` backend: ``'gloo'`` or
            ``'nccl'``.

    Raises:
        TypeError: ``world_size`` is not an int.
        ValueError: ``world_size`` < 1 or ``timeout`` <= 0.
        DistributedTestError: a rank exited with a non-zero code, raised, or
            was still running at the deadline. The message names every
            failing rank with its exit code and traceback, and for a rank
            that was stopped, the stacks of its threads at that moment.

    """
    __tracebackhide__ = True  # pytest: show the caller, not the launcher
    if isinstance(world_size, bool) or not isinstance(world_size, int):
        raise TypeError(f'world_size must be an int; got {world_size!r}')
    if world_size < 1:
        raise ValueError(f'world_size must be >= 1; got {world_size}')
    if not timeout > 0:
        raise ValueError(f'timeout must be > 0 seconds; got {timeout!r}')
    run_dir = tmp_path / f'run-{uuid.uuid4().hex}'
    run_dir.mkdir(parents=True)
    spec = _Spec(
        world_size=world_size,
        backend=backend,
        init_file=run_dir / 'rendezvous',
        traceback_dir=run_dir,
        timeout_s=float(timeout),
    )
    context = multiprocessing.get_context('spawn')
    processes = [
        context.Process(
            target=_worker,
            args=(rank, spec, fn, args),
            name=f'rank{rank}',
        )
        for rank in range(world_size)
    ]
    try:
        for process in processes:
            process.start()
        notes = _supervise(processes, deadline=time.monotonic() + timeout)
    finally:  # no orphans when the parent is interrupted
        _stop([process for process in processes if process.is_alive()])
    report = _report(processes, notes, spec)
    if report:
        raise DistributedTestError(
            f'run_distributed({_name(fn)}, world_size={world_size}, '
            f'timeout={timeout:g}s) failed:\n{report}',
        )


def _worker(
    rank: int,
    spec: _Spec,
    fn: Callable[..., object],
    args: Sequence[object],
) -> None:
    """Body of one rank: join the group, run ``fn``, report a failure."""
    torch.set_num_threads(1)
    os.environ.setdefault('GLOO_SOCKET_IFNAME', _LOOPBACK)
    with spec.stack_file(rank).open('w') as stacks:
        # The parent sends SIGUSR1 to a straggler to learn where it hangs.
        faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
        failed = _run_rank(rank, spec, fn, args)
        faulthandler.unregister(signal.SIGUSR1)
    if failed:
        # SystemExit leaves through multiprocessing's normal exit path, so
        # coverage (when measuring) still saves this process's data.
        raise SystemExit(1)


def _run_rank(
    rank: int,
    spec: _Spec,
    fn: Callable[..., object],
    args: Sequence[object],
) -> bool:
    """Join the group and run ``fn``; return whether it failed."""
    failed = False
    try:
        if spec.backend == 'nccl':
            torch.cuda.set_device(rank)
        dist.init_process_group(
            spec.backend,
            init_method=f'file://{spec.init_file}',
            rank=rank,
            world_size=spec.world_size,
            timeout=datetime.timedelta(seconds=spec.timeout_s),
        )
        fn(*args)
    # Anything, KeyboardInterrupt and SystemExit included, is reported to the
    # parent with its traceback and turns into exit code 1.
    except BaseException:  # noqa: BLE001
        failed = True
        spec.traceback_file(rank).write_text(traceback.format_exc())
    # A gloo worker thread drops its references to a collective's tensors
    # just after the caller's wait returns, and for a tensor Python holds as
    # well (that of a synchronous dist.all_gather of fn's own, say) it takes
    # the GIL to do so (torch >= 2.10). A worker still waiting for the GIL
    # when the interpreter starts shutting down is ended by CPython inside
    # C++ code that cannot unwind, and the rank aborts (SIGABRT). The pause
    # lets such a worker have the GIL. K-FAC's own collectives never need
    # it (kfac.distributed._communicator; scripts/exit_stress.py runs without
    # any pause).
    time.sleep(_DRAIN_S)
    if dist.is_initialized():
        dist.destroy_process_group()
    return failed


def _supervise(
    processes: Sequence[multiprocessing.process.BaseProcess],
    deadline: float,
) -> dict[int, str]:
    """Wait for the ranks; terminate those running past the deadline.

    The deadline moves to :data:`PEER_FAILURE_GRACE_S` after the first
    failing exit. Returns notes for terminated ranks, by rank.
    """
    first_failure: int | None = None
    running = dict(enumerate(processes))
    while running:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        sentinels = [p.sentinel for p in running.values()]
        multiprocessing.connection.wait(sentinels, timeout=remaining)
        for rank, process in list(running.items()):
            if process.exitcode is None:
                continue
            del running[rank]
            if process.exitcode != 0 and first_failure is None:
                first_failure = rank
                deadline = min(
                    deadline, time.monotonic() + PEER_FAILURE_GRACE_S
                )
    if first_failure is None:
        why = 'still running at the timeout'
    else:
        why = (
            f'still running {PEER_FAILURE_GRACE_S:g}s after rank '
            f'{first_failure} failed'
        )
    _stop(list(running.values()))
    return dict.fromkeys(running, f'{why}; terminated')


def _stop(processes: Sequence[multiprocessing.process.BaseProcess]) -> None:
    """Dump the stacks of ``processes``, then terminate or kill them."""
    if not processes:
        return
    for process in processes:
        if process.pid is not None and process.exitcode is None:
            os.kill(process.pid, signal.SIGUSR1)
    time.sleep(_DUMP_GRACE_S)
    for process in processes:
        process.terminate()
    for process in processes:
        process.join(_TERMINATE_GRACE_S)
        if process.exitcode is None:
            process.kill()
            process.join()


def _report(
    processes: Sequence[multiprocessing.process.BaseProcess],
    notes: dict[int, str],
    spec: _Spec,
) -> str:
    """Describe every failing rank; empty when every rank exited with 0."""
    lines: list[str] = []
    for rank, process in enumerate(processes):
        code = process.exitcode
        if code == 0 and rank not in notes:
            continue
        status = f'rank {rank}: exit code {code}{_signal_name(code)}'
        if rank in notes:
            status += f' ({notes[rank]})'
        lines.append(status)
        trace = _indented_file(spec.traceback_file(rank))
        if rank not in notes:
            lines.extend(
                trace or ['    (no traceback: see the captured stderr)']
            )
            continue
        stacks = _indented_file(spec.stack_file(rank))
        lines.extend(trace)
        lines.append('  stacks when it was stopped:')
        lines.extend(stacks or ['    (none: it was still starting)'])
    return '\n'.join(lines)


def _indented_file(path: pathlib.Path) -> list[str]:
    """Return the lines of ``path`` indented; none if it is missing."""
    text = path.read_text().strip() if path.exists() else ''
    return ['    ' + line for line in text.split('\n')] if text else []


def _signal_name(code: int | None) -> str:
    if code is None or code >= 0:
        return ''
    try:
        return f' ({signal.Signals(-code).name})'
    except ValueError:
        return ''


def _name(fn: Callable[..., object]) -> str:
    module = getattr(fn, '__module__', '?')
    return f'{module}.{getattr(fn, "__qualname__", repr(fn))}'
