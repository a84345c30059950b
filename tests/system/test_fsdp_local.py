"""FSDP2 local mode: each rank preconditions its own rows.

Oracle (float64, one step, no KL clip): on a sharded MLP at W = 2 and 3
(uneven: 7 and 5 rows over 3 ranks), each layer's preconditioned gradient
equals the dense solve `(A ⊗ G_M + λ I)⁻¹ vec(V)` with the factors of one
process on the whole batch and `G_M` = `G` with the entries between rows
of different shards zeroed; and it differs from lossless mode (the mask
matters). An embedding, sharded along its vocabulary (the columns of its
`V`, the side of its diagonal `A`), is preconditioned exactly as in
lossless mode, and local mode gathers no gradient. EKFAC in local mode
equals one process with the same block-diagonal masks on `G` (its bases
block-diagonal, `S` estimated in them from every example). Errors: local
mode with MEM-OPT or an unsharded model.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from kfac.config import ShardingConfig
from kfac.preconditioner import KFACPreconditioner
from testing import fsdp
from testing import oracle
from testing.asserts import WORST
from testing.asserts import relative_error
from testing.distributed import run_distributed
from testing.torch_release import FSDP2_ON_CPU

DAMPING = 0.01
BATCH = 12


def _mlp() -> nn.Sequential:
    torch.manual_seed(3)
    return nn.Sequential(
        nn.Linear(4, 7), nn.Tanh(), nn.Linear(7, 5), nn.Tanh(), nn.Linear(5, 3)
    ).double()


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(11)
    x = torch.randn(BATCH, 4, dtype=torch.float64, generator=generator)
    y = torch.randint(0, 3, (BATCH,), generator=generator)
    return x, y


def _step_grads(
    model: nn.Module, shard_mode: str, part: tuple[int, int], **options: Any
) -> list[torch.Tensor]:
    """One K-FAC step without KL clip; the whole gradients it leaves."""
    from torch.distributed.tensor import DTensor

    precon = KFACPreconditioner(
        model,
        damping=DAMPING,
        relative_clip=None,
        **options,
        sharding=ShardingConfig(shard_mode=shard_mode),
    )
    x, y = (oracle.rows(t, part) for t in _data())
    nn.functional.cross_entropy(model(x), y).backward()
    precon.step()
    grads = []
    for param in model.parameters():
        grad = param.grad
        assert grad is not None
        if isinstance(grad, DTensor):
            grad = grad.full_tensor()
        grads.append(grad.detach().clone())
    return grads


def _dense(world: int) -> dict[str, list[torch.Tensor]]:
    """Per layer (weight, bias) of the masked dense solve, and of the
    unmasked one, from a single-process preconditioner's factors.
    """
    model = _mlp()
    precon = KFACPreconditioner(model, damping=DAMPING, relative_clip=None)
    x, y = _data()
    nn.functional.cross_entropy(model(x), y).backward()
    raw = [p.grad.detach().clone() for p in model.parameters()]  # type: ignore[union-attr]  # backward() above set it
    precon.step()
    masked: list[torch.Tensor] = []
    plain: list[torch.Tensor] = []
    for index, name in enumerate(('0', '2', '4')):
        layer = precon.layers[name]
        a, g = layer.a.value, layer.g.value
        assert a is not None and g is not None
        rows = g.shape[0]
        chunk = -(-rows // world)
        owner = torch.arange(rows) // chunk
        mask = owner[:, None] == owner[None, :]
        v = torch.cat([raw[2 * index], raw[2 * index + 1][:, None]], dim=1)
        for factor_g, out in ((g * mask, masked), (g, plain)):
            # vec stacks columns: vec(G V A) = (A ⊗ G) vec(V)
            kron = torch.kron(a, factor_g)
            eye = torch.eye(kron.shape[0], dtype=kron.dtype)
            solved = torch.linalg.solve(kron + DAMPING * eye, v.T.reshape(-1))
            matrix = solved.reshape(v.shape[1], v.shape[0]).T
            out.extend([matrix[:, :-1], matrix[:, -1]])
    return {'masked': masked, 'plain': plain}


def _row_blocks(rows: int, world: int) -> torch.Tensor:
    """`(rows, rows)`: True between rows of the same shard."""
    owner = torch.arange(rows) // -(-rows // world)
    return owner[:, None] == owner[None, :]


def _masked_ekfac(world: int) -> list[torch.Tensor]:
    """The gradients one EKFAC step leaves in one process, each layer's
    `G` masked by shard before it is decomposed (local mode's factors).
    """
    model = _mlp()
    precon = KFACPreconditioner(
        model, compute_method='ekfac', damping=DAMPING, relative_clip=None
    )
    for layer in precon.layers.values():
        layer.mask_factor('G', _row_blocks(layer.g.dim, world))
    x, y = _data()
    nn.functional.cross_entropy(model(x), y).backward()
    precon.step()
    return [p.grad.detach().clone() for p in model.parameters()]  # type: ignore[union-attr]


def _loss(model: nn.Module) -> float:
    tokens = fsdp.batch(0)
    with torch.no_grad():
        logits = model(tokens[:, :-1])
        loss = nn.functional.cross_entropy(
            logits.flatten(0, 1), tokens[:, 1:].flatten()
        )
    return float(loss)


def _one_step(out_dir: str) -> None:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    rank, world = dist.get_rank(), dist.get_world_size()
    results = {}
    for mode, method in (
        ('local', 'eigen'),
        ('lossless', 'eigen'),
        ('local', 'ekfac'),
    ):
        model = _mlp()
        for module in model:
            if isinstance(module, nn.Linear):
                fully_shard(module)
        fully_shard(model)
        grads = _step_grads(model, mode, (rank, world), compute_method=method)
        key = mode if method == 'eigen' else f'{mode}-{method}'
        results[key] = [g.tolist() for g in grads]
    # An embedding: sharded along the side of its diagonal A.
    embedding, gathered = {}, {}
    for mode in ('local', 'lossless'):
        torch.manual_seed(5)
        embed = nn.Embedding(11, 4).double()
        pair = nn.Sequential(embed, nn.Linear(4, 3).double())
        fully_shard(pair)
        precon = KFACPreconditioner(
            pair,
            relative_clip=None,
            damping=DAMPING,
            sharding=ShardingConfig(shard_mode=mode),
        )
        tokens = torch.arange(12).remainder(11).reshape(4, 3)
        mine = oracle.rows(tokens, (rank, world))
        pair(mine).square().sum().backward()
        precon.step()
        weight = embed.weight.grad
        assert isinstance(weight, DTensor)
        embedding[mode] = weight.full_tensor().tolist()
        gathered[mode] = precon.communicator.bytes_communicated['allgather']
    # A transformer, several steps (KL clip summed over shards, factor and
    # decomposition updates); MEM-OPT refused.
    lm = fsdp.shard(fsdp.fresh())
    losses = [_loss(lm)]
    fsdp.train(
        lm,
        {'sharding': ShardingConfig(shard_mode='local')},
        part=(rank, world),
    )
    losses.append(_loss(lm))
    with pytest.raises(ValueError, match="grad_worker_fraction='comm_opt'"):
        KFACPreconditioner(
            fsdp.shard(fsdp.fresh()),
            grad_worker_fraction='mem_opt',
            sharding=ShardingConfig(shard_mode='local'),
        )
    if rank == 0:
        (pathlib.Path(out_dir) / 'local.json').write_text(
            json.dumps(
                {
                    **results,
                    'embedding': embedding,
                    'gathered': gathered,
                    'losses': losses,
                }
            )
        )


@FSDP2_ON_CPU
@pytest.mark.timeout(200)
@pytest.mark.parametrize('world_size', [2, 3])
def test_local_mode_is_the_block_diagonal_solve(
    world_size: int, tmp_path: pathlib.Path
) -> None:
    dense = _dense(world_size)
    run_distributed(
        _one_step, world_size, str(tmp_path), tmp_path=tmp_path, timeout=180
    )
    got = json.loads((tmp_path / 'local.json').read_text())
    for mode, expected_key in (('local', 'masked'), ('lossless', 'plain')):
        for actual, expected in zip(got[mode], dense[expected_key]):
            error = relative_error(
                torch.tensor(actual, dtype=torch.float64), expected
            )
            label = f'FSDP2 {mode} mode W={world_size} vs dense solve'
            WORST[label] = max(WORST.get(label, 0.0), error)
            assert error <= 1e-10, (label, error)
    for actual, expected in zip(got['local-ekfac'], _masked_ekfac(world_size)):
        error = relative_error(
            torch.tensor(actual, dtype=torch.float64), expected
        )
        label = f'FSDP2 local EKFAC W={world_size} vs masked one process'
        WORST[label] = max(WORST.get(label, 0.0), error)
        assert error <= 1e-10, (label, error)
    differs = max(
        relative_error(torch.tensor(a), torch.tensor(b))
        for a, b in zip(got['local'], got['lossless'])
    )
    assert differs > 1e-3  # the block-diagonal G is another matrix
    local, lossless = (
        torch.tensor(got['embedding'][m], dtype=torch.float64)
        for m in ('local', 'lossless')
    )
    assert relative_error(local, lossless) <= 1e-12
    assert got['gathered'] == {
        'local': 0,
        'lossless': got['gathered']['lossless'],
    }
    assert got['gathered']['lossless'] > 0  # lossless gathers, local not
    before, after = got['losses']
    assert after < before - 0.05, got['losses']


def test_local_mode_needs_a_sharded_model() -> None:
    with pytest.raises(ValueError, match='not sharded: 0, 2, 4'):
        KFACPreconditioner(_mlp(), sharding=ShardingConfig(shard_mode='local'))
    with pytest.raises(ValueError, match="shard_mode='sideways' is not a"):
        ShardingConfig(shard_mode='sideways')


def test_block_mask_needs_rows_or_columns_of_one_owner() -> None:
    from kfac.distributed._sharding import block_mask

    rows = torch.tensor([[0.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    side, mask = block_mask(rows)
    assert side == 'G' and mask.tolist() == [[True, False], [False, True]]
    side, mask = block_mask(rows.T)
    assert side == 'A' and mask.tolist() == [[True, False], [False, True]]
    with pytest.raises(ValueError, match='by rows or by columns'):
        block_mask(torch.tensor([[0.0, 1.0], [1.0, 0.0]]))
