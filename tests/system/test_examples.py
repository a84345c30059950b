"""Smoke tests of the example scripts: two steps each, no download.

Every example runs on synthetic tensors of its real input shape
(1x28x28 IDX files written here, 3x32x32 and 3x224x224 random images), on
one process and, in one shared launch, on two gloo processes.
"""

from __future__ import annotations

import gzip
import json
import logging
import pathlib
import statistics
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist

from benchmarks import demo_seeds
from examples import char_lm
from examples import comparison
from examples import fashion_mnist
from examples import resnet
from examples import torch_cifar10_resnet
from examples import torch_imagenet_resnet
from examples import train_ddp
from examples import training
from testing.asserts import assert_rel_close
from testing.asserts import assert_same_state
from testing.data import write_idx_dir
from testing.distributed import run_distributed

QUICK = ['--epochs', '2', '--steps-per-epoch', '2', '--batch-size', '8']
#: Two steps an epoch: four random images, two per batch.
RESNET_QUICK = ['--synthetic', '4', '--batch-size', '2', '--workers', '0']
IMAGENET_SMALL = ['--width', '8', '--classes', '10']


#: Ten steps an epoch; resuming after epoch 0 lands mid-way through both
#: update intervals (factors at steps 0, 3, 6, 9, 12; inverses at 0, 4, 8,
#: 12), so the step counter and the saved decompositions must carry over.
DDP_TRAIN = [
    '--epochs',
    '2',
    '--steps-per-epoch',
    '10',
    '--batch-size',
    '32',
    '--factor-update-steps',
    '3',
    '--inv-update-steps',
    '4',
]


def test_train_ddp_learns() -> None:
    """K-FAC lifts held-out accuracy well above the untrained model's."""
    untrained = train_ddp.main([*DDP_TRAIN, '--epochs', '0'])
    accuracy = train_ddp.main(DDP_TRAIN)
    # Measured: 0.19 untrained, 0.51 after 20 K-FAC steps (0.39 with SGD;
    # over seeds 0-4 K-FAC gained 0.31 to 0.57).
    assert accuracy > untrained + 0.2
    sgd = train_ddp.main([*DDP_TRAIN, '--no-kfac'])
    assert sgd > untrained + 0.1
    assert sgd != accuracy  # --no-kfac really trains without K-FAC


def test_train_ddp_resume_is_exact(
    tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture
) -> None:
    """One epoch, a checkpoint and a resumed epoch equal two epochs."""
    straight_path = tmp_path / 'straight.pt'
    resumed_path = tmp_path / 'resumed.pt'
    straight = train_ddp.main([*DDP_TRAIN, '--checkpoint', str(straight_path)])
    train_ddp.main(
        [*DDP_TRAIN, '--epochs', '1', '--checkpoint', str(resumed_path)]
    )
    with caplog.at_level(logging.INFO, logger='train_ddp'):
        resumed = train_ddp.main(
            [*DDP_TRAIN, '--checkpoint', str(resumed_path)]
        )
    # the resumed run trained the second epoch only
    epochs = [r.getMessage().split(':')[0] for r in caplog.records]
    assert epochs == ['epoch 1']
    assert resumed == straight
    expected = torch.load(straight_path, weights_only=True)
    actual = torch.load(resumed_path, weights_only=True)
    assert expected['kfac']['decompositions']  # saved and compared too
    # parameters, momentum buffers, K-FAC factors, decompositions, counters
    assert_same_state(actual, expected)


def _demo_args(data_dir: pathlib.Path, *extra: str) -> list[str]:
    # 32 training images in batches of 16: two steps
    return [
        '--data-dir',
        str(data_dir),
        '--require-data',
        '--epochs',
        '1',
        '--batch-size',
        '16',
        '--no-progress',
        *extra,
    ]


def test_fashion_mnist_demo(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data_dir = write_idx_dir(tmp_path / 'idx', train=32, test=20)
    plot = tmp_path / 'plots' / 'demo.png'
    histories = fashion_mnist.main(
        _demo_args(
            data_dir, '--plot', str(plot), '--kfac-inv-update-steps', '1'
        )
    )
    assert list(histories) == ['sgd', 'adam', 'kfac', 'kfac-defaults']
    for history in histories.values():
        assert len(history.accuracy) == len(history.seconds) == 2
        assert history.seconds[0] == 0.0 < history.seconds[1]
        # the share of the 20 test images classified correctly
        assert all(
            abs(20 * a - round(20 * a)) < 1e-9 for a in history.accuracy
        )
    # the same start: identical weights before training
    assert len({h.accuracy[0] for h in histories.values()}) == 1
    # K-FAC changed the second step: the mean training losses differ
    assert histories['sgd'].loss[1] != histories['kfac'].loss[1]
    # with the defaults too: factors and decompositions on step 0
    assert histories['sgd'].loss[1] != histories['kfac-defaults'].loss[1]
    assert plot.read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'
    out = capsys.readouterr().out
    assert f'plot written to {plot.resolve()}' in out
    assert 'SGD + momentum + K-FAC' in out


def test_fashion_mnist_progress_bars_and_amp(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data_dir = write_idx_dir(tmp_path / 'idx', train=32, test=8)
    args = _demo_args(data_dir, '--optimizers', 'kfac', '--no-plot', '--amp')
    args.remove('--no-progress')
    (history,) = fashion_mnist.main(args).values()
    assert 'epoch 1/1' in capsys.readouterr().err  # the tqdm bar
    args = _demo_args(data_dir, '--optimizers', 'kfac', '--no-plot')
    (plain,) = fashion_mnist.main(args).values()
    # bfloat16 autocast is on (the loss moves), and harmless here
    # (measured: 1.3e-6 relative)
    assert history.loss[1] != plain.loss[1]
    assert history.loss[1] == pytest.approx(plain.loss[1], rel=1e-3)


def test_history_time_to_target() -> None:
    history = comparison.History(
        'kfac', accuracy=[0.1, 0.6, 0.8, 0.7], seconds=[0.0, 2.0, 4.5, 7.0]
    )
    history.loss = [float('nan'), 1.0, 0.5, 0.4]
    assert history.time_to(0.75) == (2, 4.5)
    assert history.time_to(0.9) is None
    table = comparison.format_history(history, 0.75)
    assert table.splitlines()[0] == 'SGD + momentum + K-FAC'
    assert '4.5 s (epoch 2)' in table
    assert 'not reached' in comparison.format_history(history, 0.9)
    summary = comparison.format_summary([history], 0.75)
    assert '70.00%' in summary and '80.00%' in summary


def test_cifar10_checkpoint_resume_is_exact(tmp_path: pathlib.Path) -> None:
    """Two epochs equal one epoch, a checkpoint and a resumed epoch."""
    kfac = ['--kfac-factor-update-steps', '1', '--kfac-inv-update-steps', '3']
    common = [*RESNET_QUICK, '--model', 'resnet20', *kfac]
    straight = torch_cifar10_resnet.main([*common, '--epochs', '2'])
    first = torch_cifar10_resnet.main(
        [*common, '--epochs', '1', '--checkpoint-dir', str(tmp_path)]
    )
    assert first.epochs_trained == 1
    state = torch.load(tmp_path / 'checkpoint.pt', weights_only=True)
    assert {'model', 'optimizer', 'lr_scheduler', 'kfac'} <= set(state)
    resumed = torch_cifar10_resnet.main(
        [*common, '--epochs', '2', '--checkpoint-dir', str(tmp_path)]
    )
    assert resumed.epochs_trained == 2
    assert resumed.train_loss == pytest.approx(straight.train_loss, rel=1e-5)
    assert resumed.val_loss == pytest.approx(straight.val_loss, rel=1e-5)


@pytest.mark.parametrize('dtype', ['bfloat16', 'float16'])
# GradScaler skips steps whose float16 gradients overflow; LambdaLR warns.
@pytest.mark.filterwarnings('ignore:Detected call of `lr_scheduler.step')
def test_cifar10_mixed_precision(tmp_path: pathlib.Path, dtype: str) -> None:
    result = torch_cifar10_resnet.main(
        [
            *RESNET_QUICK,
            '--model',
            'resnet20',
            '--epochs',
            '1',
            '--amp',
            '--amp-dtype',
            dtype,
            '--checkpoint-dir',
            str(tmp_path),
            '--log-dir',
            str(tmp_path),
            '--log-interval',
            '1',
        ]
    )
    assert np.isfinite(result.train_loss) and np.isfinite(result.val_loss)
    records = [
        json.loads(line)
        for line in (tmp_path / 'metrics.jsonl').read_text().splitlines()
    ]
    assert [r['kind'] for r in records] == ['train', 'train', 'epoch']
    state = torch.load(tmp_path / 'checkpoint.pt', weights_only=True)
    assert ('scaler' in state) == (dtype == 'float16')


def test_float16_scaler_unscales_before_kfac() -> None:
    """K-FAC sees unscaled gradients: its KL clip gets their true size."""
    model = torch.nn.Linear(4, 3)
    precision = training.Precision(torch.device('cpu'), True, 'float16')
    assert precision.scaler is not None
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    seen: list[float] = []

    class Probe:
        def step(self) -> None:
            assert model.weight.grad is not None
            seen.append(float(model.weight.grad.abs().max()))

    x = torch.randn(8, 4)
    loss = model(x).square().mean()
    expected = torch.autograd.grad(loss, model.weight)[0].abs().max()
    loss = model(x).square().mean()
    training.backward_and_step(
        loss,
        optimizer,
        Probe(),  # type: ignore[arg-type]  # only step() is called
        precision,
    )
    assert seen == [pytest.approx(float(expected))]


def test_imagenet_resnet_two_steps(tmp_path: pathlib.Path) -> None:
    result = torch_imagenet_resnet.main(
        [
            *RESNET_QUICK,
            *IMAGENET_SMALL,
            '--epochs',
            '1',
            '--checkpoint-dir',
            str(tmp_path),
        ]
    )
    assert result.epochs_trained == 1
    assert np.isfinite(result.train_loss)
    state = torch.load(tmp_path / 'checkpoint.pt', weights_only=True)
    # every convolution and the classifier are preconditioned, and have
    # factors after the two steps
    model = resnet.resnet50(classes=10, width=8)
    expected = {
        name
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Conv2d | torch.nn.Linear)
    }
    layers = state['kfac']['layers']
    assert set(layers) == expected
    assert all(set(factors) == {'A', 'G'} for factors in layers.values())


def test_resnet_examples_need_data_or_synthetic() -> None:
    with pytest.raises(ValueError, match='--data-dir'):
        torch_cifar10_resnet.main(['--workers', '0'])
    with pytest.raises(ValueError, match='--data-dir'):
        torch_imagenet_resnet.main(['--workers', '0'])


#: The string and the float spelling of two different placements on two
#: ranks (MEM-OPT: one gradient worker per layer; COMM-OPT: both).
DDP_STRATEGIES = ('mem_opt', '1.0')


def _ddp_body(tmp: str) -> None:
    assert dist.get_world_size() == 2
    for strategy in DDP_STRATEGIES:
        checkpoint = str(pathlib.Path(tmp) / f'ddp-{strategy}.pt')
        train_ddp.main(
            [*QUICK, '--strategy', strategy, '--checkpoint', checkpoint]
        )
    data_dir = pathlib.Path(tmp) / 'idx'
    histories = fashion_mnist.main(
        _demo_args(data_dir, '--optimizers', 'sgd', 'kfac', '--no-plot')
    )
    assert all(len(h.accuracy) == 2 for h in histories.values())
    cifar = torch_cifar10_resnet.main(
        [
            *RESNET_QUICK,
            '--model',
            'resnet20',
            '--epochs',
            '1',
            '--kfac-strategy',
            'mem_opt',
            '--amp',
            '--checkpoint-dir',
            str(pathlib.Path(tmp) / 'cifar'),
        ]
    )
    assert cifar.epochs_trained == 1
    imagenet = torch_imagenet_resnet.main(
        [*RESNET_QUICK, *IMAGENET_SMALL, '--epochs', '1']
    )
    assert np.isfinite(imagenet.train_loss)


@pytest.mark.timeout(240)
def test_examples_two_processes(tmp_path: pathlib.Path) -> None:
    write_idx_dir(tmp_path / 'idx', train=32, test=20)
    run_distributed(
        _ddp_body, 2, str(tmp_path), tmp_path=tmp_path, timeout=200
    )
    # train_ddp on two ranks equals one process on the same global batches
    train_ddp.main([*QUICK, '--checkpoint', str(tmp_path / 'single.pt')])
    single = torch.load(tmp_path / 'single.pt', weights_only=True)
    for strategy in DDP_STRATEGIES:
        ddp = torch.load(tmp_path / f'ddp-{strategy}.pt', weights_only=True)
        label = f'train_ddp 2 ranks ({strategy}) vs 1'
        expected = {**single['model'], **_factors(single['kfac'])}
        actual = {**ddp['model'], **_factors(ddp['kfac'])}
        assert actual.keys() == expected.keys()
        for key, value in expected.items():
            # measured: up to 1.2e-5 (float32 rounding over four steps)
            assert_rel_close(actual[key], value, rtol=1e-4, label=label)


def _factors(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    """``{'<layer> A': tensor, ...}`` of a K-FAC state dict."""
    return {
        f'{layer} {name}': tensor
        for layer, factors in state['layers'].items()
        for name, tensor in factors.items()
    }


# The character language model (examples/char_lm.py) ------------------------

#: Ten steps of a 2-block model on 8 x 32 characters; evaluated at 0, 5, 10.
LM_QUICK = [
    '--steps',
    '10',
    '--warmup',
    '2',
    '--batch-size',
    '8',
    '--context',
    '32',
    '--width',
    '32',
    '--depth',
    '2',
    '--heads',
    '2',
    '--eval-every',
    '5',
    '--eval-sequences',
    '16',
    '--kfac-inv-update-steps',
    '5',
]


def test_char_lm_learns_and_plots(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plot = tmp_path / 'lm.png'
    threads = torch.get_num_threads()
    histories = char_lm.main([*LM_QUICK, '--plot', str(plot)])
    assert torch.get_num_threads() == threads  # one thread, then restored
    assert list(histories) == ['adamw', 'kfac']
    adamw, kfac = histories['adamw'], histories['kfac']
    defaults = char_lm.main(
        [*LM_QUICK, '--no-plot', '--optimizers', 'kfac-defaults']
    )['kfac-defaults']
    for h in (adamw, kfac, defaults):
        assert h.steps == [0, 5, 10]
        assert h.seconds[0] == 0.0 < h.seconds[1] < h.seconds[2]
        # from about ln(63) = 4.14 nats per character; measured: 3.5 and
        # below after 10 steps with either optimizer
        assert h.val_loss[-1] < h.val_loss[0] - 0.3
    assert adamw.val_loss[0] == kfac.val_loss[0]  # the same start
    assert adamw.val_loss[1] != kfac.val_loss[1]  # K-FAC changed the steps
    assert adamw.val_loss[0] == defaults.val_loss[0]
    assert adamw.val_loss[1] != defaults.val_loss[1]
    assert plot.read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'
    out = capsys.readouterr().out
    assert f'to {adamw.val_loss[-1]:.4f}' in out
    assert 'AdamW + K-FAC' in out


def test_char_lm_corpus_split_and_errors(tmp_path: pathlib.Path) -> None:
    corpus = char_lm.load_corpus(char_lm.CORPUS)
    total = len(corpus.train) + len(corpus.valid)
    blocks = -(-total // char_lm.BLOCK)
    assert len(corpus.valid) == char_lm.BLOCK * (blocks // char_lm.HOLD_OUT)
    assert corpus.vocab == 63 and corpus.alphabet[0] == '\n'
    # the first held-out block is the tenth block of the text
    text = gzip.decompress(char_lm.CORPUS.read_bytes()).decode()
    start = (char_lm.HOLD_OUT - 1) * char_lm.BLOCK
    first = ''.join(corpus.alphabet[i] for i in corpus.valid[:50])
    assert first == text[start : start + 50]
    with pytest.raises(FileNotFoundError, match='--corpus'):
        char_lm.load_corpus(tmp_path / 'missing.txt')
    short = tmp_path / 'short.txt'
    short.write_text('in the beginning')
    with pytest.raises(ValueError, match='at least'):
        char_lm.load_corpus(short)
    history = char_lm.History('kfac', [0, 5, 10], [4.0, 3.0, 2.5], [0, 1, 2])
    assert history.reaching(3.0) == (5, 1)
    assert history.reaching(2.0) is None
    assert '-' in char_lm.format_summary([history], 2.0).splitlines()[1]


def test_demo_seeds_reports_the_defaults_against_sgd(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data_dir = write_idx_dir(tmp_path / 'idx', train=32, test=20)
    out = tmp_path / 'demo.json'
    threads = torch.get_num_threads()
    try:
        document = demo_seeds.main(
            [
                '--seeds',
                '0',
                '1',
                '--optimizers',
                'sgd',
                'kfac-defaults',
                '--out',
                str(out),
                *_demo_args(data_dir),
            ]
        )
    finally:
        torch.set_num_threads(threads)
    assert json.loads(out.read_text()) == json.loads(json.dumps(document))
    assert list(document['seeds']) == ['0', '1']
    runs = document['seeds']['0']
    assert list(runs) == ['sgd', 'kfac-defaults']
    assert len(runs['sgd']['accuracy']) == 2  # before and after one epoch
    text = capsys.readouterr().out
    # the median of the two seeds' accuracies after epoch 1, per optimizer
    for name, label in (
        ('sgd', 'SGD + momentum'),
        ('kfac-defaults', 'SGD + K-FAC (defaults)'),
    ):
        median = statistics.median(
            document['seeds'][s][name]['accuracy'][1] for s in ('0', '1')
        )
        assert f'| {label} | {100 * median:.2f} |' in text
    ok = statistics.median(
        document['seeds'][s]['kfac-defaults']['accuracy'][1]
        for s in ('0', '1')
    ) >= statistics.median(
        document['seeds'][s]['sgd']['accuracy'][1] for s in ('0', '1')
    )
    assert f'after every epoch: {"yes" if ok else "no"}' in text
