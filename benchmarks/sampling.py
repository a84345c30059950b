"""Sampled positions (`position_sample`): step cost and steps to a target.

``python -m benchmarks.sampling`` measures, on two workloads, K-FAC (EIGEN,
``factor_update_steps=5``, ``inv_update_steps=50``) with every position
and with ``position_sample`` in :data:`SAMPLES`, against the optimizer
alone:

* ``cnn``: :class:`IssueCNN` (``Conv2d(1,16,5,padding=2)``-ReLU-MaxPool2-
  ``Conv2d(16,32,5,padding=2)``-ReLU-MaxPool2-``Linear(1568,128)``-ReLU-
  ``Linear(128,10)``) on Fashion-MNIST, batch 128, SGD (momentum 0.9, lr
  0.1, weight decay 5e-4), K-FAC damping 0.003, KL clip 1e-4; the score is
  the accuracy on the first 2000 test images every 20 steps, and the
  accuracy on all 10000 after one epoch (468 steps);
* ``gpt``: the GPT of :func:`benchmarks.ekfac.gpt` (``examples.gpt``:
  width 64, 2 blocks, 4 heads, context 64, tied head) on the corpus of
  ``examples/char_lm.py``, batch 32, AdamW; validation loss every 20 steps
  and after 200 steps.

**Cost**: the configurations step in interleaved rounds (one step each per
round) on the workload's batches for :data:`COST_STEPS` steps after a
warm-up, ``torch.set_num_threads(1)``; per configuration the median CPU
seconds of a factor-update step without decomposition (``f``), of a plain
step (``-``), the mean of every step (two full decomposition cycles), and
the ``factor_capture`` phase per factor-update step. CPU time of one
thread: the machine is shared, and another process holding the core does
not count. **Steps to target**: one seed per configuration (the scores'
trajectories, and the first evaluation at the targets of
``benchmarks.ekfac``: 0.88 and 1.9 nats). Writes
``benchmarks/results/sampling.json`` (``--out``); no test runs it.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import platform
import statistics
import time
from collections.abc import Iterator
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.ekfac import Workload
from benchmarks.ekfac import gpt
from benchmarks.ekfac import train
from examples.data import load_image_data
from kfac.preconditioner import KFACPreconditioner
from kfac.tracing import PhaseTimer

SAMPLES = (0.25, 0.5)
"""The `position_sample` values measured."""
COST_STEPS = 100
FACTOR_STEPS, INV_STEPS = 5, 50
TRAIN_STEPS = {'cnn': 468, 'gpt': 200}


class IssueCNN(nn.Module):
    """The CNN of the cost-levers issue (module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 5, padding=2)
        self.conv2 = nn.Conv2d(16, 32, 5, padding=2)
        self.fc1 = nn.Linear(32 * 7 * 7, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        out: torch.Tensor = self.fc2(F.relu(self.fc1(x.flatten(1))))
        return out


def cnn(seed: int = 0) -> Workload:
    """IssueCNN on Fashion-MNIST; `score` on 2000 test images, and the
    whole test set as `full_score` (an attribute of the returned object).
    """
    data = load_image_data(fallback=False)
    torch.manual_seed(seed)
    model = IssueCNN()
    optimizer = torch.optim.SGD(
        model.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4
    )
    generator = torch.Generator().manual_seed(seed)

    def batches() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        while True:
            order = torch.randperm(len(data.train_labels), generator=generator)
            for idx in order.split(128)[:-1]:
                yield data.train_images[idx], data.train_labels[idx]

    @torch.no_grad()
    def accuracy(count: int) -> float:
        images, labels = data.test_images[:count], data.test_labels[:count]
        model.eval()
        hits = sum(
            int((model(x).argmax(1) == y).sum())
            for x, y in zip(images.split(500), labels.split(500))
        )
        model.train()
        return hits / len(labels)

    workload = Workload(
        'cnn',
        model,
        optimizer,
        None,
        batches(),
        F.cross_entropy,
        lambda: accuracy(2000),
        lambda score: False,  # run the whole epoch
        {'damping': 0.003, 'kl_clip': 1e-4, 'kl_clip_rule': 'kl', 'lr': 0.1},
    )
    workload.full_score = lambda: accuracy(len(data.test_labels))  # type: ignore[attr-defined]  # this benchmark's extra score
    return workload


def _gpt() -> Workload:
    workload = gpt()
    workload.reached = lambda score: False  # run every step
    workload.full_score = workload.score  # type: ignore[attr-defined]  # the same held-out windows
    return workload


WORKLOADS = {'cnn': cnn, 'gpt': _gpt}
TARGETS = {'cnn': lambda s: s >= 0.88, 'gpt': lambda s: s <= 1.9}


def _configs() -> list[tuple[str, dict[str, Any] | None]]:
    configs: list[tuple[str, dict[str, Any] | None]] = [
        ('optimizer', None),
        ('eigen', {'inv_update_steps': INV_STEPS}),
    ]
    for sample in SAMPLES:
        configs.append(
            (
                f'eigen sample={sample}',
                {'inv_update_steps': INV_STEPS, 'position_sample': sample},
            )
        )
    return configs


def cost(name: str) -> dict[str, Any]:
    """Per configuration: CPU seconds of each kind of step, interleaved."""
    runs: list[
        tuple[str, Workload, KFACPreconditioner | None, dict[str, list[float]]]
    ] = []
    for label, options in _configs():
        workload = WORKLOADS[name]()
        precon = None
        if options is not None:
            precon = KFACPreconditioner(
                workload.model,
                factor_update_steps=FACTOR_STEPS,
                **workload.kfac,
                **options,
            )
            precon.timer = PhaseTimer()
        runs.append((label, workload, precon, {'f': [], '-': [], 'all': []}))
    for step in range(COST_STEPS + 1):
        for shift in range(len(runs)):  # each round starts one later
            label, workload, precon, times = runs[(step + shift) % len(runs)]
            x, y = next(workload.batches)
            began = time.process_time()
            workload.optimizer.zero_grad(set_to_none=True)
            workload.loss(workload.model(x), y).backward()
            if precon is not None:
                precon.step()
            workload.optimizer.step()
            seconds = time.process_time() - began
            if step == 0:
                if precon is not None and precon.timer is not None:
                    precon.timer.reset()
                continue  # warm-up
            times['all'].append(seconds)
            if step % INV_STEPS:
                kind = '-' if step % FACTOR_STEPS else 'f'
                times[kind].append(seconds)
    result = {}
    for label, _, precon, times in runs:
        entry: dict[str, Any] = {
            'mean_step_s': statistics.fmean(times['all']),
            'median_plain_step_s': statistics.median(
                times['-'] or times['all']
            ),
        }
        if precon is not None:
            factor_steps = COST_STEPS // FACTOR_STEPS
            entry['median_factor_step_s'] = statistics.median(times['f'])
            timer = precon.timer or PhaseTimer()
            entry['factor_capture_s_per_factor_step'] = (
                timer.seconds.get('factor_capture', 0.0) / factor_steps
            )
            precon.remove()
        result[label] = entry
    base = result['optimizer']['mean_step_s']
    for entry in result.values():
        entry['mean_step_x_optimizer'] = entry['mean_step_s'] / base
    return result


def to_target(name: str) -> dict[str, Any]:
    """Per configuration: the score trajectory over the workload's steps."""
    result = {}
    for label, options in _configs():
        workload = WORKLOADS[name]()
        if options is not None:
            options = {**options}
        run = train(workload, options, TRAIN_STEPS[name])
        final = workload.full_score()  # type: ignore[attr-defined]  # set above
        reached = next(
            (
                {'steps': step, 'cpu_s': cpu}
                for step, score, cpu, _ in run['scores']
                if TARGETS[name](score)
            ),
            None,
        )
        result[label] = {
            'final_full_score': final,
            'target_reached': reached,
            'cpu_s': run['cpu_s'],
            'scores': run['scores'],
        }
        print(name, label, f'{final:.4f}', reached, flush=True)
    return result


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Measure cost and steps to target; write JSON."""
    parser = argparse.ArgumentParser(prog='python -m benchmarks.sampling')
    parser.add_argument('--workloads', nargs='+', default=list(WORKLOADS))
    parser.add_argument('--no-train', action='store_true')
    parser.add_argument(
        '--out',
        type=pathlib.Path,
        default=pathlib.Path('benchmarks/results/sampling.json'),
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    results: dict[str, Any] = {
        'machine': {
            'processor': platform.processor() or platform.machine(),
            'torch': torch.__version__,
            'threads': torch.get_num_threads(),
        },
        'factor_update_steps': FACTOR_STEPS,
        'inv_update_steps': INV_STEPS,
        'cost': {},
        'to_target': {},
    }
    for name in args.workloads:
        results['cost'][name] = cost(name)
        print(name, json.dumps(results['cost'][name], indent=1), flush=True)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1))
    if not args.no_train:
        for name in args.workloads:
            results['to_target'][name] = to_target(name)
            args.out.write_text(json.dumps(results, indent=1))
    return results


if __name__ == '__main__':
    main()
