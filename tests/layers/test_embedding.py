"""kfac.layers.embedding: the Embedding helper and the diagonal factor.

Every quantity is checked against its dense counterpart, formed here from
one-hot inputs (small vocabularies only): the embedding must be the
Linear on one-hot inputs it stands for, without forming a `(V, V)` matrix.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kfac.distributed import TorchDistributedCommunicator
from kfac.distributed._exchange import decomposition_payload
from kfac.distributed._exchange import start_factor_allreduce
from kfac.layers.base import JITTER
from kfac.layers.base import KFACBaseLayer
from kfac.layers.base import prepare
from kfac.layers.eigen import KFACEigenLayer
from kfac.layers.embedding import EmbeddingModuleHelper
from kfac.layers.embedding import damped_diagonal_inverse
from kfac.layers.embedding import diagonal_eigen_precondition
from kfac.layers.embedding import diagonal_inverse_precondition
from kfac.layers.embedding import unsupported_reason
from kfac.layers.inverse import KFACInverseLayer
from kfac.layers.register import get_module_helper
from kfac.layers.register import register_model
from kfac.layers.statistics import KroneckerFactor
from kfac.math import eigen_precondition
from kfac.math import inverse_precondition
from kfac.math import symmetric_eigh
from kfac.state import LayerSpec
from kfac.state import parse_state
from testing.asserts import assert_rel_close
from testing.reference import eigen_reference
from testing.reference import inverse_reference
from testing.reference import linear_factors
from testing.reference import lowrank_plus_constant

F64 = torch.float64
VOCAB, DIM = 7, 3


def embedding(**kwargs: object) -> nn.Embedding:
    torch.manual_seed(0)
    return nn.Embedding(VOCAB, DIM, **kwargs).double()  # type: ignore[arg-type]  # keyword options of nn.Embedding


def tokens(*shape: int) -> torch.Tensor:
    """Indices in which some tokens repeat and token 6 never occurs."""
    generator = torch.Generator().manual_seed(1)
    return torch.randint(0, VOCAB - 1, shape, generator=generator)


def one_hot(x: torch.Tensor) -> torch.Tensor:
    return F.one_hot(x, VOCAB).to(F64)


# The helper ----------------------------------------------------------------


def test_helper_is_a_linear_from_the_vocabulary_to_the_embedding() -> None:
    helper = EmbeddingModuleHelper(embedding())
    assert helper.a_diagonal and not helper.has_bias()
    assert helper.in_features == VOCAB
    assert helper.a_factor_shape == (VOCAB, VOCAB)
    assert helper.g_factor_shape == (DIM, DIM)
    assert helper.grad_shape == (DIM, VOCAB)


def test_gradient_matrix_is_the_transposed_weight_gradient() -> None:
    module = embedding()
    helper = EmbeddingModuleHelper(module)
    assert helper.get_grad() is None
    module(tokens(4, 5)).sum().backward()
    assert module.weight.grad is not None
    v = helper.get_grad()
    assert v is not None and torch.equal(v, module.weight.grad.T)
    new = torch.randn(DIM, VOCAB, dtype=F64)
    helper.set_grad(new, torch.tensor(0.5, dtype=F64))
    assert torch.equal(module.weight.grad, 0.5 * new.T)
    module.weight.grad = None
    helper.set_grad(new)
    written = module.weight.grad
    assert written is not None and torch.equal(written, new.T)


def test_a_statistic_is_the_diagonal_of_the_one_hot_gram() -> None:
    helper = EmbeddingModuleHelper(embedding())
    x = tokens(4, 5)
    counts, rows = helper.a_statistic(x, F64)
    dense = one_hot(x).reshape(-1, VOCAB)
    gram = dense.T @ dense
    assert rows == 20
    assert torch.equal(gram, torch.diag(torch.diagonal(gram)))
    assert torch.equal(counts, torch.diagonal(gram))
    assert counts[VOCAB - 1] == 0


def test_g_statistic_equals_a_linear_on_the_same_output_gradient() -> None:
    helper = EmbeddingModuleHelper(embedding())
    gout = torch.randn(4, 5, DIM, dtype=F64)
    total, examples = helper.g_statistic(gout, F64, 2.0, per_example=False)
    rows = 2.0 * gout.reshape(-1, DIM)
    assert examples == 4
    assert_rel_close(total, rows.T @ rows, rtol=1e-14, label='embedding G')


@pytest.mark.parametrize(
    ('batch_first', 'index_shape', 'examples', 'positions'),
    [
        (True, (4, 5), 4, 5),
        (False, (5, 4), 4, 5),
        (True, (4, 5, 2), 4, 10),
        (False, (5, 4, 2), 4, 10),
        (True, (4,), 4, 1),
        (False, (4,), 4, 1),
        (True, (), 1, 1),
    ],
)
def test_examples_and_positions_follow_the_layout(
    batch_first: bool,
    index_shape: tuple[int, ...],
    examples: int,
    positions: int,
) -> None:
    """Indices carry no feature dimension; output gradients end in `d`."""
    helper = EmbeddingModuleHelper(embedding())
    helper.batch_first = batch_first
    x = tokens(*index_shape)
    gout = torch.zeros((*index_shape, DIM), dtype=F64)
    for tensor in (x, gout):
        assert helper.batch_size(tensor) == examples
        assert helper.positions(tensor) == positions


def test_only_the_expand_approximation_is_accepted() -> None:
    """Reduce would average one-hot inputs into a dense `(V, V)` A."""
    helper = EmbeddingModuleHelper(embedding())
    helper.kfac_approx = 'expand'
    assert helper.kfac_approx == 'expand'
    with pytest.raises(ValueError, match="supports 'expand' only"):
        helper.kfac_approx = 'reduce'
    assert helper.kfac_approx == 'expand'


def test_unsupported_options_are_named() -> None:
    assert unsupported_reason(embedding(padding_idx=2)) is None
    assert unsupported_reason(embedding(sparse=True)) == (
        'embedding with sparse=True (sparse gradients)'
    )
    assert unsupported_reason(embedding(scale_grad_by_freq=True)) == (
        'embedding with scale_grad_by_freq=True (gradient divided by '
        'in-batch token counts)'
    )
    with pytest.raises(ValueError, match='cannot precondition an embedding'):
        EmbeddingModuleHelper(embedding(max_norm=2.0))
    with pytest.raises(TypeError, match='needs an nn.Embedding'):
        EmbeddingModuleHelper(nn.Linear(2, 2))  # type: ignore[arg-type]  # wrong on purpose


def test_registration_refuses_unsupported_options_with_the_reason() -> None:
    model = nn.Sequential(
        nn.Embedding(5, 2),
        nn.Embedding(5, 2, max_norm=1.0),
        nn.Embedding(5, 2, sparse=True),
        nn.Embedding(5, 2, scale_grad_by_freq=True),
        nn.Embedding(5, 2, padding_idx=0),
    )
    registration = register_model(model)
    assert list(registration.helpers) == ['0', '4']
    assert all(
        isinstance(h, EmbeddingModuleHelper)
        for h in registration.helpers.values()
    )
    assert [(s.name, s.reason) for s in registration.skipped] == [
        ('1', unsupported_reason(model[1])),  # type: ignore[arg-type]  # an nn.Embedding
        ('2', unsupported_reason(model[2])),  # type: ignore[arg-type]  # an nn.Embedding
        ('3', unsupported_reason(model[3])),  # type: ignore[arg-type]  # an nn.Embedding
    ]
    assert all(
        s.reason.startswith('embedding with') for s in registration.skipped
    )
    assert get_module_helper(model[1]) is None
    assert isinstance(get_module_helper(model[0]), EmbeddingModuleHelper)


# Pure functions of a diagonal factor ----------------------------------------


def test_diagonal_functions_equal_the_dense_ones_with_a_diagonal_a() -> None:
    torch.manual_seed(0)
    v = torch.randn(DIM, VOCAB, dtype=F64)
    a = torch.rand(VOCAB, dtype=F64)
    a[2] = 0.0
    g = torch.randn(DIM, 2 * DIM, dtype=F64)
    g = g @ g.T
    qg, dg = symmetric_eigh(g, F64)
    scale = 1.0 / (torch.outer(dg, a) + 0.1)
    eye = torch.eye(VOCAB, dtype=F64)
    assert_rel_close(
        diagonal_eigen_precondition(v, qg, scale),
        eigen_precondition(v, eye, qg, scale),
        rtol=1e-14,
        label='diagonal eigen precondition',
    )
    a_inv, ok = damped_diagonal_inverse(a, 0.5, F64)
    assert bool(ok)
    assert_rel_close(
        a_inv,
        torch.diagonal(torch.linalg.inv(torch.diag(a) + 0.5 * eye)),
        rtol=1e-15,
        label='diagonal damped inverse',
    )
    g_inv = torch.linalg.inv(g + 0.2 * torch.eye(DIM, dtype=F64))
    assert_rel_close(
        diagonal_inverse_precondition(v, a_inv, g_inv),
        inverse_precondition(v, torch.diag(a_inv), g_inv),
        rtol=1e-14,
        label='diagonal inverse precondition',
    )


@pytest.mark.parametrize('bad', [-1.0, math.nan, math.inf])
def test_damped_diagonal_inverse_flags_an_invalid_factor(bad: float) -> None:
    a = torch.ones(4, dtype=F64)
    a[1] = bad
    _, ok = damped_diagonal_inverse(a, 0.5, F64)
    assert not bool(ok)


def test_prepare_jitters_a_diagonal_factor_like_its_matrix() -> None:
    a = torch.tensor([1.0, 0.0, 3.0, 4.0], dtype=F64)
    got = prepare(a, F64, JITTER)
    dense = prepare(torch.diag(a), F64, JITTER)
    assert torch.equal(got, torch.diagonal(dense))
    assert torch.equal(prepare(a, F64, 0.0), a)


def test_diagonal_factor_has_a_vector_shape() -> None:
    dense = KroneckerFactor('G', 3, lambda x, m: (x, 1), F64)
    diagonal = KroneckerFactor('A', 5, lambda x, m: (x, 1), F64, diagonal=True)
    assert (dense.shape, diagonal.shape) == ((3, 3), (5,))
    diagonal.capture(torch.arange(5, dtype=F64), 1.0, now=True)
    diagonal.capture(torch.ones(5, dtype=F64), 1.0, now=False)
    assert diagonal.update(0.5) is not None
    assert diagonal.value is not None
    assert torch.equal(diagonal.value, (torch.arange(5) + 1.0).double() / 2)


# Layers -------------------------------------------------------------------


def embedding_layer(
    cls: type[KFACBaseLayer], padding_idx: int | None = None, **kwargs: Any
) -> tuple[KFACBaseLayer, torch.Tensor, torch.Tensor]:
    """A layer on an embedding that captured one `(4, 5)` batch: its
    indices and output gradient.
    """
    module = embedding(padding_idx=padding_idx)
    layer = cls(EmbeddingModuleHelper(module), **kwargs)
    x = tokens(4, 5)
    out = module(x)
    gout = torch.randn(out.shape, dtype=F64)
    out.backward(gout)
    layer.save_layer_input(x, now=True)
    layer.save_layer_grad_output(gout, now=False)
    return layer, x, gout


LAYERS = [
    pytest.param(
        KFACEigenLayer, {'prediv_eigenvalues': True}, id='eigen-outer'
    ),
    pytest.param(KFACEigenLayer, {}, id='eigen'),
    pytest.param(KFACInverseLayer, {}, id='inverse'),
    # G at low rank beside the diagonal A (kept whole: exact at O(V))
    pytest.param(KFACEigenLayer, {'factor_rank': 2}, id='eigen-lowrank'),
    pytest.param(KFACInverseLayer, {'factor_rank': 2}, id='inverse-lowrank'),
]


@pytest.mark.parametrize(('cls', 'kwargs'), LAYERS)
def test_layer_preconditions_like_the_dense_solve(
    cls: type[KFACBaseLayer], kwargs: dict[str, Any]
) -> None:
    """Factors are those of the Linear on one-hot inputs; the result is
    the dense solve with `A = diag(a)`.
    """
    layer, x, gout = embedding_layer(cls, **kwargs)
    layer.update_factors(0.9)
    a_ref, g_ref = linear_factors(one_hot(x), gout, bias=False)
    assert layer.a.value is not None and layer.g.value is not None
    assert layer.a.value.shape == (VOCAB,)
    assert_rel_close(
        torch.diag(layer.a.value), a_ref, rtol=1e-15, label='embedding A'
    )
    assert_rel_close(layer.g.value, g_ref, rtol=1e-14, label='embedding G')
    for name in ('A', 'G'):
        assert layer.compute_decomposition(name, 0.1)
        tensors = layer.decomposition(name)
        assert tensors is not None
        layout = layer.decomposition_layout(name)
        assert [tuple(t.shape) for t in tensors] == [s for s, _ in layout]
        assert not (name == 'A' and any(sym for _, sym in layout))
    v = layer.module.get_grad()
    assert v is not None
    got = layer.precondition_grad(0.1)
    assert got is not None and got.shape == (DIM, VOCAB)
    reference = (
        inverse_reference if cls is KFACInverseLayer else eigen_reference
    )
    rank = kwargs.get('factor_rank')
    if rank is not None:
        assert layer.decomposition_format.endswith('_lowrank')
        g_ref = lowrank_plus_constant(g_ref, rank)
    assert_rel_close(
        got,
        reference(a_ref, g_ref, v, 0.1),
        rtol=1e-12,
        label='embedding layer precondition',
    )


def test_eigen_layouts_store_no_eigenvectors_of_a() -> None:
    plain, _, _ = embedding_layer(KFACEigenLayer)
    outer, _, _ = embedding_layer(KFACEigenLayer, prediv_eigenvalues=True)
    assert plain.decomposition_layout('A') == (((VOCAB,), False),)
    assert outer.decomposition_layout('A') == ()
    assert outer.decomposition_layout('G') == (
        ((DIM, DIM), False),
        ((DIM, VOCAB), False),
    )
    inverse, _, _ = embedding_layer(KFACInverseLayer)
    assert inverse.decomposition_layout('A') == (((VOCAB,), False),)
    assert inverse.decomposition_layout('G') == (((DIM, DIM), True),)


def test_padding_column_stays_zero() -> None:
    """The padding row gets no gradient; its count is in `A`, and the
    preconditioned gradient's column is zero too.
    """
    pad = int(torch.bincount(tokens(4, 5).reshape(-1)).argmax())
    for cls in (KFACEigenLayer, KFACInverseLayer):
        layer, _, _ = embedding_layer(cls, padding_idx=pad)
        layer.update_factors(0.9)
        assert layer.a.value is not None
        assert layer.a.value[pad] == layer.a.value.max() > 0
        for name in ('A', 'G'):
            layer.compute_decomposition(name, 0.1)
        v = layer.module.get_grad()
        assert v is not None and not v[:, pad].any()
        got = layer.precondition_grad(0.1)
        assert got is not None
        assert not got[:, pad].any()
        assert got.abs().sum() > 0


def test_invalid_diagonal_factor_fails_every_attempt() -> None:
    layer, _, _ = embedding_layer(KFACInverseLayer)
    layer.update_factors(0.9)
    assert layer.a.value is not None
    layer.a.value[0] = -10.0
    assert not layer.compute_decomposition('A', 0.01)
    assert layer.counters['decomposition_failures'] == 1


def test_allreduce_and_payload_use_the_vector() -> None:
    """Symmetry-aware packing would refuse a vector: the diagonal factor is
    sent unflagged, the dense one flagged.
    """
    layer, _, _ = embedding_layer(KFACInverseLayer)
    layer.update_factors(0.9)
    comm = TorchDistributedCommunicator(symmetry_aware=True)
    handles = start_factor_allreduce(comm, layer, bucketed=True)
    comm.flush()
    assert layer.a.value is not None and layer.g.value is not None
    assert torch.equal(handles[0].wait(), layer.a.value)
    assert torch.equal(handles[1].wait(), layer.g.value)
    (payload,) = decomposition_payload(layer, 'A')
    assert payload.shape == (VOCAB,) and payload.isnan().all()


def test_memory_counts_the_vector() -> None:
    layer, _, _ = embedding_layer(KFACInverseLayer)
    layer.update_factors(0.9)
    for name in ('A', 'G'):
        layer.compute_decomposition(name, 0.1)
    usage = layer.memory_usage()
    assert usage['a_factors'] == usage['a_inverses'] == VOCAB * 8
    assert usage['g_factors'] == usage['g_inverses'] == DIM * DIM * 8


def test_state_spec_expects_a_vector_for_a_diagonal_factor() -> None:
    spec = LayerSpec({'A': 5, 'G': 2}, 'inverse', {}, frozenset({'A'}))
    state = {
        'version': 1,
        'steps': 1,
        'hyperparameters': {},
        'layers': {
            'embed': {'A': torch.ones(5, 5), 'G': torch.ones(2, 2)},
        },
    }
    with pytest.raises(
        ValueError, match=r'A has shape \(5, 5\), expected \(5,\)'
    ):
        parse_state(state, {'embed': spec}, strict=True)
    state['layers'] = {'embed': {'A': torch.ones(5), 'G': torch.ones(2, 2)}}
    parsed = parse_state(state, {'embed': spec}, strict=True)
    assert parsed.layers['embed'].factors['A'].shape == (5,)
