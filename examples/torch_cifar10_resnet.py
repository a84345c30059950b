r"""Train a CIFAR-10 ResNet with K-FAC, alone or under ``torchrun`` (DDP).

::

    python -m examples.torch_cifar10_resnet --data-dir ~/data/cifar10
    torchrun --standalone --nproc_per_node=4 \
        -m examples.torch_cifar10_resnet \
        --data-dir ~/data/cifar10 --model resnet56 --amp \
        --checkpoint-dir runs/r56 --log-dir runs/r56
    python -m examples.torch_cifar10_resnet --synthetic 512 --epochs 1

The data is torchvision's CIFAR-10 (``pip install torchvision``; add
``--download`` to fetch it), with the usual augmentation: random crops of
the image padded by 4 pixels and horizontal flips. ``--synthetic N``
trains on N random 3x32x32 images instead and needs no torchvision. The
defaults follow the KAISA paper's CIFAR-10 setup (batch 128 per process,
learning rate 0.1 per process, 5 warm-up epochs, decay by 10 at epochs 35,
75 and 90, K-FAC factors every 10 steps, decompositions every 100, damping
0.003 halved at epochs 35 and 75); see ``examples/README.md``.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import Dataset

from examples import image_classification
from examples import training
from examples.resnet import CIFAR_DEPTHS
from examples.resnet import cifar_resnet

logger = logging.getLogger('examples.torch_cifar10_resnet')

MEAN = (0.4914, 0.4822, 0.4465)
STD = (0.2470, 0.2435, 0.2616)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        '--model',
        default='resnet32',
        choices=[f'resnet{d}' for d in CIFAR_DEPTHS],
    )
    p.add_argument('--download', action='store_true', help='fetch CIFAR-10')
    image_classification.add_train_args(
        p,
        epochs=100,
        batch_size=128,
        base_lr=0.1,
        weight_decay=5e-4,
        warmup_epochs=5,
        lr_decay_epochs=(35, 75, 90),
    )
    training.add_kfac_args(
        p,
        factor_update_steps=10,
        inv_update_steps=100,
        damping=0.003,
        kl_clip=0.001,
    )
    p.set_defaults(kfac_damping_decay_epochs=[35, 75])
    return p.parse_args(argv)


def datasets(args: argparse.Namespace) -> tuple[Dataset[Any], Dataset[Any]]:
    """Training and test sets: CIFAR-10, or random images."""
    if args.synthetic:
        return (
            image_classification.synthetic_dataset(
                args.synthetic, (3, 32, 32), 10, seed=args.seed
            ),
            image_classification.synthetic_dataset(
                max(args.synthetic // 4, 1), (3, 32, 32), 10, seed=-1
            ),
        )
    if args.data_dir is None:
        raise ValueError('give --data-dir (or --synthetic N)')
    import torchvision  # type: ignore[import-not-found,import-untyped,unused-ignore]  # optional; absent or without stubs in the test environment
    from torchvision import transforms as t  # type: ignore[import-not-found,import-untyped,unused-ignore]  # optional

    normalize = t.Normalize(MEAN, STD)
    train = t.Compose(
        [
            t.RandomCrop(32, padding=4),
            t.RandomHorizontalFlip(),
            t.ToTensor(),
            normalize,
        ]
    )
    test = t.Compose([t.ToTensor(), normalize])
    cifar = torchvision.datasets.CIFAR10
    return (
        cifar(
            args.data_dir, train=True, transform=train, download=args.download
        ),
        cifar(
            args.data_dir, train=False, transform=test, download=args.download
        ),
    )


def main(argv: Sequence[str] | None = None) -> image_classification.Result:
    """Train; return the last epoch's losses and validation accuracy."""
    args = parse_args(argv)
    runtime = training.setup_distributed(args.device)
    logging.basicConfig(
        level=logging.INFO if runtime.is_main else logging.WARNING,
        format='%(asctime)s %(message)s',
    )
    train_set, val_set = datasets(args)
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    model = cifar_resnet(int(args.model.removeprefix('resnet')))
    logger.info(
        '%s on %d processes (%s), K-FAC %s',
        args.model,
        runtime.world_size,
        runtime.device,
        'off' if args.no_kfac else 'on',
    )
    return image_classification.fit(args, model, train_set, val_set, runtime)


if __name__ == '__main__':
    main()
    if dist.is_initialized():
        dist.destroy_process_group()
