"""The study's tasks: a model, its data, its loss and its metric.

(a) `cnn`: the small CNN of the learning-rate issue on Fashion-MNIST
    (`Conv2d(1,16,5,p=2)`-ReLU-MaxPool2-`Conv2d(16,32,5,p=2)`-ReLU-MaxPool2-
    `Linear(1568,128)`-ReLU-`Linear(128,10)`), batch 128, 5 epochs, no
    schedule; test accuracy every half epoch (higher is better).
(b) `gpt`: a byte-level GPT (2 pre-norm blocks, width 128, 4 heads,
    `nn.Linear` q/k/v/proj, a 4x MLP, the head tied to the byte embedding,
    64-token context) on the committed King James corpus, batch 32, 600
    steps, gradient norm clipped at 1.0; validation loss (nats per byte)
    every 25 steps (lower is better).
(c) `autoencoder`: a deep autoencoder on Fashion-MNIST
    (784-400-200-100-30-100-200-400-784, tanh, linear output), mean squared
    reconstruction error of the standardised pixels, batch 256, 5 epochs;
    test reconstruction error every half epoch (lower is better). Chosen
    before any tuning: deep autoencoders are the classic case of
    ill-conditioned curvature where K-FAC was first shown to help (Martens
    & Grosse, 2015).

Every task draws its initial weights and its batch order from the seed, so
that all optimizers of one seed see the same initial weights and batches.
"""

from __future__ import annotations

import dataclasses
import gzip
import itertools
import math
import pathlib
from collections.abc import Callable
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from examples import data as image_data

CORPUS = (
    pathlib.Path(__file__).parents[2] / 'examples' / 'corpus' / 'kjv.txt.gz'
)

Batch = tuple[torch.Tensor, torch.Tensor]


@dataclasses.dataclass(frozen=True)
class Task:
    """One training problem, fixed before any optimizer is chosen."""

    name: str
    steps: int
    eval_every: int
    higher_is_better: bool
    metric: str
    build: Callable[[int], nn.Module]
    """The model for a seed (same seed, same initial weights)."""
    batches: Callable[[int], Iterator[Batch]]
    """The training batches for a seed, at least `steps` of them."""
    criterion: Callable[[torch.Tensor, Batch], torch.Tensor]
    """The loss of the model's output on a batch."""
    evaluate: Callable[[nn.Module], float]
    fisher: str = 'cross_entropy'
    """The loss `sample_fisher` samples targets for (the MC Fisher)."""
    clip_norm: float | None = None
    matrices: Callable[[nn.Module], list[torch.Tensor]] = lambda m: []
    """The 2-D hidden weights Muon trains (AdamW trains the rest)."""

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        """The training loss of `model` on `batch`."""
        return self.criterion(model(batch[0]), batch)

    def better(self, a: float, b: float) -> bool:
        """Whether metric `a` is at least as good as `b`."""
        return a >= b if self.higher_is_better else a <= b


def _epochs(
    count: int, batch: int, epochs: int, seed: int
) -> Iterator[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    for _ in range(epochs):
        order = torch.randperm(count, generator=generator)
        for first in range(0, count - batch + 1, batch):
            yield order[first : first + batch]


def _hidden_linears(model: nn.Module, drop_first: bool) -> list[torch.Tensor]:
    """The weights of `model`'s Linear layers but the last (the output)
    and, with `drop_first`, the first (the input).
    """
    weights = [m.weight for m in model.modules() if isinstance(m, nn.Linear)]
    return weights[int(drop_first) : -1]


def _device(model: nn.Module) -> torch.device:
    """Where `model`'s parameters are (the evaluation's data goes there)."""
    return next(model.parameters()).device


def _cross_entropy(output: torch.Tensor, batch: Batch) -> torch.Tensor:
    return F.cross_entropy(output, batch[1])


@torch.no_grad()
def _accuracy(
    model: nn.Module, images: torch.Tensor, labels: torch.Tensor
) -> float:
    model.eval()
    device = _device(model)
    correct = sum(
        int((model(x.to(device)).argmax(1).cpu() == y).sum())
        for x, y in zip(images.split(1000), labels.split(1000), strict=True)
    )
    model.train()
    return 100.0 * correct / len(labels)


def cnn_model(seed: int) -> nn.Module:
    """The CNN of task (a), its weights drawn from `seed`."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(1, 16, 5, padding=2),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 5, padding=2),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(1568, 128),
        nn.ReLU(),
        nn.Linear(128, 10),
    )


def cnn(
    images: image_data.ImageData, epochs: int = 5, batch: int = 128
) -> Task:
    """Task (a) on `images` (Fashion-MNIST)."""
    count = len(images.train_labels)
    per_epoch = count // batch

    def batches(seed: int) -> Iterator[Batch]:
        for index in _epochs(count, batch, epochs, seed):
            yield images.train_images[index], images.train_labels[index]

    return Task(
        name='cnn',
        steps=per_epoch * epochs,
        eval_every=per_epoch // 2,
        higher_is_better=True,
        metric='test accuracy (%)',
        build=cnn_model,
        batches=batches,
        criterion=_cross_entropy,
        evaluate=lambda m: _accuracy(
            m, images.test_images, images.test_labels
        ),
        # Muon: the one 2-D hidden weight (the convolutions are 4-D).
        matrices=lambda m: _hidden_linears(m, drop_first=False),
    )


class _Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(width)
        self.q = nn.Linear(width, width)
        self.k = nn.Linear(width, width)
        self.v = nn.Linear(width, width)
        self.proj = nn.Linear(width, width)
        self.ln2 = nn.LayerNorm(width)
        self.fc = nn.Linear(width, 4 * width)
        self.out = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, t, w = x.shape
        h = self.ln1(x)
        q, k, v = (
            layer(h).view(n, t, self.heads, w // self.heads).transpose(1, 2)
            for layer in (self.q, self.k, self.v)
        )
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(n, t, w))
        out: torch.Tensor = x + self.out(F.gelu(self.fc(self.ln2(x))))
        return out


class ByteGPT(nn.Module):
    """The GPT of task (b): bytes in, logits over the 256 bytes out."""

    def __init__(
        self, context: int = 64, width: int = 128, depth: int = 2
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(256, width)
        self.pos = nn.Parameter(torch.zeros(context, width))
        self.blocks = nn.ModuleList(_Block(width, 4) for _ in range(depth))
        self.ln = nn.LayerNorm(width)
        self.head = nn.Linear(width, 256, bias=False)
        self.head.weight = self.embed.weight
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
        nn.init.normal_(self.pos, std=0.02)
        for block in self.modules():
            if not isinstance(block, _Block):
                continue
            for layer in (block.proj, block.out):
                nn.init.normal_(layer.weight, std=0.02 / math.sqrt(2 * depth))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits `(batch, time, 256)` of byte ids `(batch, time)`."""
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        logits: torch.Tensor = self.head(self.ln(x))
        return logits


def _lm_loss(logits: torch.Tensor, batch: Batch) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), batch[1].flatten())


def load_bytes(
    path: pathlib.Path = CORPUS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The corpus as bytes: the training text, and every 10th 8 KiB block
    held out.
    """
    raw = (
        gzip.decompress(path.read_bytes())
        if path.suffix == '.gz'
        else path.read_bytes()
    )
    ids = torch.frombuffer(bytearray(raw), dtype=torch.uint8).long()
    blocks = ids.split(8192)
    held = [b for i, b in enumerate(blocks) if i % 10 == 9]
    kept = [b for i, b in enumerate(blocks) if i % 10 != 9]
    return torch.cat(kept), torch.cat(held)


def _windows(
    ids: torch.Tensor, count: int, length: int, generator: torch.Generator
) -> Batch:
    starts = torch.randint(0, len(ids) - length, (count,), generator=generator)
    chunk = ids[starts[:, None] + torch.arange(length + 1)]
    return chunk[:, :-1], chunk[:, 1:]


def gpt(
    text: tuple[torch.Tensor, torch.Tensor],
    steps: int = 600,
    batch: int = 32,
    context: int = 64,
    valid_windows: int = 256,
) -> Task:
    """Task (b) on `text` (training and held-out byte ids)."""
    train, held = text
    valid = _windows(
        held, valid_windows, context, torch.Generator().manual_seed(1234)
    )

    def batches(seed: int) -> Iterator[Batch]:
        generator = torch.Generator().manual_seed(seed)
        while True:
            yield _windows(train, batch, context, generator)

    def build(seed: int) -> nn.Module:
        torch.manual_seed(seed)
        return ByteGPT(context)

    @torch.no_grad()
    def evaluate(model: nn.Module) -> float:
        model.eval()
        device = _device(model)
        losses = [
            float(_lm_loss(model(x.to(device)), (x, y.to(device))))
            for x, y in zip(
                valid[0].split(64), valid[1].split(64), strict=True
            )
        ]
        model.train()
        return sum(losses) / len(losses)

    return Task(
        name='gpt',
        steps=steps,
        eval_every=25,
        higher_is_better=False,
        metric='validation loss (nats/byte)',
        build=build,
        batches=batches,
        criterion=_lm_loss,
        evaluate=evaluate,
        clip_norm=1.0,
        matrices=lambda m: [
            p
            for n, p in m.named_parameters()
            if n.startswith('blocks.') and p.ndim == 2
        ],
    )


def autoencoder_model(seed: int) -> nn.Module:
    """The deep autoencoder of task (c), its weights drawn from `seed`."""
    torch.manual_seed(seed)
    sizes = [784, 400, 200, 100, 30, 100, 200, 400, 784]
    layers: list[nn.Module] = [nn.Flatten()]
    for i, (fan_in, fan_out) in enumerate(itertools.pairwise(sizes)):
        layers.append(nn.Linear(fan_in, fan_out))
        if i < len(sizes) - 2:
            layers.append(nn.Tanh())
    return nn.Sequential(*layers)


def _reconstruction(output: torch.Tensor, batch: Batch) -> torch.Tensor:
    return F.mse_loss(output, batch[0].flatten(1))


def autoencoder(
    images: image_data.ImageData, epochs: int = 5, batch: int = 256
) -> Task:
    """Task (c) on `images` (Fashion-MNIST)."""
    count = len(images.train_labels)
    per_epoch = count // batch

    def batches(seed: int) -> Iterator[Batch]:
        for index in _epochs(count, batch, epochs, seed):
            x = images.train_images[index]
            yield x, x

    @torch.no_grad()
    def evaluate(model: nn.Module) -> float:
        device = _device(model)
        total = sum(
            float(_reconstruction(model(x), (x, x))) * len(x)
            for x in images.test_images.to(device).split(2000)
        )
        return total / len(images.test_images)

    return Task(
        name='autoencoder',
        steps=per_epoch * epochs,
        eval_every=per_epoch // 2,
        higher_is_better=False,
        metric='test reconstruction error (MSE)',
        build=autoencoder_model,
        batches=batches,
        criterion=_reconstruction,
        fisher='mse',
        evaluate=evaluate,
        matrices=lambda m: _hidden_linears(m, drop_first=True),
    )


def load(name: str) -> Task:
    """Task `name` on its real data (the name is checked before any data
    is read).
    """
    if name not in ('cnn', 'gpt', 'autoencoder'):
        raise ValueError(
            f"task must be 'cnn', 'gpt' or 'autoencoder'; got {name!r}"
        )
    if name == 'gpt':
        return gpt(load_bytes())
    images = image_data.load_image_data(fallback=False)
    return cnn(images) if name == 'cnn' else autoencoder(images)
