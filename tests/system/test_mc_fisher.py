"""The Monte Carlo Fisher (`fisher_type='mc'`) against independent oracles.

* The sampling rule, reimplemented here in plain Python integers and
  floats (splitmix64, inverse transform), gives the library's targets
  bitwise; `G` from one sampled pass equals bitwise the empirical `G` of a
  second preconditioner trained on those targets as labels.
* With many samples, `G` converges to the `G` of the exact Fisher
  (`(1/N) Σ_n J_nᵀ H_n J_n`, `H_n = diag(p) − p pᵀ` for cross-entropy,
  `(2/E) I` for the mean squared error), each `J_n` a dense Jacobian, within
  a bound derived from the number of samples; the empirical `G` lies far
  outside it (the test can fail).
* The sampled pass leaves `.grad` bitwise unchanged and costs nothing on
  steps that do not update factors; accumulation, a loss scale, resume and
  `torch.compile` give what one plain process gives.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterator
from typing import Any
from typing import cast

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kfac._engine.fisher
from kfac.config import FisherConfig
from kfac.config import StatisticsConfig
from kfac.math.fisher import gaussian_noise
from kfac.math.fisher import parse_fisher
from kfac.preconditioner import KFACPreconditioner
from testing.asserts import WORST
from testing.asserts import assert_rel_close
from testing.curvlinops import curvlinops_factors
from testing.reference import py_class
from testing.reference import py_classes
from testing.reference import py_uniform
from testing.torch_release import COMPILED

F64 = torch.float64
N, D_IN, HIDDEN, C = 6, 4, 5, 3


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    """One intra-op thread: these models are tiny, and on a loaded 2-core
    machine a 2-thread softmax of 6 rows waits ~15 ms on the other thread.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(D_IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, C)
    ).to(F64)


def data() -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(1)
    return torch.randn(N, D_IN, dtype=F64) * 2, torch.randint(0, C, (N,))


def mc_step(
    net: nn.Module,
    x: torch.Tensor,
    loss: str = 'cross_entropy',
    *,
    seed: int = 0,
    samples: int = 1,
    **options: Any,
) -> KFACPreconditioner:
    """One MC step on `(x, labels)`; the preconditioner (hooks removed)."""
    precon = KFACPreconditioner(
        net,
        relative_clip=None,
        fisher=FisherConfig(
            fisher_type='mc', mc_seed=seed, mc_samples=samples
        ),
        **options,
    )
    out = net(x)
    precon.sample_fisher(out, loss)
    (out**2).mean().backward()  # any loss: G must not depend on it
    precon.step()
    precon.remove()
    return precon


def g_factors(precon: KFACPreconditioner) -> dict[str, torch.Tensor]:
    out = {}
    for name, layer in precon.layers.items():
        assert layer.g.value is not None
        out[name] = layer.g.value
    return out


# Bitwise: one sampled pass is the empirical Fisher at the sampled labels ----


@pytest.mark.parametrize('seed', [0, 7])
def test_one_sample_equals_the_empirical_g_at_independent_samples(
    seed: int,
) -> None:
    x, _ = data()
    net = model()
    mc = g_factors(mc_step(copy.deepcopy(net), x, seed=seed))
    probs = torch.softmax(net(x).detach(), -1)
    labels = torch.tensor(py_classes(probs, seed, 0, list(range(N)), 0))
    twin = copy.deepcopy(net)
    precon = KFACPreconditioner(twin, relative_clip=None)
    F.cross_entropy(twin(x), labels).backward()
    precon.step()
    for name, g in g_factors(precon).items():
        assert torch.equal(mc[name], g), name


def test_masked_tokens_are_left_out_as_ignore_index() -> None:
    """Tokens `(N, T, C)` with a mask: the empirical `G` at the sampled
    tokens, `ignore_index` where the mask is False.
    """
    torch.manual_seed(2)
    net = model()
    x = torch.randn(N, 2, D_IN, dtype=F64)
    mask = torch.rand(N, 2) > 0.3
    indices = torch.arange(10, 10 + N)
    options: dict[str, Any] = {
        'statistics': StatisticsConfig(loss_average='batch+sequence'),
        'relative_clip': None,
    }
    sampled = copy.deepcopy(net)
    precon = KFACPreconditioner(
        sampled, **options, fisher=FisherConfig(fisher_type='mc')
    )
    out = sampled(x)
    precon.sample_fisher(out, mask=mask, indices=indices)
    out.sum().backward()
    precon.step()
    probs = torch.softmax(net(x).detach(), -1)
    labels = torch.tensor(
        [
            [
                py_class(probs[n, t].tolist(), py_uniform(0, 0, 10 + n, t))
                for t in range(2)
            ]
            for n in range(N)
        ]
    )
    labels[~mask] = -100
    twin = copy.deepcopy(net)
    reference = KFACPreconditioner(twin, **options)
    F.cross_entropy(twin(x).flatten(0, 1), labels.flatten()).backward()
    reference.step()
    for name, g in g_factors(reference).items():
        assert torch.equal(g_factors(precon)[name], g), name


@pytest.mark.parametrize('loss_average', ['batch', None])
def test_mse_samples_a_gaussian_of_the_loss_variance(
    loss_average: str | None,
) -> None:
    """MSE: `ŷ = f + √(E/2) ε` with the reference's normals (E = 3 outputs
    per example; `σ² = 1/2` for a summed loss); the empirical `G` at `ŷ`.
    """
    x, _ = data()
    net = model()
    statistics = StatisticsConfig(loss_average=loss_average)
    mc = g_factors(
        mc_step(copy.deepcopy(net), x, 'mse', seed=3, statistics=statistics)
    )
    out = net(x).detach()
    u = torch.tensor(
        [
            [
                [py_uniform(3, 0, n, 2 * t + d) for d in range(2)]
                for t in range(C)
            ]
            for n in range(N)
        ],
        dtype=F64,
    )
    variance = C / 2 if loss_average else 1 / 2
    target = out + gaussian_noise(u) * math.sqrt(variance)
    twin = copy.deepcopy(net)
    precon = KFACPreconditioner(
        twin,
        relative_clip=None,
        statistics=StatisticsConfig(loss_average=loss_average),
    )
    reduction = 'mean' if loss_average else 'sum'
    F.mse_loss(twin(x), target, reduction=reduction).backward()
    precon.step()
    for name, g in g_factors(precon).items():
        assert torch.equal(mc[name], g), name


# Convergence to the exact Fisher -------------------------------------------


def jacobians(net: nn.Sequential, x: torch.Tensor) -> list[torch.Tensor]:
    """Per example, the dense Jacobian `(C, hidden)` of the output with
    respect to the first layer's output.
    """
    first, act, last = net
    jacobian = cast(Any, torch.autograd.functional.jacobian)  # untyped
    return [jacobian(lambda v: last(act(v)), first(row).detach()) for row in x]


def ce_terms(f: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The outcomes `p − e_y` `(C, C)` (row `y`) and their probabilities."""
    p = torch.softmax(f, -1)
    return p - torch.eye(len(p), dtype=p.dtype), p


def exact_moments(
    loss: str, net: nn.Sequential, x: torch.Tensor
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, the exact `G = (1/N) Σ_n J_nᵀ H_n J_n` and the exact
    variance of each entry of the one-sample estimate
    `(1/N) Σ_n (J_nᵀ z_n)(J_nᵀ z_n)ᵀ`: cross-entropy by enumerating the
    classes (`z = p − e_y`), the Gaussian by Isserlis' theorem
    (`Var(u_i u_j) = Σ_ii Σ_jj + Σ_ij²` for `u ~ N(0, Σ)`).
    """
    out: dict[str, tuple[list[torch.Tensor], list[torch.Tensor]]] = {
        '0': ([], []),
        '2': ([], []),
    }
    outputs = net(x).detach()
    for f, jac in zip(outputs, jacobians(net, x)):
        for name, j in (('2', torch.eye(C, dtype=F64)), ('0', jac)):
            if loss == 'cross_entropy':
                z, p = ce_terms(f)
                terms = torch.einsum('yi,yj->yij', z @ j, z @ j)
                mean = torch.einsum('y,yij->ij', p, terms)
                var = torch.einsum('y,yij->ij', p, (terms - mean) ** 2)
            else:
                mean = j.T @ j * (2 / C)
                var = torch.outer(mean.diag(), mean.diag()) + mean**2
            out[name][0].append(mean)
            out[name][1].append(var)
    return {
        name: (torch.stack(g).mean(0), torch.stack(v).sum(0) / N**2)
        for name, (g, v) in out.items()
    }


@pytest.mark.parametrize('loss', ['cross_entropy', 'mse'])
def test_many_samples_converge_to_the_exact_fisher(loss: str) -> None:
    """With `k` samples, each entry of `G` has variance `v / k` (`v` the
    exact one-sample variance); the Frobenius error is below
    `5 √(Σ v / k)` but for a rare event (its mean square is `Σ v / k`).
    The empirical Fisher's `G` lies far outside that bound.
    """
    samples = 400
    x, y = data()
    net = model()
    moments = exact_moments(loss, net, x)
    mc = g_factors(mc_step(copy.deepcopy(net), x, loss, samples=samples))
    for name, (exact, var) in moments.items():
        tolerance = 5 * math.sqrt(float(var.sum()) / samples)
        error = float(torch.linalg.matrix_norm(mc[name] - exact))
        label = f'mc-fisher {loss} G error / 5-sigma bound'
        WORST[label] = max(WORST.get(label, 0.0), error / tolerance)
        assert error < tolerance, (name, error, tolerance)
    if loss == 'cross_entropy':  # the empirical Fisher is not it
        twin = copy.deepcopy(net)
        precon = KFACPreconditioner(twin, relative_clip=None)
        F.cross_entropy(twin(x), y).backward()
        precon.step()
        exact, var = moments['2']
        tolerance = 5 * math.sqrt(float(var.sum()) / samples)
        empirical = g_factors(precon)['2']
        assert float(torch.linalg.matrix_norm(empirical - exact)) > (
            3 * tolerance
        )


def test_the_exact_reference_is_curvlinops_type_2() -> None:
    """curvlinops' exact Fisher (`fisher_type='type-2'`, from the loss's
    Hessian) has the `G` the convergence test converges to.
    """
    x, y = data()
    net = model()
    factors = curvlinops_factors(
        net,
        nn.CrossEntropyLoss(),
        x,
        y,
        num_per_example_loss_terms=1,
        fisher_type='type-2',
    )
    for name, (exact, _) in exact_moments('cross_entropy', net, x).items():
        assert_rel_close(
            factors[name][1], exact, rtol=1e-12, label='mc-fisher exact G'
        )


# The real step is untouched ------------------------------------------------


def test_grad_is_unchanged_and_non_update_steps_cost_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    x, y = data()
    net, plain = model(), model()
    precon = KFACPreconditioner(
        net,
        factor_update_steps=2,
        fisher=FisherConfig(fisher_type='mc', mc_samples=2),
    )
    passes = []
    grad = torch.autograd.grad

    def counted(*args: Any, **kwargs: Any) -> Any:
        passes.append(1)
        return grad(*args, **kwargs)

    monkeypatch.setattr(torch.autograd, 'grad', counted)
    for step in range(3):
        out = net(x)
        precon.sample_fisher(out)
        F.cross_entropy(out, y).backward()
        F.cross_entropy(plain(x), y).backward()
        for p, q in zip(net.parameters(), plain.parameters()):
            assert p.grad is not None and q.grad is not None
            assert torch.equal(p.grad, q.grad)
        assert len(passes) == 2 * (step // 2 + 1)  # steps 0 and 2 only
        precon.step()
        net.zero_grad()
        plain.zero_grad()


def test_empirical_ignores_sample_fisher() -> None:
    x, y = data()
    net = model()
    precon = KFACPreconditioner(net, relative_clip=None)
    out = net(x)
    precon.sample_fisher(out)
    F.cross_entropy(out, y).backward()
    precon.step()
    twin = model()
    reference = KFACPreconditioner(twin, relative_clip=None)
    F.cross_entropy(twin(x), y).backward()
    reference.step()
    for name, g in g_factors(reference).items():
        assert torch.equal(g_factors(precon)[name], g)


def test_a_forward_pass_that_was_not_sampled_raises() -> None:
    x, y = data()
    net = model()
    KFACPreconditioner(net, fisher=FisherConfig(fisher_type='mc'))
    with pytest.raises(RuntimeError, match='sample_fisher'):
        F.cross_entropy(net(x), y).backward()


# Accumulation, loss scale, compile, resume ---------------------------------


def test_micro_batches_equal_the_whole_batch() -> None:
    x, _ = data()
    whole = g_factors(mc_step(model(), x, samples=3))
    net = model()
    precon = KFACPreconditioner(
        net,
        accumulation_steps=2,
        relative_clip=None,
        fisher=FisherConfig(fisher_type='mc', mc_samples=3),
    )
    for part in x.chunk(2):
        out = net(part)
        precon.sample_fisher(out)
        (out.sum() / 2).backward()
    precon.step()
    for name, g in g_factors(precon).items():
        assert_rel_close(
            g, whole[name], rtol=1e-14, label='mc-fisher accumulation'
        )


def test_a_loss_scale_is_divided_out() -> None:
    x, y = data()
    plain = g_factors(mc_step(model(), x))
    scaled = g_factors(mc_step(model(), x, grad_scaler=lambda: 1024.0))
    assert all(torch.equal(scaled[n], plain[n]) for n in plain)
    # a GradScaler that has not scaled a loss yet: its initial scale
    scaler = torch.amp.GradScaler('cpu', init_scale=512.0)
    net = model()
    precon = KFACPreconditioner(
        net,
        grad_scaler=scaler,
        relative_clip=None,
        fisher=FisherConfig(fisher_type='mc'),
    )
    out = net(x)
    precon.sample_fisher(out)
    scaler.scale(F.cross_entropy(out, y)).backward()
    precon.step()
    for name, g in g_factors(precon).items():
        assert_rel_close(g, plain[name], rtol=1e-15, label='mc-fisher scaler')


@COMPILED
def test_compiled_model_samples_as_eager() -> None:
    x, y = data()
    eager = g_factors(mc_step(model(), x, samples=2))
    net = model()
    compiled = cast(nn.Module, torch.compile(net, backend='aot_eager'))
    precon = KFACPreconditioner(
        compiled,
        relative_clip=None,
        fisher=FisherConfig(fisher_type='mc', mc_samples=2),
    )
    out = compiled(x)
    precon.sample_fisher(out)
    F.cross_entropy(out, y).backward()
    precon.step()
    for name, g in g_factors(precon).items():
        assert_rel_close(g, eager[name], rtol=1e-14, label='mc-fisher compile')


def train(net: nn.Module, precon: KFACPreconditioner, steps: range) -> None:
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    x, y = data()
    for step in steps:
        optimizer.zero_grad()
        out = net(x + step)
        precon.sample_fisher(out)
        F.cross_entropy(out, y).backward()
        precon.step()
        optimizer.step()


def test_resume_continues_exactly() -> None:
    options: dict[str, Any] = {
        'fisher': FisherConfig(fisher_type='mc', mc_seed=11),
        'factor_decay': 0.5,
    }
    whole = model()
    train(whole, KFACPreconditioner(whole, **options), range(4))
    first = model()
    precon = KFACPreconditioner(first, **options)
    train(first, precon, range(2))
    state = precon.state_dict()
    assert parse_fisher(state) == {
        'fisher_type': 'mc',
        'mc_samples': 1,
        'mc_seed': 11,
    }
    resumed = copy.deepcopy(first)
    again = KFACPreconditioner(
        resumed, fisher=FisherConfig(fisher_type='mc')
    )  # seed 0
    again.load_state_dict(state)
    assert again.fisher.seed == 11
    train(resumed, again, range(2, 4))
    for p, q in zip(resumed.parameters(), whole.parameters()):
        assert torch.equal(p, q)


def test_a_state_without_fisher_keeps_the_seed() -> None:
    net = model()
    precon = KFACPreconditioner(
        net, fisher=FisherConfig(fisher_type='mc', mc_seed=5)
    )
    train(net, precon, range(1))
    state = dict(precon.state_dict())
    del state['fisher']
    state['version'] = 3
    precon.load_state_dict(state)
    assert precon.fisher.seed == 5


# Bad input -----------------------------------------------------------------


@pytest.mark.parametrize(
    ('options', 'error', 'match'),
    [
        ({'fisher_type': 'exact'}, ValueError, 'fisher_type'),
        ({'mc_samples': 0}, ValueError, 'mc_samples'),
        ({'mc_samples': 1.5}, TypeError, 'mc_samples'),
        ({'mc_seed': -1}, ValueError, 'mc_seed'),
        ({'mc_seed': 1 << 63}, ValueError, 'mc_seed'),
    ],
)
def test_bad_options_are_refused(
    options: dict[str, Any], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        FisherConfig(**options)


def test_several_samples_are_refused_with_ekfac() -> None:
    fisher = FisherConfig(fisher_type='mc', mc_samples=2)
    with pytest.raises(
        ValueError, match="not supported with compute_method='ekfac'"
    ):
        KFACPreconditioner(model(), compute_method='ekfac', fisher=fisher)


def test_bad_arguments_of_sample_fisher_are_refused() -> None:
    x, _ = data()
    net = model()
    precon = KFACPreconditioner(net, fisher=FisherConfig(fisher_type='mc'))
    out = net(x)
    cases: list[tuple[dict[str, Any], type[Exception], str]] = [
        ({'output': out.detach()}, ValueError, 'require grad'),
        ({'output': out[0]}, ValueError, 'output'),
        ({'output': 'logits'}, TypeError, 'output'),
        ({'loss': 'nll'}, ValueError, 'loss'),
        (
            {'loss': 'mse', 'mask': torch.ones(N, dtype=torch.bool)},
            ValueError,
            'mask',
        ),
        ({'mask': torch.ones(N + 1, dtype=torch.bool)}, ValueError, 'mask'),
        ({'mask': torch.ones(N)}, ValueError, 'mask'),
        ({'indices': torch.arange(N + 1)}, ValueError, 'indices'),
        ({'indices': torch.ones(N)}, ValueError, 'indices'),
    ]
    for kwargs, error, match in cases:
        arguments = {'output': out, **kwargs}
        with pytest.raises(error, match=match):
            precon.sample_fisher(**arguments)


def test_several_samples_need_a_batch_dimension() -> None:
    net = model()
    precon = KFACPreconditioner(
        net,
        fisher=FisherConfig(fisher_type='mc', mc_samples=2),
    )
    with pytest.raises(ValueError, match='batch dimension'):
        precon.sample_fisher(net(torch.randn(D_IN, dtype=F64)), 'mse')


def test_sharded_models_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kfac._engine.fisher, 'is_sharded', lambda w: True)
    with pytest.raises(ValueError, match='FSDP2'):
        KFACPreconditioner(model(), fisher=FisherConfig(fisher_type='mc'))


def test_a_malformed_fisher_entry_is_refused() -> None:
    net = model()
    precon = KFACPreconditioner(net, fisher=FisherConfig(fisher_type='mc'))
    state: dict[str, Any] = dict(precon.state_dict())
    for bad in (
        {'fisher_type': 'mc'},
        'mc',
        {**state['fisher'], 'mc_seed': -2},
    ):
        state['fisher'] = bad
        with pytest.raises(ValueError, match='fisher'):
            precon.load_state_dict(state)
    assert parse_fisher([1]) is None
    with pytest.raises(TypeError, match='mapping'):
        precon.load_state_dict([1])  # type: ignore[arg-type]  # on purpose


class Checkpointed(nn.Module):
    """`model()`'s layers, the first (and its activation) checkpointed
    (`reentrant` None: not checkpointed).
    """

    def __init__(self, reentrant: bool | None) -> None:
        super().__init__()
        self.net = model()
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        first, act, last = self.net

        def hidden(v: torch.Tensor) -> torch.Tensor:
            out: torch.Tensor = act(first(v))
            return out

        if self.reentrant is None:
            return last(hidden(x))  # type: ignore[no-any-return]  # a Linear
        kept = torch.utils.checkpoint.checkpoint(
            hidden, x, use_reentrant=self.reentrant
        )
        return last(kept)  # type: ignore[no-any-return]  # a Linear


def checkpointed_g(reentrant: bool | None) -> dict[str, torch.Tensor]:
    x, y = data()
    net = Checkpointed(reentrant)
    precon = KFACPreconditioner(
        net,
        relative_clip=None,
        fisher=FisherConfig(fisher_type='mc', mc_samples=2),
    )
    out = net(x.requires_grad_(reentrant is not None))
    precon.sample_fisher(out)
    F.cross_entropy(out, y).backward()
    precon.step()
    return g_factors(precon)


def test_activation_checkpointing() -> None:
    """Non-reentrant checkpointing samples as without it; the reentrant
    kind recomputes a forward pass in the real backward pass, which is
    refused.
    """
    plain = checkpointed_g(None)
    for name, g in checkpointed_g(False).items():
        assert torch.equal(g, plain[name]), name
    with pytest.raises(RuntimeError, match='not sampled'):
        checkpointed_g(True)
