"""What the cost options buy: `factor_rank`, a smaller `max_factor_dim`,
and `damping_mode='relative'`, on real data.

Three measurements, each written as JSON (one thread):

* ``steptime``: the CNN of the cost issue on Fashion-MNIST
  (`Conv2d(1,16,5,p=2)`-ReLU-MaxPool2-`Conv2d(16,32,5,p=2)`-ReLU-MaxPool2-
  `Linear(1568,128)`-ReLU-`Linear(128,10)`, batch 128, SGD with momentum
  0.9): seconds per step (forward, backward, K-FAC, optimizer) of SGD and
  SGD + K-FAC (updates every 5/20 steps) with each form of the wide `A`
  (1569 wide), the configurations interleaved step by step in one run;
  median (a step without updates) and mean (updates included).
* ``accuracy``: the same CNN trained for one epoch from the same weights
  on the same batches with each form and each learning rate (K-FAC:
  updates every 10/100 steps, the `'relative'` clip at 1); test accuracy
  after the epoch.
* ``damping``: `damping` swept under `damping_mode='absolute'` and
  `'relative'` on the CNN (SGD lr 0.04, the `'relative'` clip at 1, test
  accuracy) and on a small GPT (`examples/gpt.py`, width 64,
  depth 2, context 64, batch 16, AdamW lr 3e-3 without a clip, as the
  hyperparameter guide suggests with Adam; validation loss on the bundled
  corpus), `--steps` steps each, updates every 5/20 steps.

    python -m benchmarks.cost_options steptime --out cost_steptime.json

Not run by the test suite (minutes of CPU).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks.study.tasks import cnn_model
from examples import char_lm
from examples import data
from examples.gpt import GPT
from examples.gpt import GPTConfig
from kfac.hyperparams import ORIGINAL_DEFAULTS
from kfac.preconditioner import KFACPreconditioner

FORMS: dict[str, dict[str, Any] | None] = {
    'sgd': None,
    'kfac': {},
    'factor_rank=64': {'factor_rank': 64},
    'factor_rank=128': {'factor_rank': 128},
    'factor_rank=256': {'factor_rank': 256},
    'factor_rank=128 qr': {'factor_rank': 128, 'basis_refresh': 'qr'},
    'kfac qr': {'basis_refresh': 'qr'},
    'max_factor_dim=512': {'max_factor_dim': 512},
    'max_factor_dim=256': {'max_factor_dim': 256},
}
"""SGD, then SGD + K-FAC with each form of the wide factor."""

CLIP = {'kl_clip_rule': 'relative', 'kl_clip': 1.0}
"""The clip of the accuracy and damping runs: the preconditioned gradient
at most as long as the raw one (with the original `'kl'` rule at its
default the clip scales every step of this CNN by about 0.05-0.15 and the
learning rate hardly matters; see `results/clip_rules.json`)."""

ACCURACY_KFAC = {'factor_update_steps': 10, 'inv_update_steps': 100, **CLIP}
"""K-FAC options of the one-epoch runs (as in `clip_rules.py`)."""


class _Trainer:
    """One CNN with SGD and, unless `form` is None, K-FAC."""

    def __init__(
        self,
        form: dict[str, Any] | None,
        lr: float,
        kfac: dict[str, Any] | None = None,
    ) -> None:
        self.model = cnn_model(0)
        self.optimizer = torch.optim.SGD(
            self.model.parameters(), lr=lr, momentum=0.9
        )
        self.precon = None
        if form is not None:
            # The original defaults (damping, the 'kl' clip at 0.001) where
            # neither `kfac` nor `form` sets them, as before they changed.
            options: dict[str, Any] = {
                **ORIGINAL_DEFAULTS,
                'factor_update_steps': 5,
                'inv_update_steps': 20,
                'optimizer': self.optimizer,
                **(kfac or {}),
                **form,
            }
            self.precon = KFACPreconditioner(self.model, **options)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        self.optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(self.model(x), y)
        loss.backward()
        if self.precon is not None:
            self.precon.step()
        self.optimizer.step()
        return float(loss)

    @torch.no_grad()
    def accuracy(self, images: data.ImageData) -> float:
        self.model.eval()
        correct = 0
        for x, y in zip(
            images.test_images.split(1000), images.test_labels.split(1000)
        ):
            correct += int((self.model(x).argmax(1) == y).sum())
        self.model.train()
        return correct / len(images.test_labels)


def _batches(
    images: data.ImageData, steps: int, batch: int = 128
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    order = torch.randperm(
        len(images.train_labels), generator=torch.Generator().manual_seed(0)
    )
    out = []
    for i in range(steps):
        rows = order[(i * batch) % len(order) :][:batch]
        out.append((images.train_images[rows], images.train_labels[rows]))
    return out


def steptime(
    images: data.ImageData, steps: int, names: list[str]
) -> dict[str, Any]:
    """Seconds per step of each form, interleaved step by step."""
    names = ['sgd', *[n for n in names if n != 'sgd']]
    trainers = {name: _Trainer(FORMS[name], 0.02) for name in names}
    batches = _batches(images, steps)
    seconds: dict[str, list[float]] = {name: [] for name in trainers}
    for i, (x, y) in enumerate(batches):
        for name, trainer in trainers.items():
            began = time.perf_counter()
            trainer.step(x, y)
            if i >= 5:  # warm-up
                seconds[name].append(time.perf_counter() - began)
    sgd = statistics.median(seconds['sgd'])
    return {
        name: {
            'median_s': statistics.median(times),
            'mean_s': statistics.mean(times),
            'median_vs_sgd': statistics.median(times) / sgd,
            'mean_vs_sgd': statistics.mean(times)
            / statistics.mean(seconds['sgd']),
            'steps': len(times),
        }
        for name, times in seconds.items()
    }


def accuracy(
    images: data.ImageData, lrs: list[float], names: list[str]
) -> dict[str, Any]:
    """Test accuracy after one epoch for each form and learning rate."""
    steps = len(images.train_labels) // 128
    batches = _batches(images, steps)
    out: dict[str, Any] = {}
    for name in names:
        for lr in lrs:
            trainer = _Trainer(FORMS[name], lr, ACCURACY_KFAC)
            began = time.perf_counter()
            losses = [trainer.step(x, y) for x, y in batches]
            out[f'{name} lr={lr}'] = {
                'test_accuracy': trainer.accuracy(images),
                'final_train_loss': statistics.mean(losses[-20:]),
                'seconds': time.perf_counter() - began,
                'steps': steps,
            }
            print(name, lr, out[f'{name} lr={lr}'], flush=True)
    return out


def _cnn_run(
    images: data.ImageData, batches: list[Any], kfac: dict[str, Any]
) -> float:
    trainer = _Trainer({}, 0.04, {**CLIP, **kfac})
    for x, y in batches:
        if not torch.isfinite(torch.tensor(trainer.step(x, y))):
            return 0.0
    return trainer.accuracy(images)


def _gpt_run(
    corpus: char_lm.Corpus, steps: int, kfac: dict[str, Any]
) -> float:
    torch.manual_seed(0)
    model = GPT(GPTConfig(corpus.vocab, context=64, width=64, depth=2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    precon = KFACPreconditioner(
        model,
        factor_update_steps=5,
        inv_update_steps=20,
        optimizer=optimizer,
        loss_average='batch+sequence',
        kl_clip=None,
        **kfac,
    )
    generator = torch.Generator().manual_seed(0)
    for _ in range(steps):
        x, y = char_lm.windows(corpus.train, 16, 64, generator)
        optimizer.zero_grad(set_to_none=True)
        char_lm.lm_loss(model(x), y).backward()
        precon.step()
        optimizer.step()
    held = char_lm.windows(
        corpus.valid, 64, 64, torch.Generator().manual_seed(1)
    )
    return char_lm.evaluate(model, held)


def damping(
    images: data.ImageData,
    steps: int,
    absolute: list[float],
    relative: list[float],
) -> dict[str, Any]:
    """CNN test accuracy and GPT validation loss per damping setting."""
    batches = _batches(images, steps)
    corpus = char_lm.load_corpus(char_lm.CORPUS)
    out: dict[str, Any] = {'cnn_test_accuracy': {}, 'gpt_val_loss': {}}
    grid = [('absolute', d) for d in absolute] + [
        ('relative', d) for d in relative
    ]
    for mode, value in grid:
        kfac = {'damping': value, 'damping_mode': mode}
        key = f'{mode} {value}'
        out['cnn_test_accuracy'][key] = _cnn_run(images, batches, kfac)
        out['gpt_val_loss'][key] = _gpt_run(corpus, steps, kfac)
        print(key, out['cnn_test_accuracy'][key], out['gpt_val_loss'][key])
    return out


def main(argv: list[str] | None = None) -> None:
    """Run one measurement and write its JSON."""
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('what', choices=['steptime', 'accuracy', 'damping'])
    p.add_argument('--out', type=pathlib.Path, required=True)
    p.add_argument('--steps', type=int, default=60)
    p.add_argument('--lrs', type=float, nargs='+', default=[0.02, 0.04])
    p.add_argument('--forms', nargs='+', default=list(FORMS))
    p.add_argument(
        '--absolute', type=float, nargs='+', default=[1e-4, 1e-3, 1e-2, 0.1, 1]
    )
    p.add_argument(
        '--relative', type=float, nargs='+', default=[0.1, 1, 10, 100, 1000]
    )
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    images = data.load_image_data(fallback=False)
    runs: dict[str, Callable[[], dict[str, Any]]] = {
        'steptime': lambda: steptime(images, args.steps, args.forms),
        'accuracy': lambda: accuracy(images, args.lrs, args.forms),
        'damping': lambda: damping(
            images,
            args.steps,
            args.absolute,
            args.relative,
        ),
    }
    began = time.perf_counter()
    result = {
        'what': args.what,
        'command': 'python -m benchmarks.cost_options '
        + ' '.join(argv if argv is not None else sys.argv[1:]),
        'threads': 1,
        'torch': torch.__version__,
        'results': runs[args.what](),
        'wall_s': time.perf_counter() - began,
    }
    args.out.write_text(json.dumps(result, indent=2) + '\n')
    print(json.dumps(result['results'], indent=2))


if __name__ == '__main__':
    main()
