"""kfac._engine.capture: which calls count, how calls and passes combine, the
loss scale, the step guard and the hooks.

Tests with `compiled` run the capture rules on a model compiled with
`torch.compile` too (default backend), where the hooks call K-FAC's
operators instead (see tests/engine/test_compile.py for the rest).
"""

from __future__ import annotations

import copy
import logging
import types
from collections.abc import Callable
from typing import Any
from typing import cast

import pytest
import torch
import torch._dynamo
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from kfac._engine import capture as capture_module
from kfac._engine.capture import Capture
from kfac._engine.capture import check_grad_scaler
from kfac._engine.capture import read_loss_scale
from kfac.preconditioner import KFACPreconditioner
from testing.models import TinyMLP
from testing.models import classification_data
from testing.torch_release import COMPILED

F64 = torch.float64


def _maybe_compile(model: nn.Module, compiled: bool) -> nn.Module:
    """`model`, or `torch.compile(model)` with no graph of another test
    left (one traced without K-FAC's hooks would stand in for it).
    """
    if not compiled:
        return model
    torch._dynamo.reset()
    return cast(nn.Module, torch.compile(model))


class _Scaler:
    def __init__(self, scale: float) -> None:
        self.scale = scale
        self.reads = 0

    def get_scale(self) -> float:
        self.reads += 1
        return self.scale


def _factors(precon: KFACPreconditioner) -> dict[str, torch.Tensor]:
    out = {}
    for name, layer in precon.layers.items():
        for factor in layer.factors:
            assert factor.value is not None, (name, factor.name)
            out[f'{name}.{factor.name}'] = factor.value
    return out


def test_grad_scaler_checks() -> None:
    check_grad_scaler(None)
    check_grad_scaler(lambda: 2.0)
    check_grad_scaler(_Scaler(2.0))
    with pytest.raises(TypeError, match='grad_scaler must be None, a Grad'):
        check_grad_scaler(3.0)


def test_read_loss_scale_prefers_get_scale() -> None:
    assert read_loss_scale(_Scaler(8.0)) == 8.0
    assert read_loss_scale(lambda: 4) == 4.0


def _capture(
    precon: KFACPreconditioner, active: list[bool], **kwargs: Any
) -> Capture:
    """A Capture of `precon`'s layers in place of its own hooks."""
    options: dict[str, Any] = {
        'active': lambda: active[0],
        'grad_scaler': None,
        'accumulation_steps': 1,
        'in_hook': False,
        'on_complete': lambda name: None,
        'phase': lambda name: torch.no_grad(),
        'log_once': lambda *args: None,
    }
    options.update(kwargs)
    precon.remove()
    return Capture(precon.layers, **options)


@pytest.mark.parametrize(
    'compiled', [False, pytest.param(True, marks=COMPILED)]
)
@pytest.mark.parametrize('mode', ['eval', 'no_grad', 'inactive', 'frozen'])
def test_passes_outside_factor_steps_are_not_captured(
    mode: str, compiled: bool
) -> None:
    eager = TinyMLP().double()
    precon = KFACPreconditioner(eager)
    active = [mode != 'inactive']
    capture = _capture(precon, active)
    capture.refresh()
    model = _maybe_compile(eager, compiled)
    x, _ = classification_data(4, (6,))
    if mode == 'eval':
        model.eval()
    if mode == 'frozen':
        eager.fc2.weight.requires_grad_(False)
    with torch.no_grad() if mode == 'no_grad' else torch.enable_grad():
        out = model(x)
    if out.requires_grad:
        out.sum().backward()
    expected = [(0, 0), (0, 0)] if mode != 'frozen' else [(1, 1), (0, 0)]
    assert [layer.captures for layer in precon.layers.values()] == expected
    active[0] = True
    capture.refresh()  # what the engine does when the step changes
    model.train()
    eager.fc2.weight.requires_grad_(True)
    model(x).sum().backward()
    assert precon.layers['fc2'].captures == (1, 1)
    capture.remove()
    assert not capture.attached
    model(x).sum().backward()
    assert precon.layers['fc2'].captures == (1, 1)


def test_loss_scale_is_read_once_per_step() -> None:
    scaler = _Scaler(16.0)
    capture = _capture(
        KFACPreconditioner(TinyMLP().double()), [True], grad_scaler=scaler
    )
    assert capture.loss_scale() == 16.0
    scaler.scale = 32.0
    assert capture.loss_scale() == 16.0  # cached for the step
    capture.next_step()
    assert capture.loss_scale() == 32.0
    assert scaler.reads == 2


def test_loss_scale_is_divided_out_of_g() -> None:
    x, y = classification_data(8, (6,))
    factors = []
    for scale in (1.0, 2.0**10):
        torch.manual_seed(0)
        model = TinyMLP().double()
        precon = KFACPreconditioner(model, grad_scaler=lambda s=scale: s)
        (F.cross_entropy(model(x), y) * scale).backward()
        precon.step()
        factors.append([layer.g.value for layer in precon.layers.values()])
    unscaled, scaled = factors
    assert len(scaled) == len(unscaled) == 2
    for mine, theirs in zip(scaled, unscaled):
        assert mine is not None and theirs is not None
        torch.testing.assert_close(mine, theirs, rtol=1e-12, atol=0)
    assert precon.grad_scaler is not None


@pytest.mark.parametrize(
    'compiled', [False, pytest.param(True, marks=COMPILED)]
)
def test_in_hook_capture_completes_after_the_last_micro_batch(
    compiled: bool,
) -> None:
    eager = TinyMLP().double()
    done: list[str] = []
    capture = _capture(
        KFACPreconditioner(eager),
        [True],
        accumulation_steps=2,
        in_hook=True,
        on_complete=done.append,
    )
    model = _maybe_compile(eager, compiled)
    x, _ = classification_data(4, (6,))
    model(x).sum().backward()
    assert done == []
    model(x).sum().backward()
    assert done == ['fc2', 'fc1']  # in backward order, during the pass
    capture.remove()


# Pairs: a call counts once its gradient arrives ----------------------------


def _train_step(
    model: nn.Module,
    precon: KFACPreconditioner,
    x: torch.Tensor,
    y: torch.Tensor,
    extra: Callable[[], object] = lambda: None,
) -> None:
    extra()
    F.cross_entropy(model(x), y).backward()
    precon.step()
    model.zero_grad()


@pytest.mark.parametrize(
    ('in_hook', 'factor_update_steps', 'compiled'),
    [
        (True, 1, False),
        (True, 10, False),
        (False, 1, False),
        (False, 10, False),
        pytest.param(True, 1, True, marks=COMPILED),
        pytest.param(False, 10, True, marks=COMPILED),
    ],
)
def test_forward_without_backward_changes_nothing(
    in_hook: bool, factor_update_steps: int, compiled: bool
) -> None:
    """Defect 1: a peek at predictions before the step polluted A."""
    torch.manual_seed(0)
    eager = TinyMLP().double()
    twin = copy.deepcopy(eager)
    options: dict[str, Any] = {
        'update_factors_in_hook': in_hook,
        'factor_update_steps': factor_update_steps,
    }
    model = _maybe_compile(eager, compiled)
    precon = KFACPreconditioner(model, **options)
    reference = KFACPreconditioner(twin, **options)
    peek = torch.randn(32, 6, dtype=F64) * 5
    for step in range(3):
        x, y = classification_data(8, (6,), seed=step)
        _train_step(model, precon, x, y, lambda: model(peek).argmax(1))
        _train_step(twin, reference, x, y)
    close = _close if compiled else _equal
    for key, value in _factors(reference).items():
        close(_factors(precon)[key], value)
    for p, q in zip(eager.parameters(), twin.parameters()):
        close(p, q)


def _equal(mine: torch.Tensor, reference: torch.Tensor) -> None:
    assert torch.equal(mine, reference)


def _close(mine: torch.Tensor, reference: torch.Tensor) -> None:
    """Compiled against eager: float64 summed in another order."""
    torch.testing.assert_close(mine, reference, rtol=1e-10, atol=1e-13)


def _expand_by_hand(
    layer: nn.Linear,
    calls: list[tuple[torch.Tensor, torch.Tensor]],
    examples: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A and G of the expand rule: every call of the module is a further
    position of the same `examples` examples.

    `calls` holds each call's input and the gradient of the loss with
    respect to its output (the loss a mean over the examples).
    """
    rows_a = torch.cat(
        [torch.cat([x, torch.ones(len(x), 1, dtype=F64)], 1) for x, _ in calls]
    )
    a = rows_a.T @ rows_a / len(rows_a)
    rows_g = torch.cat([examples * g for _, g in calls])
    g = rows_g.T @ rows_g / examples
    return a, g


@pytest.mark.parametrize('in_hook', [True, False])
@pytest.mark.parametrize('form', ['siamese', 'twice_in_one_forward'])
def test_module_called_twice_follows_the_expand_rule(
    in_hook: bool, form: str
) -> None:
    """Defect 2: two calls gave A from both and G from one."""
    torch.manual_seed(0)
    shared = nn.Linear(4, 4).double()
    head = nn.Linear(4, 3).double()
    model = nn.ModuleDict({'shared': shared, 'head': head})
    precon = KFACPreconditioner(
        model, update_factors_in_hook=in_hook, factor_decay=0.5
    )
    n = 6
    x1, x2 = torch.randn(n, 4, dtype=F64), torch.randn(n, 4, dtype=F64)
    y = torch.randint(0, 3, (n,))
    inputs: list[torch.Tensor] = []
    outputs: list[torch.Tensor] = []

    def call(x: torch.Tensor) -> torch.Tensor:
        inputs.append(x)
        out: torch.Tensor = shared(x)
        out.retain_grad()
        outputs.append(out)
        return out

    if form == 'siamese':  # loss: the sum of the per-call means
        loss = F.cross_entropy(head(torch.tanh(call(x1))), y)
        loss = loss + F.cross_entropy(head(torch.tanh(call(x2))), y)
    else:  # one module at two depths of one forward pass
        loss = F.cross_entropy(head(torch.tanh(call(torch.tanh(call(x1))))), y)
        inputs[1] = inputs[1].detach()
    loss.backward()
    precon.step()
    calls = []
    for x, o in zip(inputs, outputs):
        assert o.grad is not None
        calls.append((x.detach(), o.grad))
    a, g = _expand_by_hand(shared, calls, n)
    layer = precon.layers['shared']
    assert layer.a.value is not None and layer.g.value is not None
    torch.testing.assert_close(layer.a.value, a, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(layer.g.value, g, rtol=1e-12, atol=1e-15)


class _Checkpointed(nn.Module):
    """`model.fc2(tanh(model.fc1(x)))` recomputed in the backward pass
    (`torch.utils.checkpoint`), the body compiled alone if `compile_body`.
    """

    def __init__(
        self, model: TinyMLP, reentrant: bool, compile_body: bool
    ) -> None:
        super().__init__()
        self.model = model
        self.reentrant = reentrant
        self.body = _maybe_compile(model, compile_body)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = checkpoint(
            self.body, x, use_reentrant=self.reentrant
        )
        return out


@pytest.mark.parametrize(
    'compiled',
    [
        None,
        'checkpoint in the graph',
        pytest.param('graph in the checkpoint', marks=COMPILED),
    ],
)
@pytest.mark.parametrize('reentrant', [True, False])
def test_activation_checkpointing_gives_the_same_factors(
    reentrant: bool, compiled: str | None
) -> None:
    """Recomputation fires forward hooks again; it must not count."""
    torch.manual_seed(0)
    model = TinyMLP(hidden=7).double()
    twin = copy.deepcopy(model)
    inner = compiled == 'graph in the checkpoint'
    net = _maybe_compile(
        _Checkpointed(model, reentrant, compile_body=inner),
        compiled == 'checkpoint in the graph',
    )
    precon = KFACPreconditioner(model)
    reference = KFACPreconditioner(twin)
    x, y = classification_data(8, (6,))
    x.requires_grad_(True)  # the reentrant variant needs an input with grad
    for _ in range(2):
        F.cross_entropy(net(x), y).backward()
        precon.step()
        model.zero_grad()
        _train_step(twin, reference, x, y)
    for key, value in _factors(reference).items():
        torch.testing.assert_close(
            _factors(precon)[key],
            value,
            rtol=1e-14 if compiled is None else 1e-10,
            atol=0 if compiled is None else 1e-13,
        )


class _Siamese(nn.Module):
    """One module called twice before the backward pass: on two inputs
    (`siamese`) or at two depths of one forward pass.
    """

    def __init__(self, form: str) -> None:
        super().__init__()
        self.shared = nn.Linear(4, 4)
        self.head = nn.Linear(4, 3)
        self.form = form

    def forward(
        self, x1: torch.Tensor, x2: torch.Tensor, y: torch.Tensor
    ) -> torch.Tensor:
        if self.form == 'siamese':
            loss = F.cross_entropy(self.head(torch.tanh(self.shared(x1))), y)
            two = F.cross_entropy(self.head(torch.tanh(self.shared(x2))), y)
            return loss + two
        deep = self.shared(torch.tanh(self.shared(x1)))
        return F.cross_entropy(self.head(torch.tanh(deep)), y)


@COMPILED
@pytest.mark.parametrize('form', ['siamese', 'twice_in_one_forward'])
def test_module_called_twice_compiled_equals_eager(form: str) -> None:
    """The expand rule (checked by hand above) holds on a compiled model,
    also for two calls on the same input, which the compiler must not
    merge.
    """
    torch.manual_seed(0)
    model = _Siamese(form).double()
    twin = copy.deepcopy(model)
    compiled = _maybe_compile(model, True)
    precon = KFACPreconditioner(compiled, factor_decay=0.5)
    reference = KFACPreconditioner(twin, factor_decay=0.5)
    x = torch.randn(6, 4, dtype=F64)
    y = torch.randint(0, 3, (6,))
    for x2 in (torch.randn(6, 4, dtype=F64), x):  # the same input: x2 = x
        for net, pre in ((compiled, precon), (twin, reference)):
            net(x, x2, y).backward()
            pre.step()
    for key, value in _factors(reference).items():
        _close(_factors(precon)[key], value)


def test_a_gradient_arriving_after_remove_is_ignored() -> None:
    model = TinyMLP().double()
    precon = KFACPreconditioner(model, update_factors_in_hook=False)
    x, _ = classification_data(4, (6,))
    out = model(x)
    precon.remove()
    out.sum().backward()  # the output's gradient hooks still fire
    assert all(layer.captures == (0, 0) for layer in precon.layers.values())


# The step guard -------------------------------------------------------------


@pytest.mark.parametrize(
    'compiled', [False, pytest.param(True, marks=COMPILED)]
)
def test_second_step_without_backward_changes_nothing(
    compiled: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """Defect 3: a second step() preconditioned the gradient again."""
    model = TinyMLP().double()
    net = _maybe_compile(model, compiled)
    precon = KFACPreconditioner(
        net, relative_clip=None, factor_update_steps=10
    )
    x, y = classification_data(8, (6,))
    F.cross_entropy(net(x), y).backward()
    precon.step()
    once = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]  # backward() above set it
    with caplog.at_level(logging.WARNING, logger='kfac'):
        precon.step()
        precon.step()
    assert precon.steps == 1
    for p, g in zip(model.parameters(), once):
        assert torch.equal(p.grad, g)  # type: ignore[arg-type]  # backward() above set it
    warnings = [r for r in caplog.records if 'no backward pass' in r.message]
    assert len(warnings) == 1


def test_step_before_any_backward_changes_nothing(
    caplog: pytest.LogCaptureFixture,
) -> None:
    model = TinyMLP().double()
    precon = KFACPreconditioner(model)
    model(torch.randn(3, 6, dtype=F64))  # a forward pass alone
    with caplog.at_level(logging.WARNING, logger='kfac'):
        precon.step()
    assert precon.steps == 0
    assert not any(layer.has_factors for layer in precon.layers.values())
    assert 'no backward pass since the last step()' in caplog.text


# Mixed precision misuse ----------------------------------------------------


def test_float16_autocast_without_grad_scaler_warns(
    caplog: pytest.LogCaptureFixture,
) -> None:
    model = TinyMLP()
    precon = KFACPreconditioner(model)
    x, y = classification_data(8, (6,), dtype=torch.float32)
    with caplog.at_level(logging.WARNING, logger='kfac'):
        for _ in range(2):
            with torch.autocast('cpu', dtype=torch.float16):
                loss = F.cross_entropy(model(x), y)
            loss.backward()
            precon.step()
    messages = [r.message for r in caplog.records if 'autocast' in r.message]
    assert len(messages) == 1
    assert 'grad_scaler=scaler' in messages[0]


def test_disabled_or_unused_grad_scaler_warns_and_counts_as_one(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Defect 5: a scaler that never scaled the loss divided G by its
    initial scale.
    """
    with caplog.at_level(logging.WARNING, logger='kfac'):
        KFACPreconditioner(
            TinyMLP(), grad_scaler=torch.amp.GradScaler('cpu', enabled=False)
        )
    assert 'grad_scaler passed is disabled' in caplog.text
    torch.manual_seed(0)
    model = TinyMLP().double()
    twin = copy.deepcopy(model)
    unused = torch.amp.GradScaler('cpu', init_scale=2.0**10)
    precon = KFACPreconditioner(model, grad_scaler=unused)
    reference = KFACPreconditioner(twin)
    x, y = classification_data(8, (6,))
    with caplog.at_level(logging.WARNING, logger='kfac'):
        _train_step(model, precon, x, y)  # scaler.scale() never called
    _train_step(twin, reference, x, y)
    assert 'has not scaled the loss' in caplog.text
    for key, value in _factors(reference).items():
        assert torch.equal(_factors(precon)[key], value), key


# Hooks of an earlier preconditioner ------------------------------------------


def test_second_preconditioner_on_the_same_modules_warns(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Defect 6: an old preconditioner's hooks kept running silently."""
    model = TinyMLP()
    first = KFACPreconditioner(model)
    with caplog.at_level(logging.WARNING, logger='kfac'):
        KFACPreconditioner(model)
    assert 'hooks of another K-FAC preconditioner' in caplog.text
    assert 'remove()' in caplog.text
    caplog.clear()
    first.remove()
    with caplog.at_level(logging.WARNING, logger='kfac'):
        KFACPreconditioner(TinyMLP())
    assert 'another K-FAC' not in caplog.text


# Model changes after construction -----------------------------------------


def test_model_converted_after_construction_is_followed() -> None:
    torch.manual_seed(0)
    model = TinyMLP()
    twin = copy.deepcopy(model).double()
    precon = KFACPreconditioner(model)
    reference = KFACPreconditioner(twin)
    x, y = classification_data(8, (6,))
    _train_step(model, precon, x.float(), y)
    _train_step(twin, reference, x, y)
    model.double()  # float32 factors follow to float64
    for step in range(2):
        x, y = classification_data(8, (6,), seed=step + 1)
        _train_step(model, precon, x, y)
        _train_step(twin, reference, x, y)
    for key, value in _factors(reference).items():
        mine = _factors(precon)[key]
        assert mine.dtype == F64
        torch.testing.assert_close(mine, value, rtol=1e-5, atol=1e-7)


def test_more_backward_passes_than_accumulation_steps_are_ignored(
    caplog: pytest.LogCaptureFixture,
) -> None:
    torch.manual_seed(0)
    model = TinyMLP().double()
    twin = copy.deepcopy(model)
    precon = KFACPreconditioner(model)
    reference = KFACPreconditioner(twin)
    x, y = classification_data(8, (6,))
    with caplog.at_level(logging.WARNING, logger='kfac'):
        F.cross_entropy(model(x), y).backward()
        F.cross_entropy(model(x * 2), y).backward()  # one pass too many
        precon.step()
    F.cross_entropy(twin(x), y).backward()
    reference.step()
    assert 'got more backward passes than accumulation_steps' in caplog.text
    for key, value in _factors(reference).items():
        assert torch.equal(_factors(precon)[key], value), key


def test_a_deep_copy_of_the_model_is_not_preconditioned() -> None:
    """An EMA or evaluation copy (`copy.deepcopy(model)`) works, and its
    passes leave the preconditioner's statistics alone.
    """
    import copy

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    twin = copy.deepcopy(model)
    precon = KFACPreconditioner(model)
    reference = KFACPreconditioner(twin)
    copied = copy.deepcopy(model)
    copied(torch.randn(5, 3) * 10).sum().backward()  # never seen
    x = torch.randn(6, 3)
    for net, pre in ((model, precon), (twin, reference)):
        net(x).sum().backward()
        pre.step()
    for name, layer in precon.layers.items():
        for factor in layer.factors:
            other = reference.layers[name].factor(factor.name).value
            assert factor.value is not None and other is not None
            assert torch.equal(factor.value, other), name


def test_without_the_compiler_loaded_nothing_of_it_is_touched(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where `torch._dynamo` was never imported (so nothing is compiled),
    the capture neither imports it nor wraps its own code.
    """
    monkeypatch.setattr(
        torch._dynamo.config, 'skip_nnmodule_hook_guards', True
    )
    monkeypatch.setattr(
        capture_module, 'sys', types.SimpleNamespace(modules={})
    )
    capture_module.guard_module_hooks()
    assert torch._dynamo.config.skip_nnmodule_hook_guards
    assert capture_module.uncompiled(Capture.on_input) is Capture.on_input
