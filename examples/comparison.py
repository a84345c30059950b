"""The demo's results: per-epoch history, tables and the plot.

:class:`History` holds one optimizer's test accuracy, training loss and
training wall time after every epoch; :func:`format_history` and
:func:`format_summary` make the tables ``examples.fashion_mnist`` prints,
and :func:`plot` the PNG through :func:`plot_curves`, which the character
language model (``examples.char_lm``) uses too (matplotlib, Agg backend,
imported only there).
"""

from __future__ import annotations

import dataclasses
import math
import pathlib
from collections.abc import Sequence

#: The optimizers the demo compares, by command-line name.
OPTIMIZERS = {
    'sgd': 'SGD + momentum',
    'adam': 'Adam',
    'kfac': 'SGD + momentum + K-FAC',
    'kfac-defaults': 'SGD + K-FAC (defaults)',
}


@dataclasses.dataclass
class History:
    """Test accuracy after each epoch (epoch 0: before training)."""

    name: str
    accuracy: list[float] = dataclasses.field(default_factory=list)
    #: Training wall time (seconds) up to each evaluation.
    seconds: list[float] = dataclasses.field(default_factory=list)
    #: Mean training loss of each epoch (NaN for epoch 0).
    loss: list[float] = dataclasses.field(default_factory=list)

    @property
    def label(self) -> str:
        """The optimizer's display name."""
        return OPTIMIZERS[self.name]

    def time_to(self, target: float) -> tuple[int, float] | None:
        """(epoch, seconds) of the first evaluation reaching ``target``."""
        for epoch, (acc, sec) in enumerate(zip(self.accuracy, self.seconds)):
            if acc >= target:
                return epoch, sec
        return None


def format_history(history: History, target: float) -> str:
    """The table of one optimizer: accuracy, loss and time per epoch."""
    lines = [
        history.label,
        f'{"epoch":>7} {"test acc":>9} {"train loss":>11} {"time (s)":>9}',
    ]
    for epoch, (acc, loss, sec) in enumerate(
        zip(history.accuracy, history.loss, history.seconds)
    ):
        shown = '-' if math.isnan(loss) else f'{loss:.4f}'
        lines.append(f'{epoch:>7} {acc:>9.2%} {shown:>11} {sec:>9.1f}')
    reached = history.time_to(target)
    lines.append(
        f'time to {target:.1%} test accuracy: '
        + (
            f'{reached[1]:.1f} s (epoch {reached[0]})'
            if reached
            else 'not reached'
        )
    )
    return '\n'.join(lines)


def format_summary(histories: Sequence[History], target: float) -> str:
    """One line per optimizer: final and best accuracy, times."""
    head = f'to {target:.0%} (s)'
    lines = [
        f'{"optimizer":<24} {"final acc":>9} {"best acc":>9} '
        f'{"time (s)":>9} {head:>11}',
    ]
    for h in histories:
        reached = h.time_to(target)
        shown = f'{reached[1]:.1f}' if reached else '-'
        lines.append(
            f'{h.label:<24} {h.accuracy[-1]:>9.2%} {max(h.accuracy):>9.2%} '
            f'{h.seconds[-1]:>9.1f} {shown:>11}'
        )
    return '\n'.join(lines)


@dataclasses.dataclass(frozen=True)
class Curve:
    """One run's metric at each evaluation, by step (or epoch) and time."""

    label: str
    steps: Sequence[int]
    seconds: Sequence[float]
    values: Sequence[float]


def plot_curves(
    curves: Sequence[Curve],
    path: pathlib.Path,
    title: str,
    *,
    ylabel: str,
    xlabel: str,
    legend: str = 'upper right',
    ylim: tuple[float, float] | None = None,
) -> pathlib.Path:
    """A metric against wall-clock time (left) and steps (right), as a PNG.

    matplotlib (Agg backend) is imported here only.
    """
    import matplotlib as mpl

    mpl.use('Agg')
    import matplotlib.pyplot as plt

    fig, (by_time, by_step) = plt.subplots(1, 2, figsize=(11, 4.2))
    for c in curves:
        by_time.plot(c.seconds, c.values, marker='o', label=c.label)
        by_step.plot(c.steps, c.values, marker='o', label=c.label)
    for ax, x in (
        (by_time, 'training wall-clock time (s)'),
        (by_step, xlabel),
    ):
        ax.set_xlabel(x)
        ax.set_ylabel(ylabel)
        if ylim is not None:
            ax.set_ylim(*ylim)
        ax.set_xlim(left=0)
        ax.grid(alpha=0.3)
        ax.legend(loc=legend)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot(
    histories: Sequence[History], path: pathlib.Path, title: str
) -> pathlib.Path:
    """Test accuracy against wall-clock time and epochs, as a PNG."""
    curves = [  # from epoch 1: epoch 0 is the untrained network
        Curve(
            h.label,
            range(1, len(h.accuracy)),
            h.seconds[1:],
            [100 * a for a in h.accuracy[1:]],
        )
        for h in histories
    ]
    low = min(v for c in curves for v in c.values)
    high = max(v for c in curves for v in c.values)
    return plot_curves(
        curves,
        path,
        title,
        ylabel='test accuracy (%)',
        xlabel='epoch',
        legend='lower right',
        ylim=(max(0.0, low - 2), min(100.0, high + 2)),
    )
