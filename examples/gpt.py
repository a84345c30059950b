"""A small GPT-style causal language model, written for the examples.

``token embedding + learned position embedding → depth × pre-norm block →
LayerNorm → output head tied to the token embedding``. Each block is
``x + attention(LayerNorm(x))`` then ``x + MLP(LayerNorm(x))``, with
:class:`torch.nn.MultiheadAttention` under a causal mask and a 4x-wide GELU
MLP. Every module is one K-FAC knows: the attention is converted to
separate q/k/v/out projections by the preconditioner, the embeddings get a
diagonal input factor, the LayerNorms stay with the optimizer, and the head
shares its weight with the token embedding (see the registration report,
``KFACPreconditioner.describe()``).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ['GPT', 'GPTConfig']


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """The network's sizes."""

    vocab: int
    context: int = 128
    width: int = 128
    depth: int = 4
    heads: int = 4

    def __post_init__(self) -> None:
        if self.width % self.heads:
            raise ValueError(
                f'width {self.width} must be a multiple of heads {self.heads}'
            )


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention, then the MLP."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(config.width)
        self.attn = nn.MultiheadAttention(
            config.width, config.heads, batch_first=True
        )
        self.ln2 = nn.LayerNorm(config.width)
        self.fc = nn.Linear(config.width, 4 * config.width)
        self.proj = nn.Linear(4 * config.width, config.width)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """``x`` of shape ``(batch, time, width)``; ``mask`` ``(T, T)``."""
        h = self.ln1(x)
        attended, _ = self.attn(h, h, h, attn_mask=mask, need_weights=False)
        x = x + attended
        out: torch.Tensor = x + self.proj(F.gelu(self.fc(self.ln2(x))))
        return out


class GPT(nn.Module):
    """The language model: token ids ``(batch, time)`` to logits.

    The output head has no bias and *is* the token embedding's weight
    (``head.weight is embed.weight``), as in GPT-2.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab, config.width)
        self.pos = nn.Embedding(config.context, config.width)
        blocks = [Block(config) for _ in range(config.depth)]
        self.blocks = nn.ModuleList(blocks)
        self.ln = nn.LayerNorm(config.width)
        self.head = nn.Linear(config.width, config.vocab, bias=False)
        self.head.weight = self.embed.weight
        causal = torch.ones(config.context, config.context).triu(1).bool()
        self.register_buffer('causal', causal, persistent=False)
        self.apply(_init)
        for block in blocks:  # residual branches scaled as in GPT-2
            for proj in (block.attn.out_proj, block.proj):
                nn.init.normal_(
                    proj.weight, std=0.02 / (2 * config.depth) ** 0.5
                )

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits of shape ``(batch, time, vocab)``."""
        t = tokens.shape[1]
        if t > self.config.context:
            raise ValueError(
                f'sequence of {t} tokens is longer than the context '
                f'({self.config.context})'
            )
        positions = torch.arange(t, device=tokens.device).expand_as(tokens)
        x = self.embed(tokens) + self.pos(positions)
        mask = self.get_buffer('causal')[:t, :t]
        for block in self.blocks:
            x = block(x, mask)
        logits: torch.Tensor = self.head(self.ln(x))
        return logits


def _init(module: nn.Module) -> None:
    """GPT-2's initialisation: N(0, 0.02) weights, zero biases."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)
    if isinstance(module, nn.MultiheadAttention):
        assert module.in_proj_weight is not None
        nn.init.normal_(module.in_proj_weight, std=0.02)
        if module.in_proj_bias is not None:
            nn.init.zeros_(module.in_proj_bias)
