"""Numerical faults never reach the factors or the parameters.

Every test runs on the device of ``KFAC_TEST_DEVICE`` (the ``device``
fixture of ``tests/conftest.py``; the CPU unless told).
"""

from __future__ import annotations

import copy
import logging
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kfac import math as kmath
from kfac.layers.base import LinAlgError
from kfac.layers.curvature import eigen as eigen_module
from kfac.layers.curvature import inverse as inverse_module
from kfac.preconditioner import KFACPreconditioner
from testing.models import TinyMLP
from testing.models import classification_data
from testing.options import EVERY_STEP
from testing.reference import grad_matrix

F64 = torch.float64


def snapshot(precon: KFACPreconditioner) -> dict[str, list[torch.Tensor]]:
    out = {}
    for name, layer in precon.layers.items():
        out[name] = [f.value.clone() for f in layer.factors]  # type: ignore[union-attr]  # a step above formed the factors
    return out


def batch(
    n: int,
    shape: tuple[int, ...],
    device: torch.device,
    *,
    seed: int = 0,
    dtype: torch.dtype = F64,
) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = classification_data(n, shape, seed=seed, dtype=dtype)
    return x.to(device), y.to(device)


def good_step(model: nn.Module, precon: KFACPreconditioner, seed: int) -> None:
    model.zero_grad()
    x, y = batch(8, (6,), next(model.parameters()).device, seed=seed)
    F.cross_entropy(model(x), y).backward()
    precon.step()


@pytest.mark.parametrize('in_hook', [True, False])
@pytest.mark.parametrize('where', ['input', 'grad_output'])
@pytest.mark.parametrize('value', [math.nan, math.inf])
def test_nonfinite_batch_is_discarded(
    in_hook: bool,
    where: str,
    value: float,
    caplog: pytest.LogCaptureFixture,
    device: torch.device,
) -> None:
    model = TinyMLP().to(device, F64)
    precon = KFACPreconditioner(
        model, update_factors_in_hook=in_hook, **EVERY_STEP
    )
    good_step(model, precon, 0)
    before = snapshot(precon)
    model.zero_grad()
    x, y = batch(8, (6,), device, seed=1)
    if where == 'input':
        x[3, 2] = value
    else:

        def poison(mod: nn.Module, inp: Any, out: torch.Tensor) -> None:
            out.register_hook(lambda g: g * value)

        model.fc2.register_forward_hook(poison)
    with caplog.at_level(logging.WARNING, logger='kfac'):
        F.cross_entropy(model(x), y).backward()
        precon.step()
    after = snapshot(precon)
    for name in before:
        for old, new in zip(before[name], after[name]):
            assert torch.equal(old, new)
    assert precon.metrics()['nonfinite_statistics_steps'] == 1
    assert 'non-finite factor statistics' in caplog.text
    # The preconditioner wrote no non-finite value of its own: the layers
    # whose preconditioned gradient is not finite keep the original one.
    for name in precon.layers:
        assert precon.layers[name].grad is None


def test_next_good_step_proceeds_after_a_bad_one(device: torch.device) -> None:
    model = TinyMLP().to(device, F64)
    twin = copy.deepcopy(model)
    precon = KFACPreconditioner(model, factor_decay=0.5)
    reference = KFACPreconditioner(twin, factor_decay=0.5)
    good_step(model, precon, 0)
    good_step(twin, reference, 0)
    model.zero_grad()
    x, y = batch(8, (6,), device, seed=1)
    x[0, 0] = math.nan
    F.cross_entropy(model(x), y).backward()
    precon.step()
    # the reference never saw the bad batch; its counter is one step behind
    reference._steps += 1
    good_step(model, precon, 2)
    good_step(twin, reference, 2)
    assert snapshot(precon).keys() == snapshot(reference).keys()
    for name, values in snapshot(precon).items():
        for mine, theirs in zip(values, snapshot(reference)[name]):
            assert torch.equal(mine, theirs)
    for name in precon.layers:
        mod, ref = model.get_submodule(name), twin.get_submodule(name)
        assert torch.equal(grad_matrix(mod), grad_matrix(ref))


def test_grad_scaler_overflow_leaves_factors_untouched(
    device: torch.device,
) -> None:
    model = TinyMLP().to(device)
    scaler = torch.amp.GradScaler(device.type, init_scale=2.0**127)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    precon = KFACPreconditioner(model, grad_scaler=scaler, **EVERY_STEP)
    x, y = batch(8, (6,), device, dtype=torch.float32)

    def step() -> None:
        optimizer.zero_grad()
        # 4 x loss x 2**127 overflows float32: inf gradients, a skipped step
        scaler.scale(4.0 * F.cross_entropy(model(x), y)).backward()
        scaler.unscale_(optimizer)
        precon.step()
        scaler.step(optimizer)
        scaler.update()

    step()
    assert scaler.get_scale() < 2.0**127
    assert all(not layer.has_factors for layer in precon.layers.values())
    assert precon.metrics()['nonfinite_statistics_steps'] == 1
    params = [p.clone() for p in model.parameters()]
    for _ in range(4):  # the scale halves until the loss fits
        step()
    assert all(layer.has_factors for layer in precon.layers.values())
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert any(
        not torch.equal(p, q) for p, q in zip(params, model.parameters())
    )


def failing(
    original: Callable[..., Any],
    fail: Callable[[torch.dtype], str | None],
) -> Callable[..., Any]:
    """Wrap a decomposition: raise or return NaN when ``fail`` says so."""

    def wrapper(matrix: torch.Tensor, *args: Any) -> Any:
        dtype = args[-1]
        mode = fail(dtype)
        if mode == 'raise':
            raise LinAlgError('injected failure')
        out = original(matrix, *args)
        if mode == 'nan':
            first = out[0] if isinstance(out, tuple) else out
            first.fill_(math.nan)
        return out

    return wrapper


@pytest.mark.parametrize('mode', ['raise', 'nan'])
def test_float64_retry_rescues_a_failed_float32_eigh(
    mode: str,
    monkeypatch: pytest.MonkeyPatch,
    device: torch.device,
) -> None:
    model = TinyMLP().to(device)
    eigh = failing(
        kmath.symmetric_eigh,
        lambda dtype: mode if dtype == torch.float32 else None,
    )
    monkeypatch.setattr(eigen_module, 'symmetric_eigh', eigh)
    precon = KFACPreconditioner(model, compute_method='eigen')
    x, y = batch(8, (6,), device, dtype=torch.float32)
    F.cross_entropy(model(x), y).backward()
    raw = grad_matrix(model.fc1).clone()
    precon.step()
    metrics = precon.metrics()
    assert metrics['decomposition_retries'] == 4  # 2 layers x (A, G)
    assert 'decomposition_failures' not in metrics
    assert precon.layers['fc1'].a.decomposition[0].dtype == torch.float32  # type: ignore[index]  # decomposed above
    assert not torch.equal(grad_matrix(model.fc1), raw)


def test_jitter_is_the_last_attempt(
    monkeypatch: pytest.MonkeyPatch, device: torch.device
) -> None:
    seen: list[tuple[torch.dtype, float]] = []
    original = kmath.symmetric_eigh

    def eigh(matrix: torch.Tensor, dtype: torch.dtype) -> Any:
        seen.append((dtype, float(matrix[0, 0])))
        if len(seen) < 3:
            raise LinAlgError('injected failure')
        return original(matrix, dtype)

    monkeypatch.setattr(eigen_module, 'symmetric_eigh', eigh)
    model = nn.Linear(3, 2, bias=False).to(device)
    precon = KFACPreconditioner(model, skip_layers=[], compute_method='eigen')
    x = torch.randn(4, 3, device=device)
    model(x).sum().backward()
    precon.layers[''].update_factors(0.9)
    assert precon.layers[''].compute_decomposition('A', 0.1)
    a00 = float(precon.layers[''].a.value[0, 0])  # type: ignore[index]  # factors updated above
    assert [d for d, _ in seen] == [
        torch.float32,
        torch.float64,
        torch.float64,
    ]
    assert seen[1][1] == pytest.approx(a00, rel=1e-6)
    assert seen[2][1] > seen[1][1]  # jittered diagonal
    assert precon.layers[''].counters['decomposition_retries'] == 2


@pytest.mark.parametrize('method', ['eigen', 'inverse'])
def test_failed_decomposition_keeps_the_last_good_one(
    method: str,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    device: torch.device,
) -> None:
    model = TinyMLP().to(device, F64)
    precon = KFACPreconditioner(model, compute_method=method, **EVERY_STEP)
    good_step(model, precon, 0)
    kept = {n: layer.g.decomposition for n, layer in precon.layers.items()}
    module, attr = (
        (eigen_module, 'symmetric_eigh')
        if method == 'eigen'
        else (inverse_module, 'damped_inverse_ex')
    )
    monkeypatch.setattr(
        module,
        attr,
        failing(getattr(module, attr), lambda dtype: 'raise'),
    )
    with caplog.at_level(logging.WARNING, logger='kfac'):
        for seed in (1, 2):
            good_step(model, precon, seed)
    for name, layer in precon.layers.items():
        assert layer.g.decomposition is kept[name]
        assert layer.counters['decomposition_failures'] == 4  # 2 steps x A, G
    messages = [r.getMessage() for r in caplog.records]
    assert (
        sum('decomposing a factor of fc1 failed' in m for m in messages) == 1
    )
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_no_decomposition_ever_leaves_the_raw_gradient(
    monkeypatch: pytest.MonkeyPatch,
    device: torch.device,
) -> None:
    monkeypatch.setattr(
        eigen_module,
        'symmetric_eigh',
        failing(kmath.symmetric_eigh, lambda dtype: 'nan'),
    )
    model = TinyMLP().to(device, F64)
    precon = KFACPreconditioner(
        model, relative_clip=None, compute_method='eigen'
    )
    x, y = batch(8, (6,), device)
    F.cross_entropy(model(x), y).backward()
    raw = {
        n: grad_matrix(model.get_submodule(n)).clone() for n in ('fc1', 'fc2')
    }
    precon.step()
    for name, grad in raw.items():
        assert torch.equal(grad_matrix(model.get_submodule(name)), grad)
    metrics = precon.metrics()
    assert metrics['unpreconditioned_steps'] == 2
    assert metrics['layers']['fc1']['decomposition_failures'] == 2


def test_nonfinite_preconditioned_gradient_keeps_the_original(
    caplog: pytest.LogCaptureFixture,
    device: torch.device,
) -> None:
    model = TinyMLP().to(device, F64)
    precon = KFACPreconditioner(model, compute_method='eigen')
    good_step(model, precon, 0)
    layer = precon.layers['fc1']
    # a decomposition that is finite but produces an infinite gradient
    q, outer = layer.g.decomposition  # type: ignore[misc]  # decomposed above
    layer.set_decomposition('G', (q, torch.full_like(outer, math.inf)))
    model.zero_grad()
    x, y = batch(8, (6,), device, seed=1)
    F.cross_entropy(model(x), y).backward()
    raw = grad_matrix(model.fc1).clone()
    with caplog.at_level(logging.WARNING, logger='kfac'):
        precon.factor_update_steps  # noqa: B018 (resolve hyperparameters)
        precon._update_decompositions = lambda *a, **k: []  # type: ignore[method-assign]  # a stub for this test
        precon.step()
    assert torch.equal(grad_matrix(model.fc1), raw)
    assert precon.metrics()['nonfinite_gradients'] == 1
    assert 'preconditioned gradient of fc1 is not finite' in caplog.text
    assert torch.isfinite(grad_matrix(model.fc2)).all()


def test_failed_cholesky_without_an_exception_is_retried(
    monkeypatch: pytest.MonkeyPatch,
    device: torch.device,
) -> None:
    """``cholesky_ex`` reports failure through ``info``, not by raising."""
    original = kmath.damped_inverse_ex

    def cholesky_reports_failure(
        matrix: torch.Tensor, shift: Any, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        inverse, info = original(matrix, shift, dtype)
        if dtype == torch.float32:  # finite garbage, failure in info only
            return torch.ones_like(inverse), torch.ones_like(info)
        return inverse, info

    torch.manual_seed(0)
    model = TinyMLP().to(device)
    plain = copy.deepcopy(model)
    x, y = batch(8, (6,), device)
    reference = KFACPreconditioner(plain, compute_method='inverse')
    F.cross_entropy(plain(x.float()), y).backward()
    reference.step()
    monkeypatch.setattr(
        inverse_module, 'damped_inverse_ex', cholesky_reports_failure
    )
    precon = KFACPreconditioner(model, compute_method='inverse')
    F.cross_entropy(model(x.float()), y).backward()
    precon.step()
    for name, layer in precon.layers.items():
        assert layer.counters['decomposition_retries'] == 2  # A and G
        for factor, other in zip(
            layer.factors, reference.layers[name].factors
        ):
            (inverse,) = factor.decomposition  # type: ignore[misc]  # decomposed above
            (expected,) = other.decomposition  # type: ignore[misc]  # decomposed above
            assert inverse.dtype == torch.float32
            torch.testing.assert_close(inverse, expected, rtol=1e-4, atol=0)


def test_outer_product_without_a_eigenvalues_counts_g_as_failed(
    monkeypatch: pytest.MonkeyPatch,
    device: torch.device,
) -> None:
    """A fails in every attempt at the first decomposition; G succeeds but
    cannot form ``1/(d_G d_Aᵀ + λ)``: counted as a failure, no crash.
    """
    original = kmath.symmetric_eigh

    def eigh_fails_on_a(
        matrix: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if matrix.shape[0] == 7:  # fc1's A: 6 inputs and the bias
            raise LinAlgError('injected failure')
        return original(matrix, dtype)

    monkeypatch.setattr(eigen_module, 'symmetric_eigh', eigh_fails_on_a)
    model = TinyMLP().to(device, F64)
    precon = KFACPreconditioner(
        model, relative_clip=None, compute_method='eigen'
    )
    model.zero_grad()
    x, y = batch(8, (6,), device)
    F.cross_entropy(model(x), y).backward()
    raw = grad_matrix(model.fc1).clone()
    precon.step()
    layer = precon.layers['fc1']
    assert layer.a.decomposition is None
    assert layer.g.decomposition is None
    assert layer.counters['decomposition_failures'] == 2
    assert torch.equal(grad_matrix(model.fc1), raw)
    assert precon.layers['fc2'].has_decomposition
