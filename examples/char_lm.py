"""A character-level GPT on the King James Bible: AdamW against AdamW + K-FAC.

The script behind ``make demo-lm``. Both runs train the same
:class:`~examples.gpt.GPT` (token and position embeddings, pre-norm blocks
with causal :class:`torch.nn.MultiheadAttention`, an output head tied to the
token embedding) from the same initial weights on the same sequence of
batches, with the same learning-rate schedule and the same number of steps;
every ``--eval-every`` steps they are scored on the same held-out text. It
prints a table per run (validation loss, training wall time), the steps and
seconds each needed to reach AdamW's final validation loss, and writes a PNG
of validation loss against steps and against wall-clock time::

    python -m examples.char_lm                      # the demo
    python -m examples.char_lm --steps 300 --optimizers kfac
    python -m examples.char_lm --corpus my_text.txt # any UTF-8 text
    python -m examples.char_lm --optimizers adamw kfac kfac-defaults

``kfac-defaults`` is AdamW + K-FAC with the library's defaults:
``KFACPreconditioner(model, optimizer=optimizer)`` and nothing else set.

Data: ``examples/corpus/kjv.txt.gz``, the King James Version (public
domain) as Debian's ``bible-kjv-text`` 4.38 ships it, one verse per line
(``examples/corpus/README.md``); every run reads the same bytes. Every
tenth block of 8192 characters is held out for validation. Wall times count
training only (evaluation excluded); K-FAC's time includes all of its work.
Runs in one process, on one thread unless ``--threads`` says otherwise.
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import logging
import math
import pathlib
import time
from collections.abc import Callable
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from examples import training
from examples.comparison import Curve
from examples.comparison import plot_curves
from examples.gpt import GPT
from examples.gpt import GPTConfig
from kfac.config import StatisticsConfig
from kfac.layers.curvature import method_config
from kfac.preconditioner import KFACPreconditioner

logger = logging.getLogger('examples.char_lm')

CORPUS = pathlib.Path(__file__).parent / 'corpus' / 'kjv.txt.gz'
#: Held-out blocks: every ``HOLD_OUT``-th block of ``BLOCK`` characters.
BLOCK, HOLD_OUT = 8192, 10
#: The runs this script compares, by command-line name.
OPTIMIZERS = {
    'adamw': 'AdamW',
    'kfac': 'AdamW + K-FAC',
    'kfac-defaults': 'AdamW + K-FAC (defaults)',
}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Command-line options; the defaults are the tuned demo settings."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('--corpus', type=pathlib.Path, default=CORPUS)
    p.add_argument(
        '--optimizers',
        nargs='+',
        choices=list(OPTIMIZERS),
        default=['adamw', 'kfac'],
    )
    p.add_argument('--steps', type=int, default=300)
    p.add_argument('--batch-size', type=int, default=32, help='sequences')
    p.add_argument('--context', type=int, default=128, help='tokens')
    p.add_argument('--width', type=int, default=128)
    p.add_argument('--depth', type=int, default=4)
    p.add_argument('--heads', type=int, default=4)
    p.add_argument('--lr', type=float, default=3e-3, help='peak AdamW lr')
    p.add_argument('--warmup', type=int, default=50, help='linear lr warm-up')
    p.add_argument('--weight-decay', type=float, default=0.1)
    p.add_argument('--eval-every', type=int, default=25)
    p.add_argument('--eval-sequences', type=int, default=128)
    training.add_kfac_args(
        p,
        factor_update_steps=5,
        inv_update_steps=25,
        damping=0.01,
        kl_clip=0.0,
    )
    p.add_argument(
        '--kfac-approx', choices=['expand', 'reduce'], default='expand'
    )
    p.add_argument(
        '--threads',
        type=int,
        default=1,
        help='torch threads (1: steady on a shared machine, and runs repeat '
        'exactly; see examples/README.md)',
    )
    p.add_argument('--plot', default='build/demo/char_lm_optimizers.png')
    p.add_argument('--no-plot', action='store_true')
    p.add_argument('--seed', type=int, default=0)
    return p.parse_args(argv)


@dataclasses.dataclass(frozen=True)
class Corpus:
    """Token ids of the training and held-out text, and the alphabet."""

    alphabet: str
    train: torch.Tensor
    valid: torch.Tensor
    source: str

    @property
    def vocab(self) -> int:
        """Number of distinct characters."""
        return len(self.alphabet)


def load_corpus(path: pathlib.Path) -> Corpus:
    """Read ``path`` (UTF-8, gzipped when it ends in ``.gz``) and split it.

    The alphabet is the sorted set of the text's characters. Every
    :data:`HOLD_OUT`-th block of :data:`BLOCK` characters is held out.
    """
    if not path.is_file():
        raise FileNotFoundError(
            f'no corpus at {path}: the repository ships '
            f'examples/corpus/kjv.txt.gz; pass --corpus FILE for other text'
        )
    raw = path.read_bytes()
    text = (gzip.decompress(raw) if path.suffix == '.gz' else raw).decode()
    alphabet = ''.join(sorted(set(text)))
    lookup = {c: i for i, c in enumerate(alphabet)}
    ids = torch.tensor([lookup[c] for c in text], dtype=torch.long)
    blocks = ids.split(BLOCK)
    held = [b for i, b in enumerate(blocks) if i % HOLD_OUT == HOLD_OUT - 1]
    kept = [b for i, b in enumerate(blocks) if i % HOLD_OUT != HOLD_OUT - 1]
    if not held or not kept:
        raise ValueError(
            f'{path} has {len(text)} characters; at least '
            f'{HOLD_OUT * BLOCK} are needed'
        )
    return Corpus(alphabet, torch.cat(kept), torch.cat(held), path.name)


def windows(
    ids: torch.Tensor, count: int, length: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """``count`` random windows: inputs and next-character targets."""
    starts = torch.randint(0, len(ids) - length, (count,), generator=generator)
    rows = starts[:, None] + torch.arange(length + 1)
    chunk = ids[rows]
    return chunk[:, :-1], chunk[:, 1:]


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy averaged over every token of the batch (nats)."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


@torch.no_grad()
def evaluate(
    model: nn.Module, data: tuple[torch.Tensor, torch.Tensor]
) -> float:
    """Mean per-character loss on the held-out windows."""
    model.eval()
    total = 0.0
    for x, y in zip(data[0].split(64), data[1].split(64)):
        total += float(lm_loss(model(x), y)) * len(x)
    model.train()
    return total / len(data[0])


@dataclasses.dataclass
class History:
    """Validation loss of one run after each evaluated step."""

    name: str
    steps: list[int] = dataclasses.field(default_factory=list)
    val_loss: list[float] = dataclasses.field(default_factory=list)
    #: Training wall time (seconds) up to each evaluation.
    seconds: list[float] = dataclasses.field(default_factory=list)

    @property
    def label(self) -> str:
        """The run's display name."""
        return OPTIMIZERS[self.name]

    def reaching(self, target: float) -> tuple[int, float] | None:
        """(step, seconds) of the first evaluation at or below ``target``."""
        for step, loss, sec in zip(self.steps, self.val_loss, self.seconds):
            if loss <= target:
                return step, sec
        return None


def build_kfac(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    args: argparse.Namespace,
) -> KFACPreconditioner:
    """K-FAC for a loss averaged over every token (``batch+sequence``)."""
    return KFACPreconditioner(
        model,
        factor_update_steps=args.kfac_factor_update_steps,
        inv_update_steps=args.kfac_inv_update_steps,
        damping=args.kfac_damping,
        factor_decay=args.kfac_factor_decay,
        kl_clip=args.kfac_kl_clip or None,
        relative_clip=args.kfac_relative_clip or None,
        optimizer=optimizer,
        skip_layers=args.kfac_skip_layers,
        compute_method=method_config(
            args.kfac_compute_method,
            basis_refresh=(
                None
                if args.kfac_compute_method == 'inverse'
                else args.kfac_basis_refresh
            ),
        ),
        statistics=StatisticsConfig(
            loss_average='batch+sequence', kfac_approx=args.kfac_approx
        ),
    )


def schedule(args: argparse.Namespace) -> Callable[[int], float]:
    """Linear warm-up, then a cosine decay to a tenth of the peak."""

    def factor(step: int) -> float:
        if step < args.warmup:
            return float(step + 1) / float(args.warmup)
        progress = (step - args.warmup) / max(1, args.steps - args.warmup)
        return 0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, progress)))

    return factor


def train_one(name: str, corpus: Corpus, args: argparse.Namespace) -> History:
    """Train run ``name``; validation loss every ``--eval-every`` steps."""
    torch.manual_seed(args.seed)
    config = GPTConfig(
        corpus.vocab, args.context, args.width, args.depth, args.heads
    )
    model = GPT(config)
    optimizer = torch.optim.AdamW(
        model.parameters(),
        lr=args.lr,
        betas=(0.9, 0.99),
        weight_decay=args.weight_decay,
    )
    lr_scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule(args))
    kfac = build_kfac(model, optimizer, args) if name == 'kfac' else None
    if name == 'kfac-defaults':
        # what a user adds to a working AdamW loop: nothing but the optimizer
        kfac = KFACPreconditioner(model, optimizer=optimizer)
    generator = torch.Generator().manual_seed(args.seed)
    held_out = windows(
        corpus.valid,
        args.eval_sequences,
        args.context,
        torch.Generator().manual_seed(args.seed + 1),
    )
    history, elapsed = History(name), 0.0
    for step in range(args.steps + 1):
        if step % args.eval_every == 0 or step == args.steps:
            history.steps.append(step)
            history.seconds.append(elapsed)
            history.val_loss.append(evaluate(model, held_out))
            logger.info(
                '%s step %d: validation loss %.4f (%.1f s)',
                OPTIMIZERS[name],
                step,
                history.val_loss[-1],
                elapsed,
            )
        if step == args.steps:
            break
        x, y = windows(corpus.train, args.batch_size, args.context, generator)
        began = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        lm_loss(model(x), y).backward()
        if kfac is not None:
            kfac.step()
        optimizer.step()
        lr_scheduler.step()
        elapsed += time.perf_counter() - began
    if kfac is not None:
        kfac.remove()
    return history


def format_history(history: History) -> str:
    """One run's table: validation loss and training time per evaluation."""
    lines = [history.label, f'{"step":>6} {"val loss":>9} {"time (s)":>9}']
    for step, loss, sec in zip(
        history.steps, history.val_loss, history.seconds
    ):
        lines.append(f'{step:>6} {loss:>9.4f} {sec:>9.1f}')
    return '\n'.join(lines)


def format_summary(histories: Sequence[History], target: float) -> str:
    """Per run: final loss, time, and steps and seconds to ``target``."""
    lines = [
        f'{"optimizer":<24} {"final val":>9} {"time (s)":>9} '
        f'{"to " + format(target, ".4f"):>17}',
    ]
    for h in histories:
        reached = h.reaching(target)
        shown = f'step {reached[0]}, {reached[1]:.1f} s' if reached else '-'
        lines.append(
            f'{h.label:<24} {h.val_loss[-1]:>9.4f} {h.seconds[-1]:>9.1f} '
            f'{shown:>17}'
        )
    return '\n'.join(lines)


def main(argv: Sequence[str] | None = None) -> dict[str, History]:
    """Train every run of ``--optimizers``; return their histories."""
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format='%(message)s')
    corpus = load_corpus(args.corpus)
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        histories = _compare(corpus, args)
    finally:
        torch.set_num_threads(threads)
    return {h.name: h for h in histories}


def _compare(corpus: Corpus, args: argparse.Namespace) -> list[History]:
    """Train, print the tables, write the plot."""
    logger.info(
        'corpus %s: %d characters (%d distinct), %d for training, %d held '
        'out; batches of %d x %d tokens, %d steps, %d thread(s)',
        corpus.source,
        len(corpus.train) + len(corpus.valid),
        corpus.vocab,
        len(corpus.train),
        len(corpus.valid),
        args.batch_size,
        args.context,
        args.steps,
        torch.get_num_threads(),
    )
    histories = [train_one(name, corpus, args) for name in args.optimizers]
    for h in histories:
        print(f'\n{format_history(h)}', flush=True)
    target = histories[0].val_loss[-1]
    print(f'\n{format_summary(histories, target)}', flush=True)
    if not args.no_plot:
        curves = [
            Curve(h.label, h.steps, h.seconds, h.val_loss) for h in histories
        ]
        title = (
            f'{corpus.source}: character GPT, {args.depth} blocks of width '
            f'{args.width}, batch {args.batch_size}x{args.context}, '
            f'{torch.get_num_threads()} thread(s)'
        )
        path = plot_curves(
            curves,
            pathlib.Path(args.plot),
            title,
            ylabel='validation loss (nats per character)',
            xlabel='step',
        )
        print(f'plot written to {path.resolve()}', flush=True)
    return histories


if __name__ == '__main__':
    main()
