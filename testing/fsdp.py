"""A small language model and its training loop for the FSDP2 oracles.

The model has every kind of layer K-FAC preconditions under sharding: an
embedding (rows = a vocabulary that no world size of 2-4 divides evenly),
a Conv1d front end, a converted `nn.MultiheadAttention` (its packed
`in_proj_weight` is split by rows across ranks and read as three
projections), a LayerNorm (left to the optimizer), an MLP with an uneven
width and an output head. `shard()` wraps it as FSDP2 users do: each
block, then the root.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from kfac.config import StatisticsConfig
from kfac.layers.attention import convert_attention
from kfac.preconditioner import KFACPreconditioner
from testing.oracle import lm_loss
from testing.oracle import train_steps

GLOBAL_BATCH = 12  # divisible by 1, 2, 3 and 4
LENGTH, VOCAB, WIDTH, HIDDEN = 6, 13, 8, 7
STEPS = 3


class ShardLM(nn.Module):
    """Embedding, Conv1d, attention, LayerNorm, MLP, head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.conv = nn.Conv1d(WIDTH, WIDTH, 3, padding=1)
        self.attn = nn.MultiheadAttention(WIDTH, 2, batch_first=True)
        self.norm = nn.LayerNorm(WIDTH)
        self.up = nn.Linear(WIDTH, HIDDEN)
        self.down = nn.Linear(HIDDEN, WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        mask = torch.ones(LENGTH, LENGTH, dtype=torch.bool).triu(1)
        self.register_buffer('mask', mask)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        h = h + self.conv(h.transpose(1, 2)).transpose(1, 2)
        attended = self.attn(h, h, h, attn_mask=self.mask, need_weights=False)
        h = self.norm(h + attended[0])
        h = h + self.down(torch.tanh(self.up(h)))
        out: torch.Tensor = self.head(h)
        return out


def fresh() -> ShardLM:
    """The model in float64 with fixed initial weights, attention converted
    (as FSDP2 users must, before `fully_shard`).
    """
    torch.manual_seed(7)
    model = ShardLM().double()
    convert_attention(model)
    return model


def shard(model: nn.Module, **kwargs: Any) -> nn.Module:
    """`fully_shard` each block, then the root (keyword arguments to all)."""
    from torch.distributed.fsdp import fully_shard

    for block in ('conv', 'attn', 'up', 'down'):
        fully_shard(getattr(model, block), **kwargs)
    fully_shard(model, **kwargs)
    return model


def batch(step: int) -> torch.Tensor:
    """The global batch of tokens of `step`, the same on every rank."""
    generator = torch.Generator().manual_seed(step)
    return torch.randint(
        0, VOCAB, (GLOBAL_BATCH, LENGTH + 1), generator=generator
    )


def lm_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`(inputs, targets)` of `step`: the tokens of `batch(step)` and the
    same tokens shifted by one.
    """
    tokens = batch(step)
    return tokens[:, :-1], tokens[:, 1:]


def statistics(**options: Any) -> StatisticsConfig:
    """The oracles' statistics: a loss averaged over tokens, `options`."""
    return StatisticsConfig(loss_average='batch+sequence', **options)


def build(
    model: nn.Module, config: dict[str, Any]
) -> tuple[KFACPreconditioner, torch.optim.Optimizer]:
    """The preconditioner (with `config`; its statistics default to
    `statistics()`) and optimizer of the oracles.
    """
    precon = KFACPreconditioner(
        model,
        **{
            'factor_update_steps': 1,
            'inv_update_steps': 2,
            'damping': 0.01,
            'kl_clip': 0.01,
            'statistics': statistics(),
            **config,
        },
    )
    return precon, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def run(
    model: nn.Module,
    precon: KFACPreconditioner | None,
    optimizer: torch.optim.Optimizer,
    steps: range,
    part: tuple[int, int] = (0, 1),
) -> None:
    """Train on part `i` of `n` of the global batch of each step."""
    train_steps(model, precon, optimizer, lm_batch, steps, part, loss=lm_loss)


def train(
    model: nn.Module,
    config: dict[str, Any] | None,
    part: tuple[int, int] = (0, 1),
    steps: int = STEPS,
) -> KFACPreconditioner | None:
    """SGD (+ K-FAC with `config`, unless None) for `steps` steps on part
    `i` of `n` of each global batch; returns the preconditioner.
    """
    if config is None:
        sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        run(model, None, sgd, range(steps), part)
        return None
    precon, optimizer = build(model, config)
    run(model, precon, optimizer, range(steps), part)
    return precon


def whole_params(model: nn.Module) -> torch.Tensor:
    """Every parameter, whole (DTensors gathered), flattened; a collective
    when the model is sharded.
    """
    from torch.distributed.tensor import DTensor

    parts = []
    for param in model.parameters():
        whole = param.full_tensor() if isinstance(param, DTensor) else param
        parts.append(whole.detach().reshape(-1))
    return torch.cat(parts)


def local_params(model: nn.Module) -> torch.Tensor:
    """This rank's shards of every parameter, flattened."""
    from torch.distributed.tensor import DTensor

    return torch.cat(
        [
            (p.to_local() if isinstance(p, DTensor) else p)
            .detach()
            .reshape(-1)
            for p in model.parameters()
        ]
    )


def replicas_equal(model: nn.Module, group: dist.ProcessGroup) -> bool:
    """Whether this rank's shards equal, bitwise, those of every rank of
    `group` (the replicas of an HSDP mesh).
    """
    mine = local_params(model)
    copies = [
        torch.empty_like(mine) for _ in range(dist.get_world_size(group))
    ]
    dist.all_gather(copies, mine, group=group)
    return all(torch.equal(copy, mine) for copy in copies)
