r"""Train ResNet-50 on ImageNet with K-FAC, alone or under ``torchrun`` (DDP).

::

    torchrun --standalone --nproc_per_node=8 \
        -m examples.torch_imagenet_resnet \
        --data-dir /data/imagenet --amp \
        --checkpoint-dir runs/r50 --log-dir runs/r50
    python -m examples.torch_imagenet_resnet --synthetic 64 --epochs 1 \
        --width 16 --batch-size 8

``--data-dir`` holds ``train/`` and ``val/`` directories of class folders
(torchvision's ``ImageFolder`` layout; ``pip install torchvision``).
Training images are random resized crops of 224x224 with horizontal
flips; validation images are resized to 256 and centre-cropped to 224.
``--synthetic N`` trains on N random 3x224x224 images instead; ``--width``
shrinks the network (64 is ResNet-50 itself). The defaults follow the
KAISA paper's ResNet-50 setup in spirit (batch 32 per process, learning
rate 0.0125 per process, 5 warm-up epochs, step decay, label smoothing,
K-FAC decompositions every 500 steps with the intervals growing later in
training); see ``examples/README.md``.
"""

from __future__ import annotations

import argparse
import logging
import pathlib
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import Dataset

from examples import image_classification
from examples import training
from examples.resnet import resnet50

logger = logging.getLogger('examples.torch_imagenet_resnet')

MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        '--width', type=int, default=64, help='first stage width (64)'
    )
    p.add_argument('--classes', type=int, default=1000)
    image_classification.add_train_args(
        p,
        epochs=55,
        batch_size=32,
        base_lr=0.0125,
        weight_decay=5e-5,
        warmup_epochs=5,
        lr_decay_epochs=(25, 35, 40, 45, 50),
    )
    training.add_kfac_args(
        p,
        factor_update_steps=50,
        inv_update_steps=500,
        damping=0.001,
        kl_clip=0.001,
    )
    p.set_defaults(
        label_smoothing=0.1,
        kfac_interval_growth_epochs=[25, 35],
        kfac_interval_growth=2.0,
        workers=8,
    )
    return p.parse_args(argv)


def datasets(args: argparse.Namespace) -> tuple[Dataset[Any], Dataset[Any]]:
    """Training and validation sets: ImageNet folders, or random images."""
    if args.synthetic:
        return (
            image_classification.synthetic_dataset(
                args.synthetic, (3, 224, 224), args.classes, seed=args.seed
            ),
            image_classification.synthetic_dataset(
                max(args.synthetic // 4, 1), (3, 224, 224), args.classes, -1
            ),
        )
    if args.data_dir is None:
        raise ValueError('give --data-dir (or --synthetic N)')
    from torchvision import datasets as tv_datasets  # type: ignore[import-not-found,import-untyped,unused-ignore]  # optional; absent or without stubs in the test environment
    from torchvision import transforms as t  # type: ignore[import-not-found,import-untyped,unused-ignore]  # optional

    normalize = t.Normalize(MEAN, STD)
    train = t.Compose(
        [
            t.RandomResizedCrop(224),
            t.RandomHorizontalFlip(),
            t.ToTensor(),
            normalize,
        ]
    )
    val = t.Compose(
        [t.Resize(256), t.CenterCrop(224), t.ToTensor(), normalize]
    )
    root = pathlib.Path(args.data_dir)
    return (
        tv_datasets.ImageFolder(root / 'train', transform=train),
        tv_datasets.ImageFolder(root / 'val', transform=val),
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
    model = resnet50(classes=args.classes, width=args.width)
    logger.info(
        'ResNet-50 (width %d) on %d processes (%s), K-FAC %s',
        args.width,
        runtime.world_size,
        runtime.device,
        'off' if args.no_kfac else 'on',
    )
    return image_classification.fit(args, model, train_set, val_set, runtime)


if __name__ == '__main__':
    main()
    if dist.is_initialized():
        dist.destroy_process_group()
