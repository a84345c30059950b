"""The small hyperparameter search behind the demo's defaults.

Runs ``examples.fashion_mnist`` once per setting, on the demo's own budget
unless told otherwise, and prints one line per run: the test accuracy after
each epoch and the training time. Extra arguments go to every run::

    python -m scripts.tune_demo sgd            # the SGD learning rates
    python -m scripts.tune_demo kfac --epochs 3 --train-size 30000

``examples/README.md`` records what this printed and how the defaults were
chosen from it.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from examples import fashion_mnist

#: Settings tried per optimizer: each a list of extra command-line options.
GRID: dict[str, list[list[str]]] = {
    'sgd': [['--sgd-lr', str(lr)] for lr in (0.03, 0.1, 0.3)],
    'adam': [['--adam-lr', str(lr)] for lr in (0.001, 0.003, 0.01)],
    'adam-round2': [['--adam-lr', '0.03']],  # 0.01 was the best of three
    # damping and KL clip, with statistics every 5 steps and
    # decompositions every 20
    'kfac': [
        [
            '--kfac-factor-update-steps',
            '5',
            '--kfac-inv-update-steps',
            '20',
            '--kfac-damping',
            damping,
            '--kfac-kl-clip',
            kl_clip,
        ]
        for damping, kl_clip in (
            ('0.003', '0.001'),
            ('0.003', '0.01'),
            ('0.01', '0.01'),
            ('0.03', '0.01'),
            ('0.003', '0'),
        )
    ],
    # round two, around the best of round one (damping 0.003, KL clip 0.001)
    'kfac-round2': [
        [
            '--kfac-factor-update-steps',
            factor,
            '--kfac-inv-update-steps',
            inv,
            '--kfac-damping',
            damping,
            '--kfac-kl-clip',
            kl_clip,
        ]
        for factor, inv, damping, kl_clip in (
            ('5', '20', '0.001', '0.001'),
            ('5', '20', '0.01', '0.001'),
            ('5', '20', '0.003', '0.0003'),
            ('1', '10', '0.003', '0.001'),
        )
    ],
    # round three: smaller KL clips did better in round two
    'kfac-round3': [
        [
            '--kfac-factor-update-steps',
            '5',
            '--kfac-inv-update-steps',
            '20',
            '--kfac-damping',
            damping,
            '--kfac-kl-clip',
            kl_clip,
        ]
        for damping, kl_clip in (('0.003', '0.0001'), ('0.01', '0.0003'))
    ],
    # round four: the smallest KL clip (0.0001) was still the best
    'kfac-round4': [
        [
            '--kfac-factor-update-steps',
            '5',
            '--kfac-inv-update-steps',
            '20',
            '--kfac-damping',
            '0.003',
            '--kfac-kl-clip',
            '0.00003',
        ]
    ],
    'kfac-lr': [['--kfac-lr', str(lr)] for lr in (0.03, 0.1, 0.3)],
    'kfac-intervals': [
        [
            '--kfac-factor-update-steps',
            str(factor),
            '--kfac-inv-update-steps',
            str(inv),
        ]
        for factor, inv in ((1, 10), (5, 20), (10, 100))
    ],
}


def main(argv: Sequence[str] | None = None) -> None:
    """Run the grid named on the command line."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('grid', choices=list(GRID))
    args, extra = p.parse_known_args(argv)
    optimizer = args.grid.split('-')[0]
    logging.basicConfig(level=logging.WARNING)
    for setting in GRID[args.grid]:
        argv_run = [
            '--optimizers',
            optimizer,
            '--no-plot',
            '--no-progress',
            *extra,
            *setting,
        ]
        (history,) = fashion_mnist.main(argv_run).values()
        accuracies = ' '.join(f'{a:.4f}' for a in history.accuracy[1:])
        print(
            f'{optimizer} {" ".join(setting + extra)}: {accuracies} '
            f'({history.seconds[-1]:.0f} s)',
            flush=True,
        )


if __name__ == '__main__':
    main(sys.argv[1:])
