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

import json
import pathlib
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from kfac.preconditioner import KFACPreconditioner
from testing.asserts import WORST
from testing.ddp import compare_ranks
from testing.ddp import flat_params
from testing.distributed import run_distributed

GLOBAL_BATCH = 12  # divisible by 1, 2, 3 and 4
LENGTH, VOCAB, WIDTH = 6, 13, 8
STEPS = 3
CONFIGS: list[dict[str, Any]] = [
    {'grad_worker_fraction': 'comm_opt', 'compute_method': 'eigen'},
    {
        'grad_worker_fraction': 'mem_opt',
        'compute_method': 'inverse',
        'kfac_approx': 'reduce',
        'allreduce_bucket_cap_mb': 0.0,
        'max_factor_dim': 5,  # tiles: the tied vocabulary side, the MLP
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


def _train(
    model: nn.Module, config: dict[str, Any], rank: int, world: int
) -> None:
    wrapped = model
    if dist.is_initialized():
        wrapped = nn.parallel.DistributedDataParallel(model)
    precon = KFACPreconditioner(
        wrapped,
        loss_average='batch+sequence',
        inv_update_steps=2,
        damping=0.01,
        kl_clip=0.01,
        **config,
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    per_rank = GLOBAL_BATCH // world
    for step in range(STEPS):
        generator = torch.Generator().manual_seed(step)
        tokens = torch.randint(
            0, VOCAB, (GLOBAL_BATCH, LENGTH + 1), generator=generator
        )
        mine = tokens[rank * per_rank : (rank + 1) * per_rank]
        optimizer.zero_grad()
        logits = wrapped(mine[:, :-1])
        F.cross_entropy(logits.flatten(0, 1), mine[:, 1:].flatten()).backward()
        precon.step()
        optimizer.step()


def _fresh() -> nn.Module:
    torch.manual_seed(7)
    return SmallLM().double()


def _body(world: int, out_dir: str) -> None:
    rank = dist.get_rank()
    expected = torch.load(pathlib.Path(out_dir) / 'expected.pt')
    results = []
    for index, config in enumerate(CONFIGS):
        model = _fresh()
        _train(model, config, rank, world)
        across, versus = compare_ranks(model, expected[index])
        results.append((across, versus))
        assert across < 1e-12, (config, across)
        assert versus < 1e-9, (config, versus)
    if rank == 0:
        (pathlib.Path(out_dir) / 'results.json').write_text(
            json.dumps(results)
        )


@pytest.mark.timeout(300)
@pytest.mark.parametrize('world_size', [1, 2, 3, 4])
def test_small_language_model_ddp_equals_one_process(
    world_size: int, tmp_path: pathlib.Path
) -> None:
    expected = []
    for config in CONFIGS:
        model = _fresh()
        _train(model, config, 0, 1)
        expected.append(flat_params(model))
    torch.save(expected, tmp_path / 'expected.pt')
    precon = KFACPreconditioner(_fresh())
    assert {'attn.q_proj', 'attn.out_proj', 'conv', 'mlp'} <= set(
        precon.layers
    )
    assert 'embed' in precon.layers  # tied in transposed roles: one layer
    assert 'head' not in precon.layers
    run_distributed(
        _body,
        world_size,
        world_size,
        str(tmp_path),
        tmp_path=tmp_path,
        timeout=280,
    )
    results = json.loads((tmp_path / 'results.json').read_text())
    assert len(results) == len(CONFIGS)
    for _, versus in results:
        label = f'DDP small LM W={world_size} vs single process'
        WORST[label] = max(WORST.get(label, 0.0), versus)
        assert versus > 0 or world_size == 1  # ranks really split the batch
