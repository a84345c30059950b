"""The preconditioner's numbers against dense float64 references."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kfac.preconditioner import KFACPreconditioner
from testing.asserts import assert_rel_close
from testing.models import TinyCNN
from testing.models import TinyMLP
from testing.models import classification_data
from testing.reference import conv_factors
from testing.reference import eigen_reference
from testing.reference import grad_matrix
from testing.reference import inverse_reference
from testing.reference import linear_factors
from testing.reference import per_example_fisher

F64 = torch.float64
METHODS = ['eigen', 'inverse']


def capture_io(model: nn.Module) -> dict[str, list[torch.Tensor]]:
    """Record each Linear/Conv2d input and output gradient (test hooks)."""
    store: dict[str, list[torch.Tensor]] = {}

    def hook(name: str) -> Callable[..., None]:
        def fn(
            mod: nn.Module, inp: tuple[torch.Tensor], out: torch.Tensor
        ) -> None:
            store[name] = [inp[0].detach()]
            out.register_hook(lambda g: store[name].append(g.detach()))

        return fn

    for name, mod in model.named_modules():
        if isinstance(mod, (nn.Linear, nn.Conv2d)):
            mod.register_forward_hook(hook(name))
    return store


def reference_factors(
    model: nn.Module,
    store: dict[str, list[torch.Tensor]],
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    out = {}
    for name, (x, gout) in store.items():
        mod = model.get_submodule(name)
        if isinstance(mod, nn.Conv2d):
            out[name] = conv_factors(mod, x, gout)
        else:
            out[name] = linear_factors(x, gout, bias=mod.bias is not None)
    return out


def models() -> list[tuple[str, nn.Module, tuple[int, ...]]]:
    return [
        ('mlp', TinyMLP(), (6,)),
        ('mlp-nobias', TinyMLP(bias=False), (6,)),
        ('cnn', TinyCNN(), (2, 8, 8)),
    ]


@pytest.mark.parametrize(('label', 'model', 'shape'), models())
def test_batch_size_one_factors_equal_empirical_fisher(
    label: str,
    model: nn.Module,
    shape: tuple[int, ...],
) -> None:
    model = model.double()
    x, y = classification_data(1, shape)
    names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    fishers = {
        n: per_example_fisher(model, n, F.cross_entropy, x, y) for n in names
    }
    precon = KFACPreconditioner(model, kl_clip=None)
    F.cross_entropy(model(x), y).backward()
    precon.step()
    # Convolutions share weights across positions: K-FAC approximates there.
    for name, fisher in fishers.items():
        a, g = precon.layers[name].a.value, precon.layers[name].g.value
        assert a is not None and g is not None
        assert_rel_close(
            torch.kron(a, g),
            fisher,
            rtol=1e-12,
            label='A⊗G vs per-example Fisher',
        )


@pytest.mark.parametrize(('label', 'model', 'shape'), models())
@pytest.mark.parametrize('in_hook', [True, False])
def test_factors_equal_definitions_through_hooks(
    label: str,
    model: nn.Module,
    shape: tuple[int, ...],
    in_hook: bool,
) -> None:
    model = model.double()
    store = capture_io(model)
    precon = KFACPreconditioner(model, update_factors_in_hook=in_hook)
    x, y = classification_data(8, shape)
    F.cross_entropy(model(x), y).backward()
    precon.step()
    refs = reference_factors(model, store)
    for name, layer in precon.layers.items():
        assert layer.a.value is not None and layer.g.value is not None
        assert_rel_close(layer.a.value, refs[name][0], label='hook factors A')
        assert_rel_close(layer.g.value, refs[name][1], label='hook factors G')


@pytest.mark.parametrize('method', METHODS)
@pytest.mark.parametrize('damping', [1e-3, 0.3])
@pytest.mark.parametrize('outer', [True, False])
@pytest.mark.parametrize(('label', 'model', 'shape'), models())
def test_preconditioned_grad_equals_dense_solve(
    method: str,
    damping: float,
    outer: bool,
    label: str,
    model: nn.Module,
    shape: tuple[int, ...],
) -> None:
    model = model.double()
    store = capture_io(model)
    precon = KFACPreconditioner(
        model,
        compute_method=method,
        damping=damping,
        kl_clip=None,
        compute_eigenvalue_outer_product=outer,
    )
    x, y = classification_data(6, shape)
    F.cross_entropy(model(x), y).backward()
    grads = {n: grad_matrix(model.get_submodule(n)).clone() for n in store}
    precon.step()
    refs = reference_factors(model, store)
    solve = eigen_reference if method == 'eigen' else inverse_reference
    for name in precon.layers:
        a, g = refs[name]
        expected = solve(a, g, grads[name], damping)
        assert_rel_close(
            grad_matrix(model.get_submodule(name)),
            expected,
            rtol=1e-9,
            label=f'{method} preconditioned grad vs solve',
        )


@pytest.mark.parametrize('method', METHODS)
def test_kl_clip_equals_formula(method: str) -> None:
    torch.manual_seed(0)
    model = TinyMLP().double()
    twin = copy.deepcopy(model)
    kl_clip, lr = 1e-5, 0.3
    x, y = classification_data(8, (6,))
    unclipped = KFACPreconditioner(twin, compute_method=method, kl_clip=None)
    F.cross_entropy(twin(x), y).backward()
    raw = {
        n: grad_matrix(twin.get_submodule(n)).clone() for n in ('fc1', 'fc2')
    }
    unclipped.step()
    pre = {n: grad_matrix(twin.get_submodule(n)) for n in ('fc1', 'fc2')}
    vg = sum(float((pre[n] * raw[n]).sum()) for n in pre)
    nu = min(1.0, (kl_clip / abs(lr**2 * vg)) ** 0.5)
    assert nu < 1.0  # the test must exercise clipping

    clipped = KFACPreconditioner(
        model,
        compute_method=method,
        kl_clip=kl_clip,
        lr=lr,
    )
    F.cross_entropy(model(x), y).backward()
    clipped.step()
    for name in pre:
        assert_rel_close(
            grad_matrix(model.get_submodule(name)),
            nu * pre[name],
            label='KL clip vs formula',
        )


@pytest.mark.parametrize('in_hook', [True, False])
def test_running_average_over_steps(in_hook: bool) -> None:
    model = TinyCNN().double()
    store = capture_io(model)
    decay = 0.7
    precon = KFACPreconditioner(
        model,
        factor_decay=decay,
        update_factors_in_hook=in_hook,
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    expected: dict[str, list[torch.Tensor]] = {}
    for step in range(4):
        x, y = classification_data(5, (2, 8, 8), seed=step)
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        precon.step()
        optimizer.step()
        for name, (a, g) in reference_factors(model, store).items():
            if name not in expected:
                expected[name] = [a, g]
            else:
                expected[name] = [
                    decay * old + (1 - decay) * new
                    for old, new in zip(expected[name], (a, g))
                ]
    for name, layer in precon.layers.items():
        assert layer.a.value is not None and layer.g.value is not None
        assert_rel_close(layer.a.value, expected[name][0], label='running avg')
        assert_rel_close(layer.g.value, expected[name][1], label='running avg')


@pytest.mark.parametrize('in_hook', [True, False])
@pytest.mark.parametrize('method', METHODS)
def test_accumulation_equals_one_large_batch(
    in_hook: bool, method: str
) -> None:
    torch.manual_seed(3)
    model = TinyCNN().double()
    big = copy.deepcopy(model)
    k = 3
    x, y = classification_data(4 * k, (2, 8, 8))
    kwargs = dict(compute_method=method, update_factors_in_hook=in_hook)
    accumulating = KFACPreconditioner(model, accumulation_steps=k, **kwargs)  # type: ignore[arg-type]
    single = KFACPreconditioner(big, **kwargs)  # type: ignore[arg-type]
    for xs, ys in zip(x.chunk(k), y.chunk(k)):
        (F.cross_entropy(model(xs), ys) / k).backward()
    accumulating.step()
    F.cross_entropy(big(x), y).backward()
    single.step()
    for name, layer in accumulating.layers.items():
        other = single.layers[name]
        for mine, theirs in zip(layer.factors, other.factors):
            assert mine.value is not None and theirs.value is not None
            assert_rel_close(mine.value, theirs.value, label='accumulation')
        assert_rel_close(
            grad_matrix(model.get_submodule(name)),
            grad_matrix(big.get_submodule(name)),
            rtol=1e-9,
            label='accumulation',
        )


def test_sum_reduction_matches_mean_reduction() -> None:
    """``'sum'`` drops the factor N: same factors for a summed loss."""
    model = TinyMLP().double()
    twin = copy.deepcopy(model)
    x, y = classification_data(7, (6,))
    mean = KFACPreconditioner(model)
    total = KFACPreconditioner(twin, loss_reduction='sum')
    F.cross_entropy(model(x), y).backward()
    F.cross_entropy(twin(x), y, reduction='sum').backward()
    mean.step()
    total.step()
    for name, layer in mean.layers.items():
        for mine, theirs in zip(layer.factors, total.layers[name].factors):
            assert mine.value is not None and theirs.value is not None
            assert_rel_close(theirs.value, mine.value, label='sum reduction')
