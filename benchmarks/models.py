"""The benchmark models, written here (torchvision is not a dependency).

* :class:`MLP`: 64-512-512-10 with ReLU.
* :class:`ResNet20`: the CIFAR-10 ResNet-20 of He et al. (2016), option A
  (parameter-free, zero-padded) shortcuts, 0.27M parameters.
* :class:`Transformer`: a byte-level causal language model of pre-norm
  blocks whose attention uses explicit ``q``, ``k``, ``v`` and ``out``
  :class:`torch.nn.Linear` projections and
  :func:`torch.nn.functional.scaled_dot_product_attention`, so K-FAC
  preconditions every projection (``nn.MultiheadAttention`` would hide
  ``out_proj`` behind a functional call).
* ``gpt``: :class:`examples.gpt.GPT`, a GPT-style byte-level model as
  people write it: token and learned position embeddings,
  :class:`torch.nn.MultiheadAttention` (converted by the preconditioner),
  an output head tied to the token embedding, 4 blocks of width 128,
  batches of 32 x 128 = 4096 tokens, a loss averaged over tokens
  (``loss_average='batch+sequence'``); nothing skipped.

:func:`build` returns a model with a fixed batch of synthetic data and a
loss function for each benchmark name.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from examples.gpt import GPT
from examples.gpt import GPTConfig

__all__ = [
    'GPT_BENCH',
    'MLP',
    'MODELS',
    'SKIP_LAYERS',
    'Bench',
    'ResNet20',
    'Transformer',
    'build',
]


class MLP(nn.Module):
    """``64 -> 512 -> 512 -> 10`` with ReLU activations."""

    def __init__(self, sizes: tuple[int, ...] = (64, 512, 512, 10)) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            nn.Linear(a, b) for a, b in itertools.pairwise(sizes)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = torch.relu(x)
        return x


class _BasicBlock(nn.Module):
    """Two 3x3 convolutions with batch norm and an option-A shortcut."""

    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.stride = stride
        self.pad = c_out - c_in

    def shortcut(self, x: torch.Tensor) -> torch.Tensor:
        """Identity, or subsample and zero-pad the channels (option A)."""
        if self.stride == 1 and self.pad == 0:
            return x
        x = x[:, :, :: self.stride, :: self.stride]
        half = self.pad // 2
        return F.pad(x, (0, 0, 0, 0, half, self.pad - half))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return torch.relu(out + self.shortcut(x))


class ResNet20(nn.Module):
    """CIFAR ResNet-20: 3 stages of 3 basic blocks (16, 32, 64 channels)."""

    def __init__(self, classes: int = 10, blocks: int = 3) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 16, 3, 1, 1, bias=False)
        self.bn = nn.BatchNorm2d(16)
        layers: list[nn.Module] = []
        c_in = 16
        for stage, width in enumerate((16, 32, 64)):
            for block in range(blocks):
                stride = 2 if stage > 0 and block == 0 else 1
                layers.append(_BasicBlock(c_in, width, stride))
                c_in = width
        self.blocks = nn.Sequential(*layers)
        self.fc = nn.Linear(64, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        x = torch.relu(self.bn(self.conv(x)))
        x = self.blocks(x)
        out: torch.Tensor = self.fc(x.mean(dim=(2, 3)))
        return out


class _Attention(nn.Module):
    """Causal multi-head self-attention with explicit Linear projections."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.q = nn.Linear(width, width)
        self.k = nn.Linear(width, width)
        self.v = nn.Linear(width, width)
        self.out = nn.Linear(width, width)

    def _split(self, x: torch.Tensor) -> torch.Tensor:
        n, t, d = x.shape
        return x.view(n, t, self.heads, d // self.heads).transpose(1, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (self._split(f(x)) for f in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out: torch.Tensor = self.out(y.transpose(1, 2).flatten(2))
        return out


class _Block(nn.Module):
    """Pre-norm transformer block: attention then a 4x-wide GELU MLP."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(width)
        self.attn = _Attention(width, heads)
        self.ln2 = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, 4 * width)
        self.fc2 = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        out: torch.Tensor = x + self.fc2(F.gelu(self.fc1(self.ln2(x))))
        return out


class Transformer(nn.Module):
    """Byte-level causal language model (4 blocks, width 256, 4 heads)."""

    def __init__(
        self,
        vocab: int = 256,
        width: int = 256,
        depth: int = 4,
        heads: int = 4,
        seq: int = 64,
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.pos = nn.Parameter(torch.randn(seq, width) * 0.02)
        self.blocks = nn.Sequential(
            *(_Block(width, heads) for _ in range(depth))
        )
        self.ln = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # noqa: D102
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        out: torch.Tensor = self.head(self.ln(self.blocks(x)))
        return out


Loss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

SKIP_LAYERS = ('Embedding',)
"""What the benchmarks leave to the optimizer: embeddings (preconditioned by
the library since it gained them) stay out, so that the figures compare
with earlier runs and the floor model (Linear and Conv2d layers) covers
every layer K-FAC preconditions."""


def _sequence_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


#: Synthetic batches per benchmark, used in turn (so that training does
#: not drive the loss, and with it every statistic, to zero).
BATCHES = 4


@dataclasses.dataclass
class Bench:
    """A model, :data:`BATCHES` fixed batches and its loss.

    ``inputs[k]`` and ``target[k]`` are batch ``k``. ``skip_layers`` and
    ``kfac_options`` go to :class:`~kfac.preconditioner.KFACPreconditioner`,
    ``loss_average`` to its statistics;
    ``approximations`` are the ``kfac_approx`` values benchmarked (reduce
    only where layers share weights across positions); ``low_rank`` adds
    EIGEN with ``factor_rank=64``.
    """

    name: str
    model: nn.Module
    inputs: torch.Tensor
    target: torch.Tensor
    loss: Loss
    skip_layers: tuple[str, ...] = SKIP_LAYERS
    kfac_options: dict[str, Any] = dataclasses.field(default_factory=dict)
    loss_average: str | None = 'batch'
    approximations: tuple[str, ...] = ('expand', 'reduce')
    low_rank: bool = False


def _mlp(generator: torch.Generator) -> Bench:
    x = torch.randn(BATCHES, 128, 64, generator=generator)
    y = torch.randint(0, 10, (BATCHES, 128), generator=generator)
    return Bench(
        'mlp',
        MLP(),
        x,
        y,
        F.cross_entropy,
        approximations=('expand',),
        low_rank=True,
    )


def _resnet20(generator: torch.Generator) -> Bench:
    x = torch.randn(BATCHES, 128, 3, 32, 32, generator=generator)
    y = torch.randint(0, 10, (BATCHES, 128), generator=generator)
    return Bench('resnet20', ResNet20(), x, y, F.cross_entropy)


def _transformer(generator: torch.Generator) -> Bench:
    tokens = torch.randint(0, 256, (BATCHES, 16, 65), generator=generator)
    return Bench(
        'transformer',
        Transformer(),
        tokens[:, :, :-1],
        tokens[:, :, 1:],
        _sequence_loss,
    )


#: The GPT benchmark's sizes: 32 sequences of 128 bytes (4096 tokens).
GPT_BENCH = GPTConfig(vocab=256, context=128, width=128, depth=4, heads=4)
GPT_BATCH = 32


def _gpt(generator: torch.Generator) -> Bench:
    shape = (BATCHES, GPT_BATCH, GPT_BENCH.context + 1)
    tokens = torch.randint(0, GPT_BENCH.vocab, shape, generator=generator)
    return Bench(
        'gpt',
        GPT(GPT_BENCH),
        tokens[:, :, :-1],
        tokens[:, :, 1:],
        _sequence_loss,
        skip_layers=(),
        loss_average='batch+sequence',
    )


#: Benchmark name -> builder taking a seeded generator.
MODELS: dict[str, Callable[[torch.Generator], Bench]] = {
    'mlp': _mlp,
    'resnet20': _resnet20,
    'transformer': _transformer,
    'gpt': _gpt,
}


def build(name: str, seed: int = 0) -> Bench:
    """Return benchmark ``name`` (a key of :data:`MODELS`), seeded."""
    if name not in MODELS:
        raise ValueError(f'unknown model {name!r}; known: {sorted(MODELS)}')
    torch.manual_seed(seed)
    return MODELS[name](torch.Generator().manual_seed(seed))
