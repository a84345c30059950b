"""The empirical against the Monte Carlo Fisher: time to target.

``python -m benchmarks.mc_fisher`` trains two workloads with K-FAC
(EIGEN, ``factor_update_steps=5``, ``inv_update_steps=20``) under
``fisher_type='empirical'`` and ``'mc'`` (``mc_samples=1``,
``sample_fisher(output)`` before each backward pass), one seed, and records
the steps and seconds each needs to reach a fixed target:

* ``cnn``: ``Conv2d(1,16,5,padding=2)``-ReLU-MaxPool2-
  ``Conv2d(16,32,5,padding=2)``-ReLU-MaxPool2-``Linear(1568,128)``-ReLU-
  ``Linear(128,10)`` on Fashion-MNIST (batch 128, SGD with momentum 0.9, lr
  0.1, weight decay 5e-4, damping 0.003, KL clip 1e-4), test accuracy on
  the first 2000 test images every 20 steps, target 0.88;
* ``gpt``: the small GPT of ``benchmarks.ekfac`` (``examples.gpt.GPT``,
  width 64, 2 blocks, on the King James Bible of ``examples/corpus``,
  AdamW), validation loss every 20 steps, target 1.9 nats.

Seconds are the process's CPU time in training steps (sampling included,
evaluation excluded) with ``torch.set_num_threads(1)``; wall time is
recorded too. Writes ``benchmarks/results/mc_fisher.json`` (``--out``);
no test runs it.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import platform
import time
from collections.abc import Iterator
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.ekfac import EVAL_EVERY
from benchmarks.ekfac import Workload
from benchmarks.ekfac import gpt
from examples.data import load_image_data
from kfac.preconditioner import KFACPreconditioner

__all__ = ['StudyCNN', 'main', 'train']

FISHER_TYPES = ('empirical', 'mc')


class StudyCNN(nn.Module):
    """The CNN of the time-to-target study (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 5, padding=2)
        self.conv2 = nn.Conv2d(16, 32, 5, padding=2)
        self.fc1 = nn.Linear(1568, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        out: torch.Tensor = self.fc2(F.relu(self.fc1(x.flatten(1))))
        return out


def cnn(seed: int = 0) -> Workload:
    """`StudyCNN` on Fashion-MNIST (see the module docstring)."""
    data = load_image_data(fallback=False)
    torch.manual_seed(seed)
    model = StudyCNN()
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

    return Workload(
        'cnn',
        model,
        optimizer,
        None,
        batches(),
        F.cross_entropy,
        accuracy,
        lambda score: score >= 0.88,
        {'damping': 0.003, 'kl_clip': 1e-4, 'kl_clip_rule': 'kl', 'lr': 0.1},
    )


WORKLOADS = {'cnn': cnn, 'gpt': gpt}


def train(workload: Workload, fisher_type: str, steps: int) -> dict[str, Any]:
    """Train until the target or `steps` with K-FAC and `fisher_type`."""
    precon = KFACPreconditioner(
        workload.model,
        factor_update_steps=5,
        inv_update_steps=20,
        fisher_type=fisher_type,
        **workload.kfac,
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
        output = workload.model(x)
        precon.sample_fisher(output)
        workload.loss(output, y).backward()
        precon.step()
        workload.optimizer.step()
        if workload.schedule is not None:
            workload.schedule.step()
        cpu += time.process_time() - began_cpu
        wall += time.perf_counter() - began
    precon.remove()
    return {
        'reached': reached,
        'final_score': scores[-1][1],
        'scores': scores,
        'cpu_s': cpu,
        'wall_s': wall,
        'steps_run': scores[-1][0],
        'cpu_s_per_step': cpu / max(scores[-1][0], 1),
        'finite': all(math.isfinite(s[1]) for s in scores),
    }


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run both Fisher types on the workloads asked for; write JSON."""
    parser = argparse.ArgumentParser(prog='python -m benchmarks.mc_fisher')
    parser.add_argument('--workloads', nargs='+', default=list(WORKLOADS))
    parser.add_argument('--steps', type=int, default=800)
    parser.add_argument(
        '--out',
        type=pathlib.Path,
        default=pathlib.Path('benchmarks/results/mc_fisher.json'),
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
        for fisher_type in FISHER_TYPES:
            result = train(WORKLOADS[name](), fisher_type, args.steps)
            results['runs'][f'{name}: {fisher_type}'] = result
            print(
                name,
                fisher_type,
                result['reached'],
                f'{result["final_score"]:.4f}',
                flush=True,
            )
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(results, indent=1))
    return results


if __name__ == '__main__':
    main()
