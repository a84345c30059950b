"""kfac.layers.blocks: factors longer than `max_factor_dim` become
block-diagonal, one layer per tile.

Oracle: the preconditioned gradient of a blocked layer equals a dense
solve with block-diagonal factors built here from hook-free definitions
(float64).
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from kfac._engine.report import format_report
from kfac.assignment import KAISAAssignment
from kfac.assignment import decomposition_work
from kfac.config import StatisticsConfig
from kfac.layers.blocks import BlockHelper
from kfac.layers.blocks import split
from kfac.layers.embedding import EmbeddingModuleHelper
from kfac.layers.modules import LinearModuleHelper
from kfac.layers.options import ModuleOptions
from kfac.layers.register import register_model
from kfac.preconditioner import KFACPreconditioner
from testing.asserts import assert_rel_close
from testing.reference import eigen_reference
from testing.reference import layer_factors

F64 = torch.float64
IN, OUT, LIMIT = 10, 13, 4
A_BOUNDS = (0, 4, 8, 11)  # 11 = IN + 1 (bias): three blocks of <= 4
G_BOUNDS = (0, 4, 7, 10, 13)  # four blocks of <= 4, the longer first


def block_diagonal(
    matrix: torch.Tensor, bounds: tuple[int, ...]
) -> torch.Tensor:
    """`matrix` with every entry outside the diagonal blocks zeroed."""
    out = torch.zeros_like(matrix)
    for a, b in itertools.pairwise(bounds):
        out[a:b, a:b] = matrix[a:b, a:b]
    return out


@given(st.integers(1, 300), st.integers(1, 64))
def test_split_is_the_fewest_near_equal_ranges(dim: int, limit: int) -> None:
    spans = split(dim, limit)
    sizes = [s.stop - s.start for s in spans]
    assert spans[0].start == 0 and spans[-1].stop == dim
    assert all(a.stop == b.start for a, b in itertools.pairwise(spans))
    assert max(sizes) <= limit and len(spans) == math.ceil(dim / limit)
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes)[::-1]


def test_split_without_a_limit_and_bad_arguments() -> None:
    assert split(50257, None) == [slice(0, 50257)]
    with pytest.raises(ValueError, match='limit must be >= 1'):
        split(5, 0)
    with pytest.raises(TypeError, match='dim'):
        split(2.5, 1)  # type: ignore[arg-type]  # wrong on purpose


def _model_and_grads(
    seed: int,
) -> tuple[nn.Linear, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A Linear on `(N, T, in)` inputs; its input, output gradient and
    loss (computed without hooks).
    """
    torch.manual_seed(seed)
    layer = nn.Linear(IN, OUT).double()
    x = torch.randn(5, 3, IN, dtype=F64)
    out = layer(x)
    target = torch.randn_like(out)
    loss = F.mse_loss(out, target, reduction='sum') / x.shape[0]
    (grad_output,) = torch.autograd.grad(loss, out, retain_graph=True)
    return layer, x, grad_output, loss


def _preconditioned(
    layer: nn.Linear, x: torch.Tensor, **kwargs: Any
) -> torch.Tensor:
    model = nn.Sequential(layer)
    options = {'compute_method': 'eigen', **kwargs}
    precon = KFACPreconditioner(
        model,
        relative_clip=None,
        damping=0.01,
        **options,
        statistics=StatisticsConfig(max_factor_dim=LIMIT),
    )
    out = model(x)
    target = torch.randn(out.shape, dtype=F64, generator=_gen())
    loss = F.mse_loss(out, target, reduction='sum') / x.shape[0]
    loss.backward()
    precon.step()
    assert layer.weight.grad is not None and layer.bias.grad is not None
    return torch.cat([layer.weight.grad, layer.bias.grad[:, None]], 1)


def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(7)


def _reference_inputs(
    seed: int,
) -> tuple[nn.Linear, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The layer, input, raw gradient matrix and output gradient of the
    loss `_preconditioned` uses, by autograd without hooks.
    """
    torch.manual_seed(seed)
    layer = nn.Linear(IN, OUT).double()
    x = torch.randn(5, 3, IN, dtype=F64)
    params = (layer.weight, layer.bias)
    out = F.linear(x, *params)
    target = torch.randn(out.shape, dtype=F64, generator=_gen())
    loss = F.mse_loss(out, target, reduction='sum') / x.shape[0]
    gw, gb, gout = torch.autograd.grad(loss, (*params, out))
    return layer, x, torch.cat([gw, gb[:, None]], 1), gout


@pytest.mark.parametrize('outer', [True, False])
def test_eigen_tiles_equal_a_dense_solve_with_block_diagonal_factors(
    outer: bool,
) -> None:
    layer, x, v, gout = _reference_inputs(0)
    a, g = layer_factors(x, gout, bias=True)
    a, g = block_diagonal(a, A_BOUNDS), block_diagonal(g, G_BOUNDS)
    expected = eigen_reference(a, g, v, 0.01)
    actual = _preconditioned(layer, x, compute_eigenvalue_outer_product=outer)
    assert_rel_close(actual, expected, label='blocked eigen')
    # Not the whole-factor result: the blocks change it.
    whole = eigen_reference(*layer_factors(x, gout, bias=True), v, 0.01)
    assert (actual - whole).norm() > 1e-3 * whole.norm()


def test_inverse_tiles_are_independent_k_fac_blocks() -> None:
    layer, x, v, gout = _reference_inputs(1)
    a, g = layer_factors(x, gout, bias=True)
    root = 0.01**0.5
    expected = torch.empty_like(v)
    for r0, r1 in itertools.pairwise(G_BOUNDS):
        for c0, c1 in itertools.pairwise(A_BOUNDS):
            aj, gi = a[c0:c1, c0:c1], g[r0:r1, r0:r1]
            pi = (
                (aj.trace() / aj.shape[0]) / (gi.trace() / gi.shape[0])
            ).sqrt()
            ad = aj + pi * root * torch.eye(c1 - c0, dtype=F64)
            gd = gi + root / pi * torch.eye(r1 - r0, dtype=F64)
            expected[r0:r1, c0:c1] = torch.linalg.solve(
                gd, torch.linalg.solve(ad, v[r0:r1, c0:c1].T).T
            )
    actual = _preconditioned(layer, x, compute_method='inverse')
    assert_rel_close(actual, expected, label='blocked inverse')


def test_tile_factors_are_the_blocks_of_the_whole_factors() -> None:
    layer, x, _, gout = _reference_inputs(2)
    model = nn.Sequential(layer)
    precon = KFACPreconditioner(
        model, statistics=StatisticsConfig(max_factor_dim=LIMIT)
    )
    loss = (
        F.mse_loss(
            model(x),
            torch.randn(5, 3, OUT, dtype=F64, generator=_gen()),
            reduction='sum',
        )
        / 5
    )
    loss.backward()
    precon.step()
    a, g = layer_factors(x, gout, bias=True)
    tiles = [
        (r, c)
        for r in itertools.pairwise(G_BOUNDS)
        for c in itertools.pairwise(A_BOUNDS)
    ]
    assert list(precon.layers) == [f'0.block{k}' for k in range(len(tiles))]
    for k, ((r0, r1), (c0, c1)) in enumerate(tiles):
        tile = precon.layers[f'0.block{k}']
        assert tile.a.value is not None and tile.g.value is not None
        assert_rel_close(tile.a.value, a[c0:c1, c0:c1], label='tile A')
        assert_rel_close(tile.g.value, g[r0:r1, r0:r1], label='tile G')


def test_embedding_and_convolution_tiles_precondition_their_blocks() -> None:
    """A wide embedding (G split, A diagonal kept whole) and a convolution
    (A split) equal a dense solve with block-diagonal factors.
    """
    torch.manual_seed(3)
    emb = nn.Embedding(6, 9).double()
    idx = torch.randint(0, 6, (4, 5))
    precon = KFACPreconditioner(
        emb,
        relative_clip=None,
        damping=0.1,
        compute_method='eigen',
        statistics=StatisticsConfig(max_factor_dim=4),
    )
    assert len(precon.layers) == 3  # G: 9 -> 3 + 3 + 3; A diagonal
    out = emb(idx)
    target = torch.randn(out.shape, dtype=F64, generator=_gen())
    loss = F.mse_loss(out, target)
    loss.backward()
    assert emb.weight.grad is not None
    v = emb.weight.grad.T.clone()
    onehot = F.one_hot(idx, 6).to(F64)
    grad_out = 2 * (emb.weight.detach()[idx] - target) / target.numel()
    a, g = layer_factors(onehot, grad_out, bias=False)
    a = torch.diag(torch.diagonal(a))
    expected = eigen_reference(a, block_diagonal(g, (0, 3, 6, 9)), v, 0.1)
    precon.step()
    assert_rel_close(emb.weight.grad.T, expected, label='blocked embedding')

    conv = nn.Conv1d(3, 2, 3).double()
    assert conv.bias is not None
    x = torch.randn(4, 3, 6, dtype=F64)
    precon = KFACPreconditioner(
        conv,
        relative_clip=None,
        damping=0.1,
        compute_method='eigen',
        statistics=StatisticsConfig(max_factor_dim=5),
    )
    assert len(precon.layers) == 2  # A: 3*3 + 1 = 10 -> 5 + 5
    out = conv(x)
    loss = out.pow(2).sum() / 4
    loss.backward()
    patches = F.unfold(x[..., None], (3, 1)).transpose(1, 2)  # (N, L, 9)
    grad_out = (2 * out.detach() / 4).transpose(1, 2)  # (N, L, out)
    a, g = layer_factors(patches, grad_out, bias=True)
    assert conv.weight.grad is not None and conv.bias.grad is not None
    v = torch.cat(
        [conv.weight.grad.reshape(2, -1), conv.bias.grad[:, None]], 1
    )
    expected = eigen_reference(block_diagonal(a, (0, 5, 10)), g, v, 0.1)
    precon.step()
    actual = torch.cat(
        [conv.weight.grad.reshape(2, -1), conv.bias.grad[:, None]], 1
    )
    assert_rel_close(actual, expected, label='blocked conv')


def test_default_limit_keeps_resnet_and_bert_and_splits_a_vocabulary() -> None:
    with torch.device('meta'):
        model = nn.ModuleDict(
            {
                'conv': nn.Conv2d(512, 512, 3),  # ResNet-50: A 4609
                'bert': nn.Linear(4096, 1024),  # BERT-Large: A 4097
                'wte': nn.Embedding(50257, 768),  # diagonal A: kept
                'head': nn.Linear(768, 50257, bias=False),
            }
        )
    registration = register_model(model)
    assert [n for n in registration.helpers if not n.startswith('head')] == [
        'conv',
        'bert',
        'wte',
    ]
    tiles = [registration.helpers[f'head.block{k}'] for k in range(7)]
    assert len(registration.helpers) == 3 + 7
    assert [t.g_factor_shape[0] for t in tiles] == [7180] * 4 + [7179] * 3
    assert all(t.a_factor_shape == (768, 768) for t in tiles)
    assert registration.blocks == {f'head.block{k}': 'head' for k in range(7)}
    unlimited = register_model(
        model, defaults=ModuleOptions(max_factor_dim=None)
    )
    assert list(unlimited.helpers) == ['conv', 'bert', 'wte', 'head']
    override = register_model(
        model, module_options={'conv': {'max_factor_dim': 2305}}
    )
    assert sum(n.startswith('conv.') for n in override.helpers) == 2
    assert override.sources['conv.block0']['max_factor_dim'] == (
        "module_options['conv']"
    )


@pytest.mark.parametrize(
    ('value', 'error', 'match'),
    [
        (0, ValueError, 'max_factor_dim must be >= 1; got 0'),
        (2.0, TypeError, 'max_factor_dim'),
        (True, TypeError, 'max_factor_dim'),
    ],
)
def test_max_factor_dim_is_validated(
    value: object, error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        StatisticsConfig(max_factor_dim=value)  # type: ignore[arg-type]  # wrong on purpose (some values)
    with pytest.raises(error, match=match):
        register_model(
            nn.Linear(2, 2), module_options={'': {'max_factor_dim': value}}
        )


def test_report_shows_each_tile() -> None:
    model = nn.Sequential(nn.Linear(3, 6, bias=False), nn.Linear(5, 2))
    precon = KFACPreconditioner(
        model, statistics=StatisticsConfig(max_factor_dim=3)
    )
    report = precon.describe()
    entries = {e['name']: e for e in report['preconditioned']}
    assert list(entries) == ['0.block0', '0.block1', '1.block0', '1.block1']
    assert entries['0.block1']['block'] == {
        'module': '0',
        'index': 1,
        'count': 2,
        'rows': [3, 6],
        'cols': [0, 3],
    }
    assert entries['1.block1']['block']['cols'] == [3, 6]
    assert entries['1.block1']['A'] == (3, 3)
    text = format_report(report)
    assert (
        '1.block1 (Linear): A 3x3, G 2x2; tile 2 of 2 of 1 (block-diagonal '
        'factors: rows 0:2, columns 3:6); batch_first' in text
    )
    whole = KFACPreconditioner(model).describe()['preconditioned']
    assert [e['block'] for e in whole] == [None, None]


def test_tiles_spread_decomposition_work_over_ranks() -> None:
    """The tiles of one large layer are separate units for KAISA: at
    MEM-OPT (one gradient worker per layer) every rank gets some.
    """
    model = nn.Sequential(nn.Linear(4, 8, bias=False), nn.Linear(8, 2))
    precon = KFACPreconditioner(
        model, statistics=StatisticsConfig(max_factor_dim=2)
    )
    work = decomposition_work(precon.layers, 'compute')
    tiles = [n for n in work if n.startswith('0.')]
    assert len(tiles) == 8  # G 8 -> 4 blocks, A 4 -> 2 blocks
    for fraction, colocate in (('mem_opt', True), ('comm_opt', False)):
        plans = [
            KAISAAssignment(
                work,
                local_rank=rank,
                world_size=4,
                grad_worker_fraction=fraction,
                group_func=lambda ranks: None,
                colocate_factors=colocate,
            )
            for rank in range(4)
        ]
        ranks = {plans[0].inv_worker(t, f) for t in tiles for f in 'AG'}
        assert ranks == {0, 1, 2, 3}
        workers = {
            t: [r for r in range(4) if plans[r].is_grad_worker(t)]
            for t in tiles
        }
        if fraction == 'mem_opt':
            assert {w[0] for w in workers.values()} == {0, 1, 2, 3}


def test_blocked_state_round_trips() -> None:
    """A run resumed from a blocked state continues as the original."""
    torch.manual_seed(4)
    layers = [nn.Linear(5, 7).double() for _ in range(2)]
    layers[1].load_state_dict(layers[0].state_dict())
    x = torch.randn(6, 5, dtype=F64)

    def run(
        layer: nn.Linear, precon: KFACPreconditioner, steps: range
    ) -> None:
        for step in steps:
            layer.zero_grad()
            (layer(x) * (step + 1)).pow(2).mean().backward()
            precon.step()

    precon = KFACPreconditioner(
        layers[0],
        inv_update_steps=2,
        statistics=StatisticsConfig(max_factor_dim=3),
    )
    run(layers[0], precon, range(3))
    state = precon.state_dict()
    assert set(state['layers']) == {f'block{k}' for k in range(6)}
    assert state['layers']['block5']['G'].shape == (2, 2)
    other = KFACPreconditioner(
        layers[1],
        inv_update_steps=2,
        statistics=StatisticsConfig(max_factor_dim=3),
    )
    other.load_state_dict(state)
    assert other.steps == 3
    for name, kfac_layer in precon.layers.items():
        for f in kfac_layer.factors:
            loaded = other.layers[name].factor(f.name).value
            assert loaded is not None and f.value is not None
            assert torch.equal(loaded, f.value)
    run(layers[0], precon, range(3, 5))
    run(layers[1], other, range(3, 5))
    for param in ('weight', 'bias'):
        grads = [getattr(layer, param).grad for layer in layers]
        assert grads[0] is not None and grads[1] is not None
        assert torch.equal(grads[0], grads[1])
    with pytest.raises(ValueError, match='unexpected layers: block0, '):
        KFACPreconditioner(
            nn.Linear(5, 7), statistics=StatisticsConfig(max_factor_dim=None)
        ).load_state_dict(state)


def test_block_helper_checks_and_forwards() -> None:
    base = LinearModuleHelper(nn.Linear(3, 4))
    with pytest.raises(ValueError, match=r'rows must be a non-empty slice'):
        BlockHelper(base, slice(2, 2), slice(0, 4))
    with pytest.raises(ValueError, match=r'cols must be a non-empty slice'):
        BlockHelper(base, slice(0, 2), slice(0, 5))
    emb = EmbeddingModuleHelper(nn.Embedding(5, 4))
    part = BlockHelper(emb, slice(0, 2), slice(1, 4))  # a tied weight's tile
    counts, rows = part.a_statistic(torch.tensor([[1, 1, 4, 0]]), F64)
    assert torch.equal(counts, torch.tensor([2.0, 0.0, 0.0], dtype=F64))
    assert rows == 4
    tile = BlockHelper(base, slice(0, 2), slice(2, 4))
    assert 'rows=slice(0, 2, None)' in repr(tile)
    tile.batch_first = False
    tile.kfac_approx = 'reduce'
    assert (base.batch_first, base.kfac_approx) == (False, 'reduce')
    assert (tile.batch_first, tile.kfac_approx) == (False, 'reduce')
    assert tile.in_features == 1 and tile.has_bias()
    assert tile.get_grad() is None
    grad = torch.ones(2, 2)
    tile.set_grad(grad, torch.tensor(3.0))  # no gradient yet: zeros around
    module = base.module
    assert isinstance(module, nn.Linear)
    assert module.weight.grad is not None and module.bias.grad is not None
    expected = torch.zeros(4, 3)
    expected[:2, 2] = 3.0
    assert torch.equal(module.weight.grad, expected)
    assert torch.equal(module.bias.grad, torch.tensor([3.0, 3.0, 0, 0]))
    whole = BlockHelper(base, slice(0, 4), slice(0, 4)).get_grad()
    assert whole is not None
    assert torch.equal(
        whole, torch.cat([expected, module.bias.grad[:, None]], 1)
    )
