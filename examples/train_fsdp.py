r"""Train a small GPT-style model with FSDP2 (``fully_shard``) and K-FAC.

Runs alone or under ``torchrun``::

    python examples/train_fsdp.py --steps 40
    torchrun --standalone --nproc_per_node=2 examples/train_fsdp.py --steps 40
    torchrun --standalone --nproc_per_node=4 examples/train_fsdp.py \
        --replicas 2
    torchrun --standalone --nproc_per_node=2 examples/train_fsdp.py \
        --steps 20 --strategy mem_opt --checkpoint /tmp/kfac-fsdp
    torchrun --standalone --nproc_per_node=2 examples/train_fsdp.py \
        --steps 40 --strategy mem_opt --checkpoint /tmp/kfac-fsdp --resume

On GPUs each rank uses ``cuda:LOCAL_RANK`` and NCCL; on CPUs gloo. Alone,
the script joins a process group of one, which ``fully_shard`` needs.

The model: token and position embeddings, ``--depth`` pre-norm blocks
(``nn.MultiheadAttention`` under a causal mask, a 4x-wide GELU MLP), a
final LayerNorm and an output head. The attention modules are converted
with :func:`kfac.layers.attention.convert_attention` *before*
``fully_shard``, which is applied to every block, then to the root (with
``--replicas R``, on a 2-D HSDP mesh: ``R`` replicas x ``W / R`` shards).
The preconditioner is built after sharding. The data is synthetic: each
sequence follows a fixed random permutation of the vocabulary (the next
token is ``perm[token]``, or a uniformly random token with probability
``--noise``), so the script needs no download and the loss has a known
floor; every rank trains on its own rows of each global batch.

``--checkpoint DIR`` saves the model, the optimizer (through
``torch.distributed.checkpoint.state_dict``) and K-FAC's state with
``torch.distributed.checkpoint`` (DCP) into ``DIR/step_<n>`` every
``--checkpoint-every`` steps and at the end; ``--resume`` continues from the
newest one, exactly as the uninterrupted run would at the same world size.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import math
import os
import pathlib
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.checkpoint.state_dict import set_state_dict
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from kfac.checkpoint import dcp_state
from kfac.checkpoint import load_dcp
from kfac.config import ShardingConfig
from kfac.config import StatisticsConfig
from kfac.layers.attention import convert_attention
from kfac.preconditioner import KFACPreconditioner

logger = logging.getLogger('train_fsdp')


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('--steps', type=int, default=40, help='total steps')
    p.add_argument('--batch-size', type=int, default=16, help='global')
    p.add_argument('--seq-len', type=int, default=32)
    p.add_argument('--vocab', type=int, default=64)
    p.add_argument('--width', type=int, default=64)
    p.add_argument('--depth', type=int, default=2)
    p.add_argument('--heads', type=int, default=4)
    p.add_argument('--noise', type=float, default=0.1)
    p.add_argument('--optimizer', choices=('sgd', 'adamw'), default='sgd')
    p.add_argument('--lr', type=float, default=None, help='default: by opt.')
    p.add_argument('--no-kfac', action='store_true', help='optimizer only')
    p.add_argument('--damping', type=float, default=0.01)
    p.add_argument('--factor-update-steps', type=int, default=1)
    p.add_argument('--inv-update-steps', type=int, default=5)
    p.add_argument('--compute-method', default='eigen')
    p.add_argument(
        '--strategy',
        default='comm_opt',
        help='grad_worker_fraction: comm_opt, hybrid_opt, mem_opt or a float',
    )
    p.add_argument(
        '--shard-mode',
        choices=('lossless', 'local'),
        default='lossless',
        help="K-FAC's shard_mode (local needs --strategy comm_opt)",
    )
    p.add_argument(
        '--replicas',
        type=int,
        default=1,
        help='HSDP: replicas of a (replicas x world/replicas) mesh',
    )
    p.add_argument('--checkpoint', default=None, help='DCP directory')
    p.add_argument('--checkpoint-every', type=int, default=10)
    p.add_argument('--resume', action='store_true', help='from --checkpoint')
    p.add_argument('--log-every', type=int, default=5)
    p.add_argument('--seed', type=int, default=0)
    args = p.parse_args(argv)
    if args.width % args.heads:
        p.error(f'--width {args.width} must be a multiple of --heads')
    if args.resume and not args.checkpoint:
        p.error('--resume needs --checkpoint DIR')
    if args.steps < 0 or args.checkpoint_every < 1 or args.log_every < 1:
        p.error('--steps must be >= 0, --checkpoint-every/--log-every >= 1')
    return args


def setup_distributed() -> torch.device:
    """Join torchrun's process group, or one of a single process; pick a
    device (``cuda:LOCAL_RANK`` with NCCL, else the CPU with gloo).
    """
    cuda = torch.cuda.is_available()
    if not dist.is_initialized():
        backend = 'nccl' if cuda else 'gloo'
        if 'WORLD_SIZE' in os.environ:
            dist.init_process_group(backend)
        else:  # fully_shard needs a process group, even of one
            dist.init_process_group(
                backend,
                init_method='tcp://127.0.0.1:0',  # any free port
                rank=0,
                world_size=1,
            )
    if cuda and dist.get_backend() == 'nccl':
        device = torch.device('cuda', int(os.environ.get('LOCAL_RANK', 0)))
        torch.cuda.set_device(device)
        return device
    return torch.device('cpu')


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention, then the MLP."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(width)
        self.attn = nn.MultiheadAttention(width, heads, batch_first=True)
        self.ln2 = nn.LayerNorm(width)
        self.fc = nn.Linear(width, 4 * width)
        self.proj = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """``x`` of shape ``(batch, time, width)``; ``mask`` ``(T, T)``."""
        h = self.ln1(x)
        attended, _ = self.attn(h, h, h, attn_mask=mask, need_weights=False)
        x = x + attended
        out: torch.Tensor = x + self.proj(F.gelu(self.fc(self.ln2(x))))
        return out


class TinyGPT(nn.Module):
    """Token ids ``(batch, time)`` to logits ``(batch, time, vocab)``."""

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__()
        self.embed = nn.Embedding(args.vocab, args.width)
        self.pos = nn.Embedding(args.seq_len, args.width)
        self.blocks = nn.ModuleList(
            Block(args.width, args.heads) for _ in range(args.depth)
        )
        self.ln = nn.LayerNorm(args.width)
        self.head = nn.Linear(args.width, args.vocab, bias=False)
        causal = torch.ones(args.seq_len, args.seq_len).triu(1).bool()
        self.register_buffer('causal', causal, persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # noqa: D102
        t = tokens.shape[1]
        positions = torch.arange(t, device=tokens.device).expand_as(tokens)
        x = self.embed(tokens) + self.pos(positions)
        mask = self.get_buffer('causal')[:t, :t]
        for block in self.blocks:
            x = block(x, mask)
        logits: torch.Tensor = self.head(self.ln(x))
        return logits


def build_model(args: argparse.Namespace, device: torch.device) -> nn.Module:
    """The model, attention converted, sharded per block and at the root."""
    torch.manual_seed(args.seed)
    model = TinyGPT(args).to(device)
    convert_attention(model)  # before fully_shard: K-FAC must see q, k, v
    mesh = make_mesh(args.replicas, device)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def make_mesh(replicas: int, device: torch.device) -> DeviceMesh:
    """1-D mesh of every rank, or HSDP's ``(replicas, world / replicas)``."""
    world = dist.get_world_size()
    if replicas < 1 or world % replicas:
        raise ValueError(
            f'--replicas {replicas} must divide the world size {world}'
        )
    if replicas == 1:
        return init_device_mesh(device.type, (world,))
    return init_device_mesh(
        device.type,
        (replicas, world // replicas),
        mesh_dim_names=('replicate', 'shard'),
    )


def make_batch(step: int, args: argparse.Namespace) -> torch.Tensor:
    """The global batch of ``step``, ``(batch, seq_len + 1)`` token ids,
    identical on every rank (the permutation is fixed by ``--seed``).
    """
    perm = torch.randperm(
        args.vocab, generator=torch.Generator().manual_seed(args.seed)
    )
    gen = torch.Generator().manual_seed(1_000_003 * (args.seed + 1) + step)
    shape = (args.batch_size, args.seq_len + 1)
    noise = torch.randint(0, args.vocab, shape, generator=gen)
    random = torch.rand(shape, generator=gen) < args.noise
    tokens = noise.clone()
    for t in range(1, shape[1]):
        follow = perm[tokens[:, t - 1]]
        tokens[:, t] = torch.where(random[:, t], noise[:, t], follow)
    return tokens


def build_optimizer(
    model: nn.Module, args: argparse.Namespace
) -> torch.optim.Optimizer:
    """SGD with momentum or AdamW."""
    if args.optimizer == 'adamw':
        lr = 3e-3 if args.lr is None else args.lr
        return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    lr = 0.1 if args.lr is None else args.lr
    return torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)


def build_kfac(
    model: nn.Module,
    args: argparse.Namespace,
    optimizer: torch.optim.Optimizer,
) -> KFACPreconditioner | None:
    """The preconditioner (after ``fully_shard``), or None."""
    if args.no_kfac:
        return None
    strategy = args.strategy
    with contextlib.suppress(ValueError):
        strategy = float(strategy)
    return KFACPreconditioner(
        model,
        factor_update_steps=args.factor_update_steps,
        inv_update_steps=args.inv_update_steps,
        damping=args.damping,
        kl_clip=0.001,
        compute_method=args.compute_method,
        grad_worker_fraction=strategy,
        # the loss averages over tokens
        optimizer=optimizer,
        statistics=StatisticsConfig(loss_average='batch+sequence'),
        sharding=ShardingConfig(shard_mode=args.shard_mode),
    )


@dataclasses.dataclass
class Run:
    """What :func:`train` built and measured.

    Attributes:
        model: the sharded model.
        optimizer: its optimizer.
        kfac: the preconditioner (None with ``--no-kfac``).
        losses: the mean loss over all ranks of each step this run took.
        start: the step it started from (after a resume).
    """

    model: nn.Module
    optimizer: torch.optim.Optimizer
    kfac: KFACPreconditioner | None
    losses: list[float]
    start: int


def train(args: argparse.Namespace) -> Run:
    """Build, resume if asked, train to ``--steps``, checkpoint; every rank
    calls it (the process group is joined first if needed).
    """
    device = setup_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.batch_size % world:
        raise ValueError(
            f'--batch-size {args.batch_size} must be divisible by the world '
            f'size {world}'
        )
    model = build_model(args, device)
    optimizer = build_optimizer(model, args)
    kfac = build_kfac(model, args, optimizer)
    start = resume(args, model, optimizer, kfac) if args.resume else 0
    run = Run(model, optimizer, kfac, [], start)
    per_rank = args.batch_size // world
    began = time.perf_counter()
    for step in range(start, args.steps):
        tokens = make_batch(step, args)[
            rank * per_rank : (rank + 1) * per_rank
        ]
        tokens = tokens.to(device)
        optimizer.zero_grad()
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        if kfac is not None:
            kfac.step()
        optimizer.step()
        run.losses.append(mean_over_ranks(loss))
        done = step + 1
        if done % args.log_every == 0 or done == args.steps:
            logger.info(
                'step %d: loss %.4f (%.1fs)',
                done,
                run.losses[-1],
                time.perf_counter() - began,
            )
        if args.checkpoint and (
            done % args.checkpoint_every == 0 or done == args.steps
        ):
            save(args.checkpoint, done, model, optimizer, kfac)
    return run


def mean_over_ranks(loss: torch.Tensor) -> float:
    """The loss averaged over every rank (a collective)."""
    total = loss.detach().clone()
    dist.all_reduce(total)
    return float(total) / dist.get_world_size()


def save(
    directory: str,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    kfac: KFACPreconditioner | None,
) -> None:
    """DCP checkpoint of model, optimizer and K-FAC in ``DIR/step_<n>``."""
    model_state, optim_state = get_state_dict(model, optimizer)
    state: dict[str, Any] = {
        'model': model_state,
        'optim': optim_state,
        'step': torch.tensor(step),
    }
    if kfac is not None:
        state['kfac'] = dcp_state(kfac)
    path = pathlib.Path(directory) / f'step_{step}'
    dcp_save(state, checkpoint_id=path)
    logger.info('saved %s', path)


def newest_checkpoint(directory: str) -> pathlib.Path:
    """The ``step_<n>`` directory with the largest complete ``n``."""
    found = [
        (int(path.name.removeprefix('step_')), path)
        for path in pathlib.Path(directory).glob('step_*')
        if path.name.removeprefix('step_').isdigit()
        and (path / '.metadata').exists()
    ]
    if not found:
        raise FileNotFoundError(f'--resume: no checkpoint in {directory}')
    return max(found)[1]


def resume(
    args: argparse.Namespace,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    kfac: KFACPreconditioner | None,
) -> int:
    """Load the newest checkpoint of ``--checkpoint``; return its step."""
    path = newest_checkpoint(args.checkpoint)
    model_state, optim_state = get_state_dict(model, optimizer)
    state: dict[str, Any] = {
        'model': model_state,
        'optim': optim_state,
        'step': torch.tensor(0),
    }
    dcp_load(state, checkpoint_id=path)
    set_state_dict(
        model,
        optimizer,
        model_state_dict=state['model'],
        optim_state_dict=state['optim'],
    )
    if kfac is not None:
        load_dcp(kfac, path)
    step = int(state['step'])
    logger.info('resumed from %s (step %d)', path, step)
    return step


def main(argv: list[str] | None = None) -> list[float]:
    """Train; return the mean loss of each step taken."""
    args = parse_args(argv)
    rank = int(os.environ.get('RANK', 0))
    if dist.is_initialized():
        rank = dist.get_rank()
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format='%(asctime)s %(name)s: %(message)s',
    )
    run = train(args)
    if rank == 0 and run.losses:
        logger.info(
            'steps %d-%d: loss %.4f -> %.4f (floor about %.4f)',
            run.start,
            args.steps,
            run.losses[0],
            run.losses[-1],
            loss_floor(args),
        )
    return run.losses


def loss_floor(args: argparse.Namespace) -> float:
    """Entropy of the next token given the last (nats): the best loss."""
    v, p = int(args.vocab), float(args.noise)
    if p == 0:
        return 0.0
    follow = 1 - p + p / v
    other = p / v
    return -(follow * math.log(follow) + (v - 1) * other * math.log(other))


if __name__ == '__main__':
    main()
    # FSDP2 on gloo (torch 2.13) can abort at exit while gloo's worker
    # threads still release its tensors, K-FAC or not; a short pause
    # avoids it (docs/guide/troubleshooting.md).
    time.sleep(0.3)
    dist.destroy_process_group()
