"""The training loop of the CIFAR-10 and ImageNet ResNet examples.

:func:`fit` trains a model on a map-style data set with everything a
multi-GPU K-FAC run needs: ``DistributedDataParallel`` under ``torchrun``
(each process reads its share of every epoch through a
``DistributedSampler``; ``--batch-size`` is per process and the learning
rate is ``--base-lr`` times the number of processes), a warm-up and
step-decay learning rate, K-FAC with its damping and update intervals on
a :class:`~kfac.scheduler.LambdaParamScheduler`, ``torch.amp`` mixed
precision, a checkpoint after every epoch from which a rerun resumes
(model, optimizer, both schedules, loss scaler and the preconditioner's
factors), progress in the log and metrics as JSON lines.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import pathlib
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader
from torch.utils.data import Dataset
from torch.utils.data import TensorDataset
from torch.utils.data.distributed import DistributedSampler

from examples import training

logger = logging.getLogger(__name__)


def add_train_args(
    parser: argparse.ArgumentParser,
    *,
    epochs: int,
    batch_size: int,
    base_lr: float,
    weight_decay: float,
    warmup_epochs: int,
    lr_decay_epochs: Sequence[int],
) -> None:
    """Options shared by the ResNet examples, with per-example defaults."""
    p = parser
    p.add_argument('--data-dir', default=None, help='the data set')
    p.add_argument(
        '--synthetic',
        type=int,
        default=0,
        metavar='N',
        help='train on N random images instead (no data needed)',
    )
    p.add_argument('--epochs', type=int, default=epochs)
    p.add_argument(
        '--batch-size', type=int, default=batch_size, help='per process'
    )
    p.add_argument(
        '--base-lr',
        type=float,
        default=base_lr,
        help='learning rate per process (times the number of processes)',
    )
    p.add_argument('--momentum', type=float, default=0.9)
    p.add_argument('--weight-decay', type=float, default=weight_decay)
    p.add_argument('--warmup-epochs', type=int, default=warmup_epochs)
    p.add_argument(
        '--lr-decay-epochs',
        type=int,
        nargs='*',
        default=list(lr_decay_epochs),
    )
    p.add_argument('--lr-decay', type=float, default=0.1)
    p.add_argument('--label-smoothing', type=float, default=0.0)
    p.add_argument(
        '--max-steps-per-epoch', type=int, default=None, help='for trials'
    )
    p.add_argument('--workers', type=int, default=4, help='loader processes')
    p.add_argument('--amp', action='store_true', help='mixed precision')
    p.add_argument(
        '--amp-dtype',
        choices=['float16', 'bfloat16'],
        default=None,
        help='default: float16 (with loss scaling) on CUDA, else bfloat16',
    )
    p.add_argument('--device', choices=['cpu', 'cuda'], default=None)
    p.add_argument(
        '--checkpoint-dir', default=None, help='save and resume here'
    )
    p.add_argument('--log-dir', default=None, help='write metrics.jsonl there')
    p.add_argument('--log-interval', type=int, default=50, help='steps')
    p.add_argument('--seed', type=int, default=42)


def synthetic_dataset(
    n: int, shape: Sequence[int], classes: int, seed: int = 0
) -> TensorDataset:
    """``n`` random images of ``shape`` with random labels."""
    gen = torch.Generator().manual_seed(seed)
    return TensorDataset(
        torch.randn(n, *shape, generator=gen),
        torch.randint(0, classes, (n,), generator=gen),
    )


@dataclasses.dataclass
class Result:
    """What :func:`fit` reports after the last epoch."""

    epochs_trained: int
    train_loss: float
    val_loss: float
    val_accuracy: float


class _Loop:
    """The state of one run: model, optimizer, schedules, loaders."""

    def __init__(
        self,
        args: argparse.Namespace,
        model: nn.Module,
        train_set: Dataset[Any],
        val_set: Dataset[Any],
        runtime: training.Runtime,
    ) -> None:
        self.args, self.runtime = args, runtime
        self.model = model.to(runtime.device)
        self.ddp = training.wrap_ddp(self.model, runtime)
        self.precision = training.Precision(
            runtime.device, args.amp, args.amp_dtype
        )
        self.train_loader = self._loader(train_set, train=True)
        self.val_loader = self._loader(val_set, train=False)
        self.steps = len(self.train_loader)
        if args.max_steps_per_epoch:
            self.steps = min(self.steps, args.max_steps_per_epoch)
        self.optimizer = torch.optim.SGD(
            self.model.parameters(),
            lr=args.base_lr * runtime.world_size,
            momentum=args.momentum,
            weight_decay=args.weight_decay,
        )
        self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, self._lr_factor
        )
        self.kfac, self.kfac_scheduler = training.build_kfac(
            self.ddp, args, self.optimizer, self.precision, self.steps
        )
        self.criterion = nn.CrossEntropyLoss(
            label_smoothing=args.label_smoothing
        )
        self.metrics = training.MetricsLog(
            pathlib.Path(args.log_dir) / 'metrics.jsonl'
            if args.log_dir
            else None,
            runtime,
        )

    def _loader(self, dataset: Dataset[Any], train: bool) -> DataLoader[Any]:
        sampler: DistributedSampler[Any] = DistributedSampler(
            dataset,
            num_replicas=self.runtime.world_size,
            rank=self.runtime.rank,
            shuffle=train,
            seed=self.args.seed,
            drop_last=train,
        )
        return DataLoader(
            dataset,
            batch_size=self.args.batch_size,
            sampler=sampler,
            num_workers=self.args.workers,
            pin_memory=self.runtime.device.type == 'cuda',
            drop_last=train,
            persistent_workers=self.args.workers > 0,
        )

    def _lr_factor(self, step: int) -> float:
        """Linear warm-up, then a step decay at the given epochs."""
        warmup: int = self.args.warmup_epochs * self.steps
        if step < warmup:
            return (step + 1) / warmup
        decay = training.milestone_lambda(
            self.args.lr_decay_epochs, self.args.lr_decay, self.steps
        )
        return decay(step)

    # Checkpoints -----------------------------------------------------------

    def _checkpoint_path(self) -> pathlib.Path | None:
        if self.args.checkpoint_dir is None:
            return None
        return pathlib.Path(self.args.checkpoint_dir) / 'checkpoint.pt'

    def save(self, epoch: int) -> None:
        """Rank 0 writes the state after ``epoch``; the others wait."""
        path = self._checkpoint_path()
        if path is None:
            return
        if self.runtime.is_main:
            state: dict[str, Any] = {
                'epoch': epoch,
                'model': self.model.state_dict(),
                'optimizer': self.optimizer.state_dict(),
                'lr_scheduler': self.lr_scheduler.state_dict(),
            }
            if self.kfac is not None and self.kfac_scheduler is not None:
                state['kfac'] = self.kfac.state_dict()
                state['kfac_scheduler'] = self.kfac_scheduler.state_dict()
            if self.precision.scaler is not None:
                state['scaler'] = self.precision.scaler.state_dict()
            training.save_checkpoint(path, state)
            logger.info('saved %s (epoch %d)', path, epoch + 1)
        if dist.is_initialized():
            dist.barrier()

    def resume(self) -> int:
        """Load the checkpoint if there is one; the first epoch to train."""
        path = self._checkpoint_path()
        state = (
            None
            if path is None
            else training.load_checkpoint(path, self.runtime.device)
        )
        if state is None:
            return 0
        self.model.load_state_dict(state['model'])
        self.optimizer.load_state_dict(state['optimizer'])
        self.lr_scheduler.load_state_dict(state['lr_scheduler'])
        if self.kfac is not None and self.kfac_scheduler is not None:
            if 'kfac' not in state:
                raise ValueError(
                    f'{path} was saved without K-FAC (--no-kfac); resume '
                    'it with --no-kfac or start a new checkpoint directory',
                )
            self.kfac.load_state_dict(state['kfac'])
            self.kfac_scheduler.load_state_dict(state['kfac_scheduler'])
        if self.precision.scaler is not None and 'scaler' in state:
            self.precision.scaler.load_state_dict(state['scaler'])
        logger.info('resumed from %s after epoch %d', path, state['epoch'] + 1)
        return int(state['epoch']) + 1

    # Training ---------------------------------------------------------------

    def train_epoch(self, epoch: int) -> float:
        """One epoch; the mean training loss over all ranks."""
        sampler = self.train_loader.sampler
        assert isinstance(sampler, DistributedSampler)
        sampler.set_epoch(epoch)
        self.ddp.train()
        total, count = 0.0, 0
        began = time.perf_counter()
        for step, (x, y) in enumerate(self.train_loader):
            if step == self.steps:
                break
            x = x.to(self.runtime.device, non_blocking=True)
            y = y.to(self.runtime.device, non_blocking=True)
            self.optimizer.zero_grad(set_to_none=True)
            with self.precision.autocast():
                loss = self.criterion(self.ddp(x), y)
            training.backward_and_step(
                loss, self.optimizer, self.kfac, self.precision
            )
            self.lr_scheduler.step()
            if self.kfac_scheduler is not None:
                self.kfac_scheduler.step()
            total, count = total + loss.item(), count + 1
            if (step + 1) % self.args.log_interval == 0:
                self._log_progress(epoch, step, total / count, began)
        loss_sum, n = training.all_reduce_sum(
            [total, count], self.runtime.device
        )
        return loss_sum / max(n, 1)

    def _log_progress(
        self, epoch: int, step: int, loss: float, began: float
    ) -> None:
        seconds = time.perf_counter() - began
        images = (step + 1) * self.args.batch_size * self.runtime.world_size
        lr = float(self.optimizer.param_groups[0]['lr'])
        if self.runtime.is_main:
            logger.info(
                'epoch %d step %d/%d: loss %.4f, lr %.4g, %.0f images/s',
                epoch + 1,
                step + 1,
                self.steps,
                loss,
                lr,
                images / seconds,
            )
        self.metrics.write(
            'train',
            epoch=epoch + 1,
            step=step + 1,
            loss=loss,
            lr=lr,
            images_per_s=images / seconds,
        )

    def evaluate(self) -> tuple[float, float]:
        """Validation loss and accuracy over all ranks."""
        self.ddp.eval()
        loss_sum, correct, count = 0.0, 0, 0
        with torch.no_grad(), self.precision.autocast():
            for x, y in self.val_loader:
                x, y = x.to(self.runtime.device), y.to(self.runtime.device)
                out = self.model(x).float()
                loss_sum += float(self.criterion(out, y)) * len(y)
                correct += int((out.argmax(dim=1) == y).sum())
                count += len(y)
        total, hits, n = training.all_reduce_sum(
            [loss_sum, correct, count], self.runtime.device
        )
        return total / max(n, 1), hits / max(n, 1)


def fit(
    args: argparse.Namespace,
    model: nn.Module,
    train_set: Dataset[Any],
    val_set: Dataset[Any],
    runtime: training.Runtime,
) -> Result:
    """Train ``model`` for ``args.epochs`` epochs, resuming if possible."""
    loop = _Loop(args, model, train_set, val_set, runtime)
    first = loop.resume()
    if first >= args.epochs:  # already trained: report the model as it is
        result = Result(first, float('nan'), *loop.evaluate())
    for epoch in range(first, args.epochs):
        began = time.perf_counter()
        train_loss = loop.train_epoch(epoch)
        seconds = time.perf_counter() - began
        val_loss, val_accuracy = loop.evaluate()
        if runtime.is_main:
            logger.info(
                'epoch %d/%d: train loss %.4f, val loss %.4f, val accuracy '
                '%.2f%%, %.1f s',
                epoch + 1,
                args.epochs,
                train_loss,
                val_loss,
                100 * val_accuracy,
                seconds,
            )
        loop.metrics.write(
            'epoch',
            epoch=epoch + 1,
            train_loss=train_loss,
            val_loss=val_loss,
            val_accuracy=val_accuracy,
            seconds=seconds,
        )
        loop.save(epoch)
        result = Result(epoch + 1, train_loss, val_loss, val_accuracy)
    if loop.kfac is not None:
        loop.kfac.remove()
    return result
