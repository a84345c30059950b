"""EIGEN against EKFAC, full ``eigh`` against a warm start: time to target.

``python -m benchmarks.ekfac`` trains two workloads with every combination
of ``compute_method`` (``eigen``, ``ekfac``), ``basis_refresh`` (``eigh``,
``qr``) and ``inv_update_steps`` (20, 100, 500), plus the optimizer alone,
and records the steps and seconds each needs to reach a fixed target:

* ``cnn``: ``examples.fashion_mnist.SmallCNN`` on Fashion-MNIST (batch 128,
  SGD with momentum 0.9, lr 0.1, weight decay 5e-4), test accuracy on the
  first 2000 test images every 20 steps, target 0.88;
* ``gpt``: ``examples.gpt.GPT`` (width 64, 2 blocks, 4 heads, context 64,
  head tied to the token embedding) on the King James Bible of
  ``examples/corpus`` (batch 32, AdamW lr 3e-3 with 50 warm-up steps),
  validation loss on 64 held-out windows every 20 steps, target 1.9 nats.

K-FAC: ``factor_update_steps=5``, the examples' damping and KL clip, the
library's other defaults. A run stops at its target or after ``--steps``.
Seconds are the process's CPU time in training steps (evaluation
excluded) with ``torch.set_num_threads(1)``: the machine is shared, and the
CPU time of one thread does not count the time other processes hold the
cores (wall time is recorded too). Writes ``benchmarks/results/ekfac.json``
(``--out``); no test runs it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import pathlib
import platform
import time
from collections.abc import Callable
from collections.abc import Iterator
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from examples.char_lm import CORPUS
from examples.char_lm import load_corpus
from examples.char_lm import windows
from examples.data import load_image_data
from examples.fashion_mnist import SmallCNN
from examples.gpt import GPT
from examples.gpt import GPTConfig
from kfac.preconditioner import KFACPreconditioner

__all__ = ['WORKLOADS', 'Workload', 'main', 'train']

METHODS = ('eigen', 'ekfac')
REFRESHES = ('eigh', 'qr')
INTERVALS = (20, 100, 500)
EVAL_EVERY = 20


@dataclasses.dataclass
class Workload:
    """A model, its data and optimizer, and how it is scored."""

    name: str
    model: nn.Module
    optimizer: torch.optim.Optimizer
    schedule: torch.optim.lr_scheduler.LRScheduler | None
    batches: Iterator[tuple[torch.Tensor, torch.Tensor]]
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    score: Callable[[], float]
    """The quality measured every `EVAL_EVERY` steps."""
    reached: Callable[[float], bool]
    """Whether a score reaches the target."""
    kfac: dict[str, Any]
    """The workload's K-FAC options."""


def cnn(seed: int = 0) -> Workload:
    """SmallCNN on Fashion-MNIST (see the module docstring)."""
    data = load_image_data(fallback=False)
    torch.manual_seed(seed)
    model = SmallCNN(data.image_shape, data.num_classes)
    optimizer = torch.optim.SGD(
        model.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4
    )
    generator = torch.Generator().manual_seed(seed)
    images, labels = data.test_images[:2000], data.test_labels[:2000]

    def batches() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        while True:
            order = torch.randperm(len(data.train_labels), generator=generator)
            for idx in order.split(128)[:-1]:
                yield data.train_images[idx], data.train_labels[idx]

    @torch.no_grad()
    def accuracy() -> float:
        model.eval()
        hits = sum(
            int((model(x).argmax(1) == y).sum())
            for x, y in zip(images.split(500), labels.split(500))
        )
        model.train()
        return hits / len(labels)

    options = {
        'damping': 0.003,
        'kl_clip': 1e-4,
        'kl_clip_rule': 'kl',
        'lr': 0.1,
    }
    return Workload(
        'cnn',
        model,
        optimizer,
        None,
        batches(),
        F.cross_entropy,
        accuracy,
        lambda score: score >= 0.88,
        options,
    )


def gpt(seed: int = 0) -> Workload:
    """A small GPT on the King James Bible (see the module docstring)."""
    corpus = load_corpus(CORPUS)
    torch.manual_seed(seed)
    model = GPT(GPTConfig(corpus.vocab, 64, 64, 2, 4))
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=3e-3, betas=(0.9, 0.99), weight_decay=0.1
    )
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min(1.0, (step + 1) / 50)
    )
    generator = torch.Generator().manual_seed(seed)
    held_out = windows(
        corpus.valid, 64, 64, torch.Generator().manual_seed(seed + 1)
    )

    def batches() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        while True:
            yield windows(corpus.train, 32, 64, generator)

    def token_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1), y.flatten())

    @torch.no_grad()
    def validation() -> float:
        model.eval()
        loss = float(token_loss(model(held_out[0]), held_out[1]))
        model.train()
        return loss

    options = {
        'damping': 0.01,
        'kl_clip': None,
        'lr': lambda _: float(optimizer.param_groups[0]['lr']),
        'loss_average': 'batch+sequence',
    }
    return Workload(
        'gpt',
        model,
        optimizer,
        schedule,
        batches(),
        token_loss,
        validation,
        lambda score: score <= 1.9,
        options,
    )


WORKLOADS: dict[str, Callable[[], Workload]] = {'cnn': cnn, 'gpt': gpt}


def train(
    workload: Workload,
    options: dict[str, Any] | None,
    steps: int,
) -> dict[str, Any]:
    """Train until the target or `steps`; K-FAC with `options` (None: the
    optimizer alone).
    """
    precon = None
    if options is not None:
        precon = KFACPreconditioner(
            workload.model,
            factor_update_steps=5,
            **workload.kfac,
            **options,
        )
    scores: list[tuple[int, float, float, float]] = []
    cpu = wall = 0.0
    reached = None
    for step in range(steps + 1):
        if step % EVAL_EVERY == 0 or step == steps:
            score = workload.score()
            scores.append((step, score, cpu, wall))
            if workload.reached(score):
                reached = {'steps': step, 'cpu_s': cpu, 'wall_s': wall}
                break
        if step == steps:
            break
        x, y = next(workload.batches)
        began, began_cpu = time.perf_counter(), time.process_time()
        workload.optimizer.zero_grad(set_to_none=True)
        workload.loss(workload.model(x), y).backward()
        if precon is not None:
            precon.step()
        workload.optimizer.step()
        if workload.schedule is not None:
            workload.schedule.step()
        cpu += time.process_time() - began_cpu
        wall += time.perf_counter() - began
    if precon is not None:
        precon.remove()
    return {
        'reached': reached,
        'final_score': scores[-1][1],
        'scores': scores,
        'cpu_s': cpu,
        'wall_s': wall,
        'finite': all(math.isfinite(s[1]) for s in scores),
    }


def _configs() -> list[tuple[str, dict[str, Any] | None]]:
    configs: list[tuple[str, dict[str, Any] | None]] = [('optimizer', None)]
    for interval in INTERVALS:
        for method in METHODS:
            for refresh in REFRESHES:
                configs.append(
                    (
                        f'{method} {refresh} inv={interval}',
                        {
                            'compute_method': method,
                            'basis_refresh': refresh,
                            'inv_update_steps': interval,
                        },
                    )
                )
    return configs


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run every configuration on the workloads asked for; write JSON."""
    parser = argparse.ArgumentParser(prog='python -m benchmarks.ekfac')
    parser.add_argument('--workloads', nargs='+', default=list(WORKLOADS))
    parser.add_argument('--steps', type=int, default=800)
    parser.add_argument('--only', nargs='*', default=None)
    parser.add_argument(
        '--out',
        type=pathlib.Path,
        default=pathlib.Path('benchmarks/results/ekfac.json'),
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    results: dict[str, Any] = {
        'machine': {
            'processor': platform.processor() or platform.machine(),
            'torch': torch.__version__,
            'threads': torch.get_num_threads(),
        },
        'steps_max': args.steps,
        'runs': {},
    }
    for name in args.workloads:
        for label, options in _configs():
            if args.only and label not in args.only:
                continue
            result = train(WORKLOADS[name](), options, args.steps)
            results['runs'][f'{name}: {label}'] = result
            print(
                name,
                label,
                result['reached'],
                f'{result["final_score"]:.4f}',
                flush=True,
            )
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(results, indent=1))
    return results


if __name__ == '__main__':
    main()
