r"""Run (part of) the study and add its runs to a JSON file.

    # the baselines' learning-rate grids, seed 0
    python -m benchmarks.study --task cnn --optimizers sgd adamw muon --seeds 0
    # K-FAC variants over a base optimizer at chosen learning rates
    python -m benchmarks.study --task cnn --optimizers sgd --lrs 0.02 \\
        --kfac kfac ekfac --seeds 0 1 2
    # the table and plot of what the file holds, nothing run
    python -m benchmarks.study --task cnn --report
    # SOAP's and Kron's grids beside Muon at one rate with K-FAC over it
    python -m benchmarks.study --task gpt --optimizers soap kron muon \\
        --lr-of muon=0.005 --kfac defaults --kfac-over muon --baselines
    # warm-up and cosine decay (runs go to study_gpt_cosine.json)
    python -m benchmarks.study --task gpt --schedule cosine ...

Runs already in the file (same label and seed) are skipped, so a study
can be built up over several invocations; within one invocation the runs
go seed by seed, every configuration of a seed back to back.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch

from benchmarks.study import analysis
from benchmarks.study import runner
from benchmarks.study import tasks
from benchmarks.study import variants

RESULTS = pathlib.Path(__file__).parents[1] / 'results'

GRIDS: dict[str, dict[str, list[float]]] = {
    'cnn': {
        'sgd': [0.01, 0.02, 0.04, 0.08],
        'adamw': [0.0005, 0.001, 0.002, 0.004],
        # (extended downwards: the best was at the edge)
        'muon': [0.0005, 0.001, 0.002, 0.004, 0.008],
    },
    'gpt': {
        'sgd': [0.05, 0.1, 0.2, 0.4],
        # (extended downwards: the best was at the edge)
        'adamw': [0.00075, 0.0015, 0.003, 0.006, 0.012],
        'muon': [0.0025, 0.005, 0.01, 0.02],
    },
    'autoencoder': {
        # (extended upwards while the best was at the edge)
        'sgd': [0.005 * 2**k for k in range(10)],  # up to 2.56
        'adamw': [0.00025 * 2**k for k in range(6)],  # up to 0.008
        'muon': [0.00025 * 2**k for k in range(6)],
    },
}
"""The learning rates of each optimizer, a factor of 2 apart."""

# SOAP's and PSGD Kron's grids, planned before any run: SOAP about its
# authors' 0.003, Kron about AdamW's best rate and half of it (its
# authors: "adam-like settings ... maybe a slightly lower learning rate").
GRIDS['cnn'].update(
    # (planned 0.0005 to 0.004 and 0.00025 to 0.002; extended downwards,
    # a rate at a time, while seed 0 or 1 put the best at the lower edge)
    soap=[0.00025, 0.0005, 0.001, 0.002, 0.004],
    kron=[0.0000625, 0.000125, 0.00025, 0.0005, 0.001, 0.002],
)
GRIDS['gpt'].update(
    soap=[0.0015, 0.003, 0.006, 0.012],
    # (planned 0.00075 to 0.006; extended downwards when the best was at
    # the edge, and 0.006 left unrun for lack of time: 0.0015 and 0.003
    # had ended worse than 0.00075)
    kron=[0.000375, 0.00075, 0.0015, 0.003],
)
GRIDS['autoencoder'].update(
    soap=[0.0005, 0.001, 0.002, 0.004],
    # (planned 0.0005 to 0.004; extended downwards when the best was at
    # the edge after seed 1)
    kron=[0.00025, 0.0005, 0.001, 0.002, 0.004],
)

GRID_FILES = {'soap': 'soap_kron', 'kron': 'soap_kron'}
"""The optimizers whose grids live in `study_TASK_NAME.json`, by NAME
(the others' in `study_TASK.json`)."""

SEEDS_RUN: dict[tuple[str, str], int] = {}
"""The grids committed with fewer than the study's 3 seeds, and how many
they ran (docs/study.md says so beside their tables); a grid that is not
named here and has runs holds 3 seeds at every point."""


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--task', required=True, choices=sorted(GRIDS))
    parser.add_argument(
        '--optimizers',
        nargs='+',
        default=list(runner.OPTIMIZERS),
        choices=runner.OPTIMIZERS,
    )
    parser.add_argument(
        '--lrs', nargs='+', type=float, help="default: the optimizer's grid"
    )
    parser.add_argument(
        '--lr-of',
        nargs='+',
        default=[],
        metavar='OPTIMIZER=LR[,LR...]',
        help="an optimizer's learning rates instead of its grid",
    )
    parser.add_argument(
        '--schedule',
        choices=runner.SCHEDULES,
        help='linear warm-up over 5%% of the steps, then cosine decay to '
        'zero (default: a constant rate)',
    )
    parser.add_argument(
        '--kfac',
        nargs='+',
        choices=variants.NAMES,
        help='K-FAC variants; none: the optimizer alone',
    )
    parser.add_argument(
        '--kfac-over',
        nargs='+',
        choices=runner.OPTIMIZERS,
        help='the optimizers K-FAC runs over (default: every one named)',
    )
    parser.add_argument(
        '--baselines',
        action='store_true',
        help='with --kfac: the optimizer alone too, interleaved',
    )
    parser.add_argument('--seeds', nargs='+', type=int, default=[0, 1, 2])
    parser.add_argument('--threads', type=int, default=1)
    parser.add_argument(
        '--device',
        default='cpu',
        help="where to train: 'cpu' (the study's figures) or a GPU "
        "('cuda', 'cuda:1'); evaluation runs there too",
    )
    parser.add_argument(
        '--out',
        type=pathlib.Path,
        help='default: benchmarks/results/study_TASK.json',
    )
    parser.add_argument(
        '--no-plot',
        action='store_true',
        help='print the tables only (no matplotlib needed)',
    )
    parser.add_argument(
        '--report',
        action='store_true',
        help='print the table and plot; run nothing',
    )
    args = parser.parse_args(argv)
    try:
        device = torch.device(args.device)
    except RuntimeError as err:
        parser.error(f'--device {args.device!r}: {err}')
    if device.type not in ('cpu', 'cuda'):
        parser.error(f"--device {args.device!r}: 'cpu' or a CUDA device")
    if device.type == 'cuda' and (
        not torch.cuda.is_available()
        or (device.index or 0) >= torch.cuda.device_count()
    ):
        parser.error(f'--device {args.device!r}: this torch sees no such GPU')
    try:
        args.lr_of = learning_rates(args.lr_of, args.optimizers)
    except ValueError as err:
        parser.error(f'--lr-of: {err}')
    for variant in args.kfac or ():
        refused = variants.refusal(args.task, variant)
        if refused is not None:
            parser.error(refused)
    for optimizer in () if args.report else args.optimizers:
        try:
            runner.require_optimizer(optimizer)
        except RuntimeError as err:
            parser.error(f'--optimizers {optimizer}: {err}')
    return args


def learning_rates(
    given: Sequence[str], optimizers: Sequence[str]
) -> dict[str, list[float]]:
    """`OPTIMIZER=LR[,LR...]` items as a mapping.

    Raises:
        ValueError: an item that is not of that form, or names an optimizer
            not in `optimizers`.
    """
    out = {}
    for item in given:
        name, _, rates = item.partition('=')
        if name not in optimizers or not rates:
            raise ValueError(
                f'{item!r}: expected OPTIMIZER=LR[,LR...] with an '
                f'optimizer of --optimizers {list(optimizers)}'
            )
        out[name] = [float(rate) for rate in rates.split(',')]
    return out


def default_out(
    task: str, device: str, schedule: str | None = None
) -> pathlib.Path:
    """`benchmarks/results/study_TASK.json` for the CPU (the study's
    figures); `study_TASK_cuda.json` for a GPU, so that its runs never mix
    with the CPU's; `study_TASK_SCHEDULE.json` (`study_gpt_cosine.json`)
    for a schedule.
    """
    kind = torch.device(device).type
    suffix = '' if kind == 'cpu' else f'_{kind}'
    if schedule is not None:
        suffix = f'_{schedule}{suffix}'
    return RESULTS / f'study_{task}{suffix}.json'


def configs(args: argparse.Namespace) -> list[runner.Config]:
    """The configurations the command line asks for."""
    out = []
    for name in args.optimizers:
        rates = args.lr_of.get(name) or args.lrs or GRIDS[args.task][name]
        over = args.kfac_over is None or name in args.kfac_over
        for lr in rates:
            if not args.kfac or not over or args.baselines:
                out.append(runner.Config(name, lr, schedule=args.schedule))
            for variant in (args.kfac or ()) if over else ():
                settings = variants.settings(variant)
                out.append(
                    runner.kfac_config(
                        name, lr, variant, settings, args.schedule
                    )
                )
    return out


def _load(path: pathlib.Path) -> dict[str, Any]:
    if path.exists():
        loaded: dict[str, Any] = json.loads(path.read_text())
        return loaded
    return {'sessions': [], 'runs': []}


def plot(
    document: dict[str, Any], summary: dict[str, Any], path: pathlib.Path
) -> None:
    """Metric against training CPU seconds: the median seed of the best
    configuration of each optimizer alone and with each K-FAC variant.
    """
    import matplotlib

    matplotlib.use('Agg')
    import matplotlib.pyplot as plt

    higher = document['higher_is_better']
    sign = 1.0 if higher else -1.0
    best: dict[str, dict[str, Any]] = {}
    for row in summary['rows']:
        key = (
            row['optimizer']
            if row['kfac'] is None
            else f'{row["optimizer"]}+{row["kfac"]}'
        )
        if (
            key not in best
            or sign * row['final_median'] > sign * best[key]['final_median']
        ):
            best[key] = row
    grouped = analysis.groups(document['runs'])
    figure, axis = plt.subplots(figsize=(8, 5))
    for _key, row in sorted(best.items()):
        rows = sorted(
            grouped[row['label']],
            key=lambda r: sign * analysis._final(r, higher),
        )
        median = rows[len(rows) // 2]
        steps = [e for e in median['evals'] if e[0] > 0]
        axis.plot(
            [e[3] for e in steps],
            [e[2] for e in steps],
            label=row['label'],
            linestyle='-' if row['kfac'] else '--',
        )
    axis.axhline(summary['target'], color='grey', linewidth=0.8)
    axis.set_xlabel('training CPU seconds (evaluation excluded)')
    axis.set_ylabel(document['metric'])
    if not higher:
        axis.set_yscale('log')
    axis.set_title(
        f'{document["task"]}: best learning rate of each configuration, '
        'median seed'
    )
    axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def plot_defaults(
    document: dict[str, Any],
    checked: Sequence[dict[str, Any]],
    path: pathlib.Path,
) -> None:
    """One panel per optimizer: every seed of the optimizer alone at its
    best learning rate (dashed) and with K-FAC's defaults (solid), the
    metric against training CPU seconds.
    """
    import matplotlib

    matplotlib.use('Agg')
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(
        1, len(checked), figsize=(4 * len(checked), 4), squeeze=False
    )
    for axis, row in zip(axes[0], checked):
        for kfac, style in ((None, '--'), (variants.DEFAULTS, '-')):
            runs = [
                r
                for r in document['runs']
                if r['optimizer'] == row['optimizer']
                and r['kfac'] == kfac
                and r['lr'] == row['lr']
            ]
            for i, run in enumerate(runs):
                steps = [e for e in run['evals'] if e[0] > 0]
                axis.plot(
                    [e[3] for e in steps],
                    [e[2] for e in steps],
                    linestyle=style,
                    color='C1' if kfac else 'C0',
                    label=(
                        None
                        if i
                        else ('+ K-FAC defaults' if kfac else 'alone')
                    ),
                )
        axis.axhline(row['alone_median'], color='grey', linewidth=0.8)
        axis.set_title(f'{row["optimizer"]}, lr {row["lr"]:g}', fontsize=9)
        axis.set_xlabel('training CPU seconds')
        if not document['higher_is_better']:
            axis.set_yscale('log')
        axis.legend(fontsize=7)
    axes[0][0].set_ylabel(document['metric'])
    figure.suptitle(
        f'{document["task"]}: each optimizer at its best learning rate, '
        'alone and with the defaults (every seed)',
        fontsize=10,
    )
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run what is missing, then print the table and save the plot."""
    args = parse_args(argv)
    out = args.out or default_out(args.task, args.device, args.schedule)
    document = _load(out)
    kinds = {
        torch.device(r.get('device', 'cpu')).type for r in document['runs']
    }
    if not args.report and kinds - {torch.device(args.device).type}:
        raise SystemExit(
            f'{out} holds runs on {sorted(kinds)}; runs on {args.device} '
            'go to a file of their own (--out)'
        )
    if not args.report:
        torch.set_num_threads(args.threads)
        task = tasks.load(args.task)
        document.update(
            task=task.name,
            metric=task.metric,
            higher_is_better=task.higher_is_better,
            steps=task.steps,
        )
        done = {(r['label'], r['seed']) for r in document['runs']}
        document['sessions'].append(
            {
                'command': 'python -m benchmarks.study '
                + ' '.join(argv if argv is not None else sys.argv[1:]),
                'commit': runner.git_commit(),
                'threads': args.threads,
                'device': args.device,
                'gpu': torch.cuda.get_device_name(args.device)
                if torch.device(args.device).type == 'cuda'
                else None,
                'torch': torch.__version__,
                'machine': f'{platform.machine()}, {os.cpu_count()} CPUs',
                'load_average_start': os.getloadavg(),
                'started': time.strftime('%Y-%m-%d %H:%M:%S'),
            }
        )
        for seed in args.seeds:
            for config in configs(args):
                if (config.label, seed) in done:
                    continue
                record = runner.run(task, config, seed, args.device)
                record['session'] = len(document['sessions']) - 1
                document['runs'].append(record)
                out.write_text(json.dumps(document, indent=1))
                print(
                    f'{config.label} seed {seed}: '
                    f'final {record["final"]:.4g}, {record["seconds"]:.1f} s, '
                    f'{1000 * record["seconds_per_step"]:.1f} ms/step',
                    flush=True,
                )
        document['sessions'][-1]['load_average_end'] = os.getloadavg()
        out.write_text(json.dumps(document, indent=1))
    summary = analysis.summarise(
        document['runs'], document['higher_is_better']
    )
    print(analysis.markdown(summary, document['metric']))
    print()
    own = analysis.per_optimizer(
        document['runs'], document['higher_is_better']
    )
    print(analysis.markdown_own(own, document['metric']))
    checked = analysis.defaults_check(
        document['runs'], document['higher_is_better'], variants.DEFAULTS
    )
    if checked:
        print()
        print(analysis.markdown_defaults(checked, document['metric']))
        if not args.no_plot:
            plot_defaults(
                document,
                checked,
                out.with_name(f'{out.stem}_defaults.png'),
            )
    if not args.no_plot:
        plot(document, summary, out.with_suffix('.png'))
    return summary


if __name__ == '__main__':
    main()
