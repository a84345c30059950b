"""The distributed oracle on a small language model of today's layers.

An embedding tied to the output head (one layer combining both uses, see
kfac.layers.tied; split into vocabulary tiles by `max_factor_dim` in one
configuration), a Conv1d front end, `nn.MultiheadAttention` (converted:
its q/k/v projections and `out_proj` preconditioned) with a causal mask, a
LayerNorm and an MLP, trained on a token-averaged loss
(`loss_average='batch+sequence'`). For world sizes 1-4, W ranks with
N/W sequences each must give the parameters of one process trained on
all N (float64, relative difference < 1e-9), with both compute methods,
COMM-OPT and MEM-OPT, expand and reduce.
"""

from __future__ import annotations

import pathlib
from typing import Any

import pytest
import torch
from torch import nn

from kfac.preconditioner import KFACPreconditioner
from testing import fsdp
from testing import oracle

LENGTH, VOCAB, WIDTH = fsdp.LENGTH, fsdp.VOCAB, fsdp.WIDTH
STEPS = 3
CONFIGS: list[dict[str, Any]] = [
    {'grad_worker_fraction': 'comm_opt', 'compute_method': 'eigen'},
    {
        'grad_worker_fraction': 'mem_opt',
        'compute_method': 'inverse',
        'allreduce_bucket_cap_mb': 0.0,
        # tiles: the tied vocabulary side, the MLP
        'statistics': fsdp.statistics(kfac_approx='reduce', max_factor_dim=5),
    },
]


class SmallLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.conv = nn.Conv1d(WIDTH, WIDTH, 3, padding=1)
        self.attn = nn.MultiheadAttention(WIDTH, 2, batch_first=True)
        self.norm = nn.LayerNorm(WIDTH)
        self.mlp = nn.Linear(WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.embed.weight
        mask = torch.ones(LENGTH, LENGTH, dtype=torch.bool).triu(1)
        self.register_buffer('mask', mask)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        h = h + self.conv(h.transpose(1, 2)).transpose(1, 2)
        attended = self.attn(h, h, h, attn_mask=self.mask, need_weights=False)
        h = self.norm(h + attended[0])
        out: torch.Tensor = self.head(h + torch.tanh(self.mlp(h)))
        return out


def _fresh() -> nn.Module:
    torch.manual_seed(7)
    return SmallLM().double()


def _train(config: dict[str, Any], part: oracle.Part) -> torch.Tensor:
    model = _fresh()
    wrapped = oracle.wrap(model)
    precon = KFACPreconditioner(
        wrapped,
        **{
            'factor_update_steps': 1,
            'inv_update_steps': 2,
            'damping': 0.01,
            'kl_clip': 0.01,
            'statistics': fsdp.statistics(),
            **config,
        },
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    oracle.train_steps(
        wrapped,
        precon,
        optimizer,
        fsdp.lm_batch,
        range(STEPS),
        part,
        loss=oracle.lm_loss,
    )
    return oracle.flat_params(model)


@pytest.mark.timeout(300)
@pytest.mark.parametrize('world_size', [1, 2, 3, 4])
def test_small_language_model_ddp_equals_one_process(
    world_size: int, tmp_path: pathlib.Path
) -> None:
    precon = KFACPreconditioner(_fresh())
    assert {'attn.q_proj', 'attn.out_proj', 'conv', 'mlp'} <= set(
        precon.layers
    )
    assert 'embed' in precon.layers  # tied in transposed roles: one layer
    assert 'head' not in precon.layers
    outcomes = oracle.run_oracle(
        _train, CONFIGS, world_size, tmp_path=tmp_path, timeout=280
    )
    label = f'DDP small LM W={world_size} vs single process'
    oracle.check_outcomes(outcomes, [label] * len(CONFIGS), rtol=1e-9)
