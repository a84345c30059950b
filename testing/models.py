"""Tiny models and data for tests."""

from __future__ import annotations

import torch
from torch import nn


class TinyMLP(nn.Module):
    """``in -> hidden -> out`` with a tanh; biases optional."""

    def __init__(
        self,
        n_in: int = 6,
        hidden: int = 5,
        n_out: int = 3,
        bias: bool = True,
    ) -> None:
        super().__init__()
        self.fc1 = nn.Linear(n_in, hidden, bias=bias)
        self.fc2 = nn.Linear(hidden, n_out, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.fc2(torch.tanh(self.fc1(x)))
        return out


class TinyCNN(nn.Module):
    """Two convolutions (one strided, one dilated) and a Linear head."""

    def __init__(self, channels: int = 2, classes: int = 3) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, 4, 3, stride=2, padding=1)
        self.conv2 = nn.Conv2d(4, 3, 3, padding='same', dilation=2, bias=False)
        self.fc = nn.Linear(3 * 4 * 4, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.conv1(x))
        h = torch.tanh(self.conv2(h))
        out: torch.Tensor = self.fc(h.flatten(1))
        return out


class PooledCNN(TinyCNN):
    """[`TinyCNN`][testing.models.TinyCNN] with the head on the channels'
    spatial means: a `Linear(3, classes)`, so every factor has full rank
    from a dozen examples on (EKFAC's scaling and a warm-started basis
    depend on the eigenvectors chosen inside a repeated eigenvalue, which
    follow rounding: the distributed oracles need distinct eigenvalues).
    """

    def __init__(self, channels: int = 2, classes: int = 3) -> None:
        super().__init__(channels, classes)
        self.fc = nn.Linear(3, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.conv1(x))
        h = torch.tanh(self.conv2(h))
        out: torch.Tensor = self.fc(h.mean(dim=(2, 3)))
        return out


class BranchNet(nn.Module):
    """A model whose ``branch`` layer runs only when ``use_branch`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 4)
        self.branch = nn.Linear(4, 4)
        self.fc2 = nn.Linear(4, 2)
        self.use_branch = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.fc1(x))
        if self.use_branch:
            h = self.branch(h)
        out: torch.Tensor = self.fc2(h)
        return out


class AttentionNet(nn.Module):
    """Self-attention over ``(N, T, d)`` whose ``out_proj`` never runs as a
    module (the attention kernel uses its weight functionally).
    """

    def __init__(self, d: int = 8, classes: int = 3) -> None:
        super().__init__()
        self.embed = nn.Linear(d, d)
        self.attn = nn.MultiheadAttention(d, 2, batch_first=True)
        self.head = nn.Linear(d, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        h, _ = self.attn(h, h, h, need_weights=False)
        out: torch.Tensor = self.head(h.mean(dim=1))
        return out


def classification_data(
    n: int,
    shape: tuple[int, ...],
    classes: int = 3,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random inputs of ``shape`` per example and integer labels."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn((n, *shape), generator=gen, dtype=dtype)
    y = torch.randint(0, classes, (n,), generator=gen)
    return x, y
