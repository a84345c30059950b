"""The distributed oracle with an nn.Embedding: W ranks equal one process.

The diagonal factor `A` of an embedding is allreduced as a vector (with
and without symmetry-aware packing, bucketed and not), its decomposition
placed by KAISA and broadcast like any other. For world sizes 1-3, COMM-OPT
and MEM-OPT (and HYBRID-OPT where the world size is even), EIGEN with and
without the eigenvalue outer product and INVERSE, a few DDP steps must give
parameters equal on all ranks and equal to one process trained on the
whole batch (float64, relative difference < 1e-9). One launch per world
size loops over the configurations (gloo on the CPU).
"""

from __future__ import annotations

import itertools
import pathlib
from typing import Any

import pytest
import torch
from torch import nn

from kfac.placement import valid_grad_worker_fractions
from kfac.preconditioner import KFACPreconditioner
from testing import oracle

GLOBAL_BATCH = 6  # divisible by 1, 2 and 3
POSITIONS = 5
VOCAB, DIM, CLASSES = 11, 4, 3
STEPS = 3
METHODS: list[dict[str, Any]] = [
    {'compute_method': 'eigen'},
    {'compute_method': 'eigen', 'compute_eigenvalue_outer_product': False},
    {'compute_method': 'inverse', 'colocate_factors': False},
]


def configurations(world_size: int) -> list[dict[str, Any]]:
    """Every strategy and method; packing and bucketing alternate."""
    strategies = ['comm_opt', 'mem_opt']
    if world_size == 1 or 0.5 in valid_grad_worker_fractions(world_size):
        strategies.append('hybrid_opt')
    configs = []
    for index, (strategy, method) in enumerate(
        itertools.product(strategies, METHODS)
    ):
        configs.append(
            {
                'grad_worker_fraction': strategy,
                'allreduce_bucket_cap_mb': 25.0 if index % 2 else 0.0,
                'symmetry_aware': index % 3 != 0,
                'factor_update_steps': 1,
                'inv_update_steps': 2,
                'damping': 0.01,
                'kl_clip': 0.01,
                'lr': 0.1,
                **method,
            }
        )
    return configs


class Tokens(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM, padding_idx=0)
        self.head = nn.Linear(DIM, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(torch.tanh(self.embed(x)).mean(dim=1))
        return out


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    x = torch.randint(0, VOCAB, (GLOBAL_BATCH, POSITIONS), generator=generator)
    y = torch.randint(0, CLASSES, (GLOBAL_BATCH,), generator=generator)
    return x, y


def train(config: dict[str, Any], part: oracle.Part) -> torch.Tensor:
    torch.manual_seed(1234)
    model = Tokens().double()
    wrapped = oracle.wrap(model)
    precon = KFACPreconditioner(wrapped, **config)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    oracle.train_steps(wrapped, precon, optimizer, _batch, range(STEPS), part)
    return oracle.flat_params(model)


@pytest.mark.timeout(200)
@pytest.mark.parametrize('world_size', [1, 2, 3])
def test_ddp_with_an_embedding_equals_single_process(
    world_size: int, tmp_path: pathlib.Path
) -> None:
    configs = configurations(world_size)
    trained = {config['grad_worker_fraction'] for config in configs}
    assert trained == (
        {'comm_opt', 'mem_opt'}
        if world_size == 3
        else {'comm_opt', 'mem_opt', 'hybrid_opt'}
    )
    outcomes = oracle.run_oracle(
        train, configs, world_size, tmp_path=tmp_path, timeout=180
    )
    label = f'DDP embedding W={world_size} vs single process'
    oracle.check_outcomes(
        outcomes,
        [label] * len(configs),
        rtol=1e-9,
        split=False,
        across_label='DDP embedding ranks vs each other',
    )
