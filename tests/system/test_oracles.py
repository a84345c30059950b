"""The preconditioner's numbers against dense float64 references.

Models and data live on the device of ``KFAC_TEST_DEVICE`` (the ``device``
fixture of ``tests/conftest.py``; the CPU unless told), in float64 and, on
CUDA, in float32 too (``oracle_dtype``). The references are computed on the
CPU in float64 from the tensors the model saw (captured by test hooks), so
they carry no rounding of the run they check.

Float32 tolerances. Every library quantity below is a sum of at most a few
hundred products, so a float32 run differs from float64 by a few multiples
of float32's unit roundoff (6e-8) times the square root of the number of
terms: factors, KL clip and the sum reduction get 1e-5. A preconditioned
gradient comes from an ``eigh`` or Cholesky inverse in float32, whose
error grows with the condition number of the damped factors (up to ~1e3
with damping 1e-3): 1e-3, a hundred times below the difference a missing
damping term or factor would make. Runs that must agree exactly in
float64 (accumulated against one batch) differ in float32 by the order in
which the products are summed, amplified the same way.
"""

from __future__ import annotations

import copy
import functools
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kfac.config import StatisticsConfig
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
F32 = torch.float32
METHODS = ['eigen', 'inverse']
#: The loss scale of the mixed-precision test (a power of two: dividing it
#: out is exact).
SCALE = 2.0**10
#: autocast's half-precision dtype per device type (CPU autocast is
#: bfloat16; float16 is what needs a loss scale on CUDA).
AMP_DTYPE = {'cuda': torch.float16, 'cpu': torch.bfloat16}


def tol(dtype: torch.dtype, f64: float, f32: float) -> float:
    """The tolerance of a float64 or a float32 run (module docstring)."""
    return f64 if dtype == F64 else f32


def tag(label: str, dtype: torch.dtype) -> str:
    """The oracle's label, marked when the run is not float64."""
    return (
        label
        if dtype == F64
        else f'{label} [{str(dtype).removeprefix("torch.")}]'
    )


def host(tensor: torch.Tensor) -> torch.Tensor:
    """A float64 CPU copy (never a view): where references are computed."""
    return tensor.detach().to(device='cpu', dtype=F64, copy=True)


def build(
    make: Callable[[], nn.Module],
    device: torch.device,
    dtype: torch.dtype,
    seed: int = 0,
) -> nn.Module:
    torch.manual_seed(seed)
    return make().to(device=device, dtype=dtype)


def batch(
    n: int,
    shape: tuple[int, ...],
    device: torch.device,
    dtype: torch.dtype = F64,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = classification_data(n, shape, seed=seed, dtype=dtype)
    return x.to(device), y.to(device)


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
            out[name] = conv_factors(mod, host(x), host(gout))
        else:
            out[name] = linear_factors(
                host(x), host(gout), bias=mod.bias is not None
            )
    return out


def models() -> list[Any]:
    """Model constructors (each test builds its own model), by label."""
    return [
        pytest.param('mlp', TinyMLP, (6,), id='mlp'),
        pytest.param(
            'mlp-nobias',
            functools.partial(TinyMLP, bias=False),
            (6,),
            id='mlp-nobias',
        ),
        pytest.param('cnn', TinyCNN, (2, 8, 8), id='cnn'),
    ]


@pytest.mark.parametrize(('label', 'make', 'shape'), models())
def test_batch_size_one_factors_equal_empirical_fisher(
    label: str,
    make: Callable[[], nn.Module],
    shape: tuple[int, ...],
    device: torch.device,
    oracle_dtype: torch.dtype,
) -> None:
    model = build(make, device, oracle_dtype)
    reference = copy.deepcopy(model).to(device='cpu', dtype=F64)
    x, y = batch(1, shape, device, oracle_dtype)
    names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    fishers = {
        n: per_example_fisher(reference, n, F.cross_entropy, host(x), y.cpu())
        for n in names
    }
    precon = KFACPreconditioner(model, relative_clip=None)
    F.cross_entropy(model(x), y).backward()
    precon.step()
    # Convolutions share weights across positions: K-FAC approximates there.
    for name, fisher in fishers.items():
        a, g = precon.layers[name].a.value, precon.layers[name].g.value
        assert a is not None and g is not None
        assert_rel_close(
            torch.kron(host(a), host(g)),
            fisher,
            rtol=tol(oracle_dtype, 1e-12, 1e-5),
            label=tag('A⊗G vs per-example Fisher', oracle_dtype),
        )


@pytest.mark.parametrize(('label', 'make', 'shape'), models())
@pytest.mark.parametrize('in_hook', [True, False])
def test_factors_equal_definitions_through_hooks(
    label: str,
    make: Callable[[], nn.Module],
    shape: tuple[int, ...],
    in_hook: bool,
    device: torch.device,
    oracle_dtype: torch.dtype,
) -> None:
    model = build(make, device, oracle_dtype)
    store = capture_io(model)
    precon = KFACPreconditioner(model, update_factors_in_hook=in_hook)
    x, y = batch(8, shape, device, oracle_dtype)
    F.cross_entropy(model(x), y).backward()
    precon.step()
    refs = reference_factors(model, store)
    rtol = tol(oracle_dtype, 1e-10, 1e-5)
    for name, layer in precon.layers.items():
        assert layer.a.value is not None and layer.g.value is not None
        assert layer.a.value.dtype == layer.g.value.dtype == oracle_dtype
        assert_rel_close(
            host(layer.a.value),
            refs[name][0],
            rtol=rtol,
            label=tag('hook factors A', oracle_dtype),
        )
        assert_rel_close(
            host(layer.g.value),
            refs[name][1],
            rtol=rtol,
            label=tag('hook factors G', oracle_dtype),
        )


@pytest.mark.parametrize('method', METHODS)
@pytest.mark.parametrize('damping', [1e-3, 0.3])
@pytest.mark.parametrize('outer', [True, False])
@pytest.mark.parametrize(('label', 'make', 'shape'), models())
def test_preconditioned_grad_equals_dense_solve(
    method: str,
    damping: float,
    outer: bool,
    label: str,
    make: Callable[[], nn.Module],
    shape: tuple[int, ...],
    device: torch.device,
    oracle_dtype: torch.dtype,
) -> None:
    model = build(make, device, oracle_dtype)
    store = capture_io(model)
    precon = KFACPreconditioner(
        model,
        compute_method=method,
        damping=damping,
        relative_clip=None,
        compute_eigenvalue_outer_product=outer,
    )
    x, y = batch(6, shape, device, oracle_dtype)
    F.cross_entropy(model(x), y).backward()
    grads = {n: host(grad_matrix(model.get_submodule(n))) for n in store}
    precon.step()
    refs = reference_factors(model, store)
    solve = eigen_reference if method == 'eigen' else inverse_reference
    for name in precon.layers:
        a, g = refs[name]
        expected = solve(a, g, grads[name], damping)
        assert_rel_close(
            host(grad_matrix(model.get_submodule(name))),
            expected,
            rtol=tol(oracle_dtype, 1e-9, 1e-3),
            label=tag(f'{method} preconditioned grad vs solve', oracle_dtype),
        )


@pytest.mark.parametrize('method', METHODS)
def test_kl_clip_equals_formula(
    method: str, device: torch.device, oracle_dtype: torch.dtype
) -> None:
    model = build(TinyMLP, device, oracle_dtype)
    twin = copy.deepcopy(model)
    kl_clip, lr = 1e-5, 0.3
    x, y = batch(8, (6,), device, oracle_dtype)
    unclipped = KFACPreconditioner(
        twin, compute_method=method, relative_clip=None
    )
    F.cross_entropy(twin(x), y).backward()
    raw = {n: host(grad_matrix(twin.get_submodule(n))) for n in ('fc1', 'fc2')}
    unclipped.step()
    pre = {n: host(grad_matrix(twin.get_submodule(n))) for n in ('fc1', 'fc2')}
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
            host(grad_matrix(model.get_submodule(name))),
            nu * pre[name],
            rtol=tol(oracle_dtype, 1e-10, 1e-5),
            label=tag('KL clip vs formula', oracle_dtype),
        )


@pytest.mark.parametrize('in_hook', [True, False])
def test_running_average_over_steps(
    in_hook: bool, device: torch.device, oracle_dtype: torch.dtype
) -> None:
    model = build(TinyCNN, device, oracle_dtype)
    store = capture_io(model)
    decay = 0.7
    precon = KFACPreconditioner(
        model,
        factor_update_steps=1,
        factor_decay=decay,
        update_factors_in_hook=in_hook,
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    expected: dict[str, list[torch.Tensor]] = {}
    for step in range(4):
        x, y = batch(5, (2, 8, 8), device, oracle_dtype, seed=step)
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
    rtol = tol(oracle_dtype, 1e-10, 1e-5)
    label = tag('running avg', oracle_dtype)
    for name, layer in precon.layers.items():
        assert layer.a.value is not None and layer.g.value is not None
        a, g = expected[name]
        assert_rel_close(host(layer.a.value), a, rtol=rtol, label=label)
        assert_rel_close(host(layer.g.value), g, rtol=rtol, label=label)


@pytest.mark.parametrize('in_hook', [True, False])
@pytest.mark.parametrize('method', METHODS)
def test_accumulation_equals_one_large_batch(
    in_hook: bool,
    method: str,
    device: torch.device,
    oracle_dtype: torch.dtype,
) -> None:
    model = build(TinyCNN, device, oracle_dtype, seed=3)
    big = copy.deepcopy(model)
    k = 3
    x, y = batch(4 * k, (2, 8, 8), device, oracle_dtype)
    kwargs = dict(compute_method=method, update_factors_in_hook=in_hook)
    accumulating = KFACPreconditioner(model, accumulation_steps=k, **kwargs)  # type: ignore[arg-type]  # keyword options of the preconditioner
    single = KFACPreconditioner(big, **kwargs)  # type: ignore[arg-type]  # keyword options of the preconditioner
    for xs, ys in zip(x.chunk(k), y.chunk(k)):
        (F.cross_entropy(model(xs), ys) / k).backward()
    accumulating.step()
    F.cross_entropy(big(x), y).backward()
    single.step()
    label = tag('accumulation', oracle_dtype)
    for name, layer in accumulating.layers.items():
        other = single.layers[name]
        for mine, theirs in zip(layer.factors, other.factors):
            assert mine.value is not None and theirs.value is not None
            assert_rel_close(
                host(mine.value),
                host(theirs.value),
                rtol=tol(oracle_dtype, 1e-10, 1e-5),
                label=label,
            )
        assert_rel_close(
            host(grad_matrix(model.get_submodule(name))),
            host(grad_matrix(big.get_submodule(name))),
            rtol=tol(oracle_dtype, 1e-9, 1e-3),
            label=label,
        )


def test_summed_loss_preconditions_like_the_averaged_loss(
    device: torch.device, oracle_dtype: torch.dtype
) -> None:
    """`loss_average=None` (a summed loss): `A` is unchanged and `G` is
    `N` times the averaged loss's, so with damping `N λ` the preconditioned
    gradient of the summed loss equals the averaged loss's.
    """
    n = 7
    model = build(TinyMLP, device, oracle_dtype)
    twin = copy.deepcopy(model)
    x, y = batch(n, (6,), device, oracle_dtype)
    mean = KFACPreconditioner(model, relative_clip=None, damping=0.01)
    total = KFACPreconditioner(
        twin,
        relative_clip=None,
        damping=0.01 * n,
        statistics=StatisticsConfig(loss_average=None),
    )
    F.cross_entropy(model(x), y).backward()
    F.cross_entropy(twin(x), y, reduction='sum').backward()
    mean.step()
    total.step()
    label = tag('sum reduction', oracle_dtype)
    rtol = tol(oracle_dtype, 1e-10, 1e-5)
    for name, layer in mean.layers.items():
        other = total.layers[name]
        assert layer.a.value is not None and other.a.value is not None
        assert layer.g.value is not None and other.g.value is not None
        assert_rel_close(
            host(other.a.value), host(layer.a.value), rtol=rtol, label=label
        )
        assert_rel_close(
            host(other.g.value),
            host(n * layer.g.value),
            rtol=rtol,
            label=label,
        )
    for p, q in zip(model.parameters(), twin.parameters()):
        assert p.grad is not None and q.grad is not None
        assert_rel_close(
            host(q.grad),
            host(p.grad),
            rtol=tol(oracle_dtype, 1e-9, 1e-3),
            label=label,
        )


def grad_scaler(kind: str, device: torch.device) -> Any:
    """A loss scaler at :data:`SCALE`: ``torch.amp``'s, or the deprecated
    ``torch.cuda.amp`` one (CUDA only: it disables itself elsewhere).
    """
    if kind == 'torch.amp':
        return torch.amp.GradScaler(device.type, init_scale=SCALE)
    if device.type != 'cuda':
        pytest.skip('torch.cuda.amp.GradScaler disables itself without CUDA')
    legacy = getattr(torch.cuda.amp, 'GradScaler', None)
    if legacy is None:
        pytest.skip(f'torch {torch.__version__} has no torch.cuda.amp')
    with warnings.catch_warnings():
        # deprecated in favour of torch.amp.GradScaler('cuda') (torch 2.4)
        warnings.simplefilter('ignore', FutureWarning)
        return legacy(init_scale=SCALE)


@pytest.mark.parametrize('kind', ['torch.amp', 'torch.cuda.amp'])
def test_autocast_with_a_grad_scaler_gives_the_unscaled_factors(
    kind: str, device: torch.device
) -> None:
    """DESIGN.md §3, mixed precision: G is formed from output gradients
    divided by the loss scale, and factors are float32 even when autocast
    makes activations and gradients half precision.
    """
    scaler = grad_scaler(kind, device)
    assert scaler.is_enabled()
    model = build(TinyMLP, device, F32)
    store = capture_io(model)
    precon = KFACPreconditioner(model, grad_scaler=scaler)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = batch(8, (6,), device, F32)
    half = AMP_DTYPE[device.type]
    with torch.autocast(device.type, dtype=half):
        loss = F.cross_entropy(model(x), y)
    scaler.scale(loss).backward()
    assert scaler.get_scale() == SCALE
    scaler.unscale_(optimizer)
    precon.step()
    scaler.step(optimizer)
    scaler.update()
    assert store['fc2'][0].dtype == store['fc2'][1].dtype == half
    for name, layer in precon.layers.items():
        x_in, grad_out = store[name]
        a, g = linear_factors(host(x_in), host(grad_out) / SCALE, bias=True)
        assert layer.a.value is not None and layer.g.value is not None
        assert layer.a.value.dtype == layer.g.value.dtype == F32
        assert_rel_close(host(layer.a.value), a, rtol=1e-5, label='autocast A')
        assert_rel_close(
            host(layer.g.value), g, rtol=1e-5, label='autocast G (unscaled)'
        )
