"""An embedding tied to its output head (`head.weight is wte.weight`): one
layer combining both uses (kfac.layers.tied).

Oracles (float64, hook-free): each use's factors from its definition with
autograd on separate copies of the weight; the combined factors from the
formula of `kfac.math` written out here; the preconditioned gradient from a
dense solve with them.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kfac._engine.report import format_report
from kfac.config import StatisticsConfig
from kfac.layers.curvature import EigenCurvature
from kfac.layers.curvature import method_config
from kfac.layers.register import register_model
from kfac.layers.tied import TiedHelper
from kfac.layers.tied import TiedStatistics
from kfac.preconditioner import KFACPreconditioner
from kfac.state import STATE_VERSION
from testing.asserts import assert_rel_close
from testing.reference import eigen_reference
from testing.reference import inverse_reference
from testing.reference import layer_factors
from testing.reference import lowrank_plus_constant

F64 = torch.float64
DIM = 3


class TiedLM(nn.Module):
    """Embedding, a mixing layer and a head sharing the embedding's
    weight.
    """

    def __init__(self, vocab: int, bias: bool = False) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, DIM)
        self.mix = nn.Linear(DIM, DIM)
        self.head = nn.Linear(DIM, vocab, bias=bias)
        self.head.weight = self.wte.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(torch.tanh(self.mix(self.wte(idx))))
        return out


def _data(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    idx = torch.randint(0, vocab, (4, 5), generator=gen)
    return idx, torch.randint(0, vocab, (4, 5), generator=gen)


def _loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def _mean(m: torch.Tensor) -> torch.Tensor:
    return m.trace() / m.shape[0]


def _combine(
    terms: list[tuple[torch.Tensor, torch.Tensor]],
) -> tuple[torch.Tensor, torch.Tensor]:
    """The documented rule, dense: X = Σ m(Y) X / √C, Y = Σ m(X) Y / √C."""
    root = torch.stack([_mean(x) * _mean(y) for x, y in terms]).sum().sqrt()
    x_bar = torch.stack([_mean(y) * x for x, y in terms]).sum(0) / root
    y_bar = torch.stack([_mean(x) * y for x, y in terms]).sum(0) / root
    return x_bar, y_bar


def _reference(
    model: TiedLM, idx: torch.Tensor, y: torch.Tensor
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Each use's factors (loss averaged over tokens) and `V = (∇E)ᵀ`,
    with autograd on two separate copies of the weight (no hooks).
    """
    weight = model.wte.weight.detach()
    w_emb = weight.clone().requires_grad_()
    w_head = weight.clone().requires_grad_()
    x = F.embedding(idx, w_emb)
    h = torch.tanh(F.linear(x, model.mix.weight, model.mix.bias))
    logits = F.linear(h, w_head)
    g_emb, g_head, gx, glogits = torch.autograd.grad(
        _loss(logits, y), (w_emb, w_head, x, logits)
    )
    vocab = weight.shape[0]
    onehot = F.one_hot(idx, vocab).to(F64)
    a_e, g_e = layer_factors(
        onehot, gx, bias=False, loss_average='batch+sequence'
    )
    a_h, g_h = layer_factors(
        h.detach(), glogits, bias=False, loss_average='batch+sequence'
    )
    factors = {'a_e': a_e, 'g_e': g_e, 'a_h': a_h, 'g_h': g_h}
    return factors, (g_emb + g_head).T


def _step(
    model: TiedLM, idx: torch.Tensor, y: torch.Tensor, **kwargs: object
) -> KFACPreconditioner:
    precon = KFACPreconditioner(
        model,
        **{
            'relative_clip': None,
            'damping': 0.01,
            'statistics': StatisticsConfig(loss_average='batch+sequence'),
            **kwargs,
        },  # type: ignore[arg-type]  # keyword options of the preconditioner
    )
    _loss(model(idx), y).backward()
    precon.step()
    return precon


@pytest.mark.parametrize('rank', [None, 3])
@pytest.mark.parametrize('method', ['eigen', 'inverse'])
def test_tied_factors_and_gradient_equal_the_documented_combination(
    method: str, rank: int | None
) -> None:
    """With `factor_rank`, the combined factors are kept at low rank like
    any dense pair (the reference: their top eigenpairs plus the mean of
    the rest).
    """
    torch.manual_seed(0)
    model = TiedLM(7).double()
    idx, y = _data(7)
    ref, v = _reference(model, idx, y)
    precon = _step(
        model, idx, y, compute_method=method_config(method, factor_rank=rank)
    )
    assert list(precon.layers) == ['wte', 'mix']
    layer = precon.layers['wte']
    uses = {f.name: f.value for f in layer.factors}
    assert list(uses) == ['wte:A', 'wte:G', 'head:A', 'head:G']
    assert uses['wte:A'] is not None and uses['wte:A'].shape == (7,)
    assert_rel_close(torch.diag(uses['wte:A']), ref['a_e'], label='tied use')
    for name, key in (('wte:G', 'g_e'), ('head:A', 'a_h'), ('head:G', 'g_h')):
        value = uses[name]
        assert value is not None
        assert_rel_close(value, ref[key], label='tied use')
    a, g = _combine([(ref['a_e'], ref['g_e']), (ref['g_h'], ref['a_h'])])
    combined_a = layer.decomposition_input('A')
    combined_g = layer.decomposition_input('G')
    assert combined_a is not None and combined_g is not None
    assert_rel_close(combined_a, a, label='tied combined')
    assert_rel_close(combined_g, g, label='tied combined')
    if rank is not None:
        assert layer.decomposition_format == f'{method}_lowrank'
        a, g = lowrank_plus_constant(a, rank), lowrank_plus_constant(g, rank)
    reference = eigen_reference if method == 'eigen' else inverse_reference
    expected = reference(a, g, v, 0.01)
    grad = model.wte.weight.grad
    assert grad is not None and model.head.weight.grad is grad
    assert_rel_close(grad.T, expected, label='tied preconditioned')


def test_tied_tiles_combine_each_vocabulary_block() -> None:
    """V = 10 > max_factor_dim = 4: three tiles of 4, 3 and 3 tokens,
    each combining the two uses' blocks with its own traces.
    """
    torch.manual_seed(1)
    model = TiedLM(10).double()
    idx, y = _data(10)
    ref, v = _reference(model, idx, y)
    precon = _step(
        model,
        idx,
        y,
        statistics=StatisticsConfig(
            max_factor_dim=4, loss_average='batch+sequence'
        ),
        compute_method='eigen',
    )
    assert list(precon.layers) == [f'wte.block{k}' for k in range(3)] + ['mix']
    grad = model.wte.weight.grad
    assert grad is not None
    for k, (c0, c1) in enumerate(itertools.pairwise((0, 4, 7, 10))):
        a, g = _combine(
            [
                (ref['a_e'][c0:c1, c0:c1], ref['g_e']),
                (ref['g_h'][c0:c1, c0:c1], ref['a_h']),
            ]
        )
        tile = precon.layers[f'wte.block{k}']
        assert tile.a.shape == (c1 - c0, c1 - c0)
        expected = eigen_reference(a, g, v[:, c0:c1], 0.01)
        assert_rel_close(grad.T[:, c0:c1], expected, label='tied tiles')


def test_one_use_alone_is_preconditioned_with_its_own_factors() -> None:
    """Only the head runs: the combination is the head's own Kronecker
    product, transposed.
    """
    torch.manual_seed(2)
    model = TiedLM(5).double()
    precon = KFACPreconditioner(
        model, relative_clip=None, damping=0.1, compute_method='eigen'
    )
    h = torch.randn(6, DIM, dtype=F64)
    target = torch.randint(0, 5, (6,))
    F.cross_entropy(model.head(h), target).backward()
    grad = model.wte.weight.grad
    assert grad is not None
    v = grad.T.clone()
    a_h, g_h = layer_factors(
        h[:, None], _head_grad(model, h, target)[:, None], bias=False
    )
    precon.step()
    assert model.wte.weight.grad is not None
    assert_rel_close(
        model.wte.weight.grad.T,
        eigen_reference(g_h, a_h, v, 0.1),
        label='tied one use',
    )


def _head_grad(
    model: TiedLM, h: torch.Tensor, target: torch.Tensor
) -> torch.Tensor:
    logits = F.linear(h, model.head.weight.detach()).requires_grad_()
    (grad,) = torch.autograd.grad(F.cross_entropy(logits, target), logits)
    return grad


def test_a_small_tied_language_model_trains() -> None:
    torch.manual_seed(4)
    model = TiedLM(11)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2)
    precon = KFACPreconditioner(
        model,
        lr=0.2,
        damping=0.01,
        statistics=StatisticsConfig(loss_average='batch+sequence'),
    )
    pattern = torch.arange(11)
    idx = torch.stack([pattern.roll(s) for s in range(8)])
    y = idx.roll(-1, dims=1)
    losses = []
    for _ in range(40):
        optimizer.zero_grad()
        loss = _loss(model(idx), y)
        loss.backward()
        precon.step()
        optimizer.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < 0.5 * losses[0], losses


def test_report_state_and_refusals() -> None:
    model = TiedLM(6).double()
    precon = KFACPreconditioner(model, compute_method='eigen')
    entry = precon.describe()['preconditioned'][0]
    assert entry['tied'] is not None
    assert (entry['tied']['embedding'], entry['tied']['head']) == (
        'wte',
        'head',
    )
    assert entry['shares_weight_with'] == ['head']
    assert entry['A'] == (6, 6) and entry['G'] == (DIM, DIM)
    assert precon.describe()['not_preconditioned'] == []
    assert 'weight tied: embedding wte and head head (transposed)' in (
        format_report(precon.describe())
    )
    idx, y = _data(6)
    _loss(model(idx), y).backward()
    precon.step()
    state = precon.state_dict()
    assert state['version'] == STATE_VERSION
    assert set(state['layers']['wte']) == {
        'wte:A',
        'wte:G',
        'head:A',
        'head:G',
    }
    other = KFACPreconditioner(model, compute_method='eigen')
    other.load_state_dict(state)
    tied = other.layers['wte']
    assert isinstance(tied.statistics, TiedStatistics)
    assert (
        isinstance(tied.curvature, EigenCurvature) and tied.has_decomposition
    )
    memory = tied.memory_usage()
    assert memory['a_factors'] == (6 + 36) * 8
    assert memory['g_factors'] == 2 * DIM * DIM * 8
    assert memory['a_inverses'] > 0 and memory['grad'] == 0
    with pytest.raises(ValueError, match="one of \\['A', 'G', 'wte:A'"):
        tied.factor('B')
    # A head with a bias is left to the optimizer, with the reason.
    biased = register_model(TiedLM(6, bias=True))
    assert list(biased.helpers) == ['mix']
    assert {s.name for s in biased.skipped} == {'wte', 'head'}


def test_tied_helper_checks() -> None:
    model = TiedLM(4)
    registration = register_model(model)
    helper = registration.helpers['wte']
    assert isinstance(helper, TiedHelper)
    assert helper.in_features == 4 and helper.bias is None
    assert 'TiedHelper(' in repr(helper)
    x = torch.zeros(2, dtype=torch.long)
    with pytest.raises(NotImplementedError, match='per use'):
        next(iter(helper.a_columns(x, F64)))
    with pytest.raises(NotImplementedError, match='per use'):
        helper.g_columns(torch.zeros(2, DIM), F64, 1.0)
    assert helper.batch_size(x) == 2 and helper.positions(x) == 1
    with pytest.raises(ValueError, match='TiedHelper needs an embedding'):
        TiedHelper(helper.head, helper.embedding, ('head', 'wte'))
    with pytest.raises(TypeError, match='needs a TiedHelper'):
        TiedStatistics(helper.head)


def test_tied_layer_edges() -> None:
    """No use ran (nothing to update, nothing to decompose), the model
    moves to another dtype (the decompositions follow), and a weight used
    by three modules is left to the optimizer.
    """
    model = TiedLM(5)
    precon = KFACPreconditioner(model, relative_clip=None)
    layer = precon.layers['wte']
    assert layer.update_factors(0.9) is None
    assert layer.decomposition_input('A') is None and not layer.has_factors
    idx, y = _data(5)
    _loss(model(idx), y).backward()
    precon.step()
    assert layer.has_decomposition
    model.double()
    assert layer.follow_module()
    decomposition = layer.decomposition('A')
    assert decomposition is not None
    assert all(t.dtype == F64 for t in decomposition)
    model.zero_grad()
    _loss(model(idx), y).backward()
    precon.step()  # float64 end to end
    assert all(
        f.value is not None and f.value.dtype == F64 for f in layer.factors
    )
    third = TiedLM(5)
    third.mix = nn.Linear(5, DIM, bias=False)  # weight (3, 5): a third user
    third.mix.weight = third.wte.weight
    registration = register_model(third)
    assert registration.helpers == {}
    assert {s.name for s in registration.skipped} == {'wte', 'mix', 'head'}
