"""Bytes per step and rank: K-FAC under FSDP2 against FSDP2's own.

Run ``python -m benchmarks.fsdp_bytes`` (about a minute here): it trains
the GPT-style model of ``examples/train_fsdp.py`` (vocabulary 99, so the
shards are uneven, width 64, 2 blocks, ``fully_shard`` per block and at
the root) at world sizes 2 and 4, COMM-OPT, MEM-OPT and local mode, for
four steps with ``factor_update_steps=2`` and ``inv_update_steps=4`` (step
0 updates the factors and the decompositions, step 2 the factors, steps 1
and 3 neither), and prints per step and rank:

* **K-FAC**, measured: ``precon.communicator.bytes_communicated`` by kind
  (``allreduce`` of the factors, ``broadcast`` of decompositions under
  COMM-OPT, ``allgather`` of the sharded gradients, ``scatter`` of each
  rank's rows of the preconditioned gradients under MEM-OPT, counted on
  the sending rank), each collective's payload counted once on every
  rank that calls it.
* **FSDP2**, measured by wrapping ``torch.distributed.all_gather_single``
  and ``reduce_scatter_single`` (the two calls FSDP2 makes; before torch
  2.13, ``all_gather_into_tensor`` and ``reduce_scatter_tensor``) and
  checked against the formula below.

The formulas, for a parameter ``p`` with ``rows_p`` rows (dim 0), row size
``r_p`` (the product of its other dims) and ``b`` bytes per element, over a
shard group of ``S`` ranks: its padded shard is ``c_p = ⌈rows_p / S⌉``
rows, which is what FSDP2 and K-FAC both pad to.

* K-FAC's gradient all-gather, every step, every rank, summed over the
  parameters of the preconditioned modules (here every parameter but the
  LayerNorms'): ``Σ_p c_p r_p b`` (the padded shard each rank hands in;
  each rank receives ``S - 1`` times that).
* FSDP2's forward all-gather: ``Σ_p c_p r_p b`` over every parameter; its
  backward all-gather the same over the parameters of the modules that
  reshard after forward (all but the root's by default); its gradient
  reduce-scatter hands in the padded whole gradient, ``S Σ_p c_p r_p b``
  (each rank sends and receives ``S - 1`` shards). Under HSDP the shards
  are then allreduced over the replicate dimension, ``Σ_p c_p r_p b``
  more (not measured here).

So on the wire K-FAC's lossless mode costs one more all-gather of the
preconditioned parameters per step, beside FSDP2's three passes (two
all-gathers and a reduce-scatter); MEM-OPT adds a scatter of each
preconditioned gradient from its one worker, every rank getting the rows
of its shards (the worker hands in the whole gradient, padded). Local mode
(``shard_mode='local'``, COMM-OPT, case ``local``) gathers nothing: it
allreduces one number per layer over the shard group for the KL clip.
"""

from __future__ import annotations

import collections
import contextlib
import json
import math
import pathlib
import sys
import tempfile
import warnings
from collections.abc import Callable
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from examples import train_fsdp
from kfac.config import ShardingConfig
from kfac.config import StatisticsConfig
from kfac.preconditioner import KFACPreconditioner
from testing.distributed import run_distributed

__all__ = [
    'MODEL_ARGS',
    'FSDPCounter',
    'fsdp_collectives',
    'fsdp_formula',
    'kfac_allgather_formula',
    'matches',
    'measure_rank',
    'padded_shard_bytes',
    'preconditioned_params',
]

#: The model (options of ``examples/train_fsdp.py``).
MODEL_ARGS = ['--vocab', '99', '--width', '64', '--depth', '2']
#: Steps measured: factors at 0 and 2, decompositions at 0.
STEPS = 4
KINDS = ('allreduce', 'broadcast', 'allgather', 'scatter')


def padded_shard_bytes(param: torch.Tensor, shards: int) -> int:
    """``⌈rows / S⌉ × row size × element size`` of a dim-0 split."""
    rows = param.shape[0]
    row = math.prod(param.shape[1:])
    return -(-rows // shards) * row * param.element_size()


def preconditioned_params(model: nn.Module) -> list[torch.Tensor]:
    """The parameters of the modules K-FAC preconditions in the example's
    model: every one but those of the LayerNorms (left to the optimizer).
    """
    found: list[torch.Tensor] = []
    for module in model.modules():
        if isinstance(module, nn.LayerNorm):
            continue
        found.extend(module.parameters(recurse=False))
    return found


def kfac_allgather_formula(model: nn.Module, shards: int) -> int:
    """K-FAC's gradient all-gather bytes per step and rank."""
    return sum(
        padded_shard_bytes(p, shards) for p in preconditioned_params(model)
    )


def fsdp_formula(
    model: nn.Module, shards: int, resharded: list[nn.Module]
) -> dict[str, int]:
    """FSDP2's payload per step and rank: forward and backward all-gather
    and reduce-scatter; ``resharded``: the modules whose parameters are
    gathered again in backward.
    """
    every = sum(padded_shard_bytes(p, shards) for p in model.parameters())
    again = sum(
        padded_shard_bytes(p, shards)
        for module in resharded
        for p in module.parameters()
    )
    return {
        'forward_allgather': every,
        'backward_allgather': again,
        'reduce_scatter': shards * every,
    }


def fsdp_collectives() -> dict[str, str]:
    """`{kind: name}` of the `torch.distributed` functions FSDP2 calls:
    `all_gather_single` and `reduce_scatter_single` from torch 2.13 on,
    `all_gather_into_tensor` and `reduce_scatter_tensor` before.
    """
    if hasattr(dist, 'all_gather_single'):
        return {
            'allgather': 'all_gather_single',
            'reduce_scatter': 'reduce_scatter_single',
        }
    return {
        'allgather': 'all_gather_into_tensor',
        'reduce_scatter': 'reduce_scatter_tensor',
    }


class FSDPCounter:
    """Counts the input bytes of FSDP2's collectives while installed, by
    kind (`fsdp_collectives`).
    """

    def __init__(self) -> None:
        self.bytes: collections.Counter[str] = collections.Counter()
        self._wrapped = fsdp_collectives()

    def _wrap(self, kind: str, name: str) -> Callable[..., Any]:
        original: Callable[..., Any] = getattr(dist, name)

        def counted(*args: Any, **kwargs: Any) -> Any:
            key = 'input' if kind == 'reduce_scatter' else 'input_tensor'
            tensor = kwargs[key] if key in kwargs else args[1]
            self.bytes[kind] += tensor.numel() * tensor.element_size()
            return original(*args, **kwargs)

        return counted

    @contextlib.contextmanager
    def installed(self) -> Iterator[FSDPCounter]:
        """Wrap the collectives for the duration of the block."""
        names = self._wrapped.values()
        saved = {name: getattr(dist, name) for name in names}
        try:
            for kind, name in self._wrapped.items():
                setattr(dist, name, self._wrap(kind, name))
            yield self
        finally:
            for name, function in saved.items():
                setattr(dist, name, function)


def _step_bytes(
    model: nn.Module,
    precon: KFACPreconditioner,
    optimizer: torch.optim.Optimizer,
    tokens: torch.Tensor,
) -> dict[str, int]:
    comm = precon.communicator
    before = {k: comm.bytes_communicated.get(k, 0) for k in KINDS}
    counter = FSDPCounter()
    with counter.installed():
        optimizer.zero_grad()
        logits = model(tokens[:, :-1])
        forward = counter.bytes['allgather']
        loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
    precon.step()
    optimizer.step()
    row = {k: comm.bytes_communicated.get(k, 0) - before[k] for k in KINDS}
    row['forward_allgather'] = forward
    row['backward_allgather'] = counter.bytes['allgather'] - forward
    row['reduce_scatter'] = counter.bytes['reduce_scatter']
    return row


def _label(strategy: str, replicas: int, world: int) -> str:
    if replicas == 1:
        return strategy
    return f'{strategy} HSDP {replicas}x{world // replicas}'


def measure_rank(
    cases: list[tuple[str, int]], steps: int, out_dir: str
) -> None:
    """Every rank: train each ``(strategy, replicas)`` case ``steps``
    steps; write per-step bytes, measured and by formula, to
    ``out_dir/rank<r>.json``. Strategy ``'local'`` is COMM-OPT with
    ``shard_mode='local'`` (no gradient all-gather).
    """
    # K-FAC's all_gather_into_tensor is deprecated in torch 2.13 in favour
    # of all_gather_single; the warning would repeat on every rank.
    warnings.filterwarnings(
        'ignore', '.*all_gather_into_tensor', FutureWarning
    )
    rank, world = dist.get_rank(), dist.get_world_size()
    results: dict[str, Any] = {}
    for strategy, replicas in cases:
        args = train_fsdp.parse_args(
            [*MODEL_ARGS, '--replicas', str(replicas)]
        )
        shards = world // replicas
        model = train_fsdp.build_model(args, torch.device('cpu'))
        optimizer = train_fsdp.build_optimizer(model, args)
        local = strategy == 'local'
        precon = KFACPreconditioner(
            model,
            factor_update_steps=2,
            inv_update_steps=4,
            damping=0.001,
            kl_clip=0.001,
            grad_worker_fraction='comm_opt' if local else strategy,
            statistics=StatisticsConfig(loss_average='batch+sequence'),
            sharding=ShardingConfig(
                shard_mode='local' if local else 'lossless'
            ),
        )
        per_rank = args.batch_size // world
        rows = []
        for step in range(steps):
            tokens = train_fsdp.make_batch(step, args)
            part = tokens[rank * per_rank : (rank + 1) * per_rank]
            rows.append(_step_bytes(model, precon, optimizer, part))
        blocks = list(getattr(model, 'blocks'))  # noqa: B009
        results[_label(strategy, replicas, world)] = {
            'steps': rows,
            'shards': shards,
            'allgather_formula': 0
            if local
            else kfac_allgather_formula(model, shards),
            'allgather_unpadded': sum(
                p.numel() * p.element_size()
                for p in preconditioned_params(model)
            )
            // shards,
            'fsdp_formula': fsdp_formula(model, shards, blocks),
        }
    path = pathlib.Path(out_dir) / f'rank{rank}.json'
    path.write_text(json.dumps(results))


def run(
    world: int, cases: list[tuple[str, int]], steps: int = STEPS
) -> list[dict[str, Any]]:
    """Launch ``world`` ranks of :func:`measure_rank`; their results."""
    with tempfile.TemporaryDirectory() as tmp:
        run_distributed(
            measure_rank,
            world,
            cases,
            steps,
            tmp,
            tmp_path=pathlib.Path(tmp),
            timeout=600,
        )
        return [
            json.loads((pathlib.Path(tmp) / f'rank{r}.json').read_text())
            for r in range(world)
        ]


def matches(ranks: list[dict[str, Any]]) -> bool:
    """Whether every rank's measured bytes equal the formulas, every step:
    K-FAC's all-gather, FSDP2's all-gathers and reduce-scatter.
    """
    for rank in ranks:
        for result in rank.values():
            for row in result['steps']:
                if row['allgather'] != result['allgather_formula']:
                    return False
                formula = result['fsdp_formula']
                if any(row[k] != formula[k] for k in formula):
                    return False
    return True


def _kb(n: float) -> str:
    return f'{n / 1024:.1f}'


def report(world: int, ranks: list[dict[str, Any]]) -> str:
    """Markdown table of rank 0's bytes per step, in KiB."""
    same = all(r == ranks[0] for r in ranks)
    lines = [
        f'### W = {world} (KiB per rank; every rank counted the same: {same})',
        '',
        '| case | step | K-FAC allreduce | K-FAC broadcast | '
        'K-FAC allgather (formula) | K-FAC scatter | K-FAC total | '
        'FSDP2 AG fwd | FSDP2 AG bwd | FSDP2 RS in | FSDP2 total | '
        'K-FAC / FSDP2 |',
        '| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- '
        '| --- |',
    ]
    for label, result in ranks[0].items():
        for step, row in enumerate(result['steps']):
            kfac = sum(row[k] for k in KINDS)
            fsdp = sum(row[k] for k in result['fsdp_formula'])
            lines.append(
                f'| {label} | {step} | {_kb(row["allreduce"])} | '
                f'{_kb(row["broadcast"])} | {_kb(row["allgather"])} '
                f'({_kb(result["allgather_formula"])}) | '
                f'{_kb(row["scatter"])} | {_kb(kfac)} | '
                f'{_kb(row["forward_allgather"])} | '
                f'{_kb(row["backward_allgather"])} | '
                f'{_kb(row["reduce_scatter"])} | {_kb(fsdp)} | '
                f'{kfac / fsdp:.2f} |'
            )
    return '\n'.join(lines)


def main(argv: list[str] | None = None) -> int:
    """Measure at W = 2 and 4; print the tables; 1 if a formula missed."""
    del argv
    ok = True
    print('## K-FAC under FSDP2: bytes per step and rank\n')
    for world in (2, 4):
        ranks = run(world, [('comm_opt', 1), ('mem_opt', 1), ('local', 1)])
        ok &= matches(ranks)
        print(report(world, ranks) + '\n')
    print(
        'measured == formula (K-FAC all-gather; FSDP2 all-gathers and '
        f'reduce-scatter), every rank and step: {ok}'
    )
    return 0 if ok else 1


if __name__ == '__main__':
    sys.exit(main())
