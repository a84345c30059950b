"""Memory per rank at W = 4: DDP + K-FAC against FSDP2 + K-FAC.

Run ``python -m benchmarks.fsdp_memory`` (a few minutes here). For each
set-up it launches four fresh gloo ranks on the CPU
(:func:`testing.distributed.run_distributed`), each training the
GPT-style model of ``examples/train_fsdp.py`` (vocabulary 512, width 256,
4 blocks, sequence 64, global batch 16; float32; SGD with momentum) for
three steps, factors every step and decompositions at step 0 (eigen, with
the eigenvalue outer product). Set-ups: DDP and FSDP2 (``fully_shard``
per block and root), each without K-FAC, with COMM-OPT and with MEM-OPT.

Per rank it reports

* ``precon.memory_usage()`` after the last step: the factors (on every
  rank), the decompositions (on the layers' gradient workers) and the
  total;
* the model state this rank holds: its parameters, gradients and
  optimizer state (whole under DDP, its shards under FSDP2);
* the **measured peak**: the increase of the process's resident-set
  high-water mark (``VmHWM``, reset through ``/proc/self/clear_refs``)
  from just before the model is built to after the last step. It counts
  everything the run allocates (model, gradients, DDP's buckets or
  FSDP2's gathered parameters, activations, K-FAC's state and transient
  buffers, allocator slack), so it is an upper bound on what the set-up
  needs, noisier than ``memory_usage()`` (a few MB).
"""

from __future__ import annotations

import gc
import json
import pathlib
import sys
import tempfile
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from examples import train_fsdp
from kfac.config import StatisticsConfig
from kfac.layers.attention import convert_attention
from kfac.preconditioner import KFACPreconditioner
from testing.distributed import run_distributed

__all__ = ['MODEL_ARGS', 'SETUPS', 'measure_rank', 'state_bytes']

MODEL_ARGS = [
    '--vocab', '512', '--width', '256', '--depth', '4', '--heads', '4',
    '--seq-len', '64', '--batch-size', '16',
]  # fmt: skip
SETUPS = [
    'ddp none',
    'ddp comm_opt',
    'ddp mem_opt',
    'fsdp none',
    'fsdp comm_opt',
    'fsdp mem_opt',
]
WORLD = 4
STEPS = 3
_MB = 2**20


def _status(field: str) -> int:
    """A ``/proc/self/status`` size in bytes (``VmHWM``, ``VmRSS``)."""
    for line in pathlib.Path('/proc/self/status').read_text().splitlines():
        if line.startswith(field + ':'):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes of this rank's parameters, gradients and optimizer state."""
    total = 0
    for param in model.parameters():
        total += _local(param).numel() * param.element_size()
        if param.grad is not None:
            total += _local(param.grad).numel() * param.element_size()
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                local = _local(value)
                total += local.numel() * local.element_size()
    return total


def _build(
    kind: str, args: Any
) -> tuple[nn.Module, nn.Module, torch.optim.Optimizer]:
    """The model, what the training loop calls, and the optimizer."""
    if kind == 'fsdp':
        model = train_fsdp.build_model(args, torch.device('cpu'))
        return model, model, train_fsdp.build_optimizer(model, args)
    torch.manual_seed(args.seed)
    model = train_fsdp.TinyGPT(args)
    convert_attention(model)
    wrapped = nn.parallel.DistributedDataParallel(model)
    return model, wrapped, train_fsdp.build_optimizer(model, args)


def measure_rank(setup: str, out_dir: str) -> None:
    """Every rank: build and train ``setup``; write its figures to
    ``out_dir/rank<r>.json``.
    """
    warnings.filterwarnings(
        'ignore', '.*all_gather_into_tensor', FutureWarning
    )
    kind, strategy = setup.split()
    rank, world = dist.get_rank(), dist.get_world_size()
    args = train_fsdp.parse_args(MODEL_ARGS)
    gc.collect()
    pathlib.Path('/proc/self/clear_refs').write_text('5')
    base = _status('VmRSS')
    model, wrapped, optimizer = _build(kind, args)
    precon = None
    if strategy != 'none':
        precon = KFACPreconditioner(
            wrapped,
            factor_update_steps=1,
            inv_update_steps=STEPS,
            damping=0.001,
            kl_clip=0.001,
            grad_worker_fraction=strategy,
            statistics=StatisticsConfig(loss_average='batch+sequence'),
        )
    per_rank = args.batch_size // world
    for step in range(STEPS):
        tokens = train_fsdp.make_batch(step, args)
        tokens = tokens[rank * per_rank : (rank + 1) * per_rank]
        optimizer.zero_grad()
        logits = wrapped(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        if precon is not None:
            precon.step()
        optimizer.step()
    figures = {
        'peak': _status('VmHWM') - base,
        'model_state': state_bytes(model, optimizer),
        'kfac': {} if precon is None else precon.memory_usage(),
    }
    path = pathlib.Path(out_dir) / f'rank{rank}.json'
    path.write_text(json.dumps(figures))


def run(setup: str) -> list[dict[str, Any]]:
    """Four fresh ranks of :func:`measure_rank`; their figures."""
    with tempfile.TemporaryDirectory() as tmp:
        run_distributed(
            measure_rank,
            WORLD,
            setup,
            tmp,
            tmp_path=pathlib.Path(tmp),
            timeout=600,
        )
        return [
            json.loads((pathlib.Path(tmp) / f'rank{r}.json').read_text())
            for r in range(WORLD)
        ]


def _per_rank(values: list[float]) -> str:
    return ' / '.join(f'{v / _MB:.1f}' for v in values)


def report(results: dict[str, list[dict[str, Any]]]) -> str:
    """Markdown table: MB per rank (ranks 0 / 1 / 2 / 3)."""
    lines = [
        f'## Memory per rank at W = {WORLD} (MB, ranks 0 / 1 / 2 / 3)',
        '',
        '| set-up | K-FAC factors | K-FAC decompositions | K-FAC total '
        '(`memory_usage`) | params + grads + optimizer state | measured '
        'peak (RSS high-water increase) |',
        '| --- | --- | --- | --- | --- | --- |',
    ]
    for setup, ranks in results.items():
        usage = [r['kfac'] for r in ranks]
        factors = [
            u.get('a_factors', 0) + u.get('g_factors', 0) for u in usage
        ]
        inverses = [
            u.get('a_inverses', 0) + u.get('g_inverses', 0) for u in usage
        ]
        lines.append(
            f'| {setup} | {_per_rank(factors)} | {_per_rank(inverses)} | '
            f'{_per_rank([u.get("total", 0) for u in usage])} | '
            f'{_per_rank([r["model_state"] for r in ranks])} | '
            f'{_per_rank([r["peak"] for r in ranks])} |'
        )
    return '\n'.join(lines)


def main(argv: list[str] | None = None) -> int:
    """Measure every set-up in turn; print the table."""
    setups = argv if argv else SETUPS
    unknown = sorted(set(setups) - set(SETUPS))
    if unknown:
        raise SystemExit(f'unknown set-ups {unknown}; choose from {SETUPS}')
    results = {setup: run(setup) for setup in setups}
    print(report(results))
    return 0


if __name__ == '__main__':
    sys.exit(main(sys.argv[1:]))
