"""CPU seconds per step: an optimizer alone and with K-FAC configurations.

One study task, the optimizer alone and with each K-FAC configuration
named (the study's names, `variants.NAMES`; by default `kfac` and
`defaults`: the defaults under EIGEN and under INVERSE), interleaved in
one process (one thread), so that load on a shared machine falls on all of
them alike::

    python -m benchmarks.study.step_cost --task gpt --optimizer adamw \
        --lr 0.0015
    python -m benchmarks.study.step_cost --task cnn --optimizer sgd \
        --lr 0.04 --kfac kfac rank64 blocks512 sample0.25

Each configuration trains from the same weights on the same batches for
`--steps` steps (which include the decompositions of every 100th step),
`--repeats` times in turn; the medians and their ratios to the optimizer
alone are printed.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch

from benchmarks.study import runner
from benchmarks.study import tasks
from benchmarks.study import variants
from kfac.preconditioner import KFACPreconditioner

KFAC = ('kfac', variants.DEFAULTS)
"""The configurations measured unless `--kfac` names others."""


def cost(
    task: tasks.Task,
    optimizer: str,
    lr: float,
    settings: dict[str, Any] | None,
    steps: int,
) -> float:
    """Mean CPU milliseconds per step of `steps` steps (seed 0), with
    K-FAC's keyword arguments `settings` (None: the optimizer alone).
    """
    model = task.build(0)
    optimizers = runner.make_optimizers(optimizer, model, lr, task)
    precon = (
        None
        if settings is None
        else KFACPreconditioner(
            model, optimizer=optimizers, **variants.keywords(settings)
        )
    )
    batches = task.batches(0)
    cpu = 0.0
    for _ in range(steps):
        batch = next(batches)
        start = time.process_time()
        runner.train_step(task, model, optimizers, precon, batch)
        cpu += time.process_time() - start
    return 1000 * cpu / steps


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument(
        '--task', required=True, choices=['autoencoder', 'cnn', 'gpt']
    )
    parser.add_argument(
        '--optimizer', required=True, choices=runner.OPTIMIZERS
    )
    parser.add_argument('--lr', type=float, required=True)
    parser.add_argument(
        '--kfac', nargs='+', default=list(KFAC), choices=variants.NAMES
    )
    parser.add_argument('--steps', type=int, default=300)
    parser.add_argument('--repeats', type=int, default=3)
    args = parser.parse_args(argv)
    for name in args.kfac:
        refused = variants.refusal(args.task, name)
        if refused is not None:
            parser.error(refused)
    try:
        runner.require_optimizer(args.optimizer)
    except RuntimeError as err:
        parser.error(f'--optimizer {args.optimizer}: {err}')
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, list[float]]:
    """Measure and print; the per-repeat figures by configuration."""
    args = parse_args(argv)
    torch.set_num_threads(1)
    task = tasks.load(args.task)
    labels: dict[str, dict[str, Any] | None] = {
        f'{args.optimizer} alone': None
    }
    labels.update({f'+ {n}': variants.settings(n) for n in args.kfac})
    results: dict[str, list[float]] = {label: [] for label in labels}
    for _ in range(args.repeats):
        for label, settings in labels.items():
            results[label].append(
                cost(task, args.optimizer, args.lr, settings, args.steps)
            )
    base = statistics.median(next(iter(results.values())))
    for label, values in results.items():
        median = statistics.median(values)
        runs = ', '.join(f'{v:.1f}' for v in values)
        print(
            f'{label}: median {median:.1f} ms/step ({runs}), '
            f'{median / base:.2f}x'
        )
    return results


if __name__ == '__main__':
    main()
