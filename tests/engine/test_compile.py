"""K-FAC on models compiled with `torch.compile`: equal to eager, no graph
break and no recompilation from K-FAC, the capture rules, layer names and
checkpoints.

Models and batches are tiny: each compilation (inductor, the default
backend, generating C++ on the CPU) takes seconds. Equality is checked in
float64, which inductor compiles on the CPU; its kernels sum in another
order than eager's, hence the tolerances below (float64 rounding, grown
over a few steps through the eigendecompositions).
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from typing import Any
from typing import cast

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._dynamo.testing import CompileCounter

from kfac.config import StatisticsConfig
from kfac.preconditioner import KFACPreconditioner
from testing.models import AttentionNet
from testing.models import TinyCNN
from testing.models import TinyMLP
from testing.models import classification_data
from testing.torch_release import COMPILED
from testing.torch_release import requires_torch

F64 = torch.float64
RTOL, ATOL = 1e-9, 1e-12
"""Compiled against eager, float64, after a few steps."""


def _compile(model: nn.Module, **options: Any) -> nn.Module:
    return cast(nn.Module, torch.compile(model, **options))


@pytest.fixture(autouse=True)
def _fresh_compiler() -> None:
    """Each test compiles its own graphs (and a graph left by another test
    cannot stand in for one with K-FAC's hooks).
    """
    torch._dynamo.reset()


def _state(
    model: nn.Module, precon: KFACPreconditioner
) -> dict[str, torch.Tensor]:
    out = {f'param.{k}': v.detach() for k, v in model.named_parameters()}
    for name, layer in precon.layers.items():
        for factor in layer.factors:
            assert factor.value is not None, (name, factor.name)
            out[f'{name}.{factor.name}'] = factor.value
    return out


def _train(
    net: nn.Module,
    precon: KFACPreconditioner,
    batches: list[tuple[torch.Tensor, torch.Tensor]],
) -> None:
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for x, y in batches:
        opt.zero_grad()
        F.cross_entropy(net(x), y).backward()
        precon.step()
        opt.step()


MODELS: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...]]] = {
    'mlp': (TinyMLP, (6,)),
    'cnn': (TinyCNN, (2, 8, 8)),
    'attention': (AttentionNet, (5, 8)),
}


@COMPILED
@pytest.mark.parametrize(
    'kind',
    [
        'mlp',
        'cnn',
        # torch 2.11 and 2.12 fail here without K-FAC too ('expected
        # scalar type Double but found Float')
        pytest.param(
            'attention',
            marks=requires_torch(
                '2.13', "inductor's float64 attention backward on the CPU"
            ),
        ),
    ],
)
def test_compiled_model_equals_eager(kind: str) -> None:
    make, shape = MODELS[kind]
    torch.manual_seed(0)
    model = make().double()
    twin = copy.deepcopy(model)
    options: dict[str, Any] = {'factor_decay': 0.5, 'lr': 0.1}
    eager = KFACPreconditioner(model, **options)
    compiled_model = _compile(twin)
    compiled = KFACPreconditioner(compiled_model, **options)
    assert list(compiled.layers) == list(eager.layers)
    batches = [classification_data(8, shape, seed=s) for s in range(3)]
    _train(model, eager, batches)
    _train(compiled_model, compiled, batches)
    mine, reference = _state(twin, compiled), _state(model, eager)
    assert mine.keys() == reference.keys()
    for key, value in reference.items():
        torch.testing.assert_close(
            mine[key], value, rtol=RTOL, atol=ATOL, msg=key
        )


# Graph breaks and recompilation ---------------------------------------------


class _Deep(nn.Module):
    """`depth` Linear layers with a tanh between; optionally a graph break
    of the model's own inside the loop over the layers (dynamo then runs
    the model's frame eagerly and compiles what it calls).
    """

    def __init__(
        self, depth: int, width: int = 4, own_break: bool = False
    ) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            nn.Linear(width, width) for _ in range(depth)
        )
        self.own_break = own_break

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
            if self.own_break:
                torch._dynamo.graph_break()
        return x


class _Broken(nn.Module):
    """Two Linear layers with a graph break of the model's own between."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 4)
        self.fc2 = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.fc1(x))
        torch._dynamo.graph_break()
        out: torch.Tensor = self.fc2(h)
        return out


@COMPILED
@pytest.mark.parametrize(
    ('make', 'graphs'), [(lambda: _Deep(3), 1), (_Broken, 2)]
)
def test_kfac_adds_no_graph_break(
    make: Callable[[], nn.Module], graphs: int
) -> None:
    """`torch._dynamo.explain` counts the same graphs and breaks with and
    without K-FAC's hooks (none, or the model's own one).
    """
    x = torch.randn(3, 4)
    counts = []
    for with_kfac in (False, True):
        torch._dynamo.reset()
        model = make()
        precon = KFACPreconditioner(model) if with_kfac else None
        explained = torch._dynamo.explain(model)(x)
        counts.append((explained.graph_count, explained.graph_break_count))
        if precon is not None:
            precon.remove()
    assert counts[0] == counts[1] == (graphs, graphs - 1)


def _step(
    compiled: nn.Module, precon: KFACPreconditioner, x: torch.Tensor
) -> None:
    compiled(x).sum().backward()
    precon.step()


@COMPILED
@pytest.mark.parametrize(
    'own_break',
    [
        False,
        # torch 2.11 compiles 2 frames there (its factors equal eager
        # ones, checked by hand)
        pytest.param(
            True,
            marks=requires_torch(
                '2.12', "dynamo's frames after a model's own graph break"
            ),
        ),
    ],
)
def test_twenty_layers_compile_once(
    own_break: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """20 hooked layers compile once per kind of step (one graph for the
    steps that update factors, one without K-FAC's operators for the
    others), with `fullgraph=True` and no recompile-limit warning. A model
    whose own frame dynamo runs eagerly (a graph break inside its loop)
    gets K-FAC's hook compiled alone, one graph for every layer (two: the
    first layer's input needs no gradient), not one per layer. Either
    way the factors are the eager model's.
    """
    counter = CompileCounter()
    torch.manual_seed(0)
    model = _Deep(20, own_break=own_break).double()
    twin = copy.deepcopy(model)
    compiled = _compile(model, backend=counter, fullgraph=not own_break)
    options: dict[str, Any] = {'factor_update_steps': 2, 'factor_decay': 0.5}
    precon = KFACPreconditioner(compiled, **options)
    reference = KFACPreconditioner(twin, **options)
    x = torch.randn(3, 4, dtype=F64)
    with caplog.at_level(logging.WARNING):
        for _ in range(4):
            _step(compiled, precon, x)
            _step(twin, reference, x)
    # own_break: Linear.forward and K-FAC's hook, each with and without
    # an input needing a gradient
    assert counter.frame_count == (4 if own_break else 2)
    assert 'recompile' not in caplog.text
    assert precon.steps == 4
    for key, value in _state(twin, reference).items():
        torch.testing.assert_close(
            _state(model, precon)[key], value, rtol=RTOL, atol=ATOL
        )


# Names, checkpoints and the preconditioner's lifetime ------------------------


@COMPILED
def test_checkpoint_round_trip_compiled_eager_compiled() -> None:
    """A preconditioner names its layers without `_orig_mod.`; its state
    loads into one on the eager model and back, and training on from it
    compiled equals training on eagerly.
    """
    torch.manual_seed(0)
    model = TinyMLP().double()
    batches = [classification_data(8, (6,), seed=s) for s in range(3)]
    compiled_model = _compile(model)
    first = KFACPreconditioner(compiled_model)
    assert list(first.layers) == ['fc1', 'fc2']
    _train(compiled_model, first, batches[:1])
    eager_model = copy.deepcopy(model)
    eager = KFACPreconditioner(eager_model)
    eager.load_state_dict(first.state_dict())
    _train(eager_model, eager, batches[1:2])
    again_model = copy.deepcopy(eager_model)
    twin = copy.deepcopy(eager_model)
    again_compiled = _compile(again_model)
    again = KFACPreconditioner(again_compiled)
    reference = KFACPreconditioner(twin)
    state = eager.state_dict()
    again.load_state_dict(state)
    reference.load_state_dict(state)
    _train(again_compiled, again, batches[2:])
    _train(twin, reference, batches[2:])
    mine, theirs = _state(again_model, again), _state(twin, reference)
    for key, value in theirs.items():
        torch.testing.assert_close(mine[key], value, rtol=RTOL, atol=ATOL)


@COMPILED
def test_graph_compiled_before_the_hooks_is_an_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Without K-FAC's guard on hook-less modules (set when a
    preconditioner is built or steps), dynamo keeps a graph traced without
    hooks when hooks are added: K-FAC would see nothing, so step() says so.
    """
    monkeypatch.setattr(
        torch._dynamo.config, 'skip_nnmodule_hook_guards', True
    )
    model = TinyMLP().double()
    compiled = _compile(model, backend='eager')
    x, y = classification_data(8, (6,))
    compiled(x).sum().backward()  # traced without K-FAC's hooks
    precon = KFACPreconditioner(compiled)
    assert not torch._dynamo.config.skip_nnmodule_hook_guards
    F.cross_entropy(compiled(x), y).backward()
    with pytest.raises(RuntimeError, match=r'torch._dynamo.reset\(\)'):
        precon.step()
    torch._dynamo.reset()
    model.zero_grad()
    F.cross_entropy(compiled(x), y).backward()
    precon.step()
    assert all(layer.has_factors for layer in precon.layers.values())


@COMPILED
def test_instance_without_hooks_keeps_its_own_graph() -> None:
    """A model compiled and run without K-FAC beside another instance of
    its class with K-FAC (an A/B comparison in one process): each runs
    its own graph, and K-FAC captures only its own model.
    """
    torch.manual_seed(0)
    model = TinyMLP().double()
    plain, twin = copy.deepcopy(model), copy.deepcopy(model)
    compiled = _compile(model, backend='aot_eager')
    precon = KFACPreconditioner(compiled)
    reference = KFACPreconditioner(twin)
    plain_compiled = _compile(plain, backend='aot_eager')
    batches = [classification_data(8, (6,), seed=s) for s in range(2)]
    for x, y in batches:
        F.cross_entropy(plain_compiled(x * 3), y).backward()  # first
        for net, pre in ((compiled, precon), (twin, reference)):
            F.cross_entropy(net(x), y).backward()
            pre.step()
    for key, value in _state(twin, reference).items():
        torch.testing.assert_close(
            _state(model, precon)[key], value, rtol=RTOL, atol=ATOL
        )


@COMPILED
def test_removed_preconditioner_captures_nothing_and_a_new_one_does() -> None:
    """remove() detaches the compiled model from the old preconditioner
    (dynamo recompiles for the changed hooks) and a new one captures.
    """
    model = TinyMLP().double()
    compiled = _compile(model, backend='aot_eager')
    # statistics kept until step(), so that captures can be counted
    first = KFACPreconditioner(compiled, update_factors_in_hook=False)
    x, y = classification_data(8, (6,))
    F.cross_entropy(compiled(x), y).backward()
    assert all(layer.captures == (1, 1) for layer in first.layers.values())
    first.remove()
    second = KFACPreconditioner(compiled, update_factors_in_hook=False)
    F.cross_entropy(compiled(x), y).backward()
    assert all(layer.captures == (0, 0) for layer in first.layers.values())
    assert all(layer.captures == (1, 1) for layer in second.layers.values())


@COMPILED
def test_operators_of_a_removed_receiver_do_nothing() -> None:
    """A compiled graph that outlives its preconditioner calls operators
    that neither fail nor capture.
    """
    model = TinyMLP().double()
    precon = KFACPreconditioner(model, update_factors_in_hook=False)
    key = torch.tensor([precon._capture._receiver, 0])  # module fc1
    x = torch.randn(2, 6, dtype=F64)
    ticket, anchor = torch.ops.kfac.capture_input(x, x, key, False)
    assert ticket[1] >= 0 and anchor.item() == 0
    precon.remove()
    stale, _ = torch.ops.kfac.capture_input(x, x, key, False)
    assert stale.tolist() == [key[0].item(), -1]
    torch.ops.kfac.capture_grad(torch.ones(2, 5, dtype=F64), ticket)
    torch.ops.kfac.capture_grad(torch.ones(2, 5, dtype=F64), stale)
    assert all(layer.captures == (0, 0) for layer in precon.layers.values())


@COMPILED
def test_operator_path_run_eagerly_equals_the_hook_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What the hooks do in a traced region (the operators and `GradTap`),
    run eagerly, gives the factors and gradients of the eager hooks, and
    leaves the output unchanged (an in-place activation after a layer
    included).
    """
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(6, 5), nn.ReLU(inplace=True), nn.Linear(5, 3)
    )
    model = model.double()
    twin = copy.deepcopy(model)
    precon = KFACPreconditioner(model)
    reference = KFACPreconditioner(twin)
    batches = [classification_data(8, (6,), seed=s) for s in range(2)]
    _train(twin, reference, batches)
    monkeypatch.setattr(torch.compiler, 'is_compiling', lambda: True)
    _train(model, precon, batches)
    for key, value in _state(twin, reference).items():
        assert torch.equal(_state(model, precon)[key], value), key


class _TwoHeads(nn.Module):
    """A body and two heads; the loss may use one head only."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 4)
        self.head = nn.Linear(4, 3)
        self.aux = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.tanh(self.body(x))
        return self.head(h), self.aux(h)


@COMPILED
def test_graph_output_without_gradient_counts_as_zero_gradient() -> None:
    """The documented difference from eager mode: a registered module's
    output returned by the compiled region but left out of the loss gets
    a zero gradient from the compiled backward (AOTAutograd passes zeros
    for outputs without a gradient), so K-FAC counts the call; eager
    K-FAC counts nothing.
    """
    torch.manual_seed(0)
    model = _TwoHeads().double()
    twin = copy.deepcopy(model)
    compiled = _compile(model, backend='aot_eager')
    precon = KFACPreconditioner(compiled)
    reference = KFACPreconditioner(twin)
    x, y = classification_data(6, (4,))
    for net, pre in ((compiled, precon), (twin, reference)):
        out, _ = net(x)
        F.cross_entropy(out, y).backward()
        pre.step()
    assert not reference.layers['aux'].has_factors
    aux = precon.layers['aux']
    assert aux.has_factors and aux.g.value is not None
    assert torch.equal(aux.g.value, torch.zeros_like(aux.g.value))
    for name in ('body', 'head'):
        for factor in ('A', 'G'):
            mine = precon.layers[name].factor(factor).value
            theirs = reference.layers[name].factor(factor).value
            assert mine is not None and theirs is not None
            torch.testing.assert_close(mine, theirs, rtol=RTOL, atol=ATOL)


# Compiled K-FAC arithmetic --------------------------------------------------


@pytest.mark.parametrize(
    'compiled_model', [False, pytest.param(True, marks=COMPILED)]
)
def test_compiled_arithmetic_equals_eager(compiled_model: bool) -> None:
    """`compile_arithmetic=True` (running averages in one compiled kernel)
    trains as the eager arithmetic does, on an eager and a compiled model.
    """
    torch.manual_seed(0)
    model = TinyMLP().double()
    twin = copy.deepcopy(model)
    batches = [classification_data(8, (6,), seed=s) for s in range(3)]
    eager = KFACPreconditioner(model, factor_decay=0.5)
    _train(model, eager, batches)
    net = _compile(twin) if compiled_model else twin
    fused = KFACPreconditioner(
        net,
        factor_decay=0.5,
        statistics=StatisticsConfig(compile_arithmetic=True),
    )
    assert fused.options.compile_arithmetic
    _train(net, fused, batches)
    mine, theirs = _state(twin, fused), _state(model, eager)
    for key, value in theirs.items():
        torch.testing.assert_close(mine[key], value, rtol=RTOL, atol=ATOL)
