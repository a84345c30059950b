"""The benchmark harness's counting: FLOPs, schedules, shapes, byte model.

Oracles: ``torch.utils.flop_counter`` for the matrix products the library
really runs, the library's own registration and phase counts, published
parameter counts of ResNet-50 and BERT-Large, and conservation laws of the
traffic model. No test here asserts a time.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Sequence

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from benchmarks import comm
from benchmarks.floor import Work
from benchmarks.floor import cycle_counts
from benchmarks.floor import floor_seconds
from benchmarks.floor import layer_shapes
from benchmarks.floor import phase_work
from benchmarks.floor import step_work
from benchmarks.harness import CONFIGS
from benchmarks.harness import RANK_CONFIGS
from benchmarks.harness import REDUCE_CONFIGS
from benchmarks.harness import SAMPLE_CONFIGS
from benchmarks.harness import Config
from benchmarks.harness import Sample
from benchmarks.harness import cycle_kinds
from benchmarks.harness import spread
from benchmarks.harness import step_kind
from benchmarks.machine import LINALG_OPS
from benchmarks.machine import Rates
from benchmarks.machine import calibrate_linalg
from benchmarks.machine import machine_info
from benchmarks.models import MLP
from benchmarks.models import SKIP_LAYERS
from benchmarks.models import Bench
from benchmarks.models import ResNet20
from benchmarks.models import Transformer
from benchmarks.report import markdown
from benchmarks.scaling import load_balance
from benchmarks.scaling import make_plan
from benchmarks.shapes import bert_large_shapes
from benchmarks.shapes import resnet50_shapes
from benchmarks.summary import paired_ratios
from benchmarks.summary import run_model
from examples.gpt import GPT
from examples.gpt import GPTConfig
from kfac.layers.base import KFACBaseLayer
from kfac.layers.eigen import KFACEigenLayer
from kfac.layers.embedding import EmbeddingModuleHelper
from kfac.layers.inverse import KFACInverseLayer
from kfac.layers.modules import Conv2dModuleHelper
from kfac.layers.modules import LinearModuleHelper
from kfac.layers.modules import ModuleHelper
from kfac.layers.sampling import PositionSampler
from kfac.layers.sampling import SampleKey
from kfac.preconditioner import KFACPreconditioner
from kfac.tracing import PhaseTimer

# --------------------------------------------------------------------------
# FLOPs of the phases, against the matrix products the library runs.


def _addmm_inplace_flops(
    inp: Sequence[int],
    a: Sequence[int],
    b: Sequence[int],
    *args: object,
    out_shape: object = None,
    **kwargs: object,
) -> int:
    """``Tensor.addmm_``, which FlopCounterMode does not count itself."""
    return 2 * a[0] * a[1] * b[1]


def _flops(fn: object) -> int:
    assert callable(fn)
    mapping = {torch.ops.aten.addmm_: _addmm_inplace_flops}
    with FlopCounterMode(display=False, custom_mapping=mapping) as counter:
        fn()
    return int(counter.get_total_flops())


def _layer(method: str, helper: ModuleHelper) -> KFACBaseLayer:
    if method == 'eigen':
        return KFACEigenLayer(helper, prediv_eigenvalues=True)
    return KFACInverseLayer(helper)


CASES = [
    (nn.Linear(7, 5), (6, 7), 'expand'),
    (nn.Linear(7, 5, bias=False), (3, 4, 7), 'expand'),
    (nn.Conv2d(3, 4, 3, stride=2, padding=1), (2, 3, 9, 9), 'expand'),
    (nn.Conv2d(2, 3, (3, 2), dilation=2, bias=False), (2, 2, 8, 7), 'expand'),
    # Linear on sequences and convolutions under reduce: one row per example
    (nn.Linear(7, 5), (3, 4, 7), 'reduce'),
    (nn.Linear(7, 5, bias=False), (2, 3, 2, 7), 'reduce'),
    (nn.Conv2d(3, 4, 3, stride=2, padding=1), (2, 3, 9, 9), 'reduce'),
    # Embedding: diagonal A (token counts), no product for A
    (nn.Embedding(11, 5), (3, 4), 'expand'),
    (nn.Embedding(11, 5, padding_idx=0), (6,), 'expand'),
]


def _input(module: nn.Module, shape: tuple[int, ...]) -> torch.Tensor:
    if isinstance(module, nn.Embedding):
        return torch.randint(0, module.num_embeddings, shape)
    return torch.randn(shape)


def _helper(module: nn.Module, approx: str) -> ModuleHelper:
    helper: ModuleHelper
    if isinstance(module, nn.Conv2d):
        helper = Conv2dModuleHelper(module)
    elif isinstance(module, nn.Embedding):
        helper = EmbeddingModuleHelper(module)
    else:
        helper = LinearModuleHelper(module)
    if approx != 'expand':
        helper.kfac_approx = approx
    return helper


@pytest.mark.parametrize('method', ['eigen', 'inverse'])
@pytest.mark.parametrize(('module', 'shape', 'approx'), CASES)
def test_capture_and_precondition_flops_match_the_library(
    method: str, module: nn.Module, shape: tuple[int, ...], approx: str
) -> None:
    torch.manual_seed(0)
    x = _input(module, shape)
    (counted_shape,) = layer_shapes(
        nn.Sequential(module), x, kfac_approx=approx
    )
    layer = _layer(method, _helper(module, approx))
    out = module(x)
    out.sum().backward()
    grad_out = torch.randn_like(out)
    capture = _flops(lambda: layer.save_layer_input(x, now=True))
    capture += _flops(lambda: layer.save_layer_grad_output(grad_out, now=True))
    layer.update_factors(0.95)
    layer.commit_factors()
    for name in ('A', 'G'):
        assert layer.compute_decomposition(name, 0.1)
    precondition = _flops(lambda: layer.precondition_grad(0.1))
    work = phase_work(counted_shape, method)
    assert capture == work['factor_capture'].flops
    assert precondition == work['precondition'].flops
    assert counted_shape.a_dim == layer.a.dim
    assert counted_shape.g_dim == layer.g.dim
    assert counted_shape.a_diagonal == layer.a.diagonal


def test_reduce_and_embedding_terms_count_as_written() -> None:
    """The new floor terms against a count made here by hand."""
    # Linear 7 -> 5 with a bias on (3, 4, 7): a = 8, g = 5
    expand, reduce = (
        layer_shapes(
            nn.Sequential(nn.Linear(7, 5)), torch.randn(3, 4, 7), kfac_approx=k
        )[0]
        for k in ('expand', 'reduce')
    )
    assert (expand.rows, reduce.rows) == (12, 3)  # N T rows, N rows
    assert phase_work(reduce, 'eigen')['factor_capture'].flops == 2 * 3 * (
        49 + 25
    )
    # reduce changes the statistics only
    for phase in ('running_average', 'decomposition', 'precondition'):
        assert (
            phase_work(reduce, 'eigen')[phase]
            == phase_work(expand, 'eigen')[phase]
        )
    # Embedding of 11 tokens, width 5, on 12 indices: A is 11 numbers
    (emb,) = layer_shapes(
        nn.Sequential(nn.Embedding(11, 5)), torch.zeros(3, 4, dtype=torch.long)
    )
    assert (emb.a_dim, emb.g_dim, emb.rows, emb.a_numel) == (11, 5, 12, 11)
    eigen, inverse = phase_work(emb, 'eigen'), phase_work(emb, 'inverse')
    assert eigen['factor_capture'].flops == 2 * 12 * 25
    assert eigen['running_average'] == Work(3.0 * (11 + 25), 4 * 3 * (11 + 25))
    assert eigen['decomposition'].flops == 9 * 125 + 2 * 55
    assert inverse['decomposition'].flops == 125
    assert eigen['precondition'].flops == 4 * 25 * 11
    assert inverse['precondition'].flops == 2 * 25 * 11
    # its step work equals that of the Linear on one-hot inputs, less the
    # products with a dense A
    onehot = dataclasses.replace(emb, a_diagonal=False)
    dense = phase_work(onehot, 'eigen')['precondition'].flops
    assert dense - eigen['precondition'].flops == 4 * 5 * 11 * 11
    with pytest.raises(ValueError, match='kfac_approx'):
        layer_shapes(MLP(), kfac_approx='diagonal')


def _small_gpt() -> GPT:
    return GPT(GPTConfig(vocab=13, context=8, width=8, depth=2, heads=2))


@pytest.mark.parametrize(
    ('model', 'x', 'skip'),
    [
        (MLP(), torch.randn(2, 64), SKIP_LAYERS),
        (ResNet20(), torch.randn(2, 3, 32, 32), SKIP_LAYERS),
        (Transformer(depth=1), torch.randint(0, 256, (2, 8)), SKIP_LAYERS),
        # embedding preconditioned
        (Transformer(depth=1), torch.randint(0, 256, (2, 8)), ()),
        # converted attention, position embedding, tied head
        (_small_gpt(), torch.randint(0, 13, (2, 8)), ()),
    ],
)
def test_layer_shapes_match_the_registered_layers(
    model: nn.Module, x: torch.Tensor, skip: tuple[str, ...]
) -> None:
    shapes = layer_shapes(model, skip_types=skip)
    pre = KFACPreconditioner(model, skip_layers=skip)
    assert [s.name for s in shapes] == list(pre.layers)
    model(x).sum().backward()
    for shape in shapes:
        layer = pre.layers[shape.name]
        assert (shape.a_dim, shape.g_dim) == (layer.a.dim, layer.g.dim)
        assert shape.a_diagonal == layer.a.diagonal
        grad = layer.module.get_grad()  # V, bias column included
        assert grad is not None
        assert shape.grad_numel == grad.numel()
    pre.remove()


@pytest.mark.parametrize(
    ('module', 'shape', 'rows'),
    [
        (nn.Linear(7, 5), (3, 8, 7), 3 * 2),  # 2 of 8 positions
        (nn.Conv2d(3, 4, 3, stride=2, padding=1), (2, 3, 9, 9), 2 * 7),
    ],
)
def test_sampled_capture_flops_match_the_library(
    module: nn.Module, shape: tuple[int, ...], rows: int
) -> None:
    """`position_sample=0.25`: `k = ⌈T/4⌉` rows per example (25
    positions of the convolution give 7).
    """
    torch.manual_seed(0)
    x = torch.randn(shape)
    (counted,) = layer_shapes(nn.Sequential(module), x, position_sample=0.25)
    assert counted.rows == rows
    helper = _helper(module, 'expand')
    helper.sampler = PositionSampler(0.25, SampleKey())
    layer = _layer('eigen', helper)
    grad_out = torch.randn_like(module(x))
    capture = _flops(lambda: layer.save_layer_input(x, now=True))
    capture += _flops(lambda: layer.save_layer_grad_output(grad_out, now=True))
    assert capture == phase_work(counted, 'eigen')['factor_capture'].flops


def test_gpt_bench_rows_match_the_library_statistics() -> None:
    """Rows per layer of the GPT model, and its tied embedding and head."""
    model = _small_gpt()
    tokens = torch.randint(0, 13, (3, 8))
    for approx in ('expand', 'reduce'):
        shapes = {
            s.name: s for s in layer_shapes(model, tokens, kfac_approx=approx)
        }
        assert {'embed', 'pos', 'blocks.1.attn.v_proj'} <= set(shapes)
        assert 'head' not in shapes  # one layer for the tied weight
        # counted on a converted copy; the model itself is left as it is
        assert type(model.blocks[0].attn) is nn.MultiheadAttention
        for shape in shapes.values():
            sequence = approx == 'expand' or shape.a_diagonal or shape.tied
            assert shape.rows == (3 * 8 if sequence else 3), shape
        embed = shapes['embed']
        assert (embed.a_dim, embed.g_dim, embed.a_diagonal) == (13, 8, False)
        # the head's use: a Linear of 8 inputs and 13 outputs
        assert embed.head_rows == (3 * 8 if approx == 'expand' else 3)
        capture = phase_work(embed, 'eigen')['factor_capture'].flops
        assert capture == 2 * 24 * 8**2 + 2 * embed.head_rows * (64 + 169)
        average = phase_work(embed, 'eigen')['running_average'].flops
        assert average == 3 * (13 + 64 + 64 + 169)  # each use's factors
        assert (
            phase_work(embed, 'inverse')['decomposition'].flops == 13**3 + 8**3
        )


def test_transformer_attention_projections_are_preconditioned() -> None:
    pre = KFACPreconditioner(Transformer(depth=2), skip_layers=SKIP_LAYERS)
    names = {n.rsplit('.', 1)[-1] for n in pre.layers}
    assert {'q', 'k', 'v', 'out', 'fc1', 'fc2', 'head'} <= names
    assert len(pre.layers) == 2 * 6 + 1
    pre.remove()


def test_step_work_sums_layers_and_floor_is_a_roofline() -> None:
    shapes = layer_shapes(MLP(), torch.randn(4, 64))
    total = step_work(shapes, 'inverse')
    parts = [phase_work(s, 'inverse') for s in shapes]
    for phase, work in total.items():
        assert work.flops == sum(p[phase].flops for p in parts)
        assert work.nbytes == sum(p[phase].nbytes for p in parts)
    work = total['precondition']
    assert floor_seconds(work, work.flops, 1e30) == pytest.approx(1.0)
    assert floor_seconds(work, 1e30, work.nbytes) == pytest.approx(1.0)
    with pytest.raises(ValueError, match='method'):
        phase_work(shapes[0], 'cholesky')


# --------------------------------------------------------------------------
# Schedules: the harness's cycle model against the preconditioner's.


@pytest.mark.parametrize(('factor', 'inverse'), [(10, 100), (1, 1), (3, 7)])
def test_cycle_counts_match_the_phases_the_preconditioner_runs(
    factor: int, inverse: int
) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    pre = KFACPreconditioner(
        model, factor_update_steps=factor, inv_update_steps=inverse
    )
    timer = PhaseTimer()
    pre.timer = timer
    x = torch.randn(8, 3)
    for _ in range(100):
        model.zero_grad()
        model(x).square().sum().backward()
        pre.step()
    counts = cycle_counts(factor, inverse, 100)
    assert timer.counts['running_average'] == counts['factor'] * 2
    assert timer.counts['decomposition'] == counts['inverse']
    assert timer.counts['write_back'] == counts['step']
    config = Config('x', 'eigen', factor, inverse)
    kinds = cycle_kinds(config)
    assert kinds['fi'] + kinds['f'] == counts['factor']
    assert kinds['fi'] + kinds.get('i', 0) == counts['inverse']
    assert sum(kinds.values()) == 100


def test_step_kinds() -> None:
    sgd, eigen = CONFIGS[0], CONFIGS[2]
    assert step_kind(0, sgd) == '-'
    assert collections.Counter(
        step_kind(s, eigen) for s in range(1, 101)
    ) == collections.Counter({'-': 90, 'f': 9, 'fi': 1})
    assert spread([])['n'] == 0
    assert spread([2.0]) == {
        'n': 1,
        'median': 2.0,
        'mean': 2.0,
        'p10': 2.0,
        'p90': 2.0,
        'min': 2.0,
        'max': 2.0,
    }


# --------------------------------------------------------------------------
# Scaling shapes: published parameter counts.


def test_resnet50_shapes_give_the_published_parameter_count() -> None:
    shapes = resnet50_shapes()
    convs, fc = shapes[:-1], shapes[-1]
    assert len(convs) == 53
    batch_norm = 2 * sum(s.g_dim for s in convs)  # one after every conv
    weights = sum(s.grad_numel for s in shapes)
    assert weights + batch_norm == 25_557_032  # torchvision resnet50
    assert (fc.a_dim, fc.g_dim) == (2049, 1000)


def test_bert_large_shapes_give_the_published_parameter_count() -> None:
    hidden, vocab, positions, types, layers = 1024, 30522, 512, 2, 24
    shapes = bert_large_shapes()
    assert len(shapes) == 6 * layers + 1
    embeddings = (vocab + positions + types) * hidden
    layer_norms = (1 + 2 * layers) * 2 * hidden
    total = sum(s.grad_numel for s in shapes) + embeddings + layer_norms
    assert total == 335_141_888  # bert-large-uncased (BertModel)


# --------------------------------------------------------------------------
# Load balance and the byte model.


def test_load_balance_is_at_least_the_lower_bound() -> None:
    shapes = bert_large_shapes()
    for world in (1, 8, 64, 256):
        for fraction in ('comm_opt', 'hybrid_opt', 'mem_opt'):
            for strategy in ('compute', 'memory'):
                b = load_balance(shapes, world, fraction, strategy)
                assert b['max_over_mean'] >= b['lower_bound'] - 1e-12
                assert b['lower_bound'] >= 1.0
                assert 1 <= b['busy_ranks'] <= min(world, len(shapes))


def test_counted_is_zero_on_one_rank() -> None:
    shapes = resnet50_shapes()
    plan = make_plan(shapes, 1, 'comm_opt')
    assert set(comm.counted(shapes, plan, 0, comm.CommConfig()).values()) == {
        (0, 0)
    }
    for sent, recv in comm.traffic(shapes, plan, comm.CommConfig()).values():
        assert float(sent.sum()) == float(recv.sum()) == 0.0


def test_bucket_count() -> None:
    mib = 2**20
    assert comm.bucket_count([1, 2, 3], 0) == 3
    assert comm.bucket_count([], 1.0) == 0
    assert comm.bucket_count([mib // 2, mib // 2, 1], 1.0) == 2
    assert comm.bucket_count([mib // 2, mib // 2 + 1, mib // 2], 1.0) == 3
    assert comm.bucket_count([2 * mib, 1, 2 * mib], 1.0) == 3


@pytest.mark.parametrize('world', [2, 8, 64])
@pytest.mark.parametrize('fraction', ['comm_opt', 'hybrid_opt', 'mem_opt'])
@pytest.mark.parametrize('name', ['eigen', 'inverse packed', 'ekfac'])
def test_traffic_conserves_bytes_and_agrees_with_counted(
    world: int, fraction: str, name: str
) -> None:
    from benchmarks.scaling import COMM_CONFIGS

    config = COMM_CONFIGS[name]
    shapes = resnet50_shapes()
    plan = make_plan(shapes, world, fraction)
    traffic = comm.traffic(shapes, plan, config)
    counted = [comm.counted(shapes, plan, r, config) for r in range(world)]
    for phase in ('decomposition_broadcast', 'grad_broadcast'):
        sent, recv = traffic[phase]
        assert float(sent.sum()) == pytest.approx(float(recv.sum()))
        # Every rank of a broadcast counts its payload; all but the root
        # receive it, so the difference is one payload per broadcast.
        total = sum(c[phase][0] for c in counted)
        roots = {
            'decomposition_broadcast': sum(
                sum(comm.decomposition_payloads(x, f, config))
                for x in shapes
                for f in ('A', 'G')
            )
            * (plan.grad_workers > 1 or name == 'ekfac'),
            'grad_broadcast': sum(x.grad_numel for x in shapes)
            * plan.grad_workers
            * (plan.grad_workers < world),
        }[phase]
        assert total - float(recv.sum()) == pytest.approx(
            roots * config.itemsize
        )
    sent, recv = traffic['factor_allreduce']
    nbytes, _ = counted[0]['factor_allreduce']
    assert float(sent[0]) == pytest.approx(2 * (world - 1) / world * nbytes)
    assert torch.equal(sent, recv)
    sent, recv = traffic['scale_allreduce']
    nbytes, _ = counted[0]['scale_allreduce']
    assert (nbytes > 0) == (name == 'ekfac')
    assert float(sent[0]) == pytest.approx(2 * (world - 1) / world * nbytes)
    assert torch.equal(sent, recv)


def test_paired_ratios_compare_steps_of_the_same_round() -> None:
    # SGD's rounds 2 and 4 ran under twice the load; so did K-FAC's.
    sgd = [1.0, 2.0, 1.0, 2.0, 1.0]
    kinds = ['-', '-', 'f', '-', '-']
    kfac = [1.1, 2.2, 1.5, 2.2, 1.1]
    samples = [
        Sample(step=i + 1, kind=k, seconds=t, phases={})
        for i, (k, t) in enumerate(zip(kinds, kfac))
    ]
    ratios = paired_ratios(samples, sgd)
    assert ratios == {'-': pytest.approx(1.1), 'f': pytest.approx(1.5)}


@pytest.mark.parametrize('method', ['eigen', 'inverse'])
@pytest.mark.parametrize(
    ('module', 'shape', 'rank'),
    [
        (nn.Linear(7, 5), (6, 7), 3),  # both factors at low rank
        (nn.Linear(7, 5), (6, 7), 5),  # G (5) whole
        (nn.Conv2d(3, 4, 3, stride=2, padding=1), (2, 3, 9, 9), 2),
    ],
)
def test_low_rank_precondition_flops_match_the_library(
    method: str, module: nn.Module, shape: tuple[int, ...], rank: int
) -> None:
    torch.manual_seed(0)
    x = _input(module, shape)
    (counted_shape,) = layer_shapes(nn.Sequential(module), x)
    cls = KFACEigenLayer if method == 'eigen' else KFACInverseLayer
    layer = cls(_helper(module, 'expand'), factor_rank=rank)
    out = module(x)
    out.sum().backward()
    layer.save_layer_input(x, now=True)
    layer.save_layer_grad_output(torch.randn_like(out), now=True)
    layer.update_factors(0.95)
    layer.commit_factors()
    for name in ('A', 'G'):
        assert layer.compute_decomposition(name, 0.1)
    precondition = _flops(lambda: layer.precondition_grad(0.1))
    work = phase_work(counted_shape, method, rank=rank)
    assert precondition == work['precondition'].flops > 0


# --------------------------------------------------------------------------
# The harness end to end on the MLP (a smoke test: no time is asserted).


def test_linalg_constants_include_the_warm_start() -> None:
    """`make bench`'s machine table times every decomposition the library
    can run, the warm start's QR step (`basis_refresh='qr'`) beside `eigh`
    and the inverses; `c` is the time at the stated matmul rate per `n³`.
    """
    rates = Rates(flops_per_s=2e9, bytes_per_s=1e9)
    (row,) = calibrate_linalg(rates, torch.device('cpu'), sizes=(32,))
    assert set(LINALG_OPS) >= {'eigh', 'qr_step'}
    for op in LINALG_OPS:
        assert row[f'{op}_ms'] > 0
        assert math.isclose(
            row[f'{op}_c'], row[f'{op}_ms'] / 1e3 * 2e9 / 32**3
        )
    text = markdown(
        {
            'machine': machine_info(torch.device('cpu')),
            'linalg': [row],
            'models': {},
        }
    )
    assert '| n | eigh ms (c) |' in text and 'qr_step ms (c) |' in text
    assert text.count('| 32 |') == 1


def test_run_model_and_report_smoke() -> None:
    torch.manual_seed(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the harness runs; fast on a shared CPU
    try:
        result = run_model(
            'mlp',
            device=torch.device('cpu'),
            steps=10,
            fi_steps=1,
            full_cycle=False,
        )
    finally:
        torch.set_num_threads(threads)
    configs = result['configs']
    assert list(configs) == [c.name for c in (*CONFIGS, *RANK_CONFIGS)]
    for name, entry in configs.items():
        assert entry['step_seconds']['n'] == (1 if '1/1' in name else 10)
        if name == 'sgd':
            continue
        assert entry['cycle']['ratio_to_sgd'] > 0
        assert entry['cycle']['ratio_paired'] > 0
        assert entry['memory']['memory_usage']['total'] > 0
        phases = entry['phases']
        assert phases['precondition']['floor_seconds'] > 0
        assert phases['factor_allreduce']['floor_seconds'] == 0
    text = markdown(
        {
            'machine': machine_info(torch.device('cpu')),
            'linalg': [],
            'models': {'mlp': result},
        }
    )
    assert '| mlp | sgd |' in text
    assert '| mlp | factor_rank=64 |' in text
    assert 'eigen 10/100 x SGD' in text


def test_run_model_reports_reduce_beside_expand(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A GPT-style model (embedding, tied head, attention): both
    approximations are run, each against the floor of its own statistics.
    """
    tokens = torch.randint(0, 13, (4, 3, 9))
    bench = Bench(
        'gpt',
        _small_gpt(),
        tokens[:, :, :-1],
        tokens[:, :, 1:],
        lambda y, t: F.cross_entropy(y.flatten(0, 1), t.flatten()),
        skip_layers=(),
        loss_average='batch+sequence',
    )
    monkeypatch.setattr('benchmarks.summary.build', lambda name: bench)
    result = run_model(
        'gpt',
        device=torch.device('cpu'),
        steps=10,
        fi_steps=1,
        full_cycle=False,
    )
    configs = result['configs']
    assert list(configs) == [
        c.name for c in (*CONFIGS, *REDUCE_CONFIGS, *SAMPLE_CONFIGS)
    ]
    expand = configs['eigen 10/100']['phases']['factor_capture']
    sample = configs['eigen 10/100 sample']['phases']['factor_capture']
    assert 0 < sample['floor_seconds'] <= expand['floor_seconds']
    assert configs['eigen 10/100 sample']['cycle']['ratio_to_sgd'] > 0
    for method in ('eigen', 'inverse'):
        expand = configs[f'{method} 10/100']['phases']['factor_capture']
        reduce = configs[f'{method} 10/100 reduce']['phases']['factor_capture']
        # (this tiny model's capture is bound by bytes, equal in both)
        assert 0 < reduce['floor_seconds'] <= expand['floor_seconds']
        cycle = configs[f'{method} 10/100 reduce']['cycle']
        assert cycle['ratio_to_sgd'] > 0
    text = markdown(
        {
            'machine': machine_info(torch.device('cpu')),
            'linalg': [],
            'models': {'gpt': result},
        }
    )
    assert '| gpt | eigen 10/100 reduce |' in text
    assert '| gpt | reduce |' in text  # the summary row
    assert '| gpt | eigen 10/100 sample |' in text
    assert '| gpt | sample |' in text
