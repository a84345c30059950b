"""Train one small CNN on Fashion-MNIST four ways: SGD, Adam, SGD + K-FAC.

The script behind ``make demo``: SGD with momentum, Adam, SGD + K-FAC with
the demo's tuned settings (``kfac``) and SGD + K-FAC with the library's
defaults (``kfac-defaults``: ``KFACPreconditioner(model,
optimizer=optimizer)`` added to the SGD run, nothing else set). Each
optimizer trains the same network from the same initial weights on the
same sequence of batches for the same number of epochs; after every epoch
the script measures test accuracy. It
prints a table per optimizer (test accuracy per epoch, training wall time,
time to ``--target-accuracy``), a summary, and writes a PNG of test
accuracy against wall-clock time and against epochs::

    python -m examples.fashion_mnist                    # the demo
    python -m examples.fashion_mnist --data-dir ~/mnist # MNIST IDX files
    python -m examples.fashion_mnist --optimizers sgd kfac --epochs 5
    torchrun --standalone --nproc_per_node=2 -m examples.fashion_mnist

Data: the IDX files in ``--data-dir`` (default: where Debian's
``dataset-fashion-mnist`` puts them), else scikit-learn's 8x8 digits, as
the output says. Under ``torchrun`` every rank trains on its shard of each
global batch (``--batch-size`` is global) through DDP, and the test set is
split between the ranks. Wall times count training only (evaluation
excluded); K-FAC's time includes all of its extra work.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import math
import pathlib
import time
from collections.abc import Iterable
from collections.abc import Sequence
from typing import TYPE_CHECKING
from typing import NoReturn

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from examples import training
from examples.comparison import OPTIMIZERS
from examples.comparison import History
from examples.comparison import format_history
from examples.comparison import format_summary
from examples.comparison import plot
from examples.data import ImageData
from examples.data import load_image_data
from kfac.preconditioner import KFACPreconditioner
from kfac.scheduler import LambdaParamScheduler

if TYPE_CHECKING:
    from tqdm import tqdm

logger = logging.getLogger('examples.fashion_mnist')


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Command-line options; the defaults are the tuned demo settings."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('--data-dir', default=None, help='MNIST-format IDX files')
    p.add_argument(
        '--require-data',
        action='store_true',
        help='fail instead of falling back to the 8x8 digits',
    )
    p.add_argument(
        '--optimizers',
        nargs='+',
        choices=list(OPTIMIZERS),
        default=list(OPTIMIZERS),
    )
    p.add_argument('--epochs', type=int, default=3)
    p.add_argument(
        '--train-size',
        type=int,
        default=None,
        help='train on a random subset of this many images',
    )
    p.add_argument('--batch-size', type=int, default=256, help='global')
    p.add_argument('--sgd-lr', type=float, default=0.1)
    p.add_argument('--adam-lr', type=float, default=0.01)
    p.add_argument('--kfac-lr', type=float, default=0.1, help="SGD's lr")
    p.add_argument('--momentum', type=float, default=0.9)
    p.add_argument('--weight-decay', type=float, default=5e-4)
    p.add_argument(
        '--lr-schedule',
        choices=['constant', 'cosine'],
        default='cosine',
        help='per step, the same for every optimizer',
    )
    training.add_kfac_args(
        p,
        factor_update_steps=5,
        inv_update_steps=20,
        damping=0.003,
        kl_clip=0.0,
        relative_clip=1.0,
    )
    p.add_argument('--target-accuracy', type=float, default=0.88)
    p.add_argument(
        '--plot',
        default='build/demo/fashion_mnist_optimizers.png',
        help='PNG path',
    )
    p.add_argument('--no-plot', action='store_true')
    p.add_argument('--no-progress', action='store_true', help='no tqdm bars')
    p.add_argument('--amp', action='store_true', help='torch.amp autocast')
    p.add_argument('--amp-dtype', choices=['float16', 'bfloat16'])
    p.add_argument('--device', choices=['cpu', 'cuda'], default=None)
    p.add_argument('--seed', type=int, default=0)
    return p.parse_args(argv)


class SmallCNN(nn.Module):
    """Two 3x3 convolutions with max pooling, and a linear classifier.

    ``conv(1→32) → ReLU → pool → conv(32→64, stride 2) → ReLU → pool →
    linear``: 28x28 inputs reach the classifier as 64x3x3 features (8x8
    inputs as 64x1x1). The strided second convolution keeps K-FAC's
    statistics cheap: its input factor is 289x289, gathered over 7x7
    positions rather than 14x14.
    """

    def __init__(self, image_shape: tuple[int, int, int], classes: int):
        super().__init__()
        channels, height, width = image_shape
        self.conv1 = nn.Conv2d(channels, 32, 3, padding=1)
        self.conv2 = nn.Conv2d(32, 64, 3, stride=2, padding=1)
        self.fc = nn.Linear(64 * (height // 8) * (width // 8), classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        out: torch.Tensor = self.fc(x.flatten(1))
        return out


def make_optimizer(
    name: str, model: nn.Module, args: argparse.Namespace
) -> torch.optim.Optimizer:
    """The base optimizer of run ``name`` (K-FAC runs use SGD)."""
    if name == 'adam':
        return torch.optim.Adam(
            model.parameters(), lr=args.adam_lr, weight_decay=args.weight_decay
        )
    return torch.optim.SGD(
        model.parameters(),
        lr=args.kfac_lr if name == 'kfac' else args.sgd_lr,
        momentum=args.momentum,
        weight_decay=args.weight_decay,
    )


def evaluate(
    model: nn.Module,
    data: ImageData,
    runtime: training.Runtime,
    precision: training.Precision,
) -> float:
    """Test accuracy; each rank scores its share of the test set."""
    model.eval()
    shard = torch.arange(
        runtime.rank, len(data.test_labels), runtime.world_size
    )
    correct = 0
    with torch.no_grad(), precision.autocast():
        for chunk in shard.split(1000):
            x = data.test_images[chunk].to(runtime.device)
            predicted = model(x).argmax(dim=1).cpu()
            correct += int((predicted == data.test_labels[chunk]).sum())
    model.train()
    total, hits = training.all_reduce_sum(
        [len(shard), correct], runtime.device
    )
    return hits / total


@dataclasses.dataclass
class Run:
    """One optimizer's model, optimizer and schedules."""

    model: nn.Module
    ddp: nn.Module
    optimizer: torch.optim.Optimizer
    lr_scheduler: torch.optim.lr_scheduler.LRScheduler
    kfac: KFACPreconditioner | None
    kfac_scheduler: LambdaParamScheduler | None
    precision: training.Precision


def build_run(
    name: str,
    data: ImageData,
    args: argparse.Namespace,
    runtime: training.Runtime,
) -> Run:
    """A fresh :class:`SmallCNN` (seeded) and optimizer ``name``."""
    torch.manual_seed(args.seed)
    model = SmallCNN(data.image_shape, data.num_classes).to(runtime.device)
    ddp = training.wrap_ddp(model, runtime)
    optimizer = make_optimizer(name, model, args)
    precision = training.Precision(runtime.device, args.amp, args.amp_dtype)
    steps_per_epoch = len(data.train_labels) // args.batch_size
    total = steps_per_epoch * args.epochs
    cosine = args.lr_schedule == 'cosine'
    lr_scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda s: 0.5 * (1 + math.cos(math.pi * s / total)) if cosine else 1,
    )
    kfac_args = argparse.Namespace(**{**vars(args), 'no_kfac': name != 'kfac'})
    kfac, kfac_scheduler = training.build_kfac(
        ddp, kfac_args, optimizer, precision, steps_per_epoch
    )
    if name == 'kfac-defaults':
        # what a user adds to a working SGD loop: nothing but the optimizer
        kfac = KFACPreconditioner(
            ddp, optimizer=optimizer, grad_scaler=precision.scaler
        )
    return Run(
        model, ddp, optimizer, lr_scheduler, kfac, kfac_scheduler, precision
    )


def train_epoch(
    run: Run,
    data: ImageData,
    batches: Iterable[torch.Tensor],
    runtime: training.Runtime,
    bar: tqdm[NoReturn] | None,
) -> float:
    """Train on ``batches`` of indices (global batches); the mean loss."""
    losses = []
    for idx in batches:
        shard = len(idx) // runtime.world_size
        mine = idx[runtime.rank * shard : (runtime.rank + 1) * shard]
        x = data.train_images[mine].to(runtime.device)
        y = data.train_labels[mine].to(runtime.device)
        run.optimizer.zero_grad(set_to_none=True)
        with run.precision.autocast():
            loss = F.cross_entropy(run.ddp(x), y)
        training.backward_and_step(
            loss, run.optimizer, run.kfac, run.precision
        )
        run.lr_scheduler.step()
        if run.kfac_scheduler is not None:
            run.kfac_scheduler.step()
        losses.append(loss.item())
        if bar is not None:
            bar.set_postfix(loss=f'{losses[-1]:.3f}', refresh=False)
            bar.update()
    return sum(losses) / len(losses)


def train_one(
    name: str,
    data: ImageData,
    args: argparse.Namespace,
    runtime: training.Runtime,
) -> History:
    """Train with optimizer ``name``; test accuracy after every epoch."""
    run = build_run(name, data, args, runtime)
    history = History(name)
    history.accuracy.append(evaluate(run.model, data, runtime, run.precision))
    history.seconds.append(0.0)
    history.loss.append(math.nan)
    generator = torch.Generator().manual_seed(args.seed)
    n, elapsed = len(data.train_labels), 0.0
    for epoch in range(1, args.epochs + 1):
        bar = _progress(args, runtime, n // args.batch_size, name, epoch)
        began = time.perf_counter()
        batches = training.batches(n, args.batch_size, generator)
        loss = train_epoch(run, data, batches, runtime, bar)
        elapsed += time.perf_counter() - began
        if bar is not None:
            bar.close()
        history.loss.append(loss)
        history.seconds.append(elapsed)
        history.accuracy.append(
            evaluate(run.model, data, runtime, run.precision)
        )
    if run.kfac is not None:
        run.kfac.remove()
    return history


def _progress(
    args: argparse.Namespace,
    runtime: training.Runtime,
    steps: int,
    name: str,
    epoch: int,
) -> tqdm[NoReturn] | None:
    """A progress bar on rank 0 (tqdm is imported only when needed)."""
    if args.no_progress or not runtime.is_main:
        return None
    from tqdm import tqdm

    return tqdm(
        total=steps,
        desc=f'{OPTIMIZERS[name]:>22} epoch {epoch}/{args.epochs}',
        unit='step',
        leave=False,
        dynamic_ncols=True,
    )


def main(argv: Sequence[str] | None = None) -> dict[str, History]:
    """Train every optimizer in ``--optimizers``; return their histories."""
    args = parse_args(argv)
    runtime = training.setup_distributed(args.device)
    logging.basicConfig(
        level=logging.INFO if runtime.is_main else logging.WARNING,
        format='%(message)s',
    )
    if args.batch_size % runtime.world_size:
        raise ValueError(
            f'--batch-size {args.batch_size} must be a multiple of the '
            f'number of processes ({runtime.world_size})',
        )
    data = load_image_data(args.data_dir, fallback=not args.require_data)
    data = data.subset(args.train_size, seed=args.seed)
    logger.info(
        'data: %s; %d training, %d test images of shape %s',
        data.source,
        len(data.train_labels),
        len(data.test_labels),
        'x'.join(map(str, data.image_shape)),
    )
    logger.info(
        'training the same CNN for %d epochs of %d steps (batch %d, %d '
        'process%s; a short budget, so that the demo ends in about 5 '
        'minutes on 2 CPU cores) with: %s',
        args.epochs,
        len(data.train_labels) // args.batch_size,
        args.batch_size,
        runtime.world_size,
        'es' if runtime.world_size > 1 else '',
        ', '.join(OPTIMIZERS[n] for n in args.optimizers),
    )

    def say(text: str) -> None:
        if runtime.is_main:
            print(text, flush=True)

    histories = []
    for name in args.optimizers:
        history = train_one(name, data, args, runtime)
        histories.append(history)
        say(f'\n{format_history(history, args.target_accuracy)}\n')
    say(format_summary(histories, args.target_accuracy))
    if runtime.is_main and not args.no_plot:
        title = (
            f'{data.source}: {len(data.train_labels):,} training images, '
            f'batch {args.batch_size}, {runtime.world_size} process(es), '
            f'{torch.get_num_threads()} thread(s) each'
        )
        path = plot(histories, pathlib.Path(args.plot), title)
        say(f'plot written to {path.resolve()}')
    return {h.name: h for h in histories}


if __name__ == '__main__':
    main()
    if dist.is_initialized():
        dist.destroy_process_group()
