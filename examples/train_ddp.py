"""Train a small CNN with K-FAC, alone or under ``torchrun`` with DDP.

Runs the same on one process and on many::

    python examples/train_ddp.py --epochs 2
    torchrun --standalone --nproc_per_node=2 examples/train_ddp.py --epochs 2

On GPUs each rank uses ``cuda:LOCAL_RANK`` and NCCL; on CPUs gloo. The data
is a synthetic 10-class image task labelled by a fixed random linear
"teacher" of the 4x4 average-pooled image, so the script needs no
download; each rank trains on its own shard of every global batch
(``--batch-size`` is the global batch size).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from kfac.preconditioner import KFACPreconditioner

logger = logging.getLogger('train_ddp')


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('--epochs', type=int, default=3)
    p.add_argument('--steps-per-epoch', type=int, default=50)
    p.add_argument('--batch-size', type=int, default=128, help='global')
    p.add_argument('--lr', type=float, default=0.05)
    p.add_argument('--no-kfac', action='store_true', help='plain SGD')
    p.add_argument('--damping', type=float, default=0.003)
    p.add_argument('--factor-update-steps', type=int, default=1)
    p.add_argument('--inv-update-steps', type=int, default=10)
    p.add_argument('--compute-method', default='eigen')
    p.add_argument(
        '--strategy',
        default='comm_opt',
        help='grad_worker_fraction: comm_opt, hybrid_opt, mem_opt or a float',
    )
    p.add_argument('--checkpoint', default=None, help='save/resume path')
    p.add_argument('--seed', type=int, default=0)
    return p.parse_args(argv)


def setup_distributed() -> tuple[int, int, torch.device]:
    """Join the process group when launched by torchrun; pick a device."""
    if 'WORLD_SIZE' in os.environ and not dist.is_initialized():
        backend = 'nccl' if torch.cuda.is_available() else 'gloo'
        dist.init_process_group(backend)
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    device = torch.device('cpu')
    if torch.cuda.is_available():
        device = torch.device('cuda', int(os.environ.get('LOCAL_RANK', 0)))
        torch.cuda.set_device(device)
    return rank, world, device


class Net(nn.Module):
    """Two convolutions and a classifier for 1x16x16 inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 16, 3, stride=2, padding=1)
        self.fc = nn.Linear(16 * 4 * 4, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        h = F.relu(self.conv1(x))
        h = F.avg_pool2d(F.relu(self.conv2(h)), 2)
        out: torch.Tensor = self.fc(h.flatten(1))
        return out


def make_batch(
    step: int,
    batch_size: int,
    teacher: nn.Module,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step``: identical on every rank."""
    gen = torch.Generator().manual_seed(10_000 + step)
    x = torch.randn(batch_size, 1, 16, 16, generator=gen)
    with torch.no_grad():
        y = teacher(F.avg_pool2d(x, 4).flatten(1)).argmax(dim=1)
    return x, y


def build_kfac(
    model: nn.Module,
    args: argparse.Namespace,
    optimizer: torch.optim.Optimizer,
) -> KFACPreconditioner | None:
    """The preconditioner, or None for plain SGD."""
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
        optimizer=optimizer,
    )


def main(argv: list[str] | None = None) -> float:
    """Train; return the final evaluation accuracy."""
    args = parse_args(argv)
    rank, world, device = setup_distributed()
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING)
    torch.manual_seed(args.seed)
    teacher, model = nn.Linear(16, 10), Net().to(device)
    ddp: nn.Module = model
    if dist.is_initialized():
        ids = [device.index] if device.type == 'cuda' else None
        ddp = nn.parallel.DistributedDataParallel(model, device_ids=ids)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    kfac = build_kfac(ddp, args, optimizer)
    start_epoch = 0
    if args.checkpoint and os.path.exists(args.checkpoint):
        state = torch.load(
            args.checkpoint, map_location=device, weights_only=True
        )
        model.load_state_dict(state['model'])
        optimizer.load_state_dict(state['optimizer'])
        if kfac is not None:
            kfac.load_state_dict(state['kfac'])
        start_epoch = state['epoch'] + 1
    shard = args.batch_size // world
    for epoch in range(start_epoch, args.epochs):
        began = time.perf_counter()
        for i in range(args.steps_per_epoch):
            x, y = make_batch(
                epoch * args.steps_per_epoch + i, args.batch_size, teacher
            )
            x, y = (
                x[rank * shard : (rank + 1) * shard].to(device),
                y[rank * shard : (rank + 1) * shard].to(device),
            )
            optimizer.zero_grad()
            loss = F.cross_entropy(ddp(x), y)
            loss.backward()
            if kfac is not None:
                kfac.step()
            optimizer.step()
        accuracy = evaluate(model, teacher, device)
        logger.info(
            'epoch %d: loss %.4f, accuracy %.3f, %.1fs',
            epoch,
            loss.item(),
            accuracy,
            time.perf_counter() - began,
        )
        if args.checkpoint and rank == 0:
            state = {
                'model': model.state_dict(),
                'optimizer': optimizer.state_dict(),
                'epoch': epoch,
            }
            if kfac is not None:
                state['kfac'] = kfac.state_dict()
            torch.save(state, args.checkpoint)
    return evaluate(model, teacher, device)


def evaluate(
    model: nn.Module, teacher: nn.Module, device: torch.device
) -> float:
    """Accuracy on a fixed held-out batch of 1,000 examples."""
    x, y = make_batch(-1, 1000, teacher)
    with torch.no_grad():
        predicted = model(x.to(device)).argmax(dim=1).cpu()
    return float((predicted == y).float().mean())


if __name__ == '__main__':
    main()
    if dist.is_initialized():
        dist.destroy_process_group()
