"""The clip rules on real data: what `kl_clip_rule` does to a working loop.

Trains the small CNN of the learning-rate issue on Fashion-MNIST
(`Conv2d(1,16,5,p=2)`-ReLU-MaxPool2-`Conv2d(16,32,5,p=2)`-ReLU-MaxPool2-
`Linear(1568,128)`-ReLU-`Linear(128,10)`, batch 128, SGD with momentum
0.9) for one epoch from the same initial weights on the same batches:
SGD alone, then SGD + K-FAC (`optimizer=`, updates every 10/100 steps)
under the `'kl'` rule (κ = 0.001, the original default) and under the
`'relative'` rule (κ = 1), each at two learning rates a factor of 2
apart. Records per step the clip scale ν and the norm ratio from
`metrics()`, the training loss, and the test accuracy after the epoch;
writes JSON and prints a Markdown table.

    python -m benchmarks.clip_rules --out benchmarks/results/clip_rules.json

Not run by the test suite (minutes of CPU).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import time
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks.study.tasks import cnn_model
from examples import data
from kfac.preconditioner import KFACPreconditioner


def _run(
    images: data.ImageData, lr: float, kfac: dict[str, Any] | None
) -> dict[str, Any]:
    model = cnn_model(0)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    precon = None
    if kfac is not None:
        precon = KFACPreconditioner(
            model,
            optimizer=optimizer,
            factor_update_steps=10,
            inv_update_steps=100,
            # the original damping and 'kl' rule unless `kfac` sets them
            # (`kfac` itself is recorded as given)
            **{'damping': 0.001, 'kl_clip_rule': 'kl', **kfac},
        )
    generator = torch.Generator().manual_seed(0)
    order = torch.randperm(len(images.train_images), generator=generator)
    scales, ratios, losses = [], [], []
    start = time.perf_counter()
    for first in range(0, len(order) - 127, 128):
        index = order[first : first + 128]
        optimizer.zero_grad()
        loss = F.cross_entropy(
            model(images.train_images[index]), images.train_labels[index]
        )
        loss.backward()
        if precon is not None:
            precon.step()
            metrics = precon.metrics()
            scales.append(metrics['kl_clip_scale'])
            ratios.append(metrics['grad_norm_ratio'])
        optimizer.step()
        losses.append(float(loss))
    seconds = time.perf_counter() - start
    with torch.no_grad():
        predicted = model(images.test_images).argmax(dim=1)
    accuracy = float((predicted == images.test_labels).float().mean())
    return {
        'lr': lr,
        'kfac': kfac,
        'seconds': seconds,
        'steps': len(losses),
        'final_loss': statistics.fmean(losses[-20:]),
        'test_accuracy': accuracy,
        'scale_median': statistics.median(scales) if scales else None,
        'scale_min': min(scales) if scales else None,
        'ratio_median': statistics.median(ratios) if ratios else None,
    }


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    """Run every configuration; write JSON; print a table."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument('--out', default='build/clip_rules.json')
    parser.add_argument('--threads', type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    images = data.load_idx_dir(data.FASHION_MNIST_DIR)
    runs = []
    for lr in (0.02, 0.04):
        runs.append(_run(images, lr, None))
        runs.append(_run(images, lr, {'kl_clip': 0.001}))
        runs.append(
            _run(images, lr, {'kl_clip': 1.0, 'kl_clip_rule': 'relative'})
        )
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps({'threads': args.threads, 'runs': runs}, indent=1)
    )
    print(
        '| optimizer | lr | test acc. | final loss | ν median (min) '
        '| norm ratio median | s |'
    )
    print('| --- | --- | --- | --- | --- | --- | --- |')
    for run in runs:
        kfac = run['kfac']
        name = (
            'SGD'
            if kfac is None
            else f'K-FAC {kfac.get("kl_clip_rule", "kl")} κ={kfac["kl_clip"]}'
        )
        scale = (
            '-'
            if run['scale_median'] is None
            else f'{run["scale_median"]:.3g} ({run["scale_min"]:.3g})'
        )
        ratio = (
            '-'
            if run['ratio_median'] is None
            else f'{run["ratio_median"]:.3g}'
        )
        print(
            f'| {name} | {run["lr"]} | {run["test_accuracy"]:.2%} | '
            f'{run["final_loss"]:.4f} | {scale} | {ratio} | '
            f'{run["seconds"]:.1f} |'
        )
    return runs


if __name__ == '__main__':
    main()
