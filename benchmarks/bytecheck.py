"""Check the byte model of :mod:`benchmarks.comm` against real gloo runs.

Every rank trains a small model with each configuration for two steps
(factor updates every step, a decomposition in the first) while a
:class:`PhaseBytes` meter, installed as the preconditioner's timer,
attributes the bytes and calls the communicator counts to the phase that
started them; each rank compares its own counts with :func:`counted` for
its rank, exactly.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import pathlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from benchmarks.comm import COMM_PHASES
from benchmarks.comm import CommConfig
from benchmarks.comm import counted
from benchmarks.floor import layer_shapes
from kfac.assignment import KAISAAssignment
from kfac.distributed import TorchDistributedCommunicator
from kfac.layers.curvature import CurvatureConfig
from kfac.layers.curvature import method_config
from kfac.placement import KAISAPlan
from kfac.placement import factor_cost
from kfac.placement import plan_kaisa
from kfac.preconditioner import KFACPreconditioner
from kfac.tracing import PhaseTimer

__all__ = [
    'STEPS',
    'Case',
    'PhaseBytes',
    'cases',
    'check_rank',
    'expected',
]

#: Steps of each case: factors every step, a decomposition at step 0.
STEPS = 2
_OCCURRENCES = {
    'factor_allreduce': 2,
    'decomposition_broadcast': 1,
    'scale_allreduce': 2,
    'grad_broadcast': 2,
}


class PhaseBytes(PhaseTimer):
    """A phase timer that also counts communicated bytes per phase.

    Args:
        communicator: the preconditioner's communicator, whose
            ``bytes_communicated`` and ``collectives_started`` grow while a
            phase runs.

    """

    def __init__(self, communicator: TorchDistributedCommunicator) -> None:
        super().__init__()
        self.communicator = communicator
        self.bytes: collections.Counter[str] = collections.Counter()
        self.calls: collections.Counter[str] = collections.Counter()

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time phase ``name`` and attribute the bytes it started to it."""
        comm = self.communicator
        nbytes = sum(comm.bytes_communicated.values())
        calls = sum(comm.collectives_started.values())
        with super().phase(name):
            yield
        self.bytes[name] += sum(comm.bytes_communicated.values()) - nbytes
        self.calls[name] += sum(comm.collectives_started.values()) - calls


@dataclasses.dataclass(frozen=True)
class Case:
    """One preconditioner configuration of the check."""

    fraction: str
    comm: CommConfig


def cases(world_size: int) -> list[Case]:
    """Every strategy valid at ``world_size``, method and packing, EKFAC
    under each strategy, the unbucketed allreduce, and (at W=2)
    ``factor_rank``.
    """
    fractions = ['comm_opt', 'mem_opt']
    if world_size % 2 == 0:
        fractions.append('hybrid_opt')
    methods = [('eigen', True), ('eigen', False), ('inverse', False)]
    found = [
        Case(fraction, CommConfig(method, prediv, packed))
        for fraction in fractions
        for method, prediv in methods
        for packed in (False, True)
    ]
    # EKFAC: its bases to every rank and S's allreduce, with packed factors.
    found += [Case(f, CommConfig('ekfac', True, True)) for f in fractions]
    # EIGEN_ADAM and ONE_SIDED from K-FAC's factors and from the gradient's
    # own (no factor allreduce), one side each.
    found += [
        Case(f, CommConfig(method, True, True, source=source, side=side))
        for f in fractions
        for method, source, side in (
            ('eigen_adam', 'kfac', 'input'),
            ('eigen_adam', 'gradient', 'input'),
            ('one_sided', 'kfac', 'input'),
            ('one_sided', 'gradient', 'output'),
        )
    ]
    # factor_rank 8: both A factors at low rank (eigen ignores prediv),
    # their decompositions broadcast under COMM-OPT; at W=2 only.
    if world_size == 2:
        found += [
            Case(
                'comm_opt', CommConfig(m, True, m == 'inverse', factor_rank=8)
            )
            for m in ('eigen', 'inverse')
        ]
    # Unbucketed, and a 2 KiB cap: fc's A (4.6 KiB packed) travels alone.
    for cap in (0.0, 2 / 1024):
        comm = CommConfig('inverse', symmetry_aware=True, bucket_cap_mb=cap)
        found.append(Case(fractions[-1], comm))
    return found


class _Net(nn.Module):
    """A convolution with a bias and a Linear layer without one."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3, stride=2, padding=1)
        self.fc = nn.Linear(48, 3, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.fc(torch.relu(self.conv(x)).flatten(1))
        return out


def _plan(
    model: nn.Module, world: int, grad_workers: int, comm: CommConfig
) -> KAISAPlan:
    """KAISA's plan: every factor costs its decomposition, but for the
    factor one_sided does not use (one unit).
    """

    def cost(dim: int, factor: str) -> float:
        if comm.method == 'one_sided' and factor != comm.side_factor:
            return 1.0
        return factor_cost(dim, 'compute')

    work = {
        x.name: {'A': cost(x.a_dim, 'A'), 'G': cost(x.g_dim, 'G')}
        for x in layer_shapes(model)
    }
    return plan_kaisa(
        work,
        world_size=world,
        grad_workers=grad_workers,
        colocate_factors=True,
    )


def expected(
    model: nn.Module, plan: KAISAPlan, rank: int, comm: CommConfig
) -> dict[str, tuple[int, int]]:
    """``(bytes, calls)`` per phase over :data:`STEPS` steps on ``rank``.

    Factors are reduced in backward order (the hooks fire last layer
    first).
    """
    order = layer_shapes(model)[::-1]
    once = counted(order, plan, rank, comm)
    return {
        phase: (nbytes * _OCCURRENCES[phase], calls * _OCCURRENCES[phase])
        for phase, (nbytes, calls) in once.items()
    }


def _method(comm: CommConfig) -> CurvatureConfig:
    """The compute method `comm` describes."""
    if comm.method == 'eigen_adam':
        return method_config(comm.method, source=comm.source)
    if comm.method == 'one_sided':
        return method_config(comm.method, source=comm.source, side=comm.side)
    return method_config(
        comm.method,
        prediv_eigenvalues=comm.prediv if comm.method != 'inverse' else None,
        factor_rank=comm.factor_rank,
    )


def _run_case(case: Case, rank: int) -> dict[str, object]:
    torch.manual_seed(0)
    model = _Net()
    comm = case.comm
    pre = KFACPreconditioner(
        model,
        compute_method=_method(comm),
        symmetry_aware=comm.symmetry_aware,
        allreduce_bucket_cap_mb=comm.bucket_cap_mb,
        grad_worker_fraction=case.fraction,
        factor_update_steps=1,
        inv_update_steps=2,
        damping=0.001,
        kl_clip=0.001,
    )
    meter = PhaseBytes(pre.communicator)
    pre.timer = meter
    generator = torch.Generator().manual_seed(rank)
    for _ in range(STEPS):
        x = torch.randn(4, 2, 8, 8, generator=generator)
        y = torch.randint(0, 3, (4,), generator=generator)
        model.zero_grad()
        F.cross_entropy(model(x), y).backward()
        pre.step()
    assignment = pre.assignment
    assert isinstance(assignment, KAISAAssignment)
    world = dist.get_world_size()
    plan = _plan(model, world, assignment.grad_workers, comm)
    assert dict(plan.inv_workers) == dict(assignment.plan.inv_workers)
    want = expected(model, plan, rank, comm)
    got = {p: (meter.bytes[p], meter.calls[p]) for p in COMM_PHASES}
    return {
        'case': f'{case.fraction} {comm}',
        'rank': rank,
        'expected': want,
        'counted': got,
        'match': want == got,
    }


def check_rank(world_size: int, out_dir: str | None = None) -> None:
    """Run every case of :func:`cases` on this rank and assert the counts.

    Called on every rank of an initialised gloo group (see
    :func:`testing.distributed.run_distributed`). With ``out_dir``, each
    rank writes its results to ``out_dir/rank<r>.json`` before asserting.
    """
    rank = dist.get_rank()
    assert dist.get_world_size() == world_size
    results = [_run_case(case, rank) for case in cases(world_size)]
    if out_dir is not None:
        path = pathlib.Path(out_dir) / f'rank{rank}.json'
        path.write_text(json.dumps(results))
    bad = [r for r in results if not r['match']]
    assert not bad, f'byte model mismatch on rank {rank}: {bad}'
