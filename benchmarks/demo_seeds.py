"""`make demo` over several seeds: SGD + K-FAC with the defaults against SGD.

Runs `examples.fashion_mnist` once per seed (one thread, no plot) and
prints the median test accuracy after every epoch of each optimizer, and
whether SGD + K-FAC with the library's defaults (`kfac-defaults`) is at or
above SGD alone after every epoch::

    python -m benchmarks.demo_seeds --seeds 0 1 2

Results: `benchmarks/results/demo_defaults.json` (per seed, per epoch).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch

from benchmarks.study.runner import git_commit
from examples import fashion_mnist
from examples.comparison import OPTIMIZERS

RESULTS = pathlib.Path(__file__).resolve().parent / 'results'


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the seeds; print and save the medians."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('--seeds', type=int, nargs='+', default=[0, 1, 2])
    p.add_argument(
        '--optimizers',
        nargs='+',
        default=['sgd', 'kfac-defaults', 'kfac'],
        choices=list(OPTIMIZERS),
    )
    p.add_argument('--out', type=pathlib.Path, default=None)
    args, demo_args = p.parse_known_args(argv)
    torch.set_num_threads(1)
    out = args.out or RESULTS / 'demo_defaults.json'
    document: dict[str, Any] = {
        'command': 'python -m benchmarks.demo_seeds '
        + ' '.join(argv if argv is not None else sys.argv[1:]),
        'commit': git_commit(),
        'threads': 1,
        'torch': torch.__version__,
        'machine': f'{platform.machine()}, {os.cpu_count()} CPUs',
        'load_average_start': os.getloadavg(),
        'started': time.strftime('%Y-%m-%d %H:%M:%S'),
        'seeds': {},
    }
    for seed in args.seeds:
        histories = fashion_mnist.main(
            [
                '--no-plot',
                '--no-progress',
                '--seed',
                str(seed),
                '--optimizers',
                *args.optimizers,
                *demo_args,
            ]
        )
        document['seeds'][str(seed)] = {
            name: {
                'accuracy': h.accuracy,
                'seconds': h.seconds,
                'loss': h.loss,
            }
            for name, h in histories.items()
        }
        out.write_text(json.dumps(document, indent=1))
    document['load_average_end'] = os.getloadavg()
    out.write_text(json.dumps(document, indent=1))
    print(report(document))
    return document


def report(document: dict[str, Any]) -> str:
    """Median test accuracy per epoch of each optimizer, and the check."""
    runs = list(document['seeds'].values())
    names = list(runs[0])
    epochs = len(runs[0][names[0]]['accuracy'])
    median = {
        name: [
            statistics.median(run[name]['accuracy'][e] for run in runs)
            for e in range(epochs)
        ]
        for name in names
    }
    seconds = {
        name: statistics.median(run[name]['seconds'][-1] for run in runs)
        for name in names
    }
    lines = [
        f'median over {len(runs)} seeds of test accuracy (%) after each epoch',
        '',
        '| optimizer | '
        + ' | '.join(f'epoch {e}' for e in range(1, epochs))
        + ' | training s (median) |',
        '| --- |' + ' --- |' * epochs,
    ]
    for name in names:
        lines.append(
            f'| {OPTIMIZERS[name]} | '
            + ' | '.join(f'{100 * a:.2f}' for a in median[name][1:])
            + f' | {seconds[name]:.0f} |'
        )
    if 'sgd' in median and 'kfac-defaults' in median:
        ok = all(
            k >= s
            for k, s in zip(median['kfac-defaults'][1:], median['sgd'][1:])
        )
        lines += [
            '',
            'SGD + K-FAC with the defaults at or above SGD after every '
            f'epoch: {"yes" if ok else "no"}',
        ]
    return '\n'.join(lines)


if __name__ == '__main__':
    main()
