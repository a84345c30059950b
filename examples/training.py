"""What the example scripts share: processes, precision, K-FAC, state.

* :func:`setup_distributed`: join the process group that ``torchrun``
  describes in the environment (NCCL on GPUs, gloo on CPUs), or run as a
  single process; pick the device.
* :class:`Precision`: ``torch.amp`` autocast, with a ``GradScaler`` for
  float16, and :func:`backward_and_step`, the order of one mixed-precision
  K-FAC step.
* :func:`add_kfac_args` and :func:`build_kfac`: K-FAC's command-line
  options, and the preconditioner plus a
  :class:`~kfac.scheduler.LambdaParamScheduler` decaying the damping and
  growing the update intervals at given epochs.
* :func:`save_checkpoint` / :func:`load_checkpoint` and
  :class:`MetricsLog`.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import os
import pathlib
import time
from collections.abc import Callable
from collections.abc import Iterator
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from kfac.layers.curvature import method_config
from kfac.preconditioner import KFACPreconditioner
from kfac.scheduler import LambdaParamScheduler

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Runtime:
    """This process's place in the run."""

    rank: int
    world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        """Rank 0: the one that logs and writes files."""
        return self.rank == 0


def setup_distributed(device: str | None = None) -> Runtime:
    """Join the process group when launched by ``torchrun``; pick a device.

    ``device`` (``'cpu'``, ``'cuda'``) overrides the default, which is
    ``cuda:LOCAL_RANK`` when CUDA is available and the CPU otherwise. A
    process group that already exists (as in the tests) is used as it is.
    """
    use_cuda = (
        torch.cuda.is_available() if device is None else (device == 'cuda')
    )
    if 'WORLD_SIZE' in os.environ and not dist.is_initialized():
        dist.init_process_group('nccl' if use_cuda else 'gloo')
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    dev = torch.device('cpu')
    if use_cuda:
        dev = torch.device('cuda', int(os.environ.get('LOCAL_RANK', 0)))
        torch.cuda.set_device(dev)
    return Runtime(rank=rank, world_size=world, device=dev)


def wrap_ddp(model: nn.Module, runtime: Runtime) -> nn.Module:
    """``model`` in ``DistributedDataParallel`` when a group exists."""
    if not dist.is_initialized():
        return model
    ids = [runtime.device.index] if runtime.device.type == 'cuda' else None
    return nn.parallel.DistributedDataParallel(model, device_ids=ids)


def all_reduce_sum(
    values: Sequence[float], device: torch.device
) -> list[float]:
    """Sum ``values`` over all ranks (every rank must call it)."""
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(tensor)
    return [float(v) for v in tensor.tolist()]


# Mixed precision -----------------------------------------------------------


@dataclasses.dataclass
class Precision:
    """Autocast and loss scaling of one run.

    Args:
        device: where the model runs.
        amp: use ``torch.amp`` autocast.
        dtype: ``'float16'`` or ``'bfloat16'``; default float16 on CUDA
            and bfloat16 on the CPU. Float16 gets a ``GradScaler``.

    """

    device: torch.device
    amp: bool = False
    dtype: str | None = None
    scaler: torch.amp.GradScaler | None = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        if self.dtype is None:
            self.dtype = (
                'float16' if self.device.type == 'cuda' else 'bfloat16'
            )
        if self.dtype not in ('float16', 'bfloat16'):
            raise ValueError(
                f'amp dtype must be float16 or bfloat16; got {self.dtype!r}',
            )
        self.scaler = None
        if self.amp and self.dtype == 'float16':
            self.scaler = torch.amp.GradScaler(self.device.type)

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """The forward pass's autocast context (a no-op without amp)."""
        if not self.amp:
            return contextlib.nullcontext()
        return torch.autocast(
            self.device.type, dtype=getattr(torch, str(self.dtype))
        )


def backward_and_step(
    loss: torch.Tensor,
    optimizer: torch.optim.Optimizer,
    preconditioner: KFACPreconditioner | None,
    precision: Precision,
) -> None:
    """Backward pass, K-FAC, optimizer step; with loss scaling if any.

    The gradients are unscaled *before* ``preconditioner.step()``, so KL
    clipping sees their true size; the preconditioner divides the scale
    out of the output gradients it captured (it holds the scaler).
    """
    scaler = precision.scaler
    if scaler is None:
        loss.backward()
    else:
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
    if preconditioner is not None:
        preconditioner.step()
    if scaler is None:
        optimizer.step()
    else:
        scaler.step(optimizer)  # skipped when a gradient is inf or NaN
        scaler.update()


# K-FAC ---------------------------------------------------------------------


def add_kfac_args(
    parser: argparse.ArgumentParser,
    *,
    factor_update_steps: int = 10,
    inv_update_steps: int = 100,
    damping: float = 0.003,
    kl_clip: float = 0.001,
    relative_clip: float = 0.0,
) -> None:
    """K-FAC's options, with the given defaults."""
    g = parser.add_argument_group('K-FAC')
    g.add_argument('--no-kfac', action='store_true', help='plain optimizer')
    g.add_argument(
        '--kfac-factor-update-steps', type=int, default=factor_update_steps
    )
    g.add_argument(
        '--kfac-inv-update-steps', type=int, default=inv_update_steps
    )
    g.add_argument('--kfac-damping', type=float, default=damping)
    g.add_argument('--kfac-factor-decay', type=float, default=0.95)
    g.add_argument(
        '--kfac-kl-clip', type=float, default=kl_clip, help='0: no clip'
    )
    g.add_argument(
        '--kfac-relative-clip',
        type=float,
        default=relative_clip,
        help='cap on the preconditioned to raw gradient norm ratio (the '
        'step keeps scaling with the learning rate); 0: no cap',
    )
    g.add_argument(
        '--kfac-damping-decay-epochs',
        type=int,
        nargs='*',
        default=[],
        help='multiply the damping by --kfac-damping-decay at these epochs',
    )
    g.add_argument('--kfac-damping-decay', type=float, default=0.5)
    g.add_argument(
        '--kfac-interval-growth-epochs',
        type=int,
        nargs='*',
        default=[],
        help='multiply both update intervals by --kfac-interval-growth at '
        'these epochs',
    )
    g.add_argument('--kfac-interval-growth', type=float, default=2.0)
    g.add_argument(
        '--kfac-strategy',
        default='comm_opt',
        help='grad_worker_fraction: comm_opt, hybrid_opt, mem_opt or a float',
    )
    g.add_argument('--kfac-skip-layers', nargs='*', default=[], help='regexes')
    g.add_argument(
        '--kfac-compute-method',
        choices=['eigen', 'inverse', 'ekfac'],
        default='eigen',
    )
    g.add_argument(
        '--kfac-basis-refresh',
        choices=['eigh', 'qr'],
        default='eigh',
        help='qr: warm-started eigenbases (eigen and ekfac)',
    )


def milestone_lambda(
    epochs: Sequence[int], factor: float, steps_per_epoch: int
) -> Callable[[int], float]:
    """``step -> factor ** (number of milestones reached)``."""
    boundaries = sorted(e * steps_per_epoch for e in epochs)

    def schedule(step: int) -> float:
        return float(factor ** sum(step >= b for b in boundaries))

    return schedule


def build_kfac(
    model: nn.Module,
    args: argparse.Namespace,
    optimizer: torch.optim.Optimizer,
    precision: Precision,
    steps_per_epoch: int,
) -> tuple[KFACPreconditioner | None, LambdaParamScheduler | None]:
    """The preconditioner and its schedule (None, None with --no-kfac).

    K-FAC reads the learning rate from the optimizer (`optimizer=`), so
    it follows the optimizer's schedule.
    """
    if args.no_kfac:
        return None, None
    strategy: str | float = args.kfac_strategy
    with contextlib.suppress(ValueError):
        strategy = float(strategy)
    preconditioner = KFACPreconditioner(
        model,
        factor_update_steps=args.kfac_factor_update_steps,
        inv_update_steps=args.kfac_inv_update_steps,
        damping=args.kfac_damping,
        factor_decay=args.kfac_factor_decay,
        kl_clip=args.kfac_kl_clip or None,
        relative_clip=args.kfac_relative_clip or None,
        optimizer=optimizer,
        grad_worker_fraction=strategy,
        grad_scaler=precision.scaler,
        skip_layers=args.kfac_skip_layers,
        compute_method=method_config(
            args.kfac_compute_method,
            basis_refresh=(
                None
                if args.kfac_compute_method == 'inverse'
                else args.kfac_basis_refresh
            ),
        ),
    )
    growth = milestone_lambda(
        args.kfac_interval_growth_epochs,
        args.kfac_interval_growth,
        steps_per_epoch,
    )
    scheduler = LambdaParamScheduler(
        preconditioner,
        damping_lambda=milestone_lambda(
            args.kfac_damping_decay_epochs,
            args.kfac_damping_decay,
            steps_per_epoch,
        ),
        factor_update_steps_lambda=growth,
        inv_update_steps_lambda=growth,
    )
    return preconditioner, scheduler


# State and logs ------------------------------------------------------------


def save_checkpoint(path: pathlib.Path, state: dict[str, Any]) -> None:
    """Write ``state`` to ``path`` atomically (call on one rank only)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + '.partial')
    torch.save(state, partial)
    os.replace(partial, path)


def load_checkpoint(
    path: pathlib.Path, device: torch.device
) -> dict[str, Any] | None:
    """The checkpoint at ``path`` (tensors on ``device``), or None."""
    if not path.is_file():
        return None
    state: dict[str, Any] = torch.load(
        path, map_location=device, weights_only=True
    )
    return state


class MetricsLog:
    """One JSON object per line in ``path`` (rank 0 only), and the log.

    Each record gets ``time``, seconds since the log was created.
    """

    def __init__(self, path: pathlib.Path | None, runtime: Runtime) -> None:
        self.path = path if runtime.is_main else None
        self.began = time.perf_counter()
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, kind: str, **values: float | int | str) -> None:
        """Record ``values`` under ``kind`` (e.g. ``'train'``, ``'eval'``)."""
        record = {
            'kind': kind,
            'time': round(time.perf_counter() - self.began, 3),
            **values,
        }
        if self.path is not None:
            with self.path.open('a') as f:
                f.write(json.dumps(record) + '\n')


def batches(
    n: int, batch_size: int, generator: torch.Generator
) -> Iterator[torch.Tensor]:
    """Indices of a random permutation of ``range(n)``, full batches only."""
    order = torch.randperm(n, generator=generator)
    for start in range(0, n - batch_size + 1, batch_size):
        yield order[start : start + batch_size]
