"""The distributed oracle: W ranks on N/W examples each equal one process
on all N.

A test gives [`run_oracle`][testing.oracle.run_oracle] a picklable
`train(case, part)` that builds a fresh model (wrapped in DDP or sharded
when `torch.distributed` is initialised), trains it on rows `part`
(`(index, parts)`) of each global batch and returns its whole parameters
(flattened, the same on every rank), and a list of picklable cases. The
harness trains each case in the parent on all rows (no process group),
then in `world_size` ranks on their own rows, and returns what each rank
measured; [`check_outcomes`][testing.oracle.check_outcomes] asserts the
tolerances in the parent and records the largest errors in
[`WORST`][testing.asserts.WORST].

The pieces every such `train` uses are here too: the rows of a part
([`rows`][testing.oracle.rows]), the DDP wrapper
([`wrap`][testing.oracle.wrap]), the training loop
([`train_steps`][testing.oracle.train_steps]) and the flattened
parameters ([`flat_params`][testing.oracle.flat_params]).
"""

from __future__ import annotations

import json
import pathlib
import uuid
from collections.abc import Callable
from collections.abc import Sequence
from dataclasses import dataclass
from dataclasses import field
from typing import Any
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from kfac.preconditioner import KFACPreconditioner
from testing.asserts import WORST
from testing.asserts import relative_error
from testing.distributed import run_distributed

Part = tuple[int, int]
"""`(index, parts)`: rows `index` of `parts` equal slices of a batch."""
ONE_PROCESS: Part = (0, 1)
"""Every row."""
ACROSS_RANKS = 1e-12
"""The largest relative difference allowed between ranks' parameters."""


class Trained(NamedTuple):
    """What `train` returns when the test checks more than parameters."""

    params: torch.Tensor
    """The whole parameters, flattened."""
    facts: dict[str, Any]
    """JSON values the test asserts on in the parent."""


Train = Callable[[Any, Part], torch.Tensor | Trained]
"""`train(case, part)`: the parameters after training on rows `part`."""


@dataclass(frozen=True)
class Outcome:
    """What one rank measured for one case."""

    versus: float
    """Relative difference of its parameters to the single process's."""
    across: float
    """Largest relative difference of its parameters to any rank's."""
    facts: dict[str, Any] = field(default_factory=dict)
    """What `train` reported besides the parameters."""


def rows(tensor: torch.Tensor, part: Part) -> torch.Tensor:
    """Rows `part` of `tensor`: `index n // parts` up to `(index + 1) n //
    parts` of its `n` (equal parts when `parts` divides `n`).
    """
    index, parts = part
    n = tensor.shape[0]
    return tensor[index * n // parts : (index + 1) * n // parts]


def this_rank() -> Part:
    """`(rank, world size)`, `(0, 1)` without a process group."""
    if not dist.is_initialized():
        return ONE_PROCESS
    return dist.get_rank(), dist.get_world_size()


def wrap(model: nn.Module) -> nn.Module:
    """`model` in `DistributedDataParallel` when `torch.distributed` is
    initialised (on the model's device), else `model` itself.
    """
    if not dist.is_initialized():
        return model
    device = next(model.parameters()).device
    return nn.parallel.DistributedDataParallel(
        model, device_ids=None if device.type == 'cpu' else [device]
    )


def flat_params(model: nn.Module) -> torch.Tensor:
    """Every parameter of `model`, flattened into one vector."""
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy averaged over every position of `(N, T, V)` logits."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def sampled_loss(
    precon: Callable[[], KFACPreconditioner],
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = (
        F.cross_entropy
    ),
) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """`loss` that first lets the current preconditioner `precon()` sample
    the Monte Carlo Fisher of the output (nothing with the empirical one).
    """

    def sampled(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        precon().sample_fisher(output)
        return loss(output, target)

    return sampled


def train_steps(
    model: nn.Module,
    precon: KFACPreconditioner | None,
    optimizer: torch.optim.Optimizer,
    batch: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
    steps: range,
    part: Part = ONE_PROCESS,
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = (
        F.cross_entropy
    ),
) -> None:
    """For each step: rows `part` of the global `batch(step)` (inputs,
    targets), moved to the model's device; backward, `precon.step()`
    (unless `precon` is None), `optimizer.step()`.
    """
    device = next(model.parameters()).device
    for step in steps:
        x, y = (rows(t, part).to(device) for t in batch(step))
        optimizer.zero_grad()
        loss(model(x), y).backward()
        if precon is not None:
            precon.step()
        optimizer.step()


def run_oracle(
    train: Train,
    cases: Sequence[Any],
    world_size: int,
    *,
    tmp_path: pathlib.Path,
    timeout: float = 120.0,
    backend: str = 'gloo',
    reference: Callable[[Any], torch.Tensor] | None = None,
) -> list[list[Outcome]]:
    """Train every case in one process, then on `world_size` ranks.

    Args:
        train: a picklable (module-level) `train(case, part)`; every rank
            calls it for every case in order.
        cases: picklable cases.
        world_size: ranks of the distributed run.
        tmp_path: the test's own directory.
        timeout: seconds the distributed run may take.
        backend: `'gloo'` or `'nccl'` (rank `r` on `cuda:r`).
        reference: the single-process parameters of a case (by default
            `train(case, ONE_PROCESS)` in the parent).

    Returns:
        `outcomes[case][rank]`.
    """
    out = tmp_path / f'oracle-{uuid.uuid4().hex}'
    out.mkdir()
    single = reference or (lambda case: _params(train(case, ONE_PROCESS)))
    torch.save([single(case).cpu() for case in cases], out / 'expected.pt')
    run_distributed(
        _rank,
        world_size,
        train,
        list(cases),
        str(out),
        tmp_path=tmp_path,
        timeout=timeout,
        backend=backend,
    )
    reports = [
        json.loads((out / f'rank{rank}.json').read_text())
        for rank in range(world_size)
    ]
    assert all(len(report) == len(cases) for report in reports)
    return [
        [Outcome(**report[index]) for report in reports]
        for index in range(len(cases))
    ]


def _params(result: torch.Tensor | Trained) -> torch.Tensor:
    return result.params if isinstance(result, Trained) else result


def _rank(train: Train, cases: list[Any], out_dir: str) -> None:
    """One rank of `run_oracle`: train every case, measure, report."""
    expected = torch.load(pathlib.Path(out_dir) / 'expected.pt')
    part = this_rank()
    report = []
    for case, reference in zip(cases, expected):
        result = train(case, part)
        params = _params(result)
        gathered = [torch.empty_like(params) for _ in range(part[1])]
        dist.all_gather(gathered, params)
        report.append(
            {
                'versus': relative_error(params, reference.to(params.device)),
                'across': max(relative_error(g, params) for g in gathered),
                'facts': result.facts if isinstance(result, Trained) else {},
            }
        )
    path = pathlib.Path(out_dir) / f'rank{part[0]}.json'
    path.write_text(json.dumps(report))


def check_outcomes(
    outcomes: Sequence[Sequence[Outcome]],
    labels: Sequence[str],
    *,
    rtol: float,
    split: bool = True,
    across_label: str | None = None,
) -> None:
    """Assert, for every case (labelled `labels[case]`) and rank: the
    ranks' parameters within [`ACROSS_RANKS`][testing.oracle.ACROSS_RANKS]
    of each other and within `rtol` of the single process's, and, with
    `split` and more than one rank, not equal to them (the ranks really
    split the batch). Records the largest errors per label in `WORST`,
    the ranks' differences under `across_label`.
    """
    assert len(outcomes) == len(labels)
    for label, ranks in zip(labels, outcomes):
        for rank, outcome in enumerate(ranks):
            where = (label, rank, outcome)
            assert outcome.across < ACROSS_RANKS, where
            assert outcome.versus < rtol, where
            if split and len(ranks) > 1:
                assert outcome.versus > 0, where
            WORST[label] = max(WORST.get(label, 0.0), outcome.versus)
            if across_label is not None:
                WORST[across_label] = max(
                    WORST.get(across_label, 0.0), outcome.across
                )
